"""`FSDPShardingManager`: the ``with`` block a verl-style worker puts around its rollout.

On entry it runs named stages in order (each timed and memory-probed into a `Timeline`):

    multi_stage_wake_up=True:   resume_weights → sync_weights → offload_params → resume_kv_cache → swap_rng
    multi_stage_wake_up=False:  resume_all → sync_weights → offload_params → swap_rng

and on exit: release_memory (kv_cache, weights) → restore_module → restore_rng. Engine calls come
from infer-TP rank 0 only (the engine handle is None on the other ranks); every stage that calls
the engine ends with an `agree` collective, so a failure on any rank (engine error, bad tensor,
dead worker) raises the same `SyncError` on every rank instead of leaving ranks blocked.

The weight sync itself has three strategies (see `SyncConfig.strategy`): ``per_tensor`` (verl's
original loop, the baseline), ``bucketed`` and ``flattened`` (default). In all three a bucket's
buffers stay alive until the engine has answered and every consumer has acknowledged, and are freed
right after, so the sync holds at most one bucket (plus the largest tensor) beyond its steady state.

Not here: how tensors are gathered (export), laid out (bucket) or shared (handles), and no process
group of its own: it runs on the mesh it is given.
"""

from __future__ import annotations

import inspect
import logging
import time
from contextlib import closing
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from . import export, handles
from .bucket import plan_buckets, sglang_metadata
from .config import SyncConfig
from .memory import Timeline, empty_cache
from .topology import SyncError, SyncTopology, agree, gather_to_src

__all__ = ["FSDPShardingManager", "SyncStats"]

log = logging.getLogger("fsdp_sync")


@dataclass
class _Call:
    """One engine call: this rank's payload sets, what it sends to infer-TP rank 0, and how rank 0
    turns the gathered list (indexed by TP rank) into the engine's ``named_tensors``."""

    sets: list
    wire: Any
    to_named: Any
    load_format: str | None
    last: bool
    what: str
    on_release: Any = None


@dataclass
class SyncStats:
    """What the last sync moved: bytes are the rollout-dtype bytes of every exported tensor."""

    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    engine_calls: int = 0


def _module_device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return torch.device("cuda", torch.cuda.current_device()) if p.device.type == "cuda" else p.device
    return torch.device("cpu")


class _ReusedBuffer:
    """The one flat buffer every bucket of a sync reuses in turn (shared memory on CPU, device
    memory on CUDA), sized for the largest bucket. Fresh pages cost a fault (and on CPU a kernel
    zero-fill) each: a buffer per bucket paid that for the whole model on every sync, this pays it
    for one bucket. Safe because the manager's calls are sequential: a bucket is released (its
    consumers acknowledged) before the next one is taken, which `take` checks."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes, self.device = nbytes, device
        self.buf: torch.Tensor | None = None
        self.busy = False

    def take(self, nbytes: int) -> torch.Tensor:
        if self.busy:
            raise RuntimeError("the sync buffer is still in use by the previous bucket")
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = None
            self.buf = handles.empty_shared(max(nbytes, self.nbytes), self.device)
        self.busy = True
        return self.buf[:nbytes]

    def give_back(self) -> None:
        self.busy = False


def _per_rank(values: list) -> Any:
    from .engines.base import SerializedPerRank

    return SerializedPerRank(values=values)


class FSDPShardingManager:
    """Syncs ``module``'s weights into ``engine`` on entry; gives memory back to training on exit.

    Args:
        module: the FSDP2, FSDP1 or plain module being trained (identical on every dp rank).
        engine: the rollout engine handle on infer-TP rank 0 of each group, ``None`` elsewhere.
        mesh: a DeviceMesh with dims ``("dp", "infer_tp")`` over the trainer ranks.
        config: a `SyncConfig`.
    """

    def __init__(self, module: torch.nn.Module, engine: Any, *, mesh, config: SyncConfig | None = None):
        self.module = module
        self.config = config or SyncConfig()
        self.topo = SyncTopology.from_mesh(mesh)
        if self.topo.is_tp_src and engine is None:
            raise ValueError(f"{self.topo.describe()}: infer-TP rank 0 needs an engine handle, got None")
        if not self.topo.is_tp_src and engine is not None:
            raise ValueError(f"{self.topo.describe()}: only infer-TP rank 0 holds the engine; "
                             f"pass engine=None on the other ranks")
        self.engine = engine
        self.timeline = Timeline()
        self.stats = SyncStats()
        self._inside = False
        self._was_training = True
        self._trainer_rng: tuple | None = None
        self._offloaded: dict[str, torch.device] = {}
        self._tp_sizes: list[int] | None = None      # per-TP-rank batch sizes of preprocess_data
        # generation RNG: seeded by dp rank, hence equal on every TP rank of a group
        saved = self._get_rng()
        torch.manual_seed(self.config.seed + self.topo.dp_rank)
        self._gen_rng = self._get_rng()
        self._set_rng(saved)

    # ------------------------------------------------------------------ the with block
    def __enter__(self) -> "FSDPShardingManager":
        if self._inside:
            raise RuntimeError("FSDPShardingManager is not re-entrant: already inside its with block")
        pids = list(getattr(self.engine, "worker_pids", None) or []) if self.topo.is_tp_src else []
        self.timeline = Timeline(engine_pids=pids, mode=self.config.memory_probe)
        self._was_training = self.module.training
        try:
            with self.timeline.stage("prepare"):
                empty_cache()  # before resuming engine memory: verl's first-iteration OOM
                self.module.eval()
            if self.config.multi_stage_wake_up:
                self._run("resume_weights", self._resume, ["weights"])
                self._run("sync_weights", self._sync_weights)
                self._run("offload_params", self._offload_params)
                self._run("resume_kv_cache", self._resume, ["kv_cache"])
            else:
                self._run("resume_all", self._resume, None)
                self._run("sync_weights", self._sync_weights)
                self._run("offload_params", self._offload_params)
            with self.timeline.stage("swap_rng"):
                self._trainer_rng = self._get_rng()
                self._set_rng(self._gen_rng)
        except BaseException as exc:
            self._restore(release=True, original=exc)
            raise
        self._inside = True
        if self.topo.rank == 0:
            log.info("fsdp_sync enter: %s", self.timeline.summary())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._inside = False
        self._restore(release=True, original=exc, collective=True)
        if self.topo.rank == 0:
            log.info("fsdp_sync exit: %s", self.timeline.summary())

    async def wake_up(self) -> None:
        """The same stages as ``__enter__``, for async rollouts."""
        self.__enter__()

    async def sleep(self) -> None:
        """The same stages as ``__exit__``, for async rollouts."""
        self.__exit__(None, None, None)

    # ------------------------------------------------------------------ data
    def preprocess_data(self, batch: Any) -> Any:
        """All-gather a batch across infer_tp so every TP rank of a group runs the same prompts.

        A dict: tensors are concatenated along dim 0, lists are concatenated, in TP-rank order.
        A verl ``DataProto``: ``DataProto.concat`` of the TP group's batches. The ranks' batches
        may differ in size (each rank's size is kept for `postprocess_data`); a dict must have the
        same keys on every rank and one batch size across its fields. Every rank sees every
        batch, so a bad one raises the same error on every rank of the group."""
        topo = self.topo
        if topo.tp_size == 1:
            return batch
        if not isinstance(batch, dict) and not (hasattr(batch, "chunk") and hasattr(type(batch), "concat")):
            raise TypeError(f"preprocess_data takes a dict of tensors/lists or a DataProto, got "
                            f"{type(batch).__name__}")
        parts: list = [None] * topo.tp_size
        dist.all_gather_object(parts, batch, group=topo.tp_group)
        if not isinstance(batch, dict):
            self._tp_sizes = [len(p) for p in parts]
            return type(batch).concat(parts)
        keys = [sorted(map(str, p)) for p in parts]
        if any(k != keys[0] for k in keys):
            diff = {r: sorted(set(k) ^ set(keys[0])) for r, k in enumerate(keys) if k != keys[0]}
            raise ValueError(f"preprocess_data: the infer-TP ranks' batches have different keys: "
                             f"rank 0 has {keys[0]}, " + ", ".join(
                                 f"rank {r} differs in {d}" for r, d in diff.items())
                             + f" ({topo.describe()})")
        self._tp_sizes = [self._batch_size(p, r) for r, p in enumerate(parts)]
        return {key: torch.cat([p[key] for p in parts], dim=0) if isinstance(value, torch.Tensor)
                else [x for p in parts for x in p[key]]
                for key, value in batch.items()}

    @staticmethod
    def _batch_size(batch: dict, rank: int) -> int:
        sizes = {k: (v.shape[0] if isinstance(v, torch.Tensor) and v.dim() else len(v))
                 for k, v in batch.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"preprocess_data: infer-TP rank {rank}'s batch fields differ in size "
                             f"{sizes}; every field holds one entry per sample")
        return next(iter(sizes.values()), 0)

    def postprocess_data(self, batch: Any) -> Any:
        """Keep this rank's part of a batch that `preprocess_data` gathered (its own size, in
        TP-rank order; k times it when each prompt became k samples); without a preceding
        `preprocess_data`, an even split."""
        topo = self.topo
        if topo.tp_size == 1:
            return batch
        sizes = getattr(self, "_tp_sizes", None)
        if isinstance(batch, dict):
            total = {k: (v.shape[0] if isinstance(v, torch.Tensor) else len(v)) for k, v in batch.items()}
        elif hasattr(batch, "chunk"):
            total = {"batch": len(batch)}
        else:
            raise TypeError(f"postprocess_data takes a dict of tensors or a DataProto, got "
                            f"{type(batch).__name__}")
        n = next(iter(total.values()), 0)
        if len(set(total.values())) > 1:
            raise ValueError(f"postprocess_data: batch fields differ in size {total}")
        if sizes is not None and sum(sizes) and n != sum(sizes) and n % sum(sizes) == 0:
            sizes = [x * (n // sum(sizes)) for x in sizes]   # k samples per gathered prompt
        if sizes is None or sum(sizes) != n:
            if n % topo.tp_size:
                raise ValueError(f"postprocess_data: {n} samples do not split into {topo.tp_size} "
                                 f"infer-TP parts" + ("" if sizes is None else
                                                      f", nor into the gathered sizes {sizes}"))
            sizes = [n // topo.tp_size] * topo.tp_size
        start = sum(sizes[:topo.tp_rank])
        end = start + sizes[topo.tp_rank]
        if isinstance(batch, dict):
            return {key: value[start:end] for key, value in batch.items()}
        if len(set(sizes)) == 1:
            return batch.chunk(topo.tp_size)[topo.tp_rank]
        return batch.slice(start, end) if hasattr(batch, "slice") else batch[start:end]

    # ------------------------------------------------------------------ stages
    def _run(self, name: str, fn, *args) -> None:
        """Run a stage on every rank; any rank's failure becomes a SyncError on all ranks."""
        with self.timeline.stage(name):
            err = None
            try:
                fn(*args)
            except SyncError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported to every rank just below
                err = f"{type(exc).__name__}: {exc}"
            agree(err, what=f"stage {name!r}")

    def _resume(self, tags: list[str] | None) -> None:
        if self.config.free_cache_engine and self.topo.is_tp_src:
            self.engine.resume_memory_occupation(tags=tags)

    def _release(self) -> None:
        if self.config.free_cache_engine and self.topo.is_tp_src:
            self.engine.release_memory_occupation(tags=["kv_cache", "weights"])

    def _offload_params(self) -> None:
        if not self.config.offload_params:
            return
        for name, p in self.module.named_parameters():
            if p.device.type != "cpu":
                self._offloaded[name] = p.device
        if self._offloaded:
            self.module.to("cpu")
            empty_cache()

    def _reload_params(self) -> None:
        if self._offloaded:
            device = next(iter(self._offloaded.values()))
            self.module.to(device)
            self._offloaded.clear()

    def _restore(self, *, release: bool, original: BaseException | None = None,
                 collective: bool = False) -> None:
        """Exit stages; each runs even if an earlier one failed. The first error is raised, unless
        an exception is already propagating (``original``): that one wins, and ours are attached
        to it as notes (a dead engine cannot release memory, but the caller must see why it died).

        ``collective`` (``__exit__``): the ranks then agree, so an error on any rank (a worker that
        died during the rollout, an exception inside the block on one rank) raises the same
        `SyncError` on every rank instead of letting the others leave the block and block in
        their next collective."""
        errors: list[BaseException] = []
        for name, fn in (("release_memory", self._release if release else (lambda: None)),
                         ("restore_module", self._restore_module),
                         ("restore_rng", self._restore_rng)):
            try:
                with self.timeline.stage(name):
                    fn()
            except BaseException as exc:  # noqa: BLE001 - finish restoring, then raise
                errors.append(exc)
        if collective:
            mine = errors[0] if errors else (
                None if original is None else
                f"{type(original).__name__} inside the with block: {original}")
            try:
                agree(mine, what="exit")
            except SyncError as exc:
                if original is None:
                    raise
                errors = [exc]
        if errors and original is None:
            raise errors[0]
        for err in errors:
            if hasattr(original, "add_note"):
                original.add_note(f"while restoring after it: {type(err).__name__}: {err}")
            log.warning("fsdp_sync: restoring after %s failed too: %s", type(original).__name__, err)

    def _restore_module(self) -> None:
        self._reload_params()
        self.module.train(self._was_training)
        empty_cache()

    def _restore_rng(self) -> None:
        if self._trainer_rng is not None:
            self._gen_rng = self._get_rng()
            self._set_rng(self._trainer_rng)
            self._trainer_rng = None

    @staticmethod
    def _get_rng() -> tuple:
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda

    @staticmethod
    def _set_rng(state: tuple) -> None:
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1])

    # ------------------------------------------------------------------ the sync
    def _check_coverage(self) -> None:
        """A full sync must leave every weight the engine holds equal to the trainer's: an engine
        that lists its weights (``hf_names()``) and holds one the trainer does not export (an
        untied lm_head behind a tied trainer) fails the sync on every rank, naming the tensor,
        before anything is sent. (What is sent but not held is refused by the engine itself.)"""
        err = None
        names = getattr(self.engine, "hf_names", None) if self.topo.is_tp_src else None
        if callable(names):
            try:
                sent = {m.name for m in export.param_metas(self.module, self.config.dtype)}
                missing = [n for n in names() if n not in sent]
                if missing:
                    err = (f"the engine holds {missing[:5]}{' …' if len(missing) > 5 else ''} "
                           f"({len(missing)} tensors) that the trainer does not export, so a sync "
                           f"would leave them stale (a tied trainer into an untied engine?); start "
                           f"the engine from the trainer's config ({self.topo.describe()})")
            except Exception as exc:  # noqa: BLE001 - reported to every rank just below
                err = f"{type(exc).__name__}: {exc}"
        agree(err, what="weight sync")

    def _sync_weights(self) -> None:
        cfg, topo = self.config, self.topo
        self._check_coverage()
        t0 = time.perf_counter()
        self.stats = SyncStats()
        self._unacked: str | None = None
        tagged = getattr(self.engine, "accepts_tagged_payloads", True) if topo.is_tp_src else True
        # every rank must agree on tagging, or rank 0 opens payloads it cannot read
        tagged = bool(self._broadcast_flag(tagged))
        if topo.is_tp_src and hasattr(self.engine, "begin_weight_update"):
            self.engine.begin_weight_update()
        ok = False
        try:
            steps = {"per_tensor": self._steps_per_tensor, "bucketed": self._steps_bucketed,
                     "flattened": self._steps_flattened}[cfg.strategy](tagged)
            with closing(steps):  # an abandoned export generator restores FSDP state on close
                for call in steps:
                    self._one_call(call)
            ok = True
        finally:
            if topo.is_tp_src and hasattr(self.engine, "end_weight_update"):
                self._end_update(commit=ok)
        self.stats.seconds = time.perf_counter() - t0
        if self._unacked:
            raise handles.HandleError(self._unacked)

    def _end_update(self, *, commit: bool) -> None:
        """Close the engine's update bracket; after a failure, abort it where the engine can (the
        reference engine then keeps serving its previous weights) instead of committing half."""
        if commit:
            self.engine.end_weight_update()
            return
        try:
            if "abort" in inspect.signature(self.engine.end_weight_update).parameters:
                self.engine.end_weight_update(abort=True)
            else:
                self.engine.end_weight_update()
        except Exception as exc:  # noqa: BLE001 - the sync's own error is the one to report
            log.warning("fsdp_sync: closing the engine's update after a failed sync: %s", exc)

    def _broadcast_flag(self, value: bool) -> bool:
        """Infer-TP rank 0's answer on every rank of its group."""
        if self.topo.tp_size == 1:
            return value
        t = torch.tensor([1 if value else 0], dtype=torch.int64)
        dist.broadcast(t, src=self.topo.tp_src, group=self.topo.tp_group)
        return bool(t.item())

    def _steps_flattened(self, tagged: bool) -> Iterator[_Call]:
        cfg, topo = self.config, self.topo
        plan = plan_buckets(export.param_metas(self.module, cfg.dtype), cfg.bucket_bytes)
        buffer = _ReusedBuffer(max((b.nbytes for b in plan), default=0), _module_device(self.module))
        it = export.iter_buckets(self.module, cfg.bucket_bytes, dtype=cfg.dtype,
                                 fsdp1_state_dict=cfg.fsdp1_state_dict, alloc=buffer.take,
                                 share_host_memory=cfg.share_host_memory)
        with closing(it):
            for i, (bucket, flat) in enumerate(it):
                obj = {"flattened_tensor": flat, "metadata": sglang_metadata(bucket)}
                sets = [handles.make_payloads(obj, topo.tp_size, ranks=[topo.tp_rank], tagged=tagged)]
                self.stats.bytes += bucket.payload_bytes
                self.stats.tensors += len(bucket.entries)
                self.stats.buckets += 1
                del flat, obj
                yield _Call(sets, sets[0].payloads[0], lambda g: g, "flattened_bucket",
                            i == len(plan) - 1, f"bucket {i} ({bucket.names[0]}…)",
                            on_release=buffer.give_back)

    def _steps_per_tensor(self, tagged: bool) -> Iterator[tuple]:
        cfg, topo = self.config, self.topo
        n = len(export.param_metas(self.module, cfg.dtype))
        it = export.iter_params(self.module, dtype=cfg.dtype, fsdp1_state_dict=cfg.fsdp1_state_dict)
        for i, (name, tensor) in enumerate(it):
            sets = [handles.make_payloads(tensor, topo.tp_size, ranks=[topo.tp_rank], tagged=tagged)]
            self.stats.bytes += tensor.numel() * tensor.element_size()
            self.stats.tensors += 1
            self.stats.buckets += 1
            del tensor
            yield _Call(sets, sets[0].payloads[0], lambda g, _n=name: [(_n, _per_rank(g))], None,
                        i == n - 1, repr(name))

    def _steps_bucketed(self, tagged: bool) -> Iterator[tuple]:
        cfg, topo = self.config, self.topo
        plan = plan_buckets(export.param_metas(self.module, cfg.dtype), cfg.bucket_bytes)
        it = export.iter_params(self.module, dtype=cfg.dtype, fsdp1_state_dict=cfg.fsdp1_state_dict)
        for i, bucket in enumerate(plan):
            names, sets = [], []
            for entry in bucket.entries:
                name, tensor = next(it)
                if name != entry.name:
                    raise RuntimeError(f"export order changed: expected {entry.name!r}, got {name!r}")
                names.append(name)
                sets.append(handles.make_payloads(tensor, topo.tp_size, ranks=[topo.tp_rank],
                                                  tagged=tagged))
                self.stats.bytes += tensor.numel() * tensor.element_size()
                del tensor
            self.stats.tensors += len(names)
            self.stats.buckets += 1

            def named(gathered: list, _names=tuple(names)) -> list:
                # gathered[tp_rank][j] is tp_rank's payload of tensor j
                return [(nm, _per_rank([g[j] for g in gathered])) for j, nm in enumerate(_names)]

            yield _Call(sets, [x.payloads[0] for x in sets], named, None, i == len(plan) - 1,
                        f"bucket {i} ({names[0]}…)")

    def _one_call(self, call: _Call) -> None:
        """Gather this rank's payloads to infer-TP rank 0, call the engine there, agree, free."""
        topo = self.topo
        err = None
        try:
            gathered = gather_to_src(call.wire, topo)
            if topo.is_tp_src:
                try:
                    self.engine.update_weights_from_tensor(call.to_named(gathered),
                                                           load_format=call.load_format,
                                                           flush_cache=call.last)
                    self.stats.engine_calls += 1
                except Exception as exc:  # noqa: BLE001 - reported to every rank by agree
                    err = (f"engine update of {call.what} on {topo.describe()}: "
                           f"{type(exc).__name__}: {exc}")
            agree(err, what="weight sync")
        finally:
            for s in call.sets:
                # Acknowledgements are checked without a collective of their own: a missing one
                # fails this rank's stage, and the stage's closing `agree` tells every rank.
                missing = [s.ranks[i] for i in s.unacknowledged()]
                if missing and err is None and self._unacked is None:
                    self._unacked = (f"engine answered for {call.what} but consumer ranks {missing} "
                                     f"never acknowledged their payloads ({topo.describe()})")
                s.release(require_ack=False)
            if call.on_release is not None:
                call.on_release()
