"""``method="disk"``: one versioned Hugging Face checkpoint per sync, then ``update_weights_from_disk``.

Every sync writes ``<disk_dir>/step_<N>/`` (layout in `fsdp_sync.weights.hf_checkpoint`: safetensors
shards, ``config.json`` when the module has an HF config, a manifest of digests, the index last), so
that SGLang 0.5.23 — whose disk update is NOT atomic: a torn or half-written directory leaves it
partly updated — only ever sees complete, immutable directories:

1. trainer rank 0 makes a hidden temp directory ``.step_<N>.tmp-<random>`` beside the versions;
2. the buckets of `export.iter_buckets` (planned by `bucket.plan_buckets`, one file per bucket)
   are written by their owner: bucket k by writer ``k mod W``, where the writers are the trainer
   ranks that see the temp directory (all of them on one host or a shared filesystem; otherwise
   rank 0 alone). With ``share_host_memory`` and ranks on one host, a bucket is filled in one
   host-shared buffer (no all-gather) and its owner copies it out; otherwise every rank
   all-gathers it. Each writer writes in a thread of its own, so bucket k is written while
   bucket k+1 is filled (at most two buckets alive per rank besides the shared one);
3. every file is written straight from its bucket (`hf_checkpoint.write_safetensors`: no
   serialized copy), its writeback started at once and its fsync done after the last bucket, its digest (``SyncConfig.disk_hash``: XXH3-128 by default, or
   sha256) taken chunk by chunk as it is written, not by reading the file again; rank 0 writes
   config.json, the manifest (which names the hash) and the index (last), fsyncs the directory
   and renames it to ``step_<N>`` (atomic);
4. trainer rank 0 calls ``engine.update_weights_from_disk(path)`` for each engine
   (`disk_load`), with the sync's weight version, an explicit ``load_format`` (``"auto"``; per-rank
   files ``"sharded_state"``: never None, which SGLang replaces with its launch ``--load-format``,
   e.g. ``dummy``, and then refuses) and ``flush_cache=False`` under ``pause_mode="in_place"``
   (refused up front for an engine that cannot skip the flush: an in-process ``sglang.Engine``).
   With several engines (a fleet), an engine that stages a disk load (the reference engine,
   ``fsdp-sync serve``) loads it inside ``begin_weight_update`` / ``end_weight_update`` and none of
   them commits (takes weights and version) until every one has loaded (`fleet.end_all`). SGLang
   loads it outside any session: it applies a disk load at once, weights and version together,
   and its ``end_weight_update`` would post-process the weights a second time, so a fleet of
   SGLang replicas is not atomic: after a refusal the replicas before it serve the new version
   (the error names them). A sync of
   the step just published (the manager's retry after quarantining a replica) skips 1-3 and loads
   that version again; a replica brought in between syncs
   (``recover``, ``add_engine``: ``ctx.reload``) loads the version the others loaded last
   (``loaded``: a commit that failed on some replicas counts, the others serve it), never one
   that no replica committed or a fresh one;
5. versions beyond the newest ``disk_keep`` (the one just published counted) are removed, never the
   one the engines serve: renamed out of view first, then deleted on trainer rank 0 by a thread
   while the engines load (step 4 waits for it; even a failed load leaves the served version),
   and once the load succeeded the version served before it where ``disk_keep`` is 1. Before step
   2 rank 0 also drops those beyond ``disk_keep`` with ``loaded`` counted (a version a refused load
   published), so a write never needs more room than the steady state's. The newest
   of them is kept, hidden, as the pool ``<disk_dir>/.recycle``: the next sync's writers move each
   file of the same name out of it and overwrite it in place (`disk_writer.write_shard`; a file
   another process holds open, or another link names, is written fresh instead), so its
   pages are reused instead of fresh ones allocated and zeroed while the old ones are freed (on
   tmpfs, 57 against 22 ms of CPU per 64 MiB; issue 39). Every byte is still written and hashed
   anew; the pool costs one more version on disk between syncs and is removed by `close`.

Before step 1, an ``lm_head.weight`` the trainer holds apart from the embedding of a tied config
(which every reader of the version would drop) is refused on every rank unless it equals the
embedding bit for bit (`weights.tied`; per-rank files: `reshard` checks it before the first file).

Each phase ends with `topology.agree` over the trainer group, so a failure on any rank (a full
disk, an engine refusal) raises the same `SyncError` on every rank; a failure before the rename
removes the temp directory, so no partial ``step_<N>`` is ever visible. A published version is
never overwritten: a sync whose ``step_<N>`` exists already is refused (use a fresh ``disk_dir``).
One trainer per ``disk_dir``: hidden leftovers of a crashed run are removed by the next sync.

**Per-rank versions** (``SyncConfig.layout="engine"``, and ``"auto"`` where every engine accepts
them): instead of Hugging Face files that every engine worker reads whole (its share of the
checksums, then its slices), the version holds one file per engine TP rank and bucket,
``model-rank-{r}-part-{k}.safetensors`` (SGLang's ``ShardedStateLoader`` pattern), with only rank
r's shard in the engine's layout (`fsdp_sync.weights.layout`: engine names, fused ``qkv_proj`` /
``gate_up_proj``, vocab rows with padding, row-parallel column slices, replicated KV heads), cut
by `reshard.iter_rank_buckets` (on one host the trainer ranks write their pieces into shared
per-rank buffers, kept from sync to sync until `close`; across hosts one ``all_to_all_single``
per bucket brings each rank's buffer to the writer of its file). The manifest (layout, TP size, model spec, per rank its files, every
file's digest, size and names) is written last instead of an index; fsync, the rename and keep-N
are the same. Each reference-engine worker hashes only its own files, through one small buffer
(`weights.verified_file`), and only when every worker's files check out does the commit read them
straight into the weights (from the page cache the check warmed): no staged copy of the shard.
An engine that hashes ahead (``hash_files_ahead``: the reference engine) is told each file once
it is complete, and hashes it while the trainer writes the next ones (`disk_ranked.HashAhead`).
The engine's TP size and model come from the engines (trainer rank 0); every rank agrees on the
layout before anything is written. Choosing the layout, writing and publishing per-rank files:
`transport.disk_ranked`.

SGLang 0.5.23 cannot load a per-rank version through ``update_weights_from_disk``: its disk update
takes only loaders that are a ``DefaultModelLoader`` (``load_format="sharded_state"`` gets
``ShardedStateLoader``, which is not one, and is refused before anything is read;
``"presharded"`` re-reads the Hugging Face files; ``--custom-weight-loader`` applies only to
``update_weights_from_tensor``). So an engine must say it loads them (``accepts_rank_checkpoints``,
the reference engine does, `SGLangEngine` does not): ``"engine"`` against any other engine is
refused on every rank before anything is written, ``"auto"`` writes the full checkpoint.

`disk_floor(nbytes, directory)` times the same bytes through plain file I/O (write, fsync, read):
the floor the bench puts beside this method. ``stats.extra`` splits each sync (seconds, the slowest
rank's): ``export_s`` (gathers and the cut), ``file_write_s`` (writes and hashing, beside the
export), ``write_wait_s``, ``fsync_s``, ``publish_s``, and within ``load_s`` the engine's
``read_hash_s`` and ``copy_s`` (engines that report them: ``disk_seconds``); per-rank files also
``files_told_ahead`` and ``files_hashed_ahead`` (those the engine took as hashed ahead).

Not here: exporting and bucket planning (`export`, `bucket`), the stages around a sync (the
manager), reading a checkpoint into an engine (the engines, with `hf_checkpoint.resolve`).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import uuid
import warnings
from typing import Any

import torch

from .. import fleet
from .disk_load import load_version
from ..config_check import load_refusal
from .disk_ranked import NO_RANK_CHECKPOINTS, HashAhead, choose_layout, publish_ranked, write_rank_buckets
from .disk_writer import OneWriter, agree_on, all_gather, broadcast, disk_hash, float_dtype, no_space, plain_alloc
from .disk_writer import disk_floor, rank_world, write_shard as _write_shard   # tests replace _write_shard here
from ..weights import bucket as _bucket
from ..weights import export
from ..weights import hf_checkpoint as ckpt
from ..weights import quantize, reshard, tied
from ..weights.gather import Received
from ..models import hf_config_json
from ..topology import SyncError, agree_after_rank0
from ..weights.layout import engine_ep_size

__all__ = ["DiskTransport", "disk_floor", "STEP_RE", "NO_RANK_CHECKPOINTS"]

STEP_RE = re.compile(r"^step_(\d+)$")
_HIDDEN_RE = re.compile(r"^\.(step_\d+|recycle)\.(tmp|del)-[0-9a-f]+$")
POOL = ".recycle"
"""The dropped version whose files the next sync's writers overwrite in place (`DiskTransport`)."""


class DiskTransport:
    """See the module docstring. ``config`` is a `SyncConfig` with ``disk_dir`` (and
    ``disk_keep``, ``bucket_bytes``, ``dtype``, ``fsdp1_state_dict``, ``share_host_memory``,
    ``layout``: ``"full"`` HF files, ``"engine"`` per-rank files, ``"auto"`` per-rank files where
    every engine loads them).

    ``parallel_write``: the trainer ranks write their own shard files (True, the default) or
    rank 0 writes every file (False). Either way every rank takes part in the gathers.
    """

    method = "disk"
    colocated = False

    def __init__(self, config: Any, *, parallel_write: bool = True) -> None:
        disk_dir = getattr(config, "disk_dir", None)
        if not disk_dir:
            raise ValueError("the disk method needs SyncConfig.disk_dir: the directory the "
                             "versioned checkpoints go to (a filesystem every trainer rank and "
                             "the engine can read)")
        keep = getattr(config, "disk_keep", 2)
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"SyncConfig.disk_keep must be an int >= 1, got {keep!r}")
        self.config = config
        self.directory = os.path.abspath(os.fspath(disk_dir))
        self.keep = keep
        self.parallel_write = bool(parallel_write)
        self.loaded: str | None = None      # the version the engines loaded last: never pruned
        self.published: int | None = None   # the step whose version was published last
        self.host_shared = False            # the last sync's buckets came from a host-shared buffer
        self.closed = False
        self._quant: Any = None             # this sync's `quantize.StreamQuantizer`, if quantized
        self._split: dict = {}              # this rank's write-phase split (`OneWriter.seconds`)
        self._host_keep: list = []          # per-rank one-host buffers, kept between syncs until close()
        self._pool: str | None = None       # trainer rank 0: the dropped version kept for reuse (`POOL`)

    # ------------------------------------------------------------------ the sync
    def sync(self, ctx: Any) -> None:
        if self.closed:
            raise RuntimeError("DiskTransport.sync after close()")
        t0 = time.perf_counter()
        group = ctx.group
        rank, world = rank_world(group)
        cfg = ctx.config
        name = f"step_{int(ctx.step)}"
        final = os.path.join(self.directory, name)
        what = f"disk sync of {final}"
        stats = ctx.stats
        if getattr(ctx, "reload", False):
            # a replica brought in (recover, add_engine): what the others serve, whatever a failed
            # sync published or left half-written since
            final = self._served(ctx, group)
            self._load(ctx, final, group)
            stats.extra.update(path=final, reloaded=True)
            stats.seconds = time.perf_counter() - t0
            return
        if self.published == int(ctx.step):
            # the version is on disk already (a retry without a failed replica, a recovered or a
            # new replica): load it, write nothing
            self._load(ctx, final, group)
            stats.extra.update(path=final, reloaded=True)
            stats.seconds = time.perf_counter() - t0
            return

        # 0. the layout (per-rank files or HF files): agreed on every rank before anything is written
        if getattr(cfg, "pause_mode", None) == "in_place":
            self._check_no_flush(ctx, rank, group, what)
        layout = choose_layout(ctx, rank, group, what)
        if layout is None:      # per-rank files: `reshard` checks it, before the first file
            self._check_tied_head(ctx, group, what)

        # 1. rank 0 makes the temp directory; the writers are the ranks that can see it
        tmp, pool, err, dropped = None, None, None, []
        if rank == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                if os.path.lexists(final):
                    raise FileExistsError(
                        f"{final} exists already; a published version is never overwritten (an "
                        f"engine may be reading it): use a fresh disk_dir, or remove the old "
                        f"step_* directories first")
                later = [os.path.basename(p) for n, p in self._versions() if n >= int(ctx.step)]
                if self.published is None and later:
                    # an earlier run's versions (a new manager counts from 0): keep-N would drop
                    # the one being published as older than theirs, before the engines load it
                    raise FileExistsError(
                        f"{self.directory} holds versions of an earlier run at or after this "
                        f"sync's {name}: {', '.join(later[:4])}{' …' if len(later) > 4 else ''}; "
                        f"this manager numbers its versions from its own step, so keep-N would "
                        f"drop the new one as older: use a fresh disk_dir, or remove the old "
                        f"step_* directories first")
                dropped = self._drop_before_write()     # their hidden names swept just below
                self._sweep_hidden()
                tmp = os.path.join(self.directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
                os.mkdir(tmp)
                pool = os.path.join(self.directory, POOL) if os.path.isdir(
                    os.path.join(self.directory, POOL)) else None
                self._pool = pool or self._pool     # an earlier run's too: close removes it
            except Exception as exc:   # noqa: BLE001 - every rank must hear of it
                err = exc
        agree_on(err, group, f"{what} (prepare)")
        tmp, pool = broadcast((tmp, pool), group)
        ahead = None                        # per-rank files: the engines told of them (`HashAhead`)
        try:
            # with what each rank writes by: rank 0's hash names every rank's digests in the
            # manifest, and the writers decide who writes which file (per-rank: the all-to-all's)
            seen = all_gather((os.path.isdir(tmp), disk_hash(cfg), self.parallel_write), group, world)
            _same_on_every_rank(seen, what)
            sees = [s[0] for s in seen]
            writers = [r for r in range(world) if sees[r]] if self.parallel_write else [0]

            # 2. gather every bucket; its owner writes it while the next one is gathered
            t_write = time.perf_counter()
            metas = export.param_metas(ctx.module, cfg.dtype)
            st = reshard.ReshardStats()
            told = 0                        # files told to the engines while the rest were written
            self._quant = self._quantizer(ctx, rank, group, layout, what)
            if layout is None:
                n_files = len(_bucket.plan_buckets(metas, cfg.bucket_bytes))
                if rank == 0:
                    _trim_pool(pool, {ckpt.shard_file_name(k, n_files) for k in range(n_files)})
                records, err = self._write_buckets(ctx, tmp, rank, writers, n_files, pool, st)
                stats.buckets = n_files
            else:
                parts = len(reshard.plan_rank_buckets(layout, metas[0].dtype, cfg.bucket_bytes))
                n_files = parts * layout.tp
                if rank == 0:
                    _trim_pool(pool, {ckpt.rank_file_name(i, k) for i in range(layout.tp) for k in range(parts)})
                ahead = HashAhead(ctx.engines, tmp, layout.tp, disk_hash(cfg), rank, published=final)
                records, err, self.host_shared, self._split = write_rank_buckets(
                    ctx, tmp, rank, writers, layout, parts, st, quant=self._quant,
                    host_keep=self._host_keep, ahead=ahead, pool=pool)
                told = len(ahead.told)
                stats.buckets = parts
            agree_on(no_space(err, self.directory, tmp, self._need(metas, layout), self.keep),
                     group, f"{what} (write)")
            if self._quant is not None:     # what the files hold: fp8 weights and their scales
                metas = quantize.expand_metas(metas, self._quant.hf)
            stats.bytes = sum(m.nbytes for m in metas)
            stats.tensors = len(metas)      # per-rank files: the engine's, set below
            write_s = time.perf_counter() - t_write

            # 3. rank 0: config, manifest, index last; fsync; publish by rename
            t_pub = time.perf_counter()
            everyone = all_gather((records, st.bytes_in, self._split), group, world)
            if layout is not None:          # the engine's parameters, as one engine rank gets them
                stats.tensors = sum(len(r["names"]) for rs, _, _ in everyone for r in rs if r["rank"] == 0)
            trainer_in = max(b for _, b, _ in everyone)
            # the write phase's split: the slowest rank's figure of each part
            split = {k: max(s[k] for _, _, s in everyone) for k in everyone[0][2]}
            err = None
            if rank == 0:
                try:
                    files = [r for rs, _, _ in everyone for r in rs]
                    if layout is None:
                        self._publish(ctx, tmp, final, files, n_files, metas)
                    else:
                        publish_ranked(ctx, tmp, final, self.directory, files, layout, parts, metas)
                    tmp = None
                except Exception as exc:   # noqa: BLE001
                    # published already (a failed fsync of the directory after the rename): whole
                    err = exc if os.path.lexists(final) else no_space(exc, self.directory, tmp,
                                                                      stats.bytes, self.keep)
            agree_on(err, group, f"{what} (publish)")
            tmp = None
            publish_s = time.perf_counter() - t_pub
        finally:
            if rank == 0 and tmp is not None:   # not published: leave nothing behind
                shutil.rmtree(tmp, ignore_errors=True)
                if ahead is not None:           # nor engine workers holding its files open
                    ahead.drop()

        # 4. the engines load it; 5. meanwhile rank 0 removes the versions keep-N drops (its main
        # thread only waits on the engines here: freeing 2 versions' pages took 0.13 CPU s at
        # qwen2-160m on tmpfs, after the load, on the sync's critical path)
        t_load = time.perf_counter()
        self.published = int(ctx.step)
        pruning = self._start_prune() if rank == 0 else None
        try:
            self._load(ctx, final, group)
        except BaseException:
            if ahead is not None:               # engines not asked to load it hold its files
                ahead.drop()
            raise
        finally:
            pruned = dropped + (pruning.finish() if pruning is not None else [])
        load_s = time.perf_counter() - t_load
        # what the engine ranks read (the engines that count it: the reference engine), on every rank
        read = [max(getattr(e, "disk_bytes_read", None) or [0]) for e in ctx.engines or []
                if getattr(e, "disk_bytes_read", None)]
        # the engines' split of the load (the reference engine's: hashing its files, the commit)
        load_split = [getattr(e, "disk_seconds", None) or {} for e in ctx.engines or []]
        load_split = {k: max(d.get(k, 0.0) for d in load_split)
                      for k in ("read_hash_s", "copy_s", "files_hashed_ahead")
                      if any(k in d for d in load_split)}
        engine_in, load_split, told = broadcast((max(read) if read else None, load_split, told), group)

        # 5. what is left to drop now that the load succeeded: the version the engines served
        # before (only ever one of the newest disk_keep when disk_keep is 1)
        if rank == 0:
            try:
                pruned += self._prune()
            except OSError as exc:   # the weights are synced; a stale version is not worth failing for
                warnings.warn(f"could not remove old versions under {self.directory}: {exc}",
                              RuntimeWarning, stacklevel=2)
        stats.seconds = time.perf_counter() - t0
        stats.extra = {**(self._quant.figures() if self._quant is not None else {}),
                       "path": final, "files": n_files, "writers": len(writers),
                       "host_shared": self.host_shared,
                       "write_s": write_s, "publish_s": publish_s, "load_s": load_s,
                       # the split (module docstring): write_s ~ export_s + write_wait_s + fsync_s
                       "export_s": split.get("export_s"), "file_write_s": split.get("write_s"),
                       "write_wait_s": split.get("wait_s"), "fsync_s": split.get("fsync_s"),
                       "read_hash_s": load_split.get("read_hash_s"), "copy_s": load_split.get("copy_s"),
                       # per-rank files told to the engines early / taken as hashed then (`disk_ranked`)
                       "files_told_ahead": told,
                       "files_hashed_ahead": load_split.get("files_hashed_ahead"),
                       "pruned": pruned, "layout": "full" if layout is None else "engine",
                       "engine_rank_bytes_in": engine_in}
        stats.extra["trainer_rank_bytes_in"] = trainer_in    # the most any rank received
        if layout is not None:
            shard = (st.engine_shard_bytes if self._quant is None       # FP8: the engine rank's FP8 shard
                     else self._quant.layout.engine_bytes(float_dtype(metas).itemsize))
            stats.extra.update(reshard_path=st.path, engine_rank_shard_bytes=shard,
                               trainer_rank_bytes_written=st.bytes_written)    # this rank's

    def _need(self, metas: list, layout: Any) -> int | None:
        """Bytes of this sync's tensors on disk (HF files, or every engine rank's shard), for a
        full disk's error (`no_space`); None where it cannot be told."""
        try:
            if layout is None:
                q = self._quant
                return sum(m.nbytes for m in (quantize.expand_metas(metas, q.hf) if q else metas))
            lay = self._quant.layout if self._quant is not None else layout
            return lay.tp * lay.engine_bytes(metas[0].dtype.itemsize)
        except Exception:   # noqa: BLE001 - only a figure for an error message
            return None

    def _load(self, ctx: Any, final: str, group: Any) -> None:
        """Step 4 (trainer rank 0 calls, every rank agrees): the engines load ``final`` with the
        sync's version (`disk_load.load_version`: a fleet commits only when every engine has
        loaded it, where the engines stage a load)."""
        done: list = []

        def load() -> BaseException | None:
            out = load_version(ctx, final)
            done.append(out)
            if out.served:      # a failed commit: some serve it now, so a replica brought in loads it
                self.loaded = final
            ctx.stats.engine_calls = out.calls
            return out.err

        try:
            # a load may take longer than the trainer group's timeout (a big checkpoint): rank 0
            # loads in a thread, the others hear every second that it still does
            agree_after_rank0(load, group, what=f"update_weights_from_disk({final!r})")
        except SyncError:
            # the error says who kept the version or part of it; the manager takes out (and keeps
            # generation paused on) only those whose weights are not one known version (`Loaded`)
            if done:
                fleet.note_partial(done[0].kept, torn=done[0].torn)
            raise
        self.loaded = final

    def _served(self, ctx: Any, group: Any) -> str:
        """The directory the engines in service loaded (``loaded``), checked on trainer rank 0
        before a replica brought in loads it; a refusal fails every rank."""
        err = None
        if rank_world(group)[0] == 0:
            what = f"bringing a replica in at version {getattr(ctx, 'version', None)!r}"
            if self.loaded is None:
                err = RuntimeError(f"{what}: no version was loaded through {self.directory} yet")
            elif not os.path.isfile(os.path.join(self.loaded, ckpt.MANIFEST_FILE)):
                err = FileNotFoundError(
                    f"{what}: its files {self.loaded} are gone (removed outside fsdp_sync), so the "
                    f"replica cannot be given the weights the others serve; it stays out of "
                    f"service: bring it in after the next sync")
        agree_on(err, group, f"update_weights_from_disk({self.loaded!r})")
        return str(self.loaded)

    @staticmethod
    def _check_no_flush(ctx: Any, rank: int, group: Any, what: str) -> None:
        """``pause_mode="in_place"``: the load must not flush the cache, which SGLang refuses while
        requests are held (0.5.23 fails the load, its weights loaded; 0.5.12's scheduler asserts
        and the server dies). An engine that cannot skip the flush says why
        (``disk_option_refusal``: an in-process ``sglang.Engine`` always flushes): refused on
        every rank before anything is written."""
        err = None
        if rank == 0:
            for i, e in enumerate(ctx.engines or []):
                fn = getattr(e, "disk_option_refusal", None)
                why = fn(flush_cache=False) if callable(fn) else None
                if why:
                    err = ValueError(f"pause_mode='in_place' with method='disk': {fleet.describe(e, i)}: "
                                     f"{why}; use an SGLang server (SGLangEngine(base_url=...)) or "
                                     f"another pause_mode")
                    break
        agree_on(err, group, f"{what} (pause_mode='in_place')")

    @staticmethod
    def _check_tied_head(ctx: Any, group: Any, what: str) -> None:
        """A trainer ``lm_head.weight`` of its own under a tied config would be written and then
        dropped by every reader (the config says the head is the embedding): unless it equals the
        embedding bit for bit, every rank refuses before anything is written (`tied`)."""
        cfg, refused = ctx.config, None
        try:
            refused = tied.module_refusal(ctx.module, fsdp1_state_dict=cfg.fsdp1_state_dict, dtype=cfg.dtype)
        except Exception as exc:   # noqa: BLE001 - every rank must hear of it
            refused = f"{type(exc).__name__}: {exc}"
        agree_on(refused and ValueError(refused), group, f"{what} (tied embeddings)")

    def _quantizer(self, ctx: Any, rank: int, group: Any, layout: Any, what: str) -> Any:
        """``SyncConfig.quantization``: every writer quantizes the buckets it writes. The split it
        is checked against: the per-rank layout's, or (HF files) every engine's TP/EP, checked on
        trainer rank 0, which holds the engines; a refusal fails every rank before a byte is
        written."""
        cfg = ctx.config
        if getattr(cfg, "quantization", None) is None:
            return None
        quant, err = None, None
        try:
            if layout is not None:
                quant = quantize.for_sync(ctx.module, cfg, layout.tp, layout.ep)
            else:
                quant = quantize.for_sync(ctx.module, cfg, 1)
                if rank == 0:
                    for e in ctx.engines or []:
                        tp = getattr(e, "tp_size", None)
                        quantize.for_sync(ctx.module, cfg, int(tp) if tp else 1, engine_ep_size(e))
                        why = load_refusal(ctx.module, e, cfg)   # SGLang's Llama loader: scales dropped
                        if why:
                            raise ValueError(why)
        except Exception as exc:   # noqa: BLE001 - every rank must hear of it
            err = exc
        agree_on(err, group, f"{what} (quantization={cfg.quantization!r})")
        return quant

    def _write_buckets(self, ctx: Any, tmp: str, rank: int, writers: list[int], n_files: int,
                       pool: str | None, st: Any) -> tuple[list[dict], BaseException | None]:
        """Gather every bucket (collective: every rank runs the whole stream even after a local
        write failure) and write this rank's own; returns its file records and its error. What
        the gathers brought this rank is added to ``st.bytes_in``."""
        cfg = ctx.config
        w = OneWriter("export", n_files, tmp)
        mine: list[torch.Tensor] = []
        self.host_shared = False

        def alloc(nbytes: int) -> torch.Tensor:
            mine[:] = [plain_alloc(nbytes)]
            return mine[0]

        algo = disk_hash(cfg)

        def write_one(file: str, bkt: _bucket.Bucket, flat: torch.Tensor) -> list[dict]:
            return [_write_shard(tmp, file, bkt, flat, hash=algo, fsync=False, pool=pool)]

        def write(item: tuple) -> None:
            k, (bkt, flat) = item
            own = writers[k % len(writers)] == rank
            shared = not (mine and flat is mine[0])
            mine.clear()
            self.host_shared |= shared
            if w.err is not None or not own:
                return              # keep consuming: the stream is collective
            try:                    # a local failure must not leave the peers in a collective
                if k >= n_files:
                    raise RuntimeError(f"export yielded more buckets than the {n_files} "
                                       f"planned from param_metas")
                if self._quant is not None:     # into a buffer of its own: no clone needed
                    bkt, flat = self._quant.bucket(bkt, flat, plain_alloc)
                elif shared:
                    flat = flat.clone()
                w.submit(write_one, ckpt.shard_file_name(k, n_files), bkt, flat)  # at most one
            except Exception as exc:   # noqa: BLE001
                w.fail(exc)

        # share_host_memory: on one host the ranks fill one shared buffer (no all-gather); it
        # is reused by the next bucket, so the owner copies its bucket out before writing it
        self._split = w.seconds
        received = Received()
        try:
            return w.drive(enumerate(export.iter_buckets(
                ctx.module, cfg.bucket_bytes, dtype=cfg.dtype, fsdp1_state_dict=cfg.fsdp1_state_dict,
                alloc=alloc, share_host_memory=bool(getattr(cfg, "share_host_memory", False)),
                received=received)), write)
        finally:
            st.bytes_in += received.bytes_in

    def _publish(self, ctx: Any, tmp: str, final: str, records: list[dict], n_files: int,
                 metas: list) -> None:
        files = sorted(records, key=lambda r: r["file"])
        want = [ckpt.shard_file_name(k, n_files) for k in range(n_files)]
        if [r["file"] for r in files] != want:
            raise RuntimeError(f"written files {[r['file'] for r in files]} are not the planned "
                               f"{want}")
        algo = disk_hash(ctx.config)
        manifest_files = {r["file"]: {algo: r["digest"], "bytes": r["bytes"]} for r in files}
        config = hf_config_json(ctx.module, float_dtype(metas), getattr(ctx.config, "quantization", None))
        if config is not None:
            digest, size = ckpt.write_json(os.path.join(tmp, ckpt.CONFIG_FILE), config, algo)
            manifest_files[ckpt.CONFIG_FILE] = {algo: digest, "bytes": size}
        total = sum(m.nbytes for m in metas)
        ckpt.write_json(os.path.join(tmp, ckpt.MANIFEST_FILE), {
            "format": ckpt.MANIFEST_FORMAT, "step": int(ctx.step), "hash": algo, "total_size": total,
            "tensors": len(metas), "files": manifest_files})
        weight_map = {n: r["file"] for r in files for n in r["names"]}
        ckpt.write_json(os.path.join(tmp, ckpt.INDEX_FILE),
                        {"metadata": {"total_size": total}, "weight_map": weight_map})
        ckpt.fsync_dir(tmp)
        os.rename(tmp, final)          # atomic: the version appears whole or not at all
        ckpt.fsync_dir(self.directory)

    def _versions(self) -> list[tuple[int, str]]:
        out = []
        for entry in os.listdir(self.directory):
            m = STEP_RE.match(entry)
            if m and os.path.isdir(os.path.join(self.directory, entry)):
                out.append((int(m.group(1)), os.path.join(self.directory, entry)))
        return sorted(out)

    def _prune(self) -> list[str]:
        """Remove versions older than the newest ``keep`` (by step), never the one loaded last."""
        doomed, hidden = self._hide_doomed()
        for path in hidden:
            shutil.rmtree(path, ignore_errors=True)
        return doomed

    def _hide_doomed(self) -> tuple[list[str], list[str]]:
        """The versions `_prune` removes, out of view at once (`_hide`); returns (versions, hidden
        paths)."""
        versions = self._versions()
        # never the version just published (`_start_prune` runs while the engines load it)
        newest = os.path.join(self.directory, f"step_{self.published}") if self.published is not None else None
        doomed = [p for _, p in versions[:-self.keep] if p != self.loaded and p != newest]
        return doomed, self._hide(doomed)

    def _drop_before_write(self) -> list[str]:
        """Step 1 on trainer rank 0, before a byte is written: the write may have beside it
        ``disk_keep`` published versions, ``loaded`` (never dropped) counted, as in the steady
        state, so no sync needs more room than that. A version published but never loaded (a
        refused load) is dropped here: keep-N runs only after a publish, and under ``disk_keep=1``
        it stayed beside the served one, so every later write needed room for a third version
        (ENOSPC at every sync on a disk sized for two). Out of view by `_hide` (its files become
        the pool this write reuses); returns them."""
        paths = [p for _, p in self._versions()]
        others = [p for p in paths if p != self.loaded]
        doomed = others[:max(0, len(others) - (self.keep - (self.loaded in paths)))]
        try:
            self._hide(doomed)
        except OSError as exc:   # as `_start_prune`'s: the write may still find room
            warnings.warn(f"could not remove old versions under {self.directory}: {exc}",
                          RuntimeWarning, stacklevel=3)
            return []
        return doomed

    def _hide(self, doomed: list[str]) -> list[str]:
        """Rename ``doomed`` (versions, oldest first) out of view: the newest becomes the pool
        (`POOL`) the next write's files are taken from, the rest and the pool before it get hidden
        names, to be deleted (and swept by the next sync if their deletion never ends); returns
        the hidden paths."""
        hidden = []
        pool = os.path.join(self.directory, POOL)
        for path in doomed[:-1] + ([pool] if doomed and os.path.lexists(pool) else []):
            hidden.append(os.path.join(self.directory, f".{os.path.basename(path).lstrip('.')}"
                                                       f".del-{uuid.uuid4().hex[:12]}"))
            os.rename(path, hidden[-1])
        if doomed:
            os.rename(doomed[-1], pool)
            self._pool = pool
        return hidden

    def _start_prune(self) -> "_Pruning":
        """Step 5 beside step 4: the versions beyond the newest ``keep`` (the one being loaded
        counts among them), never the one the engines serve now (``loaded``), hidden at once and
        deleted on a thread while the engines load; `_Pruning.finish` waits for it. Pruned even
        when the load then fails: the engines keep serving ``loaded``, which stays."""
        try:
            doomed, hidden = self._hide_doomed()
        except OSError as exc:   # as `_prune`'s: a stale version is not worth failing the sync for
            warnings.warn(f"could not remove old versions under {self.directory}: {exc}",
                          RuntimeWarning, stacklevel=3)
            doomed, hidden = [], []
        return _Pruning(doomed, hidden)

    def _sweep_hidden(self) -> None:
        """Temp and half-deleted directories a crashed sync left behind (one trainer per dir)."""
        for entry in os.listdir(self.directory):
            if _HIDDEN_RE.match(entry):
                shutil.rmtree(os.path.join(self.directory, entry), ignore_errors=True)

    def close(self) -> None:
        """Frees the one-host buffers kept between syncs (the writer thread ends with each sync);
        the published versions stay on disk."""
        self.closed = True
        self._host_keep.clear()
        if self._pool is not None:           # one version's worth of files: not left behind
            shutil.rmtree(self._pool, ignore_errors=True)
            self._pool = None


def _trim_pool(pool: str | None, planned: set[str]) -> None:
    """Trainer rank 0, as the writers start: the pool's entries this sync writes no file of (named
    by another layout or bucket count: ``layout="auto"`` switching, another ``bucket_bytes``; its
    JSON files) are removed. Never reused, they stayed until a sync succeeded, so on a disk sized
    for the steady state every sync after such a change failed with ENOSPC, the pool unchanged."""
    if pool is None:
        return
    try:
        for entry in os.listdir(pool):
            if entry not in planned:
                path = os.path.join(pool, entry)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
    except OSError as exc:   # another writer took it meanwhile, or it is gone: only room lost
        warnings.warn(f"could not trim the pool {pool}: {exc}", RuntimeWarning, stacklevel=2)


def _same_on_every_rank(seen: list[tuple], what: str) -> None:
    """Every rank's (sees the temp dir, ``disk_hash``, ``parallel_write``): the settings must
    match rank 0's (a rank hashing with another hash had its digests listed under rank 0's, and
    the reference engine refused every version as torn; other writers planned other files). Raises
    the same `SyncError` on every rank (each has the gathered list), before anything is written."""
    for i, name in ((1, "SyncConfig.disk_hash"), (2, "DiskTransport(parallel_write=...)")):
        for r, s in enumerate(seen):
            if s[i] != seen[0][i]:
                raise SyncError(f"{what}: the trainer ranks disagree on {name}: rank 0 has "
                                f"{seen[0][i]!r}, rank {r} has {s[i]!r}; set the same on every "
                                f"rank; nothing was written")


class _Pruning:
    """Hidden versions being deleted on a thread of their own (`DiskTransport._start_prune`)."""

    def __init__(self, doomed: list[str], hidden: list[str]) -> None:
        self.doomed = doomed
        self._thread = None
        if hidden:
            self._thread = threading.Thread(target=_remove_all, args=(hidden,),
                                            name="fsdp_sync-disk-prune")
            self._thread.start()

    def finish(self) -> list[str]:
        """Wait for the deletion; returns the versions removed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        return self.doomed


def _remove_all(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)

