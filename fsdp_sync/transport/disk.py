"""``method="disk"``: one versioned Hugging Face checkpoint per sync, then ``update_weights_from_disk``.

Every sync writes ``<disk_dir>/step_<N>/`` (layout in `fsdp_sync.hf_checkpoint`: safetensors
shards, ``config.json`` when the module has an HF config, a sha256 manifest, the index last), so
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
3. every file is fsynced, its sha256 taken from what is on disk; rank 0 writes config.json, the
   manifest and the index (last), fsyncs the directory and renames it to ``step_<N>`` (atomic);
4. trainer rank 0 calls ``engine.update_weights_from_disk(path)`` for each engine;
5. after success, versions beyond the newest ``disk_keep`` are removed (renamed to a hidden name
   first, then deleted), never the one just loaded.

Each phase ends with `topology.agree` over the trainer group, so a failure on any rank (a full
disk, an engine refusal) raises the same `SyncError` on every rank; a failure before the rename
removes the temp directory, so no partial ``step_<N>`` is ever visible. A published version is
never overwritten: a sync whose ``step_<N>`` exists already is refused (use a fresh ``disk_dir``).
One trainer per ``disk_dir``: hidden leftovers of a crashed run are removed by the next sync.

`disk_floor(nbytes, directory)` times the same bytes through plain file I/O (write, fsync, read):
the floor the bench puts beside this method.

Not here: exporting and bucket planning (`export`, `bucket`), the stages around a sync (the
manager), reading a checkpoint into an engine (the engines, with `hf_checkpoint.resolve`).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from .. import bucket as _bucket
from .. import export
from .. import hf_checkpoint as ckpt
from ..topology import SyncError, agree

__all__ = ["DiskTransport", "disk_floor", "STEP_RE"]

STEP_RE = re.compile(r"^step_(\d+)$")
_HIDDEN_RE = re.compile(r"^\.step_\d+\.(tmp|del)-[0-9a-f]+$")


def _plain_alloc(nbytes: int) -> torch.Tensor:
    # buffers stay in this process (written to a file, never shared): plain memory, no /dev/shm
    return torch.empty(nbytes, dtype=torch.uint8)


def _hf_model(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside FSDP1 wrappers (FSDP2 keeps the module itself)."""
    while hasattr(module, "_fsdp_wrapped_module"):
        module = module._fsdp_wrapped_module
    return module


def _hf_config_json(module: torch.nn.Module, dtype: torch.dtype | None) -> dict | None:
    """config.json as ``save_pretrained`` writes it (architectures, dtype of the saved tensors),
    or None when the module has no HF config."""
    model = _hf_model(module)
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return None
    d = json.loads(copy.deepcopy(config).to_json_string(use_diff=True))
    arch = next((c.__name__ for c in type(model).__mro__
                 if c.__module__.startswith("transformers.")
                 and c.__name__.endswith(("ForCausalLM", "Model", "LMHeadModel"))), None)
    if arch is not None:
        d["architectures"] = [arch]
    if dtype is not None:
        name = _bucket.dtype_name(dtype)
        d["dtype"] = name
        if "torch_dtype" in d:
            d["torch_dtype"] = name
    return d


def _write_shard(directory: str, file: str, bkt: _bucket.Bucket, flat: torch.Tensor) -> dict:
    """One bucket as one safetensors file, fsynced; sha256 of what is on disk."""
    from safetensors.torch import save_file

    path = os.path.join(directory, file)
    tensors = dict(_bucket.unflatten(flat, bkt.entries))
    save_file(tensors, path, metadata={"format": "pt"})
    del tensors
    ckpt.fsync_file(path)
    sha, size = ckpt.sha256_file(path)
    return {"file": file, "sha256": sha, "bytes": size, "names": list(bkt.names)}


class DiskTransport:
    """See the module docstring. ``config`` is a `SyncConfig` with ``disk_dir`` (and
    ``disk_keep``, ``bucket_bytes``, ``dtype``, ``fsdp1_state_dict``).

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
        self.host_shared = False            # the last sync's buckets came from a host-shared buffer
        self.closed = False

    # ------------------------------------------------------------------ collectives
    @staticmethod
    def _dist(group: Any) -> tuple[int, int]:
        if not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(group), dist.get_world_size(group)

    def _agree(self, error: BaseException | None, group: Any, what: str) -> None:
        if not (dist.is_available() and dist.is_initialized()):   # one process: no peers to tell
            if error is not None:
                raise SyncError(f"{what} failed: {type(error).__name__}: {error}") from error
            return
        agree(error, group, what=what)

    @staticmethod
    def _broadcast(obj: Any, group: Any) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None
                                   else 0, group=group)
        return box[0]

    @staticmethod
    def _all_gather(obj: Any, group: Any, world: int) -> list:
        if world == 1:
            return [obj]
        out: list = [None] * world
        dist.all_gather_object(out, obj, group=group)
        return out

    # ------------------------------------------------------------------ the sync
    def sync(self, ctx: Any) -> None:
        if self.closed:
            raise RuntimeError("DiskTransport.sync after close()")
        t0 = time.perf_counter()
        group = ctx.group
        rank, world = self._dist(group)
        cfg = ctx.config
        name = f"step_{int(ctx.step)}"
        final = os.path.join(self.directory, name)
        what = f"disk sync of {final}"
        stats = ctx.stats

        # 1. rank 0 makes the temp directory; the writers are the ranks that can see it
        tmp, err = None, None
        if rank == 0:
            try:
                os.makedirs(self.directory, exist_ok=True)
                if os.path.lexists(final):
                    raise FileExistsError(
                        f"{final} exists already; a published version is never overwritten (an "
                        f"engine may be reading it): use a fresh disk_dir, or remove the old "
                        f"step_* directories first")
                self._sweep_hidden()
                tmp = os.path.join(self.directory, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
                os.mkdir(tmp)
            except Exception as exc:   # noqa: BLE001 - every rank must hear of it
                err = exc
        self._agree(err, group, f"{what} (prepare)")
        tmp = self._broadcast(tmp, group)
        try:
            sees = self._all_gather(os.path.isdir(tmp), group, world)
            writers = [r for r in range(world) if sees[r]] if self.parallel_write else [0]

            # 2. gather every bucket; its owner writes it while the next one is gathered
            t_write = time.perf_counter()
            metas = export.param_metas(ctx.module, cfg.dtype)
            n_files = len(_bucket.plan_buckets(metas, cfg.bucket_bytes))
            records, err = self._write_buckets(ctx, tmp, rank, writers, n_files)
            self._agree(err, group, f"{what} (write)")
            stats.bytes = sum(m.nbytes for m in metas)
            stats.tensors = len(metas)
            stats.buckets = n_files
            write_s = time.perf_counter() - t_write

            # 3. rank 0: config, manifest, index last; fsync; publish by rename
            t_pub = time.perf_counter()
            everyone = self._all_gather(records, group, world)
            err = None
            if rank == 0:
                try:
                    self._publish(ctx, tmp, final, [r for rs in everyone for r in rs], n_files,
                                  metas)
                    tmp = None
                except Exception as exc:   # noqa: BLE001
                    err = exc
            self._agree(err, group, f"{what} (publish)")
            tmp = None
            publish_s = time.perf_counter() - t_pub
        finally:
            if rank == 0 and tmp is not None:   # not published: leave nothing behind
                shutil.rmtree(tmp, ignore_errors=True)

        # 4. the engines load it
        t_load = time.perf_counter()
        err = None
        calls = 0
        engines = list(ctx.engines or [])
        for i, engine in enumerate(engines):
            try:
                engine.update_weights_from_disk(final)
                calls += 1
            except Exception as exc:   # noqa: BLE001
                err = exc if len(engines) == 1 else RuntimeError(
                    f"engine {i} of {len(engines)} failed to load it (engines {list(range(i))} "
                    f"loaded it; the later ones were not asked): {type(exc).__name__}: {exc}")
                break
        stats.engine_calls = calls
        self._agree(err, group, f"update_weights_from_disk({final!r})")
        load_s = time.perf_counter() - t_load
        self.loaded = final

        # 5. keep the newest disk_keep versions
        pruned: list[str] = []
        if rank == 0:
            try:
                pruned = self._prune()
            except OSError as exc:   # the weights are synced; a stale version is not worth failing for
                warnings.warn(f"could not remove old versions under {self.directory}: {exc}",
                              RuntimeWarning, stacklevel=2)
        stats.seconds = time.perf_counter() - t0
        stats.extra = {"path": final, "files": n_files, "writers": len(writers),
                       "host_shared": self.host_shared,
                       "write_s": write_s, "publish_s": publish_s, "load_s": load_s,
                       "pruned": pruned}

    def _write_buckets(self, ctx: Any, tmp: str, rank: int, writers: list[int],
                       n_files: int) -> tuple[list[dict], BaseException | None]:
        """Gather every bucket (collective: every rank runs the whole stream even after a local
        write failure) and write this rank's own; returns its file records and its error."""
        cfg = ctx.config
        records: list[dict] = []
        err: BaseException | None = None
        pending: Future | None = None
        count = 0
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp_sync-disk-writer")
        mine: list[torch.Tensor] = []
        self.host_shared = False

        def alloc(nbytes: int) -> torch.Tensor:
            mine[:] = [_plain_alloc(nbytes)]
            return mine[0]

        try:
            # share_host_memory: on one host the ranks fill one shared buffer (no all-gather); it
            # is reused by the next bucket, so the owner copies its bucket out before writing it
            stream = export.iter_buckets(ctx.module, cfg.bucket_bytes, dtype=cfg.dtype,
                                         fsdp1_state_dict=cfg.fsdp1_state_dict, alloc=alloc,
                                         share_host_memory=bool(getattr(cfg, "share_host_memory",
                                                                        False)))
            for k, (bkt, flat) in enumerate(stream):
                count += 1
                own = writers[k % len(writers)] == rank
                shared = not (mine and flat is mine[0])
                mine.clear()
                self.host_shared |= shared
                if err is not None or not own:
                    del flat
                    continue        # keep consuming: the stream is collective
                try:                # a local failure must not leave the peers in a collective
                    if k >= n_files:
                        raise RuntimeError(f"export yielded more buckets than the {n_files} "
                                           f"planned from param_metas")
                    if shared:
                        flat = flat.clone()
                    if pending is not None:     # at most one bucket being written
                        fut, pending = pending, None
                        records.append(fut.result())
                    pending = pool.submit(_write_shard, tmp, ckpt.shard_file_name(k, n_files),
                                          bkt, flat)
                except Exception as exc:   # noqa: BLE001
                    err = exc
                del flat
            if pending is not None:
                try:
                    records.append(pending.result())
                except Exception as exc:   # noqa: BLE001
                    err = err or exc
                pending = None
        except Exception as exc:   # noqa: BLE001 - export failures come as the same SyncError
            err = err or exc
        finally:
            if pending is not None:
                pending.cancel()
            pool.shutdown(wait=True)
        if err is None and count != n_files:
            err = RuntimeError(f"export yielded {count} buckets, {n_files} were planned")
        return records, err

    def _publish(self, ctx: Any, tmp: str, final: str, records: list[dict], n_files: int,
                 metas: list) -> None:
        files = sorted(records, key=lambda r: r["file"])
        want = [ckpt.shard_file_name(k, n_files) for k in range(n_files)]
        if [r["file"] for r in files] != want:
            raise RuntimeError(f"written files {[r['file'] for r in files]} are not the planned "
                               f"{want}")
        manifest_files = {r["file"]: {"sha256": r["sha256"], "bytes": r["bytes"]} for r in files}
        config = _hf_config_json(ctx.module, _float_dtype(metas))
        if config is not None:
            sha, size = ckpt.write_json(os.path.join(tmp, ckpt.CONFIG_FILE), config)
            manifest_files[ckpt.CONFIG_FILE] = {"sha256": sha, "bytes": size}
        total = sum(m.nbytes for m in metas)
        ckpt.write_json(os.path.join(tmp, ckpt.MANIFEST_FILE), {
            "format": ckpt.MANIFEST_FORMAT, "step": int(ctx.step), "total_size": total,
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
        """Remove versions older than the newest ``keep`` (by step), never the one just loaded."""
        versions = self._versions()
        doomed = [p for _, p in versions[:-self.keep] if p != self.loaded]
        for path in doomed:
            head, tail = os.path.split(path)
            hidden = os.path.join(head, f".{tail}.del-{uuid.uuid4().hex[:12]}")
            os.rename(path, hidden)     # gone from view at once; deleted below
            shutil.rmtree(hidden, ignore_errors=True)
        return doomed

    def _sweep_hidden(self) -> None:
        """Temp and half-deleted directories a crashed sync left behind (one trainer per dir)."""
        for entry in os.listdir(self.directory):
            if _HIDDEN_RE.match(entry):
                shutil.rmtree(os.path.join(self.directory, entry), ignore_errors=True)

    def close(self) -> None:
        """Nothing stays open between syncs (the writer thread ends with each sync); the published
        versions stay on disk."""
        self.closed = True


def _float_dtype(metas: list) -> torch.dtype | None:
    for m in metas:
        if m.dtype.is_floating_point:
            return m.dtype
    return None


def disk_floor(nbytes: int, directory: str, *, files: int = 1, chunk_bytes: int = 8 << 20) -> float:
    """Seconds to write ``nbytes`` with plain file I/O into ``files`` files under ``directory``,
    fsync them and the directory, and read them back (the disk method's floor; no hashing, no
    serialization). The files are removed afterwards."""
    if nbytes < 0 or files < 1:
        raise ValueError(f"nbytes must be >= 0 and files >= 1, got {nbytes}, {files}")
    os.makedirs(directory, exist_ok=True)
    work = os.path.join(directory, f".disk-floor-{uuid.uuid4().hex[:12]}")
    os.mkdir(work)
    chunk = bytearray(os.urandom(min(chunk_bytes, max(nbytes, 1))))
    sizes = [nbytes // files + (1 if i < nbytes % files else 0) for i in range(files)]
    try:
        t0 = time.perf_counter()
        paths = []
        for i, size in enumerate(sizes):
            path = os.path.join(work, f"part-{i:05d}")
            paths.append(path)
            with open(path, "wb", buffering=0) as f:
                left = size
                view = memoryview(chunk)
                while left:
                    n = f.write(view[:min(left, len(chunk))])
                    left -= n
                os.fsync(f.fileno())
        ckpt.fsync_dir(work)
        buf = bytearray(len(chunk))
        for path in paths:
            with open(path, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
