"""A reference-engine worker: one process per TP rank, driven over a Pipe by `ReferenceEngine`.

`serve` is the process entry point (started by `procs.start` in a fresh interpreter). It sets up the process (threads; glibc's mmap
threshold pinned so freed weights and KV cache go back to the OS), joins the TP process group
(gloo on CPU, NCCL on CUDA, with a timeout), builds its `TPModel` shard with deterministic random
weights and a KV cache, then answers requests one at a time: ``("cmd", args)`` in, ``("ok", result)``
or ``("err", kind, message, traceback)`` out, both as plain pickles (tensors travel by value here;
only weight payloads travel as handles, see `fsdp_sync.weights.handles`).

Weight updates are two-phase. ``stage`` opens this rank's payloads, checks every name, shape and
dtype, and records the writes without touching a weight; ``commit`` applies them (or, inside an
open transaction that protects valid weights, copies them aside to apply at ``end``); ``abort``
drops them. Every opened payload is acknowledged as soon as its memory is no longer needed
(a per-rank bucket's shared buffer, reused by its sender bucket after bucket, stays mapped until the
update ends, so it is not mapped anew every bucket: `_keep_mapped`). A
checkpoint directory (``update_weights_from_disk``) is staged the same way: this rank's share of
the files is checked against the manifest's sha256, every tensor's name, dtype and shape is
checked from the safetensors headers, and only this rank's slices are read (into CPU memory).

Memory tags: releasing ``weights`` drops the parameter tensors (contents lost, or kept as a CPU
backup when the engine was started with one); releasing ``kv_cache`` drops the cache;
``cuda_graph`` holds nothing here (no graphs are captured) and is accepted for SGLang parity. On
CUDA, `torch_memory_saver` is used when installed (same virtual addresses after resume), else the
tensors are freed and reallocated.

Not here: choosing ranks, sending payloads or deciding commit vs abort (that is `reference`).
"""

from __future__ import annotations

import collections
import ctypes
import datetime
import hashlib
import math
import os
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from ...weights import handles
from ...faultpoint import fault_point
from ...weights.bucket import dtype_name, unflatten
from ...weights.layout import TPLayout, rank_digest
from ...wire import open_flattened_bucket
from .generation import Decode
from .tp_model import Span, TPModel

__all__ = ["main", "serve"]

KIND_UPDATE, KIND_STATE, KIND_OTHER = "update", "state", "other"
MAX_MAPPED = 4      # per-rank bucket buffers kept mapped within one update (two per pipelined slot)


class WorkerError(Exception):
    """An error to report to the engine with its kind (update / state / other)."""

    def __init__(self, kind: str, message: str, name: str | None = None):
        super().__init__(message)
        self.kind, self.name = kind, name


# --------------------------------------------------------------------------- process setup

def _pin_malloc() -> Any:
    """Make glibc serve every allocation >= 128 KiB with its own mmap, and keep it so.

    glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB), after
    which same-sized blocks come from the heap and are not returned on free: released weights
    would stay in RSS. Setting the threshold explicitly turns that adjustment off.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)        # M_MMAP_THRESHOLD
        libc.mallopt(-1, 128 * 1024)        # M_TRIM_THRESHOLD
        return libc
    except (OSError, AttributeError):       # not glibc: nothing to pin
        return None


def _fmt_shape(shape: Any) -> str:
    return str(tuple(int(x) for x in shape))


@dataclass
class _Write:
    engine: str
    dst: tuple
    src: torch.Tensor
    covers: tuple[str, ...]


@dataclass
class _Txn:
    staging: bool                       # True: writes are copied aside and applied at end
    writes: list[_Write] = field(default_factory=list)
    covers: set[str] = field(default_factory=set)
    aborted: str | None = None


class Worker:
    def __init__(self, rank: int, tp: int, init_method: str | None, opts: dict):
        self.rank, self.tp, self.opts = rank, tp, opts
        self.libc = _pin_malloc()
        torch.set_num_threads(int(opts.get("num_threads") or 1))
        self.device = torch.device(opts["device"])
        if self.device.type == "cuda":
            idx = rank % torch.cuda.device_count()
            self.device = torch.device("cuda", idx)
            torch.cuda.set_device(self.device)
        self.dtype: torch.dtype = opts["dtype"]
        self.group = None
        if tp > 1:
            import torch.distributed as dist

            kw = {"device_id": self.device} if self.device.type == "cuda" else {}
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    init_method=init_method, rank=rank, world_size=tp,
                                    timeout=datetime.timedelta(seconds=float(opts["pg_timeout_s"])), **kw)
            self.group = dist.group.WORLD
        self.layout = TPLayout(opts["spec"], tp)   # a plain dataclass: workers never import transformers
        self.model = TPModel(self.layout, rank, dtype=self.dtype, device=self.device, group=self.group)
        self.saver = self._memory_saver() if self.device.type == "cuda" else None
        self.hf_set = set(self.layout.hf_names())
        self.engine_shapes = self.layout.engine_shapes()
        self.gen = torch.Generator().manual_seed(int(opts["seed"]))
        self.decode: Decode | None = None   # the generate call in progress (`gen_step`)
        # weights
        self.weights_released = False
        self.valid = True                   # weights hold a complete model
        self.dummy = True                   # ... but only the random start-up one: nothing to protect
        self.coverage: set[str] = set()     # HF names loaded since the weights became invalid
        self.backup: dict[str, torch.Tensor] | None = None
        self._alloc_weights()
        self.model.init_random(int(opts["seed"]))
        # KV cache
        self.kv_tokens = self._kv_budget()
        self.kv: torch.Tensor | None = None
        self.kv_released = False
        self._alloc_kv()
        self.cuda_graph_released = False
        # updates
        self.call: list[_Write] | None = None
        self.received: list[handles.Received] = []
        self.txn: _Txn | None = None
        self.fault: str | None = None
        self.update_groups: dict[str, Any] = {}     # weight-update groups (group name -> ProcessGroup)
        self.in_update = False              # between begin and end (transactional or not)
        self.keep_call = False              # this call's buffers are the update's, reused call after call
        self.mapped: collections.OrderedDict[int, torch.UntypedStorage] = collections.OrderedDict()
        self.closed = False

    # ----------------------------------------------------------------- memory
    def _memory_saver(self) -> Any:
        if not self.opts.get("use_memory_saver", True):
            return None
        try:
            import torch_memory_saver as tms  # noqa: F401 - optional
        except ImportError:
            return None
        saver = getattr(tms, "torch_memory_saver", None) or getattr(tms, "memory_saver", None)
        if saver is None and hasattr(tms, "TorchMemorySaver"):
            saver = tms.TorchMemorySaver()
        if saver is not None and hasattr(saver, "hook_mode"):
            try:
                saver.hook_mode = "torch"   # no LD_PRELOAD needed
            except Exception:  # noqa: BLE001 - older versions fix the mode
                pass
        return saver

    def _region(self, tag: str, backup: bool = False):
        from contextlib import nullcontext

        if self.saver is None:
            return nullcontext()
        try:
            return self.saver.region(tag=tag, enable_cpu_backup=backup)
        except TypeError:
            return self.saver.region(tag=tag)

    def _alloc_weights(self) -> None:
        with self._region("weights", bool(self.opts.get("weights_cpu_backup"))):
            self.model.allocate()

    def _kv_shape(self, tokens: int) -> tuple[int, ...]:
        s = self.layout.spec
        return (s.num_layers, 2, tokens, self.layout.kv_local, s.head_dim)

    def _kv_bytes_per_token(self) -> int:
        s = self.layout.spec
        return s.num_layers * 2 * self.layout.kv_local * s.head_dim * self.dtype.itemsize

    def _kv_budget(self) -> int:
        if self.opts.get("kv_cache_tokens") is not None:
            return int(self.opts["kv_cache_tokens"])
        frac = float(self.opts["mem_fraction"])
        if self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[1]
        else:
            import psutil

            total = psutil.virtual_memory().total / self.tp     # ranks share the host's memory
        budget = frac * total - self.model.nbytes()
        tokens = int(budget // self._kv_bytes_per_token())
        if tokens < 1:
            raise WorkerError(KIND_STATE, f"mem_fraction {frac} of {total / 2**30:.1f} GiB leaves no room "
                                          f"for a KV cache after {self.model.nbytes() / 2**20:.1f} MiB "
                                          f"of weights on TP rank {self.rank}")
        return tokens

    def _alloc_kv(self) -> None:
        with self._region("kv_cache"):
            self.kv = torch.zeros(self._kv_shape(self.kv_tokens), dtype=self.dtype, device=self.device)

    def _trim(self) -> None:
        # no gc.collect(): freed tensors go at once (reference counts), and a full collection in a
        # process with torch loaded cost ~100 ms of every release
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if self.libc is not None:
            self.libc.malloc_trim(0)

    def release(self, tags: list[str]) -> None:
        if self.call is not None or self.txn is not None:
            raise WorkerError(KIND_STATE, "cannot release memory while a weight update is open")
        for tag in tags:
            if tag == "kv_cache" and not self.kv_released:
                if self.saver is not None:
                    self.saver.pause("kv_cache")
                else:
                    self.kv = None
                self.kv_released = True
            elif tag == "weights" and not self.weights_released:
                backup = bool(self.opts.get("weights_cpu_backup"))
                if self.saver is not None:
                    self.saver.pause("weights")   # tms keeps a CPU copy when the region asked for one
                elif backup:
                    # On CPU the backup *is* the weights (no copy, nothing freed); on CUDA a copy.
                    self.backup = {k: (v if v.device.type == "cpu" else v.to("cpu"))
                                   for k, v in self.model.params.items()}
                    self.model.params = {}
                else:
                    self.model.params = {}
                self.weights_released = True
                if not backup:
                    self.valid, self.coverage = False, set()
            elif tag == "cuda_graph":
                self.cuda_graph_released = True
        self._trim()

    def resume(self, tags: list[str]) -> None:
        if self.call is not None or self.txn is not None:
            raise WorkerError(KIND_STATE, "cannot resume memory while a weight update is open")
        for tag in tags:
            if tag == "weights" and self.weights_released:
                if self.saver is not None:
                    self.saver.resume("weights")
                elif self.backup is not None:
                    self.model.params = {k: v.to(self.device) for k, v in self.backup.items()}
                    self.backup = None
                else:
                    self._alloc_weights()     # zeros: the contents were lost with the release
                self.weights_released = False
            elif tag == "kv_cache" and self.kv_released:
                if self.saver is not None:
                    self.saver.resume("kv_cache")
                else:
                    self._alloc_kv()
                self.kv_released = False
            elif tag == "cuda_graph":
                self.cuda_graph_released = False

    def memory_stats(self) -> dict:
        import psutil

        proc = psutil.Process()
        try:
            full = proc.memory_full_info()
            rss, uss = int(full.rss), int(full.uss)
        except (psutil.Error, OSError):
            rss, uss = int(proc.memory_info().rss), 0
        staging = 0
        if self.txn is not None:
            staging = sum(w.src.numel() * w.src.element_size() for w in self.txn.writes)
        out = {
            "rank": self.rank, "pid": os.getpid(), "alive": True,
            "weights_bytes": 0 if self.weights_released else self.model.nbytes(),
            "kv_cache_bytes": 0 if self.kv_released else self.kv.numel() * self.kv.element_size(),
            "kv_cache_tokens": self.kv_tokens,
            "cpu_backup_bytes": sum(v.numel() * v.element_size() for v in (self.backup or {}).values()),
            "staging_bytes": staging,
            "weights_valid": self.valid and not self.weights_released,
            "rss": rss, "uss": uss,
        }
        if self.device.type == "cuda":
            out["cuda"] = {"allocated": int(torch.cuda.memory_allocated(self.device)),
                           "reserved": int(torch.cuda.memory_reserved(self.device)),
                           "max_allocated": int(torch.cuda.max_memory_allocated(self.device))}
        return out

    # ----------------------------------------------------------------- weight updates
    def _mismatch(self, name: str, what: str, expected: Any, got: Any) -> WorkerError:
        return WorkerError(KIND_UPDATE, f"expected {what} {expected} for {name!r} on TP rank {self.rank}, "
                                        f"got {got}", name)

    def _check(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        if not isinstance(t, torch.Tensor):
            raise self._mismatch(name, "a", "tensor", type(t).__name__)
        if t.dtype != self.dtype:
            err = self._mismatch(name, "dtype", dtype_name(self.dtype), dtype_name(t.dtype))
            want = dtype_name(self.dtype)
            hint = (f"; the engine runs in {want}: send {want} tensors (FSDPShardingManager "
                           f"casts them with SyncConfig(dtype=torch.{want}))")
            raise WorkerError(err.kind, str(err) + hint, name)
        if tuple(t.shape) != tuple(shape):
            raise self._mismatch(name, "shape", _fmt_shape(shape), _fmt_shape(t.shape))

    def _hf_writes(self, name: str, t: torch.Tensor, out: list[_Write]) -> None:
        if not self.layout.accepts(name):
            raise WorkerError(KIND_UPDATE, f"unknown parameter {name!r} on TP rank {self.rank}: not a "
                                           f"{self.layout.spec.model_type} parameter name of this model "
                                           f"(e.g. {self.layout.hf_names()[1]!r})", name)
        self._check(name, t, self.layout.full_shape(name))
        if name == "lm_head.weight" and self.layout.spec.tie_word_embeddings:
            self._check_tied_head(t, out)
        for pl in self.layout.placements(name, self.rank):
            out.append(_Write(pl.engine, pl.dst, t[pl.src], (name,)))
        if not self.layout.placements(name, self.rank) and name in self.hf_set:
            out.append(_Write("", (), t[:0], (name,)))   # holds no piece here, but counts as loaded

    def _check_tied_head(self, head: torch.Tensor, out: list[_Write]) -> None:
        """This engine ties lm_head to embed_tokens, so a sent ``lm_head.weight`` is not loaded:
        it must equal the embedding (this call's, this transaction's, or the loaded one), or the
        engine would serve other logits than the trainer's (an untied trainer)."""
        emb = "model.embed_tokens.weight"
        for pl in self.layout.placements(emb, self.rank):
            latest = next((w.src for w in reversed(out) if emb in w.covers and w.engine == pl.engine), None)
            if latest is None and self.txn is not None and self.txn.staging:
                latest = next((w.src for w in reversed(self.txn.writes)
                               if emb in w.covers and w.engine == pl.engine), None)
            if latest is None:
                if self.weights_released or pl.engine not in self.model.params:
                    continue
                latest = self.model.params[pl.engine][pl.dst]
            if not torch.equal(head[pl.src].to(latest.device), latest):
                raise WorkerError(KIND_UPDATE, f"'lm_head.weight' differs from {emb!r} on TP rank "
                                               f"{self.rank}, but this engine ties them "
                                               f"(tie_word_embeddings=True) and would drop it: the "
                                               f"sender's model is untied; start the engine from "
                                               f"the trainer's config", "lm_head.weight")

    def _direct_writes(self, name: str, t: torch.Tensor, out: list[_Write]) -> None:
        if name not in self.engine_shapes:
            raise WorkerError(KIND_UPDATE, f"unknown parameter {name!r} on TP rank {self.rank}: not one "
                                           f"of the engine's own (direct-layout) parameter names "
                                           f"(e.g. 'model.layers.0.self_attn.qkv_proj.weight')", name)
        self._check(name, t, self.engine_shapes[name])
        out.append(_Write(name, (slice(None),), t, tuple(self.layout.engine_covers(name))))

    def _open(self, payload: Any) -> Any:
        try:
            rec = handles.open_payload(payload, self.rank)
        except Exception as exc:  # noqa: BLE001 - a bad payload is a refused update
            raise WorkerError(KIND_UPDATE, f"could not open the payload for TP rank {self.rank}: "
                                           f"{type(exc).__name__}: {exc}") from exc
        self.received.append(rec)
        if self.keep_call and self.in_update:
            handles._for_each_cpu_storage(rec.value, self._keep_mapped)
        return rec.value

    def _keep_mapped(self, storage: torch.UntypedStorage) -> None:
        """Keep a per-rank bucket's shared buffer mapped until the update ends: the sender reuses
        its buffers bucket after bucket (`load_rank_bucket`), so the next bucket's payload opens
        this mapping again (torch's shared-storage cache) instead of mapping and faulting in the
        same pages anew. At most ``MAX_MAPPED`` buffers are kept (the least recently used goes
        first), so a sender that does make a new buffer per call holds no more than that."""
        key = storage.data_ptr()
        self.mapped[key] = storage
        self.mapped.move_to_end(key)
        while len(self.mapped) > MAX_MAPPED:
            self.mapped.popitem(last=False)

    def _maybe_fault(self) -> None:
        if self.fault == "die_in_stage":
            os.kill(os.getpid(), signal.SIGKILL)

    def stage(self, items: list, keep_mapped: bool = False) -> dict:
        """Phase one: open, check and record every write of one call; weights are not touched.
        ``keep_mapped``: the call's shared buffers stay mapped until the update ends (see
        `_keep_mapped`)."""
        if self.call is not None:
            raise WorkerError(KIND_STATE, "an earlier update on this rank was neither committed nor aborted")
        if self.weights_released:
            raise WorkerError(KIND_STATE, f"weights are released on TP rank {self.rank}; call "
                                          f"resume_memory_occupation(['weights']) before updating them")
        if self.txn is not None and self.txn.aborted:
            raise WorkerError(KIND_STATE, f"this weight update was aborted: {self.txn.aborted}")
        writes: list[_Write] = []
        self.call = writes
        self.keep_call = bool(keep_mapped)
        seen: set[str] = set()
        self.bytes_read = 0
        for item in items:
            kind, layout_kind = item[0], item[1]
            if kind == "disk":
                (self._stage_disk if layout_kind == "hf" else self._stage_disk_ranked)(item[2], writes, seen)
                self._maybe_fault()
                continue
            if kind == "bucket":
                value = self._open(item[2])
                try:
                    named = open_flattened_bucket(value)
                except ValueError as exc:
                    raise WorkerError(KIND_UPDATE, f"TP rank {self.rank}: {exc}") from exc
            else:
                name, payload = item[2], item[3]
                value = self._open(payload) if isinstance(payload, (bytes, bytearray, str)) else payload
                named = [(name, value)]
            for name, t in named:
                if name in seen:
                    raise WorkerError(KIND_UPDATE, f"{name!r} appears twice in one update "
                                                   f"(TP rank {self.rank})", name)
                seen.add(name)
                (self._hf_writes if layout_kind == "hf" else self._direct_writes)(name, t, writes)
            self._maybe_fault()
        return {"writes": len(writes), "bytes_read": self.bytes_read}

    def _stage_disk(self, spec: dict, writes: list[_Write], seen: set[str]) -> None:
        """A checkpoint directory: verify this rank's share of the files against the manifest,
        then check every tensor's name, dtype and shape from the file headers and read only this
        rank's slices (`SliceReader`: no full tensor is materialized for a sharded one)."""
        from ...weights.hf_checkpoint import SAFETENSORS_DTYPES, CheckpointError, SliceReader, verify_file

        directory = spec["dir"]
        for file, sha in spec["verify"].items():
            try:
                verify_file(directory, file, sha)
            except CheckpointError as exc:
                raise WorkerError(KIND_UPDATE, f"{exc} (TP rank {self.rank})") from exc
            self.bytes_read += os.path.getsize(os.path.join(directory, file))
        index = spec.get("index")
        for file in spec["files"]:
            path = os.path.join(directory, file)
            try:
                with SliceReader(path) as f:   # not safe_open's slices: they leak (see SliceReader)
                    names = list(f.keys())
                    if index is not None:
                        listed = {n for n, fl in index.items() if fl == file}
                        missing, extra = sorted(listed - set(names)), sorted(set(names) - listed)
                        if missing:
                            raise WorkerError(KIND_UPDATE, f"{path}: the index places tensor {missing[0]!r} "
                                                           f"in this file, but the file lacks it "
                                                           f"({len(missing)} such names)", missing[0])
                        if extra:
                            raise WorkerError(KIND_UPDATE, f"{path}: the file holds tensor {extra[0]!r}, "
                                                           f"which the index does not place in it "
                                                           f"({len(extra)} such names)", extra[0])
                    for name in names:
                        if name in seen:
                            raise WorkerError(KIND_UPDATE, f"{path}: tensor {name!r} appears twice in "
                                                           f"the checkpoint (TP rank {self.rank})", name)
                        seen.add(name)
                        self._disk_writes(path, name, f, writes, SAFETENSORS_DTYPES)
            except WorkerError:
                raise
            except Exception as exc:  # noqa: BLE001 - a torn header, a short file: a refused update
                raise WorkerError(KIND_UPDATE, f"cannot read {path} on TP rank {self.rank}: "
                                               f"{type(exc).__name__}: {exc}") from exc

    def _stage_disk_ranked(self, spec: dict, writes: list[_Write], seen: set[str]) -> None:
        """This rank's files of a per-rank checkpoint (``layout="engine"``): each is read once,
        checked against the manifest's sha256 on the bytes read, and must hold exactly the tensor
        names the manifest lists for it; every tensor is checked as a ``direct`` update (engine
        name, this rank's shape, dtype). No other rank's file is opened."""
        from ...weights.hf_checkpoint import CheckpointError, engine_name_of, read_verified

        directory = spec["dir"]
        for file in spec["files"]:
            path = os.path.join(directory, file)
            try:
                tensors, size = read_verified(path, spec["sha256"][file])
            except CheckpointError as exc:
                raise WorkerError(KIND_UPDATE, f"{exc} (TP rank {self.rank})") from exc
            self.bytes_read += size
            listed = list(spec["names"][file])
            if sorted(tensors) != sorted(listed):
                diff = sorted(set(tensors) ^ set(listed))
                raise WorkerError(KIND_UPDATE, f"{path}: holds other tensors than the manifest lists "
                                               f"for it (e.g. {diff[:2]}; TP rank {self.rank})",
                                  diff[0] if diff else None)
            tied = bool(self.layout.spec.tie_word_embeddings)
            for key in listed:
                name = engine_name_of(key, tied)     # a tied embedding is keyed lm_head.weight
                if name in seen:
                    raise WorkerError(KIND_UPDATE, f"{path}: tensor {key!r} appears twice in this "
                                                   f"rank's files (TP rank {self.rank})", name)
                seen.add(name)
                try:
                    self._direct_writes(name, tensors[key], writes)
                except WorkerError as exc:
                    raise WorkerError(exc.kind, f"{path}: {exc}", name) from exc

    def _disk_writes(self, path: str, name: str, f: Any, out: list[_Write], dtypes: dict) -> None:
        if not self.layout.accepts(name):
            raise WorkerError(KIND_UPDATE, f"{path}: unknown parameter {name!r} on TP rank {self.rank}: "
                                           f"not a {self.layout.spec.model_type} parameter name of this "
                                           f"model (e.g. {self.layout.hf_names()[1]!r})", name)
        code = f.dtype_code(name)
        dtype = dtypes.get(code)
        if dtype != self.dtype:
            raise WorkerError(KIND_UPDATE, f"{path}: expected dtype {dtype_name(self.dtype)} for {name!r} "
                                           f"on TP rank {self.rank}, got {dtype_name(dtype) if dtype else code}",
                              name)
        shape = f.shape(name)
        want = tuple(self.layout.full_shape(name))
        if shape != want:
            raise WorkerError(KIND_UPDATE, f"{path}: expected shape {_fmt_shape(want)} for {name!r} on "
                                           f"TP rank {self.rank}, got {_fmt_shape(shape)}", name)
        placements = self.layout.placements(name, self.rank)
        for pl in placements:
            piece = f.read(name, pl.src)
            self.bytes_read += piece.numel() * piece.element_size()
            out.append(_Write(pl.engine, pl.dst, piece, (name,)))
        if not placements and name in self.hf_set:
            out.append(_Write("", (), torch.empty(0, dtype=self.dtype), (name,)))   # counts as loaded

    def _apply(self, writes: list[_Write]) -> None:
        params = self.model.params
        for w in writes:
            if w.engine:
                params[w.engine][w.dst].copy_(w.src)

    def _ack_all(self) -> None:
        for rec in self.received:
            rec.ack()
        self.received = []

    def _covered(self, covers: set[str]) -> None:
        if self.valid:
            return
        self.coverage |= covers
        if self.coverage >= self.hf_set:
            self.valid, self.coverage = True, set()

    def commit(self) -> dict:
        """Phase two for one call: apply (or, inside a staging transaction, copy aside)."""
        writes, self.call = self.call or [], None
        try:
            covers = {c for w in writes for c in w.covers}
            if self.txn is None:
                self._apply(writes)
                self._covered(covers)
                self.dummy = False
            elif self.txn.staging:
                for w in writes:
                    w.src = w.src.to("cpu", copy=True)   # the sender frees its buffer after the call
                self.txn.writes.extend(writes)
                self.txn.covers |= covers
            else:
                self._apply(writes)                     # nothing to protect: write in place
                self.txn.covers |= covers
                self.dummy = False
        except BaseException:
            self.valid = False
            raise
        finally:
            del writes
            self._ack_all()
        return {}

    def abort(self, reason: str = "") -> dict:
        self.call = None
        self._ack_all()
        if self.txn is not None and not self.txn.aborted:
            if not self.txn.staging:
                self.coverage -= self.txn.covers        # those params now hold aborted data
            self.txn.writes, self.txn.aborted = [], reason or "aborted"
        return {}

    def begin(self, transactional: bool) -> dict:
        if self.txn is not None:
            raise WorkerError(KIND_STATE, "begin_weight_update called twice without end_weight_update")
        self.mapped.clear()
        self.in_update = True
        if not transactional:
            return {"staging": False}       # each call commits on its own, as outside begin/end
        # Stage copies only when there is something worth protecting: loaded, valid weights.
        self.txn = _Txn(staging=self.valid and not self.weights_released and not self.dummy)
        return {"staging": self.txn.staging}

    def end(self, abort: bool = False) -> dict:
        self.in_update = False
        self.mapped.clear()                 # the update's buffers: the sender frees them now
        txn, self.txn = self.txn, None
        if txn is None:
            return {"committed": False}
        if abort or txn.aborted:
            if not txn.staging:
                self.coverage -= txn.covers
            return {"committed": False}
        try:
            if txn.staging:
                self._apply(txn.writes)
            else:
                self._covered(txn.covers)
        except BaseException:
            self.valid = False
            raise
        finally:
            txn.writes = []
            if txn.staging:
                self._trim()    # give the staged copies back to the OS; nothing to trim otherwise
        return {"committed": True}

    # ----------------------------------------------------------------- serving
    def _require_weights(self) -> None:
        if self.weights_released:
            raise WorkerError(KIND_STATE, "weights are released; resume_memory_occupation(['weights']) "
                                          "and push weights before serving")
        if not self.valid:
            missing = [n for n in self.layout.hf_names() if n not in self.coverage]
            raise WorkerError(KIND_STATE, f"weights were released without a CPU backup and not all pushed "
                                          f"again: {len(missing)} of {len(self.hf_set)} tensors missing "
                                          f"(e.g. {missing[0]!r})")

    @torch.no_grad()
    def forward_logits(self, prompts: list[list[int]], all_positions: bool) -> Any:
        self._require_weights()
        ids, pos, spans, rows = self._pack(prompts, [0] * len(prompts), all_positions)
        logits = self.model.forward(ids, pos, spans, None, rows)
        if self.rank != 0:
            return None
        logits = logits.cpu()
        if not all_positions:
            return logits
        return list(logits.split([len(p) for p in prompts]))

    def _pack(self, chunks: list[list[int]], starts: list[int], all_positions: bool,
              slots: list[int] | None = None):
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
        pos = torch.cat([torch.arange(s, s + len(c)) for c, s in zip(chunks, starts)])
        spans, off, rows = [], 0, []
        for i, (c, s) in enumerate(zip(chunks, starts)):
            spans.append(Span(off, len(c), slots[i] if slots else 0, s))
            rows.extend(range(off, off + len(c)) if all_positions else [off + len(c) - 1])
            off += len(c)
        return ids.to(self.device), pos.to(self.device), spans, torch.tensor(rows, device=self.device)

    def gen_begin(self, a: dict) -> None:
        """Start a generate call (`generation.Decode`); the client then drives `gen_step`."""
        self._require_weights()
        if self.kv_released:
            raise WorkerError(KIND_STATE, "the KV cache is released; call "
                                          "resume_memory_occupation(['kv_cache']) before generating")
        try:
            self.decode = Decode(self.model, self.kv, self.kv_tokens, self.device, a["prompts"],
                                 a["rows"], self.gen, bool(a.get("logprobs")))
        except ValueError as exc:
            raise WorkerError(KIND_STATE, str(exc)) from None

    @torch.no_grad()
    def gen_step(self, a: dict) -> dict | None:
        if self.decode is None:
            raise WorkerError(KIND_STATE, "gen_step without gen_begin")
        if a.get("drop"):
            self.decode.drop(a["drop"])
        # up to `steps` forwards per call: each call is a round trip to the client, which only
        # needs one per step to stream every token or to drop an aborted row at once
        out: dict = {"tokens": {}, "logprobs": {}, "ended": {}}
        for _ in range(max(1, int(a.get("steps", 1)))):
            one = self.decode.step()
            for key in ("tokens", "logprobs"):
                for row, v in one[key].items():
                    out[key].setdefault(row, []).append(v)
            out["ended"].update(one["ended"])
            if self.decode.finished:
                break
        out["finished"] = self.decode.finished
        return out if self.rank == 0 else {"finished": out["finished"]}

    def pieces(self, names: list[str]) -> dict:
        """This rank's owned pieces of full HF tensors: ``{name: [(src slices, tensor), ...]}``."""
        self._require_weights()
        out = {}
        for name in names:
            if not self.layout.accepts(name):
                raise WorkerError(KIND_OTHER, f"unknown parameter {name!r}; HF names of this model are "
                                              f"e.g. {self.layout.hf_names()[:2]}")
            if name == "lm_head.weight" and self.layout.spec.tie_word_embeddings:
                name_src = "model.embed_tokens.weight"
            else:
                name_src = name
            out[name] = [(pl.src, self.model.params[pl.engine][pl.dst].cpu().clone())
                         for pl in self.layout.placements(name_src, self.rank) if pl.owner]
        return out

    def rank_digests(self, names: list[str]) -> dict:
        """``{name: layout.rank_digest}`` of the pieces of each HF tensor this rank serves."""
        self._require_weights()
        bad = [n for n in names if not self.layout.accepts(n)]
        if bad:
            raise WorkerError(KIND_OTHER, f"unknown parameter {bad[0]!r}; HF names of this model are "
                                          f"e.g. {self.layout.hf_names()[:2]}")
        params = self.model.params
        return {n: rank_digest(self.layout, n, self.rank, lambda pl: params[pl.engine][pl.dst])
                for n in names}

    def shard_checksum(self) -> str:
        h = hashlib.sha256()
        if self.weights_released:
            return "released"
        for k in self.engine_shapes:
            t = self.model.params[k].detach().cpu().contiguous()
            h.update(k.encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        return h.hexdigest()

    # ----------------------------------------------------------------- loop
    def handle(self, cmd: str, args: dict) -> Any:
        tags = args.get("tags") if cmd in ("resume", "release") and isinstance(args, dict) else None
        fault_point("worker", self.rank, cmd + (":" + ",".join(tags) if tags else ""))  # FSDP_SYNC_FAULT
        if cmd == "stage":
            return self.stage(args["items"], bool(args.get("keep_mapped")))
        if cmd == "commit":
            return self.commit()
        if cmd == "abort":
            return self.abort(args.get("reason", ""))
        if cmd == "begin":
            return self.begin(bool(args.get("transactional", True)))
        if cmd == "end":
            return self.end(bool(args.get("abort")))
        if cmd == "gen_begin":
            return self.gen_begin(args)
        if cmd == "gen_step":
            return self.gen_step(args)
        if cmd == "gen_end":
            self.decode = None
            return None
        if cmd == "forward_logits":
            return self.forward_logits(args["prompts"], args["all_positions"])
        if cmd == "pieces":
            return self.pieces(args["names"])
        if cmd == "release":
            return self.release(args["tags"])
        if cmd == "resume":
            return self.resume(args["tags"])
        if cmd == "flush_cache":
            return None   # no prefix cache: nothing outlives a generate call
        if cmd == "memory_stats":
            return self.memory_stats()
        if cmd == "shard_checksum":
            return self.shard_checksum()
        if cmd == "rank_digests":
            return self.rank_digests(args["names"])
        if cmd == "join_group":
            return self.join_group(args)
        if cmd == "leave_group":
            return self.leave_group(args["group_name"])
        if cmd == "stage_broadcast":
            return self.stage(self.receive_broadcast(args))
        if cmd == "receive_raw":      # benchmark floor: bare broadcasts, received and dropped
            import torch.distributed as dist

            buf = torch.empty(int(args["nbytes"]), dtype=torch.uint8, device=self.device)
            pg = self.update_groups[args["group_name"]]
            for _ in range(int(args["count"])):
                if args.get("p2p"):   # the per-rank floor: one point-to-point message each
                    dist.recv(buf, group=pg, group_src=0)
                else:
                    dist.broadcast(buf, src=0, group=pg)
            return None
        if cmd == "set_fault":
            self.fault = args["fault"]
            return None
        raise WorkerError(KIND_OTHER, f"unknown command {cmd!r}")

    # ----------------------------------------------------------------- update_weights_from_distributed
    def join_group(self, a: dict) -> dict:
        from ...wire import new_update_group

        self.leave_group(a["group_name"])
        try:
            self.update_groups[a["group_name"]] = new_update_group(
                backend=a["backend"], master_address=a["master_address"], master_port=a["master_port"],
                world_size=a["world_size"], rank=a["rank"], group_name=a["group_name"],
                timeout_s=float(self.opts.get("update_recv_timeout_s", 60.0)))
        except Exception as exc:  # noqa: BLE001 - reported to the engine
            raise WorkerError(KIND_UPDATE, f"TP rank {self.rank} could not join weight-update group "
                                           f"{a['group_name']!r} at {a['master_address']}:{a['master_port']} "
                                           f"as rank {a['rank']}/{a['world_size']}: {exc}") from exc
        return {}

    def leave_group(self, group_name: str) -> dict:
        from ...wire import destroy_update_group

        pg = self.update_groups.pop(group_name, None)
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # noqa: BLE001 - destroying it is what matters
                pass
            destroy_update_group(pg)
        return {}

    def receive_broadcast(self, a: dict) -> list:
        """Receive one ``update_weights_from_distributed`` call's tensors from group rank 0, as
        SGLang's receiver does (per tensor, or one tight flattened buffer; or fsdp_sync's
        ``per_rank_bucket``: only this rank's shard, one ``recv``), into fresh buffers;
        returns stage items. Nothing is written to the weights here."""
        import torch.distributed as dist

        from ...wire import PER_RANK_BUCKET, per_rank_bucket_plan

        name = a["group_name"]
        pg = self.update_groups.get(name)
        if pg is None:
            raise WorkerError(KIND_UPDATE, f"TP rank {self.rank} is not in weight-update group {name!r}")
        entries = a["entries"]
        try:
            if a["load_format"] == PER_RANK_BUCKET:   # only this rank's shard, sent to it alone
                bkt = per_rank_bucket_plan(entries)
                flat = torch.empty(bkt.nbytes, dtype=torch.uint8, device=self.device)
                if bkt.nbytes:
                    dist.recv(flat, group=pg, group_src=0)
                return [("tensor", "direct", n, t) for n, t in unflatten(flat, bkt.entries)]
            if a["load_format"] == "flattened_bucket":
                total = sum(math.prod(s) * d.itemsize for _, d, s in entries)
                flat = torch.empty(total, dtype=torch.uint8, device=self.device)
                if total:
                    dist.broadcast(flat, src=0, group=pg)
                out, off = [], 0
                for n, d, s in entries:
                    nb = math.prod(s) * d.itemsize
                    out.append((n, flat[off:off + nb].view(d).view(s)))
                    off += nb
            else:
                out = [(n, torch.empty(s, dtype=d, device=self.device)) for n, d, s in entries]
                works = [dist.broadcast(t, src=0, group=pg, async_op=True) for _, t in out if t.numel()]
                for w in works:
                    w.wait()
        except Exception as exc:  # noqa: BLE001 - a torn receive: the group is unusable now
            self.leave_group(name)
            raise WorkerError(KIND_UPDATE, f"TP rank {self.rank}: receiving {len(entries)} tensors "
                                           f"(first {entries[0][0]!r}) over weight-update group {name!r} "
                                           f"failed, nothing was loaded and the group was left: "
                                           f"{type(exc).__name__}: {str(exc)[:300]}") from exc
        return [("tensor", "hf", n, t) for n, t in out]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for name in list(self.update_groups):
            try:
                self.leave_group(name)
            except Exception:  # noqa: BLE001 - shutting down
                pass
        self.abort("shutdown")
        self.txn = None
        self.in_update = False
        self.mapped.clear()
        self.model.params, self.kv, self.backup = {}, None, None
        if self.group is not None:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may be gone already
                pass


def _send(conn: Any, msg: Any) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def _error_reply(exc: BaseException) -> tuple:
    kind = exc.kind if isinstance(exc, WorkerError) else KIND_OTHER
    name = exc.name if isinstance(exc, WorkerError) else None
    msg = str(exc) if isinstance(exc, WorkerError) else f"{type(exc).__name__}: {exc}"
    return ("err", kind, msg, traceback.format_exc(), name)


def main(rank: int, tp: int, init_method: str | None, conn: Any, opts: dict) -> None:
    """Process entry point: build the shard, say ready, serve until shutdown or the parent is gone.

    Requests are ``(seq, cmd, args)``; replies ``(seq, "ok", result)`` or
    ``(seq, "err", kind, message, traceback, name)``. The engine drops replies of an older ``seq``.
    """
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the engine's process handles Ctrl-C and stops us
    try:
        worker = Worker(rank, tp, init_method, opts)
    except BaseException as exc:  # noqa: BLE001 - the engine shows this to its caller
        try:
            _send(conn, (0, *_error_reply(exc)))
        finally:
            conn.close()
        return
    try:
        _send(conn, (0, "ok", {"pid": os.getpid(), "kv_cache_tokens": worker.kv_tokens}))
    except OSError:                     # the engine's process is gone: nobody to serve
        worker.close()
        conn.close()
        return
    try:
        while True:
            if not conn.poll(1.0):
                if os.getppid() != parent:   # orphaned: the engine's process is gone
                    break
                continue
            try:
                seq, cmd, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            if cmd == "shutdown":
                worker.close()
                try:
                    _send(conn, (seq, "ok", None))
                except OSError:
                    pass
                break
            try:
                reply = (seq, "ok", worker.handle(cmd, args))
            except BaseException as exc:  # noqa: BLE001 - every failure goes back to the engine
                if cmd in ("stage", "stage_broadcast"):   # nothing of a failed stage survives here
                    worker.call = None
                    worker._ack_all()
                reply = (seq, *_error_reply(exc))
            try:
                _send(conn, reply)
            except OSError:
                break
    finally:
        try:
            worker.close()
        finally:
            conn.close()
            sys.stdout.flush()


def serve(conn: Any, rank: int, tp: int, init_method: str | None, opts: dict) -> None:
    """`procs.start`'s entry point: ``main`` with the connection first."""
    main(rank, tp, init_method, conn, opts)
