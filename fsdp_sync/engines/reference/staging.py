"""Weight-update staging for one reference worker: the `UpdateStager` its `Worker` owns.

Weight updates are two-phase. ``stage`` opens this rank's payloads, checks every name, shape and
dtype, and records the writes without touching a weight; ``commit`` applies them (or, inside an
open transaction that protects valid weights, copies them aside to apply at ``end``); ``abort``
drops them. Every opened payload is acknowledged as soon as its memory is no longer needed
(a per-rank bucket's shared buffer, reused by its sender bucket after bucket, stays mapped until the
update ends, so it is not mapped, or on CUDA opened, anew every bucket: `_keep_mapped`). A checkpoint directory
(``update_weights_from_disk``) is staged the same way: this rank's share of the files is checked
against the manifest's digests, every tensor's name, dtype and shape is checked from the safetensors
headers, and only this rank's slices are read (into CPU memory); asked for a complete one
(``complete``, what `fsdp-sync serve` asks), a checkpoint lacking any tensor this rank holds is
refused. A per-rank checkpoint's files are only hashed while staging (`weights.verified_file`,
their descriptors kept open): the commit reads them straight into the weights, so no staged copy
of the shard is held.

Every tensor must come in the dtype the engine's layout holds it in (`TPLayout.dtype_of`: the
rollout dtype, or for a block-FP8 engine float8_e4m3fn weights and float32 ``weight_scale_inv``
scales), whichever path it came by (HF-named tensors, ``direct`` engine-named ones, a checkpoint);
a tensor in another is refused naming it, both dtypes and what to change (`quant.dtype_refusal`).
One exception, as SGLang's loader casts: a Hugging Face checkpoint that is not a sync's version
(no ``fsdp_sync_manifest.json``: ``save_pretrained``'s bfloat16 into a float32 engine, say) has
its floating-point tensors that the engine holds in the rollout dtype cast to it (never FP8
weights or their scales). Rotary tables a Hub checkpoint may carry (``rotary_emb.inv_freq``,
``cos_cached``, ``sin_cached``) are skipped, as SGLang skips them.

Not here: the process loop and command dispatch (`worker`), memory release/resume (`regions`),
deciding commit vs abort (`engine`).
"""

from __future__ import annotations

import collections
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ...faultpoint import fault_point
from ...weights import handles
from ...weights.bucket import KnownMetadata, copy_many, dtype_name
from ...weights.experts import fused_hint
from ...wire import open_flattened_bucket
from .errors import KIND_STATE, KIND_UPDATE, NOTHING_APPLIED, WorkerError
from .quant import dtype_refusal, scale_refusal
from .tied_head import HEAD, TiedHeads

__all__ = ["UpdateStager", "Write", "Txn", "MAX_MAPPED", "stage_aside"]

MAX_MAPPED = 4      # per-rank bucket buffers kept mapped within one update (two per pipelined slot)


def _holding(names: list[str]) -> str:
    """``; it holds 'a', 'b' and 3 more``: the tensors a refused file carries (a digest is per
    file, so these are the tensors that may be damaged)."""
    if not names:
        return ""
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return "; it holds " + ", ".join(repr(n) for n in names[:3]) + more


def _fp8(d: Any) -> bool:
    return isinstance(d, torch.dtype) and d.is_floating_point and d.itemsize == 1


def _float_cast(got: Any, want: Any) -> bool:
    """``got`` -> ``want`` is a plain cast between floating-point dtypes, neither of them FP8."""
    return all(isinstance(d, torch.dtype) and d.is_floating_point and not _fp8(d) for d in (got, want))


def fmt_shape(shape: Any) -> str:
    return str(tuple(int(x) for x in shape))


def stage_aside(src: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, bool]:
    """A copy of a sender's tensor, kept until the transaction ends: on the weights' ``device``
    (a device copy, and the shard the plan budgets for an engine that stages), or in host memory
    where that device has no room for it (then two trips over the host link instead). Returns
    the copy and whether it went to the host."""
    if device.type != "cpu":
        try:
            return src.to(device, copy=True), False
        except torch.OutOfMemoryError:
            pass
    return src.to("cpu", copy=True), device.type != "cpu"


@dataclass
class Write:
    engine: str
    dst: tuple
    src: torch.Tensor
    covers: tuple[str, ...]
    owned: bool = False     # src is this worker's own memory (received, not a sender's buffer)


_WHOLE = (slice(None),)


@dataclass
class Txn:
    staging: bool                       # True: writes are copied aside and applied at end
    writes: list[Write] = field(default_factory=list)
    covers: set[str] = field(default_factory=set)
    aborted: str | None = None
    applied: bool = False               # a call was written in place (not staging): weights changed
    lost: str | None = None             # what an abort of it could not take back (`_drop_in_place`)
    embedded: bool = False              # a call sent the embedding (`tied_head`)
    heads: dict[tuple, bytes] = field(default_factory=dict)   # tied heads awaiting it (`tied_head`)


OVERWRITTEN = "the start-up weights were partly overwritten in place by an aborted weight update"
"""Why weights are not served after `UpdateStager.abort` of a transaction written in place."""


class UpdateStager:
    """The update state of one worker ``w``: the open call's writes, the transaction, coverage."""

    def __init__(self, w: Any) -> None:
        self.w = w
        self.valid = True                   # weights hold a complete model
        self.dummy = True                   # ... but only the random start-up one: nothing to protect
        self.coverage: set[str] = set()     # HF names loaded since the weights became invalid
        self.call: list[Write] | None = None
        self.received: list[handles.Received] = []
        self.txn: Txn | None = None
        self.fault: str | None = None
        self.in_update = False              # between begin and end (transactional or not)
        self.keep_call = False              # this call's buffers are the update's, reused call after call
        self.mapped: collections.OrderedDict[int, torch.UntypedStorage] = collections.OrderedDict()
        self.kept = 0                       # buffers the open call found still open from an earlier one
        self.open_s = 0.0                   # the open call's time opening payloads (`_open`)
        self.bytes_read = 0                 # what the last disk update read on this rank
        self.files: list[Any] = []          # this call's checked per-rank files (`VerifiedFile`), open
        self.ahead: dict[str, Any] = {}     # file name -> `VerifiedFile` hashed ahead (`hash_ahead`)
        self.ahead_dir: str | None = None   # the temp directory they were hashed in
        self.ahead_dirfd = -1               # ... open (its name changes when it is published)
        self.ahead_used = 0                 # files the last disk stage took as hashed ahead
        self.staged_on_host = 0             # bytes the open transaction keeps in host memory
        self._held: dict[str, tuple] = {}   # HF name -> its placements on this rank (`placements`)
        self._covers: dict[str, tuple] = {}  # engine name -> the HF names it is built from, this rank
        self.known = KnownMetadata()        # bucket metadata checked at an earlier call
        self.heads = TiedHeads(self)        # a tied engine's sent lm_head, checked per call
        self.overwritten: str | None = None  # why weights are invalid, where an abort made them so

    def _mismatch(self, name: str, what: str, expected: Any, got: Any) -> WorkerError:
        return WorkerError(KIND_UPDATE, f"expected {what} {expected} for {name!r} on TP rank {self.w.rank}, "
                                        f"got {got}", name)

    def _check(self, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
        """``t`` is a tensor of ``shape`` in the dtype the layout holds ``name`` in (HF or engine
        name): the rollout dtype, or float8_e4m3fn / float32 for a block-FP8 weight / scale."""
        if not isinstance(t, torch.Tensor):
            raise self._mismatch(name, "a", "tensor", type(t).__name__)
        want = self.w.layout.dtype_of(name, self.w.dtype)
        if t.dtype != want:
            raise WorkerError(KIND_UPDATE, dtype_refusal(name, t.dtype, want, self.w.rank,
                                                         self.w.layout.quantization), name)
        if tuple(t.shape) != tuple(shape):
            raise self._mismatch(name, "shape", fmt_shape(shape), fmt_shape(t.shape))

    def placements(self, name: str) -> tuple:
        """``layout.placements(name, rank)``, worked out once per name: an update asks for each
        tensor it loads twice (2.5 ms of a 338-tensor load on this host). This worker's layout
        never changes; the memo holds this rank's placements only."""
        held = self._held.get(name)    # (public: `tied_head` asks it too)
        if held is None:
            held = self._held[name] = tuple(self.w.layout.placements(name, self.w.rank))
        return held

    def _hf_writes(self, name: str, t: torch.Tensor, out: list[Write]) -> None:
        if not self.w.layout.accepts(name):
            raise WorkerError(KIND_UPDATE, f"unknown parameter {name!r} on TP rank {self.w.rank}: not a "
                                           f"{self.w.layout.spec.model_type} parameter name of this model "
                                           f"(e.g. {self.w.layout.hf_names()[1]!r})"
                                           f"{scale_refusal(name, self.w.layout.quantization)}"
                                           f"{fused_hint(name, self.w.layout.spec.model_type)}", name)
        self._check(name, t, self.w.layout.full_shape(name))
        if name == HEAD and self.w.layout.spec.tie_word_embeddings:
            self.heads.call.append(t)       # dropped, but checked once the call is all seen
        for pl in self.placements(name):
            out.append(Write(pl.engine, pl.dst, t[pl.src], (name,)))
        if not self.placements(name) and name in self.w.hf_set:
            out.append(Write("", (), t[:0], (name,)))   # holds no piece here, but counts as loaded

    def _direct_writes(self, name: str, t: torch.Tensor, out: list[Write]) -> None:
        if name not in self.w.engine_shapes:
            raise WorkerError(KIND_UPDATE, f"unknown parameter {name!r} on TP rank {self.w.rank}: not one "
                                           f"of the engine's own (direct-layout) parameter names "
                                           f"(e.g. 'model.layers.0.self_attn.qkv_proj.weight')"
                                           f"{scale_refusal(name, self.w.layout.quantization)}", name)
        self._check(name, t, self.w.engine_shapes[name])
        covers = self._covers.get(name)
        if covers is None:      # the layout never changes: worked out once per name
            covers = self._covers[name] = tuple(self.w.layout.engine_covers(name, self.w.rank))
        out.append(Write(name, _WHOLE, t, covers))

    def _open(self, payload: Any) -> Any:
        t0 = time.perf_counter()
        try:
            rec = handles.open_payload(payload, self.w.rank)
        except Exception as exc:  # noqa: BLE001 - a bad payload is a refused update
            raise WorkerError(KIND_UPDATE, f"could not open the payload for TP rank {self.w.rank}: "
                                           f"{type(exc).__name__}: {exc}") from exc
        self.received.append(rec)
        if self.keep_call and self.in_update:
            rec.each_storage(self._keep_mapped, ("cpu", "cuda"))
        self.open_s += time.perf_counter() - t0
        return rec.value

    def _keep_mapped(self, storage: torch.UntypedStorage) -> None:
        """Keep a per-rank bucket's shared buffer mapped until the update ends: the sender reuses
        its buffers bucket after bucket (`load_rank_bucket`), so the next bucket's payload opens
        this mapping again (torch's shared-storage cache) instead of mapping and faulting in the
        same pages anew, or on CUDA instead of opening and closing the sender's IPC handle (and
        its reference-counter file) every bucket; the rebuild then still waits for the sender's
        writes, as a first open does (`unpickle.rebuild_cuda_tensor_by_uuid`). At most
        ``MAX_MAPPED`` buffers are kept (the least recently used goes first), so a sender that
        does make a new buffer per call holds no more than that; the sender frees what was kept
        once the update ends (`TensorTransport`'s update bracket collects torch's IPC blocks)."""
        key = storage.data_ptr()
        self.kept += key in self.mapped
        self.mapped[key] = storage
        self.mapped.move_to_end(key)
        while len(self.mapped) > MAX_MAPPED:
            self.mapped.popitem(last=False)

    def _maybe_fault(self, phase: str = "stage") -> None:
        """The armed test fault (`ReferenceEngine._set_fault`): ``die_in_<phase>`` SIGKILLs this
        worker, ``stall_in_<phase>`` makes it stop answering (until the engine shuts it down);
        phase ``stage`` (an update call's first phase) or ``commit`` (``end_weight_update``)."""
        if self.fault == f"die_in_{phase}":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fault == f"stall_in_{phase}":
            self.fault = None
            time.sleep(3600)

    def stage(self, items: list, keep_mapped: bool = False) -> dict:
        """Phase one: open, check and record every write of one call; weights are not touched.
        ``keep_mapped``: the call's shared buffers stay mapped until the update ends (see
        `_keep_mapped`)."""
        if self.call is not None:
            raise WorkerError(KIND_STATE, "an earlier update on this rank was neither committed nor aborted")
        if self.w.memory.weights_released:
            raise WorkerError(KIND_STATE, f"weights are released on TP rank {self.w.rank}; call "
                                          f"resume_memory_occupation(['weights']) before updating them")
        if self.txn is not None and self.txn.aborted:
            raise WorkerError(KIND_STATE, f"this weight update was aborted: {self.txn.aborted}")
        writes: list[Write] = []
        self.call = writes
        self.heads.call = []
        self.keep_call = bool(keep_mapped) and self.w.opts.get("keep_bucket_buffers", True)
        self.kept, self.open_s = 0, 0.0
        seen: set[str] = set()
        self.bytes_read = 0
        self._close_files()
        if not any(item[0] == "disk" and item[1] != "hf" for item in items):
            self.close_ahead()      # files hashed ahead for a version that was never loaded
        t0 = time.perf_counter()
        for item in items:
            kind, layout_kind = item[0], item[1]
            if kind == "disk":
                (self._stage_disk if layout_kind == "hf" else self._stage_disk_ranked)(item[2], writes, seen)
                if item[2].get("complete"):
                    self._check_complete(item[2]["dir"], writes)
                self._maybe_fault()
                continue
            if kind == "bucket":
                value = self._open(item[2])
                try:
                    named = open_flattened_bucket(value, self.known)
                except ValueError as exc:
                    raise WorkerError(KIND_UPDATE, f"TP rank {self.w.rank}: {exc}") from exc
            else:
                name, payload = item[2], item[3]
                value = self._open(payload) if isinstance(payload, (bytes, bytearray, str)) else payload
                named = [(name, value)]
            first = len(writes)
            for name, t in named:
                if name in seen:
                    raise WorkerError(KIND_UPDATE, f"{name!r} appears twice in one update "
                                                   f"(TP rank {self.w.rank})", name)
                seen.add(name)
                (self._hf_writes if layout_kind == "hf" else self._direct_writes)(name, t, writes)
            if kind == "tensor" and layout_kind != "hf" and not isinstance(item[3], (bytes, bytearray, str)):
                for w in writes[first:]:        # received into this worker's own buffer, all of it
                    w.owned = True              # its shard (a full tensor's slice would keep the whole)
            self._maybe_fault()
        pending = self.heads.check_call(writes)
        return {"writes": len(writes), "bytes_read": self.bytes_read, "tensors": len(seen), "pending_heads": pending,
                "stage_s": time.perf_counter() - t0, "open_s": self.open_s, "kept": self.kept,
                "hashed_ahead": self.ahead_used}

    def _check_complete(self, directory: str, writes: list[Write]) -> None:
        """Refuse a checkpoint that lacks a tensor this rank holds: loading it would serve a mix
        of its weights and the old ones (a tied checkpoint, without ``lm_head.weight``, into an
        untied engine serves the old head)."""
        covered = {c for w in writes for c in w.covers}
        missing = [n for n in self.w.layout.hf_names() if n in self.w.hf_set and n not in covered]
        if missing:
            tied = ("; a tied checkpoint (no 'lm_head.weight') cannot load into this untied model"
                    if "lm_head.weight" in missing else "")
            shown = ", ".join(repr(n) for n in missing[:3]) + (f" and {len(missing) - 3} more"
                                                               if len(missing) > 3 else "")
            raise WorkerError(KIND_UPDATE, f"{directory} lacks {len(missing)} of the {len(self.w.hf_set)} "
                                           f"tensors TP rank {self.w.rank} holds ({shown}){tied}: a "
                                           f"partial checkpoint would serve old and new weights "
                                           f"mixed; nothing was loaded", missing[0])

    def _stage_disk(self, spec: dict, writes: list[Write], seen: set[str]) -> None:
        """A checkpoint directory: this rank's share of the files is read once each, hashed as it
        is read and checked against the manifest (`read_hashed`), and its slices are taken from
        those same bytes; of the other files only this rank's slices are read (`SliceReader`: no
        full tensor is materialized for a sharded one). Every tensor's name, dtype and shape is
        checked from the file headers. Nothing is applied here, so a file refused after others
        were staged changes nothing."""
        from ...weights.hf_checkpoint import (MANIFEST_FILE, SAFETENSORS_DTYPES, CheckpointError, SliceReader,
                                              is_rotary_cache, read_hashed)

        directory = spec["dir"]
        # a Hugging Face checkpoint of its own (no manifest: not a sync's version) is cast to the
        # engine's dtype where that is a plain float cast, as SGLang's loader casts; a sync's
        # version is written in SyncConfig.dtype, so another dtype there is the sync's mistake
        foreign = not os.path.exists(os.path.join(directory, MANIFEST_FILE))
        verify = spec["verify"]
        index = spec.get("index")
        # this rank's own files first: a corrupt one is refused before the others are sliced
        order = sorted(spec["files"], key=lambda fl: fl not in verify)
        for file in order:
            path = os.path.join(directory, file)
            data = None
            if file in verify:
                try:
                    data = read_hashed(path, verify[file], spec.get("hash", "sha256"))
                except CheckpointError as exc:
                    held = [n for n, fl in (index or {}).items() if fl == file]
                    raise WorkerError(KIND_UPDATE, f"{exc}{_holding(held)} (TP rank {self.w.rank})") from exc
                self.bytes_read += data.numel()
            try:
                with SliceReader(path, data=data) as f:   # not safe_open's slices: they leak (see SliceReader)
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
                        if is_rotary_cache(name) and not self.w.layout.accepts(name):
                            continue            # a rotary table, not a weight: SGLang skips it too
                        if name in seen:
                            raise WorkerError(KIND_UPDATE, f"{path}: tensor {name!r} appears twice in "
                                                           f"the checkpoint (TP rank {self.w.rank})", name)
                        seen.add(name)
                        self._disk_writes(path, name, f, writes, SAFETENSORS_DTYPES, cast=foreign)
                del data                       # its slices are copies: the file's bytes go now
            except WorkerError:
                raise
            except Exception as exc:  # noqa: BLE001 - a torn header, a short file: a refused update
                raise WorkerError(KIND_UPDATE, f"cannot read {path} on TP rank {self.w.rank}: "
                                               f"{type(exc).__name__}: {exc}") from exc

    def _stage_disk_ranked(self, spec: dict, writes: list[Write], seen: set[str]) -> None:
        """This rank's files of a per-rank checkpoint (``layout="engine"``): each is read once
        through a small buffer, hashed as it is read and checked against the manifest's digest
        (`VerifiedFile`: its descriptor stays open), and must hold exactly the tensor names the
        manifest lists for it; every tensor is checked as a ``direct`` update (engine name, this
        rank's shape, dtype). No other rank's file is opened, and nothing is kept in memory: the
        writes' sources are the checked files (`FileTensor`), which the commit reads straight into
        the weights (from the page cache this pass warmed) once every rank's files checked out,
        instead of a staged copy of the whole shard. A file hashed ahead (`hash_ahead`, while the
        trainer wrote the rest) is not read again where it is still the very file it hashed (device,
        inode, size, mtime) and its digest is the manifest's; any other is hashed here."""
        directory = spec["dir"]
        ahead, self.ahead, self.ahead_used = self.ahead, {}, 0
        self.close_ahead()
        try:
            self._stage_files(spec, directory, ahead, writes, seen)
        finally:
            for vf in ahead.values():           # hashed ahead but not asked for (or a failed stage)
                vf.close()

    def _stage_files(self, spec: dict, directory: str, ahead: dict, writes: list[Write],
                     seen: set[str]) -> None:
        from ...weights.hf_checkpoint import CheckpointError, engine_name_of
        from ...weights.verified_file import VerifiedFile

        algo = spec.get("hash", "sha256")
        for file in spec["files"]:
            path = os.path.join(directory, file)
            vf = ahead.pop(file, None)
            if vf is not None and vf.is_file(path, spec["digests"][file], algo):
                self.ahead_used += 1            # this very file hashed to the manifest's digest
            else:
                if vf is not None:
                    vf.close()
                try:
                    vf = VerifiedFile(path, spec["digests"][file], algo)
                except CheckpointError as exc:
                    raise WorkerError(KIND_UPDATE, f"{exc}{_holding(spec['names'][file])} "
                                                   f"(TP rank {self.w.rank})") from exc
            self.files.append(vf)
            tensors = vf.tensors
            self.bytes_read += vf.size
            listed = list(spec["names"][file])
            if sorted(tensors) != sorted(listed):
                diff = sorted(set(tensors) ^ set(listed))
                raise WorkerError(KIND_UPDATE, f"{path}: holds other tensors than the manifest lists "
                                               f"for it (e.g. {diff[:2]}; TP rank {self.w.rank})",
                                  diff[0] if diff else None)
            tied = bool(self.w.layout.spec.tie_word_embeddings)
            for key in listed:
                name = engine_name_of(key, tied)     # a tied embedding is keyed lm_head.weight
                if name in seen:
                    raise WorkerError(KIND_UPDATE, f"{path}: tensor {key!r} appears twice in this "
                                                   f"rank's files (TP rank {self.w.rank})", name)
                seen.add(name)
                try:
                    self._direct_writes(name, tensors[key].meta, writes)
                except WorkerError as exc:
                    raise WorkerError(exc.kind, f"{path}: {exc}", name) from exc
                writes[-1].src = tensors[key]        # read at the commit, straight into the weight

    def hash_ahead(self, a: dict) -> None:
        """Hash this rank's per-rank files ``a["files"]`` in ``a["dir"]`` (a version still being
        written) under ``a["hash"]``, and keep them open for the disk stage that follows
        (`_stage_disk_ranked` takes one only while it is the same file with the manifest's digest).
        The directory is opened at its first files, and later files are found by name in that open
        directory, so files told while the trainer publishes the version (renames it) are still
        found; a worker that comes to its first files only after the rename (a loaded machine)
        opens the version under ``a["published"]``, its name once published. A file that cannot
        be read or parsed yet is skipped (the stage hashes it); files of another directory are
        dropped. Changes nothing else."""
        from ...weights.hf_checkpoint import CheckpointError
        from ...weights.verified_file import VerifiedFile

        directory = str(a["dir"])
        if self.ahead_dir != directory:
            self.close_ahead()
            # opened once: its files are found by name even after the version is renamed; renamed
            # before this worker came to it: under its published name
            for where in filter(None, (directory, a.get("published"))):
                try:
                    self.ahead_dirfd = os.open(str(where), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    break
                except OSError:
                    continue
            else:
                return                          # gone (a failed sync removed it): the stage hashes
            self.ahead_dir = directory
        for file in a["files"]:
            file = os.path.basename(str(file))
            old = self.ahead.pop(file, None)
            if old is not None:
                old.close()
            try:
                self.ahead[file] = VerifiedFile(os.path.join(directory, file), None, str(a["hash"]),
                                                record=True, dir_fd=self.ahead_dirfd)
            except (CheckpointError, OSError, ValueError):
                pass

    def drop_ahead(self, directory: str) -> None:
        """The trainer gave up the version ``directory`` files were hashed ahead for (its sync
        failed; the temp directory is removed): close them and the directory now, so that their
        disk space is freed (a retry after a full disk needs it), not at the next update."""
        if self.ahead_dir == directory:
            self.close_ahead()

    def close_ahead(self) -> None:
        ahead, self.ahead, self.ahead_dir = self.ahead, {}, None
        for vf in ahead.values():
            vf.close()
        fd, self.ahead_dirfd = self.ahead_dirfd, -1
        if fd >= 0:
            os.close(fd)

    def _disk_writes(self, path: str, name: str, f: Any, out: list[Write], dtypes: dict, *,
                     cast: bool = False) -> None:
        """Stage this rank's slices of checkpoint tensor ``name``. ``cast``: a floating-point tensor
        held in the rollout dtype (not a block-FP8 weight or scale) is cast to it from another
        floating-point dtype (never from or to FP8); otherwise a dtype other than the layout's is
        refused."""
        if not self.w.layout.accepts(name):
            raise WorkerError(KIND_UPDATE, f"{path}: unknown parameter {name!r} on TP rank {self.w.rank}: "
                                           f"not a {self.w.layout.spec.model_type} parameter name of this "
                                           f"model (e.g. {self.w.layout.hf_names()[1]!r})"
                                           f"{scale_refusal(name, self.w.layout.quantization)}", name)
        code = f.dtype_code(name)
        dtype = dtypes.get(code)
        want = self.w.layout.dtype_of(name, self.w.dtype)
        plain = self.w.layout.dtype_of(name, None) is None     # held in the rollout dtype
        if dtype != want and not (cast and plain and _float_cast(dtype, want)):
            msg = dtype_refusal(name, dtype if dtype is not None else code, want, self.w.rank,
                                self.w.layout.quantization)
            if cast and plain and not _fp8(dtype):   # a checkpoint's own tensor: no sync to configure
                msg = (f"expected dtype {dtype_name(want)} for {name!r} on TP rank {self.w.rank}, got "
                       f"{dtype_name(dtype) if isinstance(dtype, torch.dtype) else code}; only "
                       f"floating-point tensors are cast to the engine's dtype")
            raise WorkerError(KIND_UPDATE, f"{path}: {msg}", name)
        cast = dtype != want
        shape, full = f.shape(name), tuple(self.w.layout.full_shape(name))
        if shape != full:
            raise WorkerError(KIND_UPDATE, f"{path}: expected shape {fmt_shape(full)} for {name!r} on "
                                           f"TP rank {self.w.rank}, got {fmt_shape(shape)}", name)
        placements = self.w.layout.placements(name, self.w.rank)
        for pl in placements:
            piece = f.read(name, pl.src)
            if not f.in_memory:                # in memory: counted when the file was read
                self.bytes_read += piece.numel() * piece.element_size()
            out.append(Write(pl.engine, pl.dst, piece.to(want) if cast else piece, (name,)))
        if not placements and name in self.w.hf_set:
            out.append(Write("", (), torch.empty(0, dtype=want), (name,)))   # counts as loaded

    def _apply(self, writes: list[Write]) -> None:
        self._files_unchanged()
        params = self.w.model.params
        dsts, srcs = [], []     # the tensors: one fused copy (`bucket.copy_many`), not one each
        for w in writes:
            if w.engine:
                dst = params[w.engine]
                if w.dst != _WHOLE:            # (a view of the whole parameter is one op each for nothing)
                    dst = dst[w.dst]
                if not isinstance(w.src, torch.Tensor):     # a checked file's tensor (`FileTensor`)
                    w.src.read_into(dst)
                elif dst.shape == w.src.shape:
                    dsts.append(dst)
                    srcs.append(w.src)
                else:
                    dst.copy_(w.src)
        copy_many(dsts, srcs)

    def _files_unchanged(self) -> None:
        """Before a weight changes: every checked file is still the one that was hashed."""
        for f in self.files:
            try:
                f.check_unchanged()
            except ValueError as exc:    # CheckpointError
                raise WorkerError(KIND_UPDATE, f"{exc} (TP rank {self.w.rank})") from exc

    def _close_files(self) -> None:
        files, self.files = self.files, []
        for f in files:
            f.close()

    def drop_call(self) -> None:
        """Forget a failed stage: nothing of it survives, and its payloads are acknowledged."""
        self.call = None
        self._close_files()
        self._ack_all()

    def _ack_all(self) -> None:
        # one stream synchronization for the batch, then values dropped, then acknowledged
        received, self.received = self.received, []
        handles.ack_all(received)

    def _covered(self, covers: set[str]) -> None:
        if self.valid:
            return
        self.coverage |= covers
        if self.coverage >= self.w.hf_set:
            self.valid, self.coverage, self.overwritten = True, set(), None

    def commit(self) -> dict:
        """Phase two for one call: apply (or, inside a staging transaction, copy aside)."""
        writes, self.call = self.call or [], None
        t0 = time.perf_counter()
        t_ack = t0
        aside = False
        try:
            covers = {c for w in writes for c in w.covers}
            if self.txn is None:
                self._apply(writes)
                self._covered(covers)
                self.dummy = False
            elif self.txn.staging:
                aside = True
                fault_point("worker", self.w.rank, "stage_aside")      # FSDP_SYNC_FAULT
                self._files_unchanged()
                for w in writes:     # the sender frees its buffer after the call; a file's tensor is read
                    if not isinstance(w.src, torch.Tensor):
                        w.src = w.src.load()
                    elif not w.owned:        # a received buffer is already a copy of its own
                        w.src, on_host = stage_aside(w.src, self.w.device)
                        self.staged_on_host += w.src.nbytes if on_host else 0
                self.txn.writes.extend(writes)
                self.txn.covers |= covers
            else:
                self.txn.applied = True                 # (a failed copy too has changed weights)
                self._apply(writes)                     # nothing to protect: write in place
                self.txn.covers |= covers
                self.dummy = False
        except BaseException as exc:
            if aside and isinstance(exc, Exception):    # copied aside only: the weights are untouched
                raise WorkerError(KIND_UPDATE, f"TP rank {self.w.rank}: copying the update aside failed "
                                               f"({type(exc).__name__}: {exc}); {NOTHING_APPLIED}") from exc
            self.valid = False
            raise
        finally:
            del writes
            self._close_files()
            t_ack = time.perf_counter()
            self._ack_all()         # on CUDA: waits for the copies above (one stream sync)
        t1 = time.perf_counter()
        return {"commit_s": t1 - t0, "apply_s": t_ack - t0, "ack_s": t1 - t_ack}

    def abort(self, reason: str = "") -> dict:
        self.call = None
        self.heads.call = []
        self._close_files()
        self._ack_all()
        self.mapped.clear()         # the sender's buffers go back to it, not at an `end` that may never come
        if self.txn is not None and not self.txn.aborted:
            self._drop_in_place(self.txn)
            self.txn.writes, self.txn.aborted = [], reason or "aborted"
        return {}

    def _drop_in_place(self, txn: Txn) -> None:
        """An aborted transaction that wrote its calls in place (nothing was worth protecting)
        cannot take them back: what they wrote is not served. Valid weights (the random start-up
        ones) become invalid, to be pushed again in full, as after a release without a backup;
        weights being pushed again after such a release lose the tensors the transaction wrote
        over. ``txn.lost`` says what changed, where anything did (invalid weights whose pushed
        tensors it did not touch are as they were: nothing to say). Every rank commits every
        call, so every rank decides the start-up case alike."""
        if txn.staging:
            return
        if self.valid and txn.applied:
            self.valid, self.coverage, self.overwritten = False, set(), OVERWRITTEN
            txn.lost = "the start-up weights were partly overwritten: every tensor must be pushed again"
            return
        again = self.coverage & txn.covers          # pushed since the release, then written over
        if again:
            txn.lost = (f"{len(again)} tensors pushed since the weights were released (e.g. "
                        f"{sorted(again)[0]!r}) were written over: they must be pushed again")
        self.coverage -= txn.covers

    def begin(self, transactional: bool) -> dict:
        if self.txn is not None:
            raise WorkerError(KIND_STATE, "begin_weight_update called twice without end_weight_update")
        self.mapped.clear()
        self.in_update = True
        self.staged_on_host = 0
        if not transactional:
            return {"staging": False}       # each call commits on its own, as outside begin/end
        # Stage copies only when there is something worth protecting: loaded, valid weights.
        self.txn = Txn(staging=self.valid and not self.w.memory.weights_released and not self.dummy)
        return {"staging": self.txn.staging}

    def end(self, abort: bool = False) -> dict:
        if not abort:
            self._maybe_fault("commit")
        self.in_update = False
        self.mapped.clear()                 # the update's buffers: the sender frees them now
        txn, self.txn = self.txn, None
        if txn is None:
            return {"committed": False}
        if abort or txn.aborted:
            if not txn.aborted:
                self._drop_in_place(txn)
            # what of the weights the transaction began with it could not give back; "dropped": this
            # end wrote no weight (`ReferenceEngine` tells a commit that failed before its body by it)
            return {"committed": False, "overwritten": txn.lost, "dropped": True}
        try:
            if txn.staging:
                fault_point("worker", self.w.rank, "end_apply")    # FSDP_SYNC_FAULT: a commit failing inside
                self._apply(txn.writes)
            else:
                self._covered(txn.covers)
        except BaseException:
            self.valid = False
            raise
        finally:
            txn.writes = []
            if txn.staging:
                self.w.memory.trim()    # give the staged copies back to the OS; nothing to trim otherwise
        return {"committed": True, "staged": txn.staging, "staged_on_host_bytes": self.staged_on_host}
