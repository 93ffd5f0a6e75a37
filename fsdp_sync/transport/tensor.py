"""The colocated method: ``update_weights_from_tensor`` with handle tuples (``method="tensor"``).

Each bucket (or tensor) is exported on every trainer rank, shared as a handle tuple (CPU shared
memory / CUDA IPC, `handles`), gathered to infer-TP rank 0 with ``gather_object`` and handed to
the engine there. Three strategies (`SyncConfig.strategy`): ``per_tensor`` (verl's original loop,
the baseline), ``bucketed`` and ``flattened`` (default). In all three a bucket's buffers stay
alive until the engine has answered and every consumer has acknowledged, and are freed right
after, so the sync holds at most one bucket (plus the largest tensor) beyond its steady state.
The calls of one sync are bracketed by ``begin_weight_update``/``end_weight_update`` where the
engine has them (aborted, not committed, after a failure; one a dead trainer left open is aborted
and begun again, with a warning: `sessions.begin`).

With ``SyncConfig.layout="engine"`` (or ``"auto"`` where the engine accepts it, strategy
``flattened``) the buckets are per-rank (`reshard.iter_rank_buckets`): each trainer rank shares the
buffer of ITS infer-TP rank's shard (engine names and layout), the payloads are gathered to
infer-TP rank 0 and handed to the engine in one call per bucket (``load_format="direct"``,
`_load_rank_bucket`). Every rank of the world must agree on the layout (one all-reduce): the
reshard is collective over the module's whole shard group. ``SyncConfig.pipelined`` (per-rank
buckets only): the engine loads bucket k on a thread of infer-TP rank 0 while every rank makes
bucket k+1 (`_run_pipelined`), so two buckets' buffers are alive at once. The per-rank buffers
come from a pool (`buffers.BufferPool`) and are reused bucket after bucket; every bucket ends in a
world-wide agree, so the one-host path needs no barrier before it rewrites a buffer
(``consumer_synced``).

`TensorTransport.send` is the same send loop for a caller that owns the export and makes its own
`Call`s (verl's adapter, `fsdp_sync.integrations.verl`, from verl's ``(name, tensor)`` stream):
the bracket, then per call gather to infer-TP rank 0, deliver, agree, release. The project has
this one loop; nothing else gathers payloads to an engine.

A rank that fails making its part of a call sends a stand-in instead (`unmade`). Not here: the
stages around the sync (the manager), how tensors are gathered (`export`), laid out (`bucket`) or
shared (`handles`).
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import closing, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from .. import fleet
from ..weights import export, handles, ipc_memory, quantize, reshard, state_words
from ..weights.gather import Received
from ..weights.bucket import plan_buckets
from ..weights.layout import engine_ep_size, layout_for
from ..topology import SyncError, cpu_group, agree, agree_after_each, broadcast_from_src, gather_to_src, released_by_backend
from ..wire import flattened_bucket
from . import SyncContext, SyncStats, unmade
from .buffers import BufferPool, ReusedBuffer
from .call_times import CallTimes
from .sessions import begin

__all__ = ["TensorTransport", "Call", "engine_reads_outlast"]

log = logging.getLogger("fsdp_sync")


@dataclass
class Call:
    """One engine call: this rank's payload sets, what it sends to infer-TP rank 0, and how rank 0
    turns the gathered list (indexed by TP rank) into the engine's ``named_tensors``.

    ``deliver(engine, gathered)``, when given, is what infer-TP rank 0 runs instead of
    ``engine.update_weights_from_tensor(to_named(gathered), load_format, flush_cache=last)`` (no
    flush with ``SyncConfig.pause_mode="in_place"``): for a wire the engine protocol has no method
    for (verl's own algorithm, `integrations.verl`).
    ``on_release`` runs once the call's payloads are released (its buffer may then be reused)."""

    sets: list
    wire: Any
    to_named: Any
    load_format: str | None
    last: bool
    what: str
    on_release: Any = None
    deliver: Any = None


@dataclass
class _RankBucketCall:
    """One per-rank bucket for the engine: its plan and one payload per TP rank (TP order)."""

    bucket: Any
    payloads: list


def _module_device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return torch.device("cuda", torch.cuda.current_device()) if p.device.type == "cuda" else p.device
    return torch.device("cpu")


def _module_storages(module: torch.nn.Module) -> set[int]:
    """The data pointers of ``module``'s own CUDA storages (its parameters and buffers, a DTensor's
    local shard): what `export.iter_params` may yield as is (a plain or one-rank module, no cast)."""
    out = set()
    for t in (*module.parameters(), *module.buffers()):
        local = getattr(t, "_local_tensor", t)
        if isinstance(local, torch.Tensor) and local.device.type == "cuda":
            out.add(local.untyped_storage().data_ptr())
    return out


def _not_the_modules(t: torch.Tensor, storages: set[int]) -> torch.Tensor:
    """``t``, or where it is one of the module's own CUDA storages a copy in a buffer of the sync
    (`handles.empty_shared`), freed when its call is released, as the CPU path copies into a
    segment of its own (`handles`). Sharing a CUDA storage wraps it in a new torch
    ``CudaIPCSentData`` (a /dev/shm ref-counter slot and, for the first 1,000 live ones, an IPC
    event) that only freeing the storage gives back: a parameter's piled up sync after sync, and
    with the events spent every later share synchronized its stream."""
    if t.device.type != "cuda" or t.numel() == 0 or t.untyped_storage().data_ptr() not in storages:
        return t
    copy = handles.empty_shared(t.numel() * t.element_size(), t.device).view(t.dtype).view(t.shape)
    return copy.copy_(t)


def engine_reads_outlast(engine: Any, topo: Any, on_cuda: bool) -> bool:
    """Whether the engine may answer a call before each of its ranks finished reading the call's
    buffers, so that a buffer must not be rewritten at the answer (`ReusedBuffer`'s ``lag``):
    SGLang at TP > 1 says so (`SGLangEngine.reads_may_outlast_answer`: its TP ranks meet at a CPU
    barrier with their copies still queued, and only rank 0's waited before it answers). Infer-TP
    rank 0 holds the engine and tells its group, whose every rank packs its own buffer. Only a CUDA
    copy can be outstanding: off CUDA nothing is asked (no collective)."""
    if not on_cuda or topo.tp_size == 1:
        return False
    flag = bool(getattr(engine, "reads_may_outlast_answer", False)) if topo.is_tp_src else False
    return bool(broadcast_from_src(flag, topo))


def _per_rank(values: list) -> Any:
    from ..engines.base import SerializedPerRank

    return SerializedPerRank(values=values)


class TensorTransport:
    """``method="tensor"``: colocated engines, one per infer-TP group, held by infer-TP rank 0."""

    method = "tensor"
    colocated = True
    _group: Any = None             # what `agree` runs over: None, the world (`send` may narrow it)
    _what = "weight sync"          # the sync's name in errors

    def __init__(self, config: Any = None) -> None:
        self.config = config
        self._quant: Any = None      # this sync's `quantize.StreamQuantizer`, if quantized
        self._version: Any = None    # the weight version the engine commits (None: unnamed)

    def close(self) -> None:
        """Nothing outlives a sync: every buffer is released when its bucket is answered."""

    def sync(self, ctx: SyncContext) -> None:
        if ctx.topo is None:
            raise ValueError("method='tensor' needs the ('dp', 'infer_tp') mesh: pass mesh= to the manager")
        self.module, self.config, self.topo = ctx.module, ctx.config, ctx.topo
        self.engine = ctx.engines[0] if ctx.engines else None
        self._version = getattr(ctx, "version", None)
        self._group, self._what = None, "weight sync"
        try:
            self._sync_weights()
        finally:
            ctx.stats = self.stats
            self.module = self.engine = None

    def send(self, calls: Iterable[Call], *, topo: Any, engine: Any, stats: SyncStats | None = None,
             group: Any = None, what: str = "weight sync",
             check: Callable[[Any], str | None] | None = None, version: Any = None,
             before: Callable[[Any], str | None] | None = None) -> SyncStats:
        """Hand ``calls`` to ``engine`` the way `sync` hands its own buckets, on every rank of the
        infer-TP group in step (``engine`` on infer-TP rank 0, None elsewhere).

        For a caller that owns the export and makes its own `Call`s (verl's adapter): the engine's
        update bracket, then per call: gather to infer-TP rank 0, deliver, `agree` over ``group``
        (None: the world), release; the next call is taken from ``calls`` (a generator may reuse
        the released call's buffer) only then. ``stats`` (kept and returned) counts the engine
        calls; the caller counts what it exported. ``what`` names the sync in errors. ``check``,
        when given, runs on infer-TP rank 0 after the update bracket closed (``check(engine)`` ->
        an error text or None; the caller's verify) and is agreed like a call. ``version`` names
        the weights the engine commits (None: the engine's own naming). ``before``, when given,
        runs on infer-TP rank 0 before anything is sent (``before(engine)`` -> an error text or
        None: the caller's check that the engine may take these weights) and is agreed. Raises
        `SyncError`, the same on every rank of ``group``, when any rank failed."""
        self.topo, self.engine, self._group, self._what = topo, engine, group, what
        self._version = version
        self.stats = stats if stats is not None else SyncStats()
        self._unacked: str | None = None
        t0 = time.perf_counter()
        self._times = CallTimes(self.stats)
        try:
            # what it shares comes from ordinary CUDA segments (`ipc_memory`; verl switches them too)
            with ipc_memory.shareable() as switched:
                if switched:
                    self.stats.extra["expandable_segments"] = ipc_memory.SWITCHED
                if before is not None:
                    refused: str | None = None
                    if self.topo.is_tp_src:
                        try:
                            refused = before(engine)
                        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                            refused = f"{type(exc).__name__}: {exc}"
                    agree(refused, self._group, what=what)
                with self._update_bracket():
                    # a generator is closed here, not when its frame goes: it may hold shared buffers
                    with closing(calls) if hasattr(calls, "close") else nullcontext():
                        self._times.t = time.perf_counter()
                        for call in unmade.made(calls, self.topo, Call):
                            self._one_call(call, self._times.made(call))
                self.stats.seconds = time.perf_counter() - t0
                if check is not None:
                    # a rank with a missing acknowledgement says so here, so no rank waits alone
                    err: str | None = self._unacked
                    if err is None and self.topo.is_tp_src:
                        try:
                            err = check(engine)
                        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                            err = f"{type(exc).__name__}: {exc}"
                    agree(err, self._group, what=f"{what}: verify")
                if self._unacked:
                    raise handles.HandleError(self._unacked)
        finally:
            self.engine = None
        return self.stats

    def _sync_weights(self) -> None:
        cfg, topo = self.config, self.topo
        t0 = time.perf_counter()
        self.stats = SyncStats()
        self._unacked: str | None = None
        tagged = getattr(self.engine, "accepts_tagged_payloads", True) if topo.is_tp_src else True
        # every rank must agree on tagging, or rank 0 opens payloads it cannot read
        tagged = bool(self._broadcast_flag(tagged))
        self._quant = self._quantizer()
        with self._update_bracket():
            layout = self._choose_layout()
            self.stats.extra["layout"] = "engine" if layout is not None else "full"
            # pipelining needs a second buffer per TP rank: the per-rank buckets rotate two
            self._pipelined = layout is not None and bool(getattr(cfg, "pipelined", False))
            self.stats.extra["pipelined"] = self._pipelined
            if layout is not None:
                steps = self._steps_rank_buckets(tagged, layout)
            else:
                steps = {"per_tensor": self._steps_per_tensor, "bucketed": self._steps_bucketed,
                         "flattened": self._steps_flattened}[cfg.strategy](tagged)
            self._times = CallTimes(self.stats)
            with closing(steps):  # an abandoned export generator restores FSDP state on close
                if self._pipelined:
                    self._run_pipelined(unmade.made(steps, topo, Call))
                else:
                    for call in unmade.made(steps, topo, Call):
                        self._one_call(call, self._times.made(call))
        if self._quant is not None:
            self.stats.extra.update(self._quant.figures())
        self.stats.seconds = time.perf_counter() - t0
        if self._unacked:
            raise handles.HandleError(self._unacked)

    def _quantizer(self) -> "quantize.StreamQuantizer | None":
        """``SyncConfig.quantization``: the sync's quantizer, cut for the engine's TP (the
        infer-TP group) and EP; a model or split it cannot quantize exactly fails on every rank
        before anything is gathered."""
        cfg, topo = self.config, self.topo
        if getattr(cfg, "quantization", None) is None:
            return None
        ep = broadcast_from_src(engine_ep_size(self.engine) if topo.is_tp_src else 1, topo)
        err, quant = None, None
        try:
            quant = quantize.for_sync(self.module, cfg, topo.tp_size, ep)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            err = f"quantization={cfg.quantization!r} ({topo.describe()}): {type(exc).__name__}: {exc}"
        agree(err, self._group, what=f"{self._what}: quantization")
        return quant

    @contextmanager
    def _update_bracket(self) -> Iterator[None]:
        """``begin_weight_update`` / ``end_weight_update`` around one sync's calls, on infer-TP
        rank 0 where the engine has them. A refused begin, or a refused end after every call, fails
        the sync on every rank (`agree`). After a failed call the update is aborted, not committed;
        a session a dead trainer left open is aborted and ours begun (`sessions.begin`)."""
        topo = self.topo
        bracket = topo.is_tp_src and hasattr(self.engine, "begin_weight_update")
        err: str | None = None
        handles.collect_ipc()   # what a failed sync's engine let go of only after this rank collected
        fleet.forget_noted()    # what an earlier sync noted and nobody took (verl's adapter takes none)
        if bracket:
            try:
                begin(self.engine)
            except Exception as exc:  # noqa: BLE001 - told to every rank by agree
                err = f"begin_weight_update on {topo.describe()}: {type(exc).__name__}: {exc}"
        agree(err, self._group, what=self._what)
        ok = False
        try:
            with state_words.pooled():   # the update's payloads share their state words' pages
                yield
            ok = True
        finally:
            try:
                ends = bracket and hasattr(self.engine, "end_weight_update")

                def commit() -> str | None:
                    try:
                        self._end_update(commit=True)
                    except Exception as exc:  # noqa: BLE001 - told to every rank by agree
                        return f"end_weight_update on {topo.describe()}: {type(exc).__name__}: {exc}"
                    return None
                if ok:
                    # a commit may outlast the group's timeout: the others hear that it still runs
                    agree_after_each(commit if ends else None, self._group, what=self._what)
                elif ends:
                    fleet.note_partial(self._end_update(commit=False))
                elif topo.is_tp_src:   # no update bracket: each call applied as it came
                    kept = [fleet.describe(self.engine, 0)]
                    log.warning("fsdp_sync: %s", fleet.partial_note(kept))
                    fleet.note_partial(kept)
            finally:
                # An engine keeps a rank's bucket buffers mapped until the update ends: their CUDA
                # blocks wait in torch's limbo until then, and go back to this rank here, before the
                # rollout's memory is woken (every rank shared its own; after the agreement each
                # knows the engine has ended the update; after a failure, without one, a rank may
                # come here first: the next sync collects those)
                try:
                    handles.collect_ipc()
                except Exception as exc:  # noqa: BLE001 - never hide the sync's own outcome
                    log.warning("torch.cuda.ipc_collect after the update failed: %s", exc)

    def _end_update(self, *, commit: bool) -> list[str]:
        """Close the engine's update bracket: commit with the sync's weight version, or after a
        failure abort it where the engine can (the reference engine then keeps serving its
        previous weights) instead of committing half (`fleet.end_all`)."""
        try:
            return fleet.end_all([self.engine], commit=commit, version=self._version)
        except fleet.CommitError as exc:
            raise exc.failed[0] from None

    def _choose_layout(self) -> Any:
        """The engine-rank layout to cut per-rank buckets by, or None for full tensors.

        ``layout="auto"``: per-rank buckets when the strategy is ``flattened``, the module's
        config has a layout (`layout.layout_for`), its sharded tensors are in one shard group
        (`reshard.rank_buckets_refusal`) and every engine accepts them (``accepts_rank_buckets``,
        read on each infer-TP rank 0); one all-reduce makes every rank of the world agree.
        ``"engine"``: the same, but a refusal anywhere is an error on every rank naming why."""
        cfg, topo = self.config, self.topo
        want = getattr(cfg, "layout", "full")
        if want == "full" or cfg.strategy != "flattened":
            return None
        why, layout = None, None
        # an engine that knows its model (the reference engine) must agree with the trainer's,
        # or per-rank buckets would be cut for the wrong shapes: full tensors then name the
        # tensor that differs; its expert-parallel split is the one buckets are cut for
        espec, ep = (getattr(getattr(self.engine, "layout", None), "spec", None),
                     engine_ep_size(self.engine)) if topo.is_tp_src else (None, 1)
        espec, ep = broadcast_from_src((espec, ep), topo)
        try:
            hf_config = getattr(self.module, "config", None)
            if hf_config is None:
                raise ValueError("the module has no Hugging Face .config to take the engine's layout from")
            layout = layout_for(hf_config, topo.tp_size, ep)
        except Exception as exc:  # noqa: BLE001 - "auto" falls back, "engine" reports it
            why = f"no engine layout for this model: {type(exc).__name__}: {exc}"
        if why is None and espec is not None and espec != layout.spec:
            diff = {k: (getattr(layout.spec, k), getattr(espec, k)) for k in vars(espec)
                    if getattr(layout.spec, k) != getattr(espec, k)}
            why = f"the engine's model differs from the trainer's (trainer, engine): {diff}"
        if why is None:     # e.g. layers on a DeviceMesh of their own: two shard groups
            why = reshard.rank_buckets_refusal(self.module, cfg.fsdp1_state_dict)
        if why is None and topo.is_tp_src and not getattr(self.engine, "accepts_rank_buckets", False):
            why = (f"the engine {type(self.engine).__name__} does not accept per-rank buckets "
                   f"(accepts_rank_buckets is false: for SGLang, start the server with "
                   f"--custom-weight-loader fsdp_sync.engines.sglang.loader.load_rank_buckets and pass "
                   f"rank_bucket_loader=True)")
        if want == "engine":
            agree(why and f"layout='engine': {why} ({topo.describe()}); use layout='full' or 'auto'",
                  what="choosing the layout")
            return layout
        flag = torch.tensor([0 if why else 1], dtype=torch.int64)
        with released_by_backend(flag):
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group())
        if why and topo.rank == 0:
            log.info("fsdp_sync: layout='auto' runs full tensors: %s", why)
        return layout if flag.item() else None

    def _steps_rank_buckets(self, tagged: bool, layout: Any) -> Iterator[Call]:
        """Per-rank buckets: this rank shares its infer-TP rank's buffer of each bucket."""
        cfg, topo = self.config, self.topo
        # what a per-rank payload opens to: the reference engine takes the bucket dict
        # ("direct"), SGLang's custom loader the bare flat tensor (metadata rides in the name)
        form = getattr(self.engine, "rank_bucket_payload", "dict") if topo.is_tp_src else None
        form = broadcast_from_src(form, topo)
        st = reshard.ReshardStats()
        dtype = cfg.dtype
        plan_len = None
        # the all-to-all path's buffers: reused bucket after bucket (the one-host path has its
        # own), each sized for the largest bucket (the module's dtype is a size hint only)
        guess = dtype or next((p.dtype for p in self.module.parameters()), torch.float32)
        rank_plan = reshard.plan_rank_buckets(layout, guess, cfg.bucket_bytes)
        quant, device = self._quant, _module_device(self.module)
        lag = engine_reads_outlast(self.engine, self.topo, device.type == "cuda")    # then the engine's buffers take turns
        pool = BufferPool(max((b.nbytes for b in rank_plan), default=0), device,
                           lag=lag and quant is None)
        # quantized: each rank's slice goes from the reshard's buffer into one of its own
        qpool = BufferPool(max((quant.plan(b, engine=True).nbytes for b in rank_plan), default=0),
                            device, lag=lag) if quant is not None else None
        it = reshard.iter_rank_buckets(self.module, layout, cfg.bucket_bytes, dtype=dtype,
                                       fsdp1_state_dict=cfg.fsdp1_state_dict,
                                       share_host_memory=cfg.share_host_memory, stats=st,
                                       host_sets=2 if self._pipelined else 1, alloc=pool.take,
                                       ranks=[topo.tp_rank],    # where each rank holds all: its own
                                       # every bucket ends in a world-wide agree after the engine
                                       # answered (`_one_call`, `_run_pipelined`'s finish)
                                       consumer_synced=True)
        engine_in = 0
        with closing(it):
            for rb in it:
                if plan_len is None:
                    plan_len = len(reshard.plan_rank_buckets(layout, rb.bucket.entries[0].dtype,
                                                             cfg.bucket_bytes))
                flat = rb.buffers.get(topo.tp_rank)
                if flat is None:
                    raise RuntimeError(
                        f"per-rank bucket {rb.index}: this rank holds engine ranks "
                        f"{sorted(rb.buffers)} but serves infer-TP rank {topo.tp_rank} "
                        f"({topo.describe()}); the mesh must put global rank r at infer-TP rank "
                        f"r % tp (the ('dp', 'infer_tp') row-major mesh does), or use layout='full'")
                if quant is not None:
                    staged = [] if rb.shared else list(rb.buffers.values())
                    err = None
                    try:    # each rank quantizes its own slice: a failure (NaN) must reach every rank
                        rb = quant.rank_bucket(rb, qpool.take, ranks=[topo.tp_rank])
                    except Exception as exc:  # noqa: BLE001
                        err = f"quantizing per-rank bucket {rb.index} ({topo.describe()}): {type(exc).__name__}: {exc}"
                    pool.give_back(staged)
                    del staged
                    agree(err, self._group, what=f"{self._what}: quantization")
                    flat = rb.buffers[topo.tp_rank]
                obj = flat if form == "tensor" else flattened_bucket(flat, rb.bucket)
                sets = [handles.make_payloads(obj, topo.tp_size, ranks=[topo.tp_rank], tagged=tagged)]
                engine_in += rb.bucket.nbytes
                self.stats.tensors += len(rb.bucket.entries)
                self.stats.buckets += 1
                bkt = rb.bucket
                views = [] if rb.shared else list(rb.buffers.values())
                back = qpool if quant is not None else pool
                del flat, obj, rb
                yield Call(sets, sets[0].payloads[0],
                           lambda g, _b=bkt: _RankBucketCall(_b, g), "direct",
                           self.stats.buckets == plan_len, f"per-rank bucket {self.stats.buckets - 1} "
                           f"({bkt.names[0]}…)", on_release=lambda _v=views, _p=back: _p.give_back(_v))
                del views
        pool.close()
        if qpool is not None:
            qpool.close()
        # bytes: what was exported (the HF tensors, as for full buckets; quantized: with fp8
        # weights and their scales); each engine rank's share of them is engine_rank_bytes_in
        itemsize = (cfg.dtype or next(self.module.parameters()).dtype).itemsize
        held = quant.layout if quant is not None else layout
        self.stats.bytes = sum(math.prod(shape) * held.dtype_of(n, None, itemsize)
                               for n, shape in held.hf_shapes.items())
        self.stats.extra.update(
            reshard_path=st.path, engine_rank_bytes_in=engine_in,
            engine_rank_shard_bytes=(st.engine_shard_bytes if quant is None
                                     else quant.layout.engine_bytes(itemsize)),
            trainer_rank_bytes_in=st.bytes_in, trainer_rank_bytes_written=st.bytes_written)

    def _broadcast_flag(self, value: bool) -> bool:
        """Infer-TP rank 0's answer on every rank of its group."""
        if self.topo.tp_size == 1:
            return value
        t = torch.tensor([1 if value else 0], dtype=torch.int64)
        with released_by_backend(t):
            dist.broadcast(t, src=self.topo.tp_src, group=cpu_group(self.topo.tp_group))
        return bool(t.item())

    def _steps_flattened(self, tagged: bool) -> Iterator[Call]:
        cfg, topo = self.config, self.topo
        plan = plan_buckets(export.param_metas(self.module, cfg.dtype), cfg.bucket_bytes)
        quant, device = self._quant, _module_device(self.module)
        lag = engine_reads_outlast(self.engine, self.topo, device.type == "cuda")    # then the engine's buffers take turns
        buffer = ReusedBuffer(max((b.nbytes for b in plan), default=0), device, lag=lag and quant is None)
        release = buffer.give_back
        if quant is not None:   # the gathered bucket is quantized into a buffer of its own
            out = ReusedBuffer(max((quant.plan(b).nbytes for b in plan), default=0), device, lag=lag)
            release = out.give_back
        received = Received()       # this rank's gathers: stats' trainer_rank_bytes_in
        self.stats.extra["trainer_rank_bytes_in"] = 0
        it = export.iter_buckets(self.module, cfg.bucket_bytes, dtype=cfg.dtype,
                                 fsdp1_state_dict=cfg.fsdp1_state_dict, alloc=buffer.take,
                                 share_host_memory=cfg.share_host_memory, received=received)
        with closing(it):
            for i, (bucket, flat) in enumerate(it):
                if quant is not None:
                    bucket, flat = quant.bucket(bucket, flat, out.take)
                    buffer.give_back()
                obj = flattened_bucket(flat, bucket)
                sets = [handles.make_payloads(obj, topo.tp_size, ranks=[topo.tp_rank], tagged=tagged)]
                self.stats.bytes += bucket.payload_bytes
                self.stats.tensors += len(bucket.entries)
                self.stats.buckets += 1
                self.stats.extra["trainer_rank_bytes_in"] = received.bytes_in
                del flat, obj
                yield Call(sets, sets[0].payloads[0], lambda g: g, "flattened_bucket",
                           i == len(plan) - 1, f"bucket {i} ({bucket.names[0]}…)",
                           on_release=release)

    def _steps_per_tensor(self, tagged: bool) -> Iterator[tuple]:
        cfg, topo = self.config, self.topo
        n = len(quantize.sync_metas(self.module, cfg))
        it = export.iter_params(self.module, dtype=cfg.dtype, fsdp1_state_dict=cfg.fsdp1_state_dict)
        if self._quant is not None:
            it = self._quant.named(it)
        own = _module_storages(self.module)
        for i, (name, tensor) in enumerate(it):
            tensor = _not_the_modules(tensor, own)
            sets = [handles.make_payloads(tensor, topo.tp_size, ranks=[topo.tp_rank], tagged=tagged)]
            self.stats.bytes += tensor.numel() * tensor.element_size()
            self.stats.tensors += 1
            self.stats.buckets += 1
            del tensor
            yield Call(sets, sets[0].payloads[0], lambda g, _n=name: [(_n, _per_rank(g))], None,
                       i == n - 1, repr(name))

    def _steps_bucketed(self, tagged: bool) -> Iterator[tuple]:
        cfg, topo = self.config, self.topo
        plan = plan_buckets(quantize.sync_metas(self.module, cfg), cfg.bucket_bytes)
        it = export.iter_params(self.module, dtype=cfg.dtype, fsdp1_state_dict=cfg.fsdp1_state_dict)
        if self._quant is not None:
            it = self._quant.named(it)
        own = _module_storages(self.module)
        for i, bucket in enumerate(plan):
            names, sets = [], []
            for entry in bucket.entries:
                name, tensor = next(it)
                if name != entry.name:
                    raise RuntimeError(f"export order changed: expected {entry.name!r}, got {name!r}")
                names.append(name)
                tensor = _not_the_modules(tensor, own)
                sets.append(handles.make_payloads(tensor, topo.tp_size, ranks=[topo.tp_rank],
                                                  tagged=tagged))
                self.stats.bytes += tensor.numel() * tensor.element_size()
                del tensor
            self.stats.tensors += len(names)
            self.stats.buckets += 1

            def named(gathered: list, _names=tuple(names)) -> list:
                # gathered[tp_rank][j] is tp_rank's payload of tensor j
                return [(nm, _per_rank([g[j] for g in gathered])) for j, nm in enumerate(_names)]

            yield Call(sets, [x.payloads[0] for x in sets], named, None, i == len(plan) - 1,
                       f"bucket {i} ({names[0]}…)")

    def _engine_call(self, call: Call, gathered: list, row: dict | None = None) -> tuple[str | None, bool]:
        """Infer-TP rank 0: hand one gathered call to the engine; (the error text or None,
        whether the engine may have opened the payloads). ``row``: its `CallTimes` row, given the
        call's own seconds."""
        t0 = time.perf_counter()
        before = getattr(self.engine, "last_call_figures", None)
        try:
            err, opened = self._engine_call_timed(call, gathered)
            after = getattr(self.engine, "last_call_figures", None)
            if row is not None and err is None and after is not before:
                # an engine that says where this call's time went in its workers (the reference one)
                for k, v in (after or {}).items():
                    row[f"worker_{k}"] = v
            return err, opened
        finally:
            if row is not None:
                row["engine_call_s"] = time.perf_counter() - t0

    def _engine_call_timed(self, call: Call, gathered: list) -> tuple[str | None, bool]:
        topo = self.topo
        # the cache is flushed with the last call, never while requests are paused in place: SGLang
        # refuses that flush (0.5.23 fails the call, its weights loaded; 0.5.12's scheduler asserts)
        flush = call.last and getattr(self.config, "pause_mode", None) != "in_place"
        try:
            if call.deliver is not None:
                call.deliver(self.engine, gathered)
            else:
                named = call.to_named(gathered)
                if isinstance(named, _RankBucketCall):
                    self.engine.load_rank_bucket(named.bucket, named.payloads, flush_cache=flush)
                else:
                    self.engine.update_weights_from_tensor(named, load_format=call.load_format,
                                                           flush_cache=flush)
            self.stats.engine_calls += 1
            return None, True
        except Exception as exc:  # noqa: BLE001 - reported to every rank by agree
            # an engine that refused the call before loading says so (SGLangUpdateError.opened)
            opened = getattr(exc, "opened", None) is not False
            return (f"engine update of {call.what} on {topo.describe()}: {type(exc).__name__}: "
                    f"{exc}"), opened

    def _release(self, call: Call, err: str | None, opened: bool = True) -> None:
        """Free the call's payloads. ``opened`` False: no consumer opened them, so the references
        their pickling took are given back (an untagged payload cannot tell by itself)."""
        for s in call.sets:
            missing = [s.ranks[i] for i in s.unacknowledged()]
            if missing and err is None and self._unacked is None:
                self._unacked = (f"engine answered for {call.what} but consumer ranks {missing} "
                                 f"never acknowledged their payloads ({self.topo.describe()})")
            s.release(require_ack=False, unopened=() if opened else list(s.ranks))
        if call.on_release is not None:
            call.on_release()
        # the call now holds nothing of its bucket: a failed sync's error keeps the frames that
        # hold it until the garbage collector runs (a reference cycle through its traceback), and
        # through its on_release the sync's buffers (bucket_bytes of shared or CUDA memory each)
        call.sets, call.wire, call.on_release = [], None, None

    def _run_pipelined(self, steps: Iterator[Call]) -> None:
        """Bucket k+1 is made (reshard, handles, gather) while the engine loads bucket k.

        Infer-TP rank 0 runs each engine call on a worker thread. Before call k+1 is handed over,
        call k is waited for and every rank agrees on its outcome (so nothing is sent after a
        failure), then call k's payloads are released: its buffers are rewritten only by bucket
        k+2 (two buffer sets, `reshard.iter_rank_buckets(host_sets=2)`)."""
        import concurrent.futures as cf

        topo = self.topo
        pool = cf.ThreadPoolExecutor(1, thread_name_prefix="fsdp_sync-engine") if topo.is_tp_src else None
        pending: tuple | None = None       # (call, future on infer-TP rank 0 / None elsewhere)

        times = self._times
        rows: dict[int, dict] = {}

        def finish(unmade_next: str | None = None) -> None:
            # agrees call k's outcome and whether a rank sent a stand-in for call k+1 (`unmade`);
            # the first call's stand-in gets an agree of its own (every rank is at its first call)
            nonlocal pending
            if pending is None:
                return agree(unmade_next, self._group, what=self._what)
            call, fut = pending
            row = rows.pop(id(call), None)
            err, opened = fut.result() if fut is not None else (None, True)
            times.lap(row, "engine_s")
            try:
                agree(err or unmade_next, self._group, what=self._what)
                times.lap(row, "agree_s")
            except SyncError:   # only infer-TP rank 0 heard whether the engine opened the payloads
                opened = bool(broadcast_from_src(opened, topo))
                raise
            finally:
                pending = None
                self._release(call, err, opened)
                times.lap(row, "release_s")

        try:
            for call in steps:
                row = rows[id(call)] = times.made(call)
                try:
                    gathered = gather_to_src(call.wire, topo)
                    times.lap(row, "gather_s")
                    finish(unmade.refusal(call, gathered, topo))    # raises on a rank's stand-in
                except BaseException:   # never handed to the engine: nobody opened it
                    self._release(call, "failed", opened=False)
                    raise
                fut = pool.submit(self._engine_call, call, gathered, row) if pool is not None else None
                pending = (call, fut)
                del gathered
            finish()
        finally:
            if pending is not None:          # an error elsewhere: wait for the engine, then free
                call, fut = pending
                if fut is not None:
                    try:
                        fut.result()
                    except BaseException:  # noqa: BLE001 - the first error is the one raised
                        pass
                self._release(call, "failed")
            if pool is not None:
                pool.shutdown(wait=True)

    def _one_call(self, call: Call, row: dict | None = None) -> None:
        """Gather this rank's payloads to infer-TP rank 0, call the engine there, agree, free
        (each phase's seconds into ``row``, `CallTimes`)."""
        err: str | None = "failed"
        opened = True
        times = self._times
        try:
            gathered = gather_to_src(call.wire, self.topo)
            times.lap(row, "gather_s")
            err = unmade.refusal(call, gathered, self.topo)     # a rank's stand-in: no engine call
            err, opened = ((err, False) if err else self._engine_call(call, gathered, row)
                           if self.topo.is_tp_src else (None, True))
            times.lap(row, "engine_s")
            del gathered
            agree(err, self._group, what=self._what)
            times.lap(row, "agree_s")
        except SyncError:
            # only infer-TP rank 0 heard whether the engine opened the payloads
            opened = bool(broadcast_from_src(opened, self.topo))
            raise
        finally:
            # Acknowledgements are checked without a collective of their own: a missing one
            # fails this rank's stage, and the stage's closing `agree` tells every rank.
            self._release(call, err, opened)
            times.lap(row, "release_s")
