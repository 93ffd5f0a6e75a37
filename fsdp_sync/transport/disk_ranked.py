"""The disk method's per-rank versions (``SyncConfig.layout="engine"``): choosing the layout, cutting
and writing one file per engine TP rank and bucket, telling the engines which files are complete
while the rest are written (`HashAhead`), and publishing the version under its manifest.

What a per-rank version holds and why SGLang cannot load one: `transport.disk` (module docstring).

**Hashing ahead.** An engine that has ``hash_files_ahead(directory, files, hash, published=)``
(the reference engine; ``published``: the version's name once renamed, where a worker that comes
to the hint late finds the files) is told, on trainer rank 0 while the trainer still writes later buckets, the names of the
files in the temp directory that are complete: this rank's own once its writer finished them, and
every writer's files of bucket k-2 once the stream has made bucket k (each writer waits for its
bucket k-2 to be written before the stream's collectives of bucket k, so they are complete by
then). Its workers hash them meanwhile and keep them open; the load then only checks that each
file it is asked for is still that file (inode, size, mtime, beside the digest the manifest
names) instead of hashing it again. Nothing is applied early: the load still verifies every file
before any weight changes, and a file told too early (not yet complete) or changed since is
hashed again at the load, as any file not told. The telling is an optimization only: it never
fails a sync (an engine that cannot take it is simply not told again this sync). A sync that
fails after telling (writing, publishing, loading) tells each engine it told to drop them
(``drop_files_ahead(directory)`` where it has it: the reference engine), so its workers do not
hold the removed temp directory's files open, their disk space allocated, until the next update.

Not here: the sync's phases, the full (Hugging Face) layout, keep-N (`transport.disk`); the cut
(`weights.reshard`); the writer thread (`transport.disk_writer`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Iterable

from .disk_writer import (OneWriter, agree_on, all_gather, broadcast, disk_hash, float_dtype,
                          plain_alloc, rank_world, write_shard)
from ..models import hf_config_json
from ..weights import hf_checkpoint as ckpt
from ..weights import reshard
from ..weights.layout import engine_ep_size, layout_for

__all__ = ["NO_RANK_CHECKPOINTS", "choose_layout", "write_rank_buckets", "publish_ranked", "HashAhead"]

log = logging.getLogger("fsdp_sync")

NO_RANK_CHECKPOINTS = (
    "SGLang 0.5.23 cannot load per-rank files through update_weights_from_disk: its disk update "
    "takes only a DefaultModelLoader (load_format='sharded_state' gets ShardedStateLoader, which "
    "is not one, and is refused before anything is read; 'presharded' re-reads the Hugging Face "
    "files), and --custom-weight-loader applies only to update_weights_from_tensor")
_ST_CODE = {v: k for k, v in ckpt.SAFETENSORS_DTYPES.items()}


def choose_layout(ctx: Any, rank: int, group: Any, what: str) -> Any:
    """The engines' `layout.TPLayout` to cut per-rank files by, or None for HF files.

    ``layout="full"``: None. Otherwise trainer rank 0 (it holds the engines) checks that there
    are engines, all with ``accepts_rank_checkpoints``, one TP size, and a model equal to the
    trainer's; every rank then builds the layout from the module's config and checks that its
    sharded tensors are in one shard group (`reshard.rank_buckets_refusal`). ``"engine"``: any
    refusal raises the same `SyncError` on every rank before anything is written; ``"auto"``:
    HF files (logged on rank 0)."""
    want = getattr(ctx.config, "layout", "full")
    if want == "full":
        return None
    tp, why = None, None
    if rank == 0:
        try:
            tp = _engine_tp(ctx)   # (tp, ep)
        except Exception as exc:   # noqa: BLE001 - "auto" falls back, "engine" reports it
            why = str(exc)
    tp, why = broadcast((tp, why), group)
    layout, err = None, None
    if why is None:
        try:
            hf_config = getattr(ctx.module, "config", None)
            if hf_config is None:
                raise ValueError("the module has no Hugging Face .config to take the engine's "
                                 "layout from")
            layout = layout_for(hf_config, *tp)
            if rank == 0:
                _check_engine_models(ctx, layout)
            spans = reshard.rank_buckets_refusal(ctx.module, ctx.config.fsdp1_state_dict)
            if spans is not None:      # e.g. layers on a DeviceMesh of their own
                raise ValueError(spans)
        except Exception as exc:   # noqa: BLE001
            err = exc
    if want == "engine":
        text = why or (err and f"{type(err).__name__}: {err}")
        agree_on(text and ValueError(
            f"layout='engine' with method='disk': {text}; use layout='full' (or 'auto', which "
            f"falls back to it) for the disk method, or method='tensor' with layout='engine'"),
            group, f"{what} (choosing the layout)")
        return layout
    # "auto": every rank must take the same answer
    ok = all_gather(why is None and err is None, group, rank_world(group)[1])
    if not all(ok):
        if rank == 0:
            log.info("fsdp_sync: disk layout='auto' writes a Hugging Face checkpoint: %s",
                     why or err or "a trainer rank could not build the engine layout")
        return None
    return layout


def _engine_tp(ctx: Any) -> tuple[int, int]:
    engines = list(ctx.engines or [])
    if not engines:
        raise ValueError("no engine on trainer rank 0 to take the TP size of the per-rank files from")
    for i, e in enumerate(engines):
        if not getattr(e, "accepts_rank_checkpoints", False):
            raise ValueError(f"engine {i} ({type(e).__name__}) does not load per-rank "
                             f"checkpoints (accepts_rank_checkpoints is not true); "
                             f"{NO_RANK_CHECKPOINTS}")
    tps = sorted({int(getattr(e, "tp_size", 0)) for e in engines})
    if len(tps) != 1 or tps[0] < 1:
        raise ValueError(f"the engines' TP sizes {tps} differ: per-rank files are cut for one")
    eps = sorted({engine_ep_size(e) for e in engines})
    if len(eps) != 1:
        raise ValueError(f"the engines' expert-parallel sizes {eps} differ: per-rank files are cut for one")
    return tps[0], eps[0]


def _check_engine_models(ctx: Any, layout: Any) -> None:
    for i, e in enumerate(ctx.engines or []):
        espec = getattr(getattr(e, "layout", None), "spec", None)
        if espec is not None and espec != layout.spec:
            diff = {k: (getattr(layout.spec, k), getattr(espec, k)) for k in vars(espec)
                    if getattr(layout.spec, k) != getattr(espec, k)}
            raise ValueError(f"engine {i}'s model differs from the trainer's (trainer, engine): "
                             f"{diff}")


class HashAhead:
    """Trainer rank 0's telling of complete files to the engines that hash ahead (module
    docstring); on other ranks, or without such an engine, it does nothing. ``told``: the files
    told this sync."""

    def __init__(self, engines: Iterable[Any], directory: str, tp: int, hash: str, rank: int,
                 published: str | None = None) -> None:
        self.engines = [e for e in engines or []
                        if callable(getattr(e, "hash_files_ahead", None))] if rank == 0 else []
        self.directory, self.tp, self.hash, self.published = directory, tp, hash, published
        self.told: set[str] = set()
        self._hinted: list[Any] = []        # the engines told at least once (`drop`)

    def tell(self, files: Iterable[str]) -> None:
        new = sorted(f for f in set(files) if f not in self.told)
        if not new or not self.engines:
            return
        self.told.update(new)
        for e in list(self.engines):
            if not any(e is h for h in self._hinted):
                self._hinted.append(e)
            try:
                e.hash_files_ahead(self.directory, new, self.hash, published=self.published)
            except Exception as exc:   # noqa: BLE001 - an optimization: the load checks every file
                log.debug("fsdp_sync: %s cannot hash ahead (%s: %s); not told again this sync",
                          type(e).__name__, type(exc).__name__, exc)
                self.engines.remove(e)

    def drop(self) -> None:
        """The sync failed: each engine told of files drops what it hashed ahead for this
        directory (module docstring); best effort, as the telling."""
        hinted, self._hinted = self._hinted, []
        for e in hinted:
            fn = getattr(e, "drop_files_ahead", None)
            if not callable(fn):
                continue
            try:
                fn(self.directory)
            except Exception as exc:   # noqa: BLE001 - the sync's own error is the one to raise
                log.warning("fsdp_sync: %s could not drop the files it hashed ahead (%s: %s)",
                            type(e).__name__, type(exc).__name__, exc)

    def at_bucket(self, k: int, own: list[dict], synced: bool) -> None:
        """The stream made bucket ``k``: this rank's written files (``own``) are complete, and
        where the stream synchronizes the ranks every bucket (``synced``: the one-host path's
        barriers, the all-to-all) every writer's files of bucket k-2 too."""
        if self.engines:
            self.tell([r["file"] for r in own]
                      + ([ckpt.rank_file_name(i, k - 2) for i in range(self.tp)] if synced and k >= 2 else []))


def write_rank_buckets(ctx: Any, tmp: str, rank: int, writers: list[int], layout: Any, parts: int,
                       st: Any, *, quant: Any, host_keep: list, ahead: HashAhead,
                       pool: str | None = None) -> tuple[list[dict], BaseException | None, bool, dict]:
    """Cut every bucket per engine rank (collective: every rank runs the whole stream even
    after a local failure) and write this rank's files; returns its file records, its error,
    whether a bucket came from host-shared buffers, and its write-phase split (`OneWriter.seconds`).

    File (engine rank i, part k) is written by the rank that holds i's buffer: on the
    all-to-all path the one owner ``writers[i % W]``; where every rank sees every buffer
    (host-shared, or full tensors everywhere) ``writers[(k * tp + i) % W]``. One bucket's
    files are written on a thread while the next bucket is cut (two buffer sets rotate);
    ``ahead`` is told which files are complete as the stream goes (`HashAhead.at_bucket`); ``pool``:
    the dropped version whose files are overwritten in place (`disk_writer.write_shard`)."""
    cfg = ctx.config
    tp = layout.tp
    w = OneWriter("reshard", parts, tmp)
    owners = [[writers[i % len(writers)]] for i in range(tp)]
    shared = [False]

    tied = bool(layout.spec.tie_word_embeddings)
    algo = disk_hash(cfg)

    def write_all(jobs: list) -> list[dict]:
        return [write_shard(tmp, ckpt.rank_file_name(i, k), bkt, flat,
                            lambda n: ckpt.rank_tensor_name(n, tied), algo, fsync=False, pool=pool)
                | {"rank": i, "part": k}
                for i, k, bkt, flat in jobs]

    def write(rb: Any) -> None:
        k = rb.index
        shared[0] |= rb.shared
        everywhere = st.path != "all-to-all"
        mine = [i for i in sorted(rb.buffers)
                if not everywhere or writers[(k * tp + i) % len(writers)] == rank]
        try:
            # its own buffers (the next bucket may reuse rb's); inside the try: a NaN in one
            # engine rank's slice, or an allocation, fails this rank only, which must keep
            # consuming the collective stream (raised here, it left its peers waiting in the
            # next bucket's all-to-all until the process-group timeout)
            if quant is not None and mine and w.err is None:
                rb = quant.rank_bucket(rb, plain_alloc, ranks=mine)
            jobs = [(i, k, rb.bucket, rb.buffers[i]) for i in mine]
            # bucket k-1's files are written before bucket k+1 is asked for: its buffers
            # (host-shared set (k-1) % 2) are rewritten by bucket k+1
            w.collect()
            if w.err is None:
                ahead.at_bucket(k, w.records, st.path in ("host-shared", "all-to-all"))
            if w.err is None and jobs:
                if k >= parts:
                    raise RuntimeError(f"reshard yielded more buckets than the {parts} planned")
                w.submit(write_all, jobs)
        except Exception as exc:   # noqa: BLE001 - keep consuming: the stream is collective
            w.fail(exc)

    records, err = w.drive(reshard.iter_rank_buckets(
        ctx.module, layout, cfg.bucket_bytes, dtype=cfg.dtype,
        fsdp1_state_dict=cfg.fsdp1_state_dict,
        share_host_memory=bool(getattr(cfg, "share_host_memory", False)),
        owners=owners, alloc=plain_alloc, stats=st, host_sets=2, host_keep=host_keep,
        # whole tensors on every rank (the local path): build only the buffers of the files
        # this rank writes, as `write` picks them
        ranks=lambda k: [i for i in range(tp) if writers[(k * tp + i) % len(writers)] == rank]), write,
        written=lambda recs: ahead.tell(r["file"] for r in recs))
    return records, err, shared[0], w.seconds


def publish_ranked(ctx: Any, tmp: str, final: str, directory: str, records: list[dict], layout: Any,
                   parts: int, metas: list) -> None:
    """Trainer rank 0: config.json, then the manifest (the index of a per-rank version) last, after
    every file is fsynced; fsync the directory and rename it to ``final`` (atomic)."""
    want = {ckpt.rank_file_name(i, k) for i in range(layout.tp) for k in range(parts)}
    got = {r["file"] for r in records}
    if got != want or len(records) != len(want):
        raise RuntimeError(f"written per-rank files {sorted(got)} are not the planned "
                           f"{sorted(want)} (each exactly once)")
    by_file = {r["file"]: r for r in records}
    algo = disk_hash(ctx.config)
    files = {f: {algo: r["digest"], "bytes": r["bytes"], "names": r["names"]}
             for f, r in sorted(by_file.items())}
    dtype = float_dtype(metas)
    config = hf_config_json(ctx.module, dtype, getattr(ctx.config, "quantization", None))
    if config is not None:
        digest, size = ckpt.write_json(os.path.join(tmp, ckpt.CONFIG_FILE), config, algo)
        files[ckpt.CONFIG_FILE] = {algo: digest, "bytes": size}
    ckpt.write_json(os.path.join(tmp, ckpt.MANIFEST_FILE), {
        "format": ckpt.MANIFEST_FORMAT, "step": int(ctx.step), "hash": algo, "layout": "engine",
        "tp_size": layout.tp, "ep_size": layout.ep, "model": dataclasses.asdict(layout.spec),
        "dtype": _ST_CODE[dtype], "quantization": getattr(ctx.config, "quantization", None),
        "hf_tensors": len(metas),
        "total_size": sum(m.nbytes for m in metas),
        "ranks": [[ckpt.rank_file_name(i, k) for k in range(parts)] for i in range(layout.tp)],
        "files": files})
    ckpt.fsync_dir(tmp)
    os.rename(tmp, final)          # atomic: the version appears whole or not at all
    ckpt.fsync_dir(directory)
