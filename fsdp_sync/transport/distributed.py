"""The disaggregated method: a broadcast over SGLang's weight-update group (``method="distributed"``).

The rollout engines run on devices of their own, outside the trainer's world. Trainer rank 0 holds
the engine handles (one per rollout replica) and, at the first sync, makes the update group as
SGLang 0.5.23 makes it (`group.new_update_group`): the trainer is rank 0, engine i's TP workers are
ranks ``rank_offset_i + tp_rank`` with ``rank_offset_i = 1 + sum(tp_j, j < i)``, ``world_size =
1 + sum(tp_i)``, a ``tcp://`` store on trainer rank 0 behind ``PrefixStore(group_name)``. The
group lives until `close` (the manager's ``close`` and interpreter exit).

One sync, per bucket k (buckets planned by `bucket.plan_tight`: SGLang's tight layout, every offset
a multiple of its dtype size, checked before any request goes out):

    every trainer rank   gather bucket k to trainer rank 0 (the others send their shards only)
    trainer rank 0       send each engine its request (a thread per engine), then broadcast
                         bucket k (async); meanwhile every rank gathers bucket k+1 into the other
                         of two buffers; then wait for bucket k: the broadcast done and every
                         engine's answer, raced, so an engine that refuses (no open update,
                         unknown group, bad dtype, bad layout: it never joins the broadcast) is
                         seen at once, the pending broadcast aborted
    every trainer rank   `agree`: a refusal raises the same `SyncError` on every rank

``dist_format="flattened_bucket"`` (default) sends one broadcast per bucket; ``"per_tensor"`` sends
SGLang's ``load_format=None`` request (one broadcast per tensor, in names order) as the baseline.

Per-rank buckets (``SyncConfig.layout="engine"``, or ``"auto"`` where every engine accepts them:
``accepts_distributed_rank_buckets``, e.g. the reference engine; SGLang's broadcasts full tensors to
every rank, so it cannot): buckets are planned over the engine's parameters
(`reshard.iter_rank_buckets`, trainer rank 0 the owner of every engine rank's buffer) and trainer
rank 0 sends engine TP rank r only ITS buffer, one point-to-point ``isend`` to group rank
``rank_offset + r`` per bucket (request ``load_format="per_rank_bucket"``,
`group.PER_RANK_BUCKET`: engine names, one rank's shard shapes). The same two-buffer overlap: bucket
k+1 is resharded while bucket k is on the wire (``SyncConfig.pipelined``). All engines must have one
TP size. The choice is made on trainer rank 0 and told to every trainer rank before anything moves;
``"engine"`` against an engine that cannot take it raises there on every rank.
Engine calls go inside ``begin_weight_update``/``end_weight_update`` where the engine has them,
``flush_cache=False`` on every bucket but the last, which flushes (`_flushes`): SGLang runs that
flush under its writer lock, which waits for the running requests, where a ``/flush_cache`` of
its own after the commit is refused (HTTP 400) while requests run; none with
``pause_mode="in_place"``, as SGLang refuses it while requests are held. With several engines the
end is the fleet's second phase (`fleet.end_all`): no engine commits until every engine has taken
every bucket, and each commits with the sync's weight version. After a failure the group is torn
down on both ends and made again at the next sync.

Not here: export (`export.iter_buckets` with ``dst``), the per-rank cut (`reshard`, `layout`), the
group's making (`update_group`: every check the trainer side can make before an engine is told to
join, and a failed opening called off), engines.
"""

from __future__ import annotations

import concurrent.futures as cf
import datetime
import logging
import time
import traceback
import weakref
from typing import Any

import torch
import torch.distributed as dist

from .. import fleet
from ..weights import export, quantize, reshard
from ..weights.gather import Received
from ..weights.bucket import Bucket, check_tight, dtype_name, plan_tight
from ..weights.layout import TPLayout, engine_ep_size, layout_for
from ..topology import SyncError, agree, agree_after_rank0, cpu_group
from . import SyncContext, SyncStats, timed_items
from ..wire import PER_RANK_BUCKET, destroy_update_group, per_rank_bucket_plan
from .sessions import begin_all
from .sessions import begin as _begin   # noqa: F401 - the old name, which tests/test_serve_abort.py imports
from .update_group import (EngineCalls, check_answer, check_distinct_gpus, destroy_ours, engine_tp, open_group,
                           outward_address)

__all__ = ["DistributedTransport", "check_distinct_gpus", "outward_address"]

log = logging.getLogger("fsdp_sync")

_POLL_S = 0.002


class _Pending:
    """One bucket in flight on trainer rank 0: its broadcasts and each engine's answer."""

    def __init__(self, what: str, works: list, futures: list, p2p: bool = False,
                 keep: Any = None) -> None:
        self.what, self.works, self.futures = what, works, futures
        # gloo's isend never reports completion before wait(): for point-to-point sends every
        # engine's answer (it has received its buffer) stands for "sent"; ``keep`` holds the
        # buffers alive until then
        self.p2p, self.keep = p2p, keep


class _RankBufferPool:
    """Trainer rank 0's per-rank buffers on the all-to-all path: two sets of one buffer per engine
    TP rank, taken in turn (bucket k+1 is filled while bucket k is sent), each grown to the largest
    bucket once."""

    def __init__(self, tp: int, device: torch.device, sets: int) -> None:
        self.bufs: list[torch.Tensor | None] = [None] * (tp * sets)
        self.device, self.turn = device, 0

    def take(self, nbytes: int) -> torch.Tensor:
        i = self.turn % len(self.bufs)
        self.turn += 1
        if self.bufs[i] is None or self.bufs[i].numel() < nbytes:
            self.bufs[i] = None
            self.bufs[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.bufs[i][:nbytes]


class DistributedTransport:
    """``method="distributed"``: disaggregated engines held by trainer rank 0. See the module."""

    method = "distributed"
    colocated = False

    def __init__(self, config: Any) -> None:
        self.config = config
        # the update group (trainer rank 0 only) and its store, held where a finalizer can reach
        # them without holding this transport: a manager dropped without close() destroys its
        # group when collected (else torch keeps the name and every later manager is refused it)
        self._held: dict = {"pg": None, "store": None}
        self._finalizer = weakref.finalize(self, _release_orphaned, self._held,
                                           getattr(config, "dist_group_name", None))
        self._finalizer.atexit = False    # at exit the process's groups go with it
        self.engines: list = []           # the engines the group was made with
        self.broken = False               # torn down after a failure: remake at the next sync
        self.offsets: list[int] = []      # each engine's rank_offset in the group
        self._calls = EngineCalls()        # engine calls, each on a daemon thread
        self._quant: Any = None           # trainer rank 0: this sync's `quantize.StreamQuantizer`
        self._stuck: set[int] = set()     # engines whose request was given up on, still running
        self._left: set[int] = set()      # engines that refused a bucket and left the group already
        self._joins: dict = {}            # each engine's init_weights_update_group (`open_group`)
        self._last_bucket = False         # the bucket being launched is the sync's last: it flushes

    @property
    def pg(self) -> Any:
        return self._held["pg"]

    @pg.setter
    def pg(self, pg: Any) -> None:
        self._held["pg"] = pg

    @property
    def _store(self) -> Any:     # the group's store, hosted while the group lives
        return self._held["store"]

    @_store.setter
    def _store(self, store: Any) -> None:
        self._held["store"] = store

    # ------------------------------------------------------------------ group
    def _backend(self, device: torch.device) -> str:
        return self.config.dist_backend or ("nccl" if device.type == "cuda" else "gloo")

    def _open_group(self, engines: list, device: torch.device) -> None:
        """Trainer rank 0: make the update group with every engine (at the first sync, and again
        after a failure; `update_group.open_group`)."""
        if self.pg is not None and not self.broken and engines == self.engines:
            return
        self._drop_group(engines)
        made = open_group(engines, self.config, device, self._backend(device), self._calls, self._joins)
        self.pg, self._store, self.offsets = made.pg, made.store, made.offsets
        self.engines, self.broken = list(engines), False

    def _drop_group(self, engines: list) -> None:
        """Tear the group down on both ends: the engines first (their workers close their
        connections, which ends a broadcast of ours still pending: gloo's destructor would wait
        for it), then ours. Errors are logged: a dead engine cannot answer."""
        if self.pg is None and not self.engines:
            self._store = None
            return
        try:    # None: ours was destroyed already (`_launch_failed`), the engines' not yet
            if self.pg is not None:
                self.pg.abort()
        except Exception:  # noqa: BLE001 - destroying it is what matters
            pass
        for i, engine in enumerate(self.engines or engines):
            if i in self._stuck:     # its lock is held by the request still running: not waited for
                log.warning("fsdp_sync: not telling %s to destroy the weight-update group: its "
                            "request is still running", fleet.describe(engine, i))
                continue
            if i in self._left:      # it refused a bucket and left at once (`_release_refused`)
                continue
            try:
                check_answer(engine.destroy_weights_update_group(self.config.dist_group_name),
                             "destroy_weights_update_group")
            except Exception as exc:  # noqa: BLE001
                log.warning("fsdp_sync: an engine's destroy_weights_update_group: %s", exc)
        pg, self.pg, self.engines, self._left = self.pg, None, [], set()
        try:
            if pg is not None:
                destroy_update_group(pg)
        except Exception as exc:  # noqa: BLE001
            log.warning("fsdp_sync: destroying the weight-update group: %s", exc)
        del pg
        self._store = None     # its port closes with the group

    def close(self) -> None:
        """Destroy the update group on both ends; idempotent. An engine call still running (a
        join called off, a request given up on) is not waited for: it ends on the engine's side."""
        self._drop_group(self.engines)

    # ------------------------------------------------------------------ sync
    def sync(self, ctx: SyncContext) -> None:
        cfg, group = self.config, ctx.group
        t0 = time.perf_counter()
        stats = ctx.stats = SyncStats()
        me = dist.get_rank(group) if dist.is_initialized() else 0
        engines = list(ctx.engines) if me == 0 else []
        device = _module_device(ctx.module)
        metas = export.param_metas(ctx.module, cfg.dtype)
        layout = self._choose_layout(ctx, engines, me)    # collective; raises for "engine" refused
        stats.extra["layout"] = "engine" if layout is not None else "full"
        stats.extra["pipelined"] = False    # per-rank buckets only (the full path always overlaps)
        # pure, the same on every rank; per-rank buckets plan over the engine's own parameters
        plan = plan_tight(metas, cfg.bucket_bytes) if layout is None else []
        self._quant = None

        def open_update() -> str | None:     # trainer rank 0; the others wait with it
            try:
                for b in plan:
                    check_tight(b)
                self._quant = self._quantizer(ctx, engines)
                self._open_group(engines, device)
                begin_all(engines)
            except Exception as exc:  # noqa: BLE001 - every trainer rank must hear of it
                return f"opening the weight update on trainer rank 0: {type(exc).__name__}: {exc}"
            return None

        # the rendezvous may take up to dist_timeout_s, longer than the trainer group's timeout
        agree_after_rank0(open_update, group, what="distributed weight sync")
        ok = False
        try:
            if layout is None:
                self._send(ctx, engines, plan, device, stats)
            else:
                self._send_ranks(ctx, engines, layout, metas, device, stats)
            ok = True
        finally:
            if me == 0 and not ok:
                fleet.note_partial(self._end(engines, False, ctx))   # the error says who kept part
        def commit() -> str | None:
            # every engine staged (the last bucket flushed the caches): the fleet's second phase
            try:
                self._end(engines, True, ctx)
            except fleet.CommitError as exc:
                ctx.commit_failed = exc
                return f"committing the update: {exc}"
            return None

        # a commit may take longer than the trainer group's timeout: the others hear it still runs
        agree_after_rank0(commit, group, what="distributed weight sync")
        stats.engine_calls += len(engines)
        if self._quant is not None:
            stats.extra.update(self._quant.figures())
        elif getattr(cfg, "quantization", None) is not None:   # trainer rank 0 quantized what was sent
            stats.extra["quantization"] = cfg.quantization
        stats.seconds = time.perf_counter() - t0

    def _quantizer(self, ctx: SyncContext, engines: list) -> "quantize.StreamQuantizer | None":
        """Trainer rank 0: ``SyncConfig.quantization``'s quantizer (it alone holds what is sent),
        checked against every engine's TP/EP split (a split that cuts a block is refused)."""
        cfg = self.config
        if getattr(cfg, "quantization", None) is None:
            return None
        splits = list(dict.fromkeys((engine_tp(e), engine_ep_size(e)) for e in engines)) or [(1, 1)]
        quants = [quantize.for_sync(ctx.module, cfg, tp, ep, tight=True) for tp, ep in splits]
        return quants[0]

    def _choose_layout(self, ctx: SyncContext, engines: list, me: int) -> TPLayout | None:
        """The engines' layout to cut per-rank buckets by, or None for full tensors.

        Decided on trainer rank 0 (it alone holds the engines) and told to every trainer rank
        (one object broadcast over the trainer group) before anything moves. ``"auto"``: per-rank
        where ``dist_format="flattened_bucket"``, the group sends point to point (not gloo on
        CUDA), every engine accepts them
        (``accepts_distributed_rank_buckets``), all have one TP size, the module's config has a
        layout, an engine that knows its model agrees with it and the module's sharded tensors are
        in one shard group (`reshard.rank_buckets_refusal`). ``"engine"``: the same, but a
        reason against is a `SyncError` on every trainer rank naming it."""
        cfg = self.config
        want = getattr(cfg, "layout", "full")
        if want == "full" or cfg.dist_format != "flattened_bucket":
            return None    # config.py refuses "engine" with dist_format="per_tensor"
        hf_config = getattr(ctx.module, "config", None)
        info: list = [None]
        if me == 0:
            why, tp, ep = None, None, 1
            try:
                tps = [engine_tp(e) for e in engines]
                refuse = [i for i, e in enumerate(engines)
                          if not getattr(e, "accepts_distributed_rank_buckets", False)]
                device = _module_device(ctx.module)
                if device.type == "cuda" and self._backend(device) == "gloo":
                    why = ("dist_backend='gloo' on CUDA: per-rank buckets go point to point (send/recv), "
                           "which torch's gloo backend does for CPU tensors only (its broadcast, which "
                           "full tensors use, takes CUDA tensors)")
                elif refuse:
                    e = engines[refuse[0]]
                    why = (f"engine {refuse[0]} ({type(e).__name__}) does not accept per-rank buckets "
                           f"over the update group (accepts_distributed_rank_buckets is false"
                           + ("; SGLang's update_weights_from_distributed broadcasts the same full "
                              "tensors to every TP rank, so each rank cannot be sent only its shard"
                              if "SGLang" in type(e).__name__ else "") + ")")
                elif len(set(tps)) > 1:
                    why = (f"the engines have different TP sizes {tps}; per-rank buckets are cut for "
                           f"one layout")
                elif hf_config is None:
                    why = "the module has no Hugging Face .config to take the engine's layout from"
                elif len({engine_ep_size(e) for e in engines}) > 1:
                    why = (f"the engines have different expert-parallel sizes "
                           f"{[engine_ep_size(e) for e in engines]}; per-rank buckets are cut for one layout")
                else:
                    tp, ep = tps[0], engine_ep_size(engines[0])
                    layout = layout_for(hf_config, tp, ep)
                    for i, e in enumerate(engines):
                        espec = getattr(getattr(e, "layout", None), "spec", None)
                        if espec is not None and espec != layout.spec:
                            diff = {k: (getattr(layout.spec, k), getattr(espec, k)) for k in vars(espec)
                                    if getattr(layout.spec, k) != getattr(espec, k)}
                            why = f"engine {i}'s model differs from the trainer's (trainer, engine): {diff}"
                            break
                    if why is None:     # e.g. layers on a DeviceMesh of their own: two shard groups
                        why = reshard.rank_buckets_refusal(ctx.module, cfg.fsdp1_state_dict)
            except Exception as exc:  # noqa: BLE001 - "auto" falls back, "engine" reports it
                why = f"no engine layout for this model: {type(exc).__name__}: {exc}"
            info = [(None if why else (tp, ep), why)]
        if dist.is_initialized() and dist.get_world_size(ctx.group) > 1:
            dist.broadcast_object_list(info, src=dist.get_global_rank(ctx.group, 0)
                                       if ctx.group is not None else 0, group=cpu_group(ctx.group))
        split, why = info[0]
        if why is not None:
            if want == "engine":
                raise SyncError(f"distributed weight sync: layout='engine': {why}; nothing was sent. "
                                f"Use layout='full' (or 'auto', which sends full tensors there)")
            if me == 0:
                log.info("fsdp_sync: layout='auto' sends full tensors: %s", why)
            return None
        return layout_for(hf_config, *split)

    def _send_ranks(self, ctx: SyncContext, engines: list, layout: TPLayout, metas: list,
                    device: torch.device, stats: SyncStats) -> None:
        """Per-rank buckets: trainer rank 0 holds every engine rank's buffer of bucket k (each
        planned to ``bucket_bytes / tp``) and sends engine rank r of each engine only buffer r. Pipelined: bucket k+1 is resharded (into the
        other of two buffer sets) while bucket k is on the wire; otherwise bucket k is finished
        first."""
        cfg, group = self.config, ctx.group
        me = dist.get_rank(group) if dist.is_initialized() else 0
        piped = bool(getattr(cfg, "pipelined", True))
        stats.extra["pipelined"] = piped
        sets = 2 if piped else 1
        st = reshard.ReshardStats()
        pool = _RankBufferPool(layout.tp, device, sets)
        quant = self._quant          # trainer rank 0 only: it holds every engine rank's buffer
        qpool = _RankBufferPool(layout.tp, device, sets) if quant is not None else None
        # rank 0 holds all TP buffers of a bucket: each is bucket_bytes / tp, so one bucket is
        # bucket_bytes in all and the memory bound stays 2 x bucket (+ the largest tensor)
        part_bytes = max(1, cfg.bucket_bytes // layout.tp)
        # the stream's plan (dtype: the module's one dtype unless cast): the last bucket flushes
        n_parts = len(reshard.plan_rank_buckets(layout, cfg.dtype or metas[0].dtype, part_bytes))
        it = reshard.iter_rank_buckets(ctx.module, layout, part_bytes, dtype=cfg.dtype,
                                       fsdp1_state_dict=cfg.fsdp1_state_dict,
                                       share_host_memory=cfg.share_host_memory,
                                       owners=[[0]] * layout.tp, alloc=pool.take, stats=st, host_sets=sets,
                                       # whole tensors on every rank (the local path): rank 0 alone
                                       # builds the buffers it sends
                                       ranks=None if me == 0 else [])
        pending: _Pending | None = None
        engine_in = 0

        failed: str | None = None     # rank 0's own failure (quantizing, launching): agreed below

        split = {"export_s": 0.0, "send_wait_s": 0.0}     # this rank's (rank 0's in the stats)

        def settle() -> None:     # every rank: the outcome of the bucket in flight
            nonlocal pending
            t = time.perf_counter()
            err, pending = (self._finish(pending) if pending is not None else None), None
            _agree(err or failed, group, "distributed weight sync")
            split["send_wait_s"] += time.perf_counter() - t

        try:
            # export_s: the stream making each bucket
            for k, rb in enumerate(timed_items(it, split, "export_s")):   # reshards bucket k (k-1 on the wire)
                if k and piped:
                    settle()
                if me == 0 and failed is None:
                    try:     # the peers are in the stream: a failure here is agreed, never raised alone
                        if quant is not None:
                            rb = quant.rank_bucket(rb, qpool.take)
                        self._last_bucket = rb.index == n_parts - 1
                        pending = self._launch_ranks(engines, rb, f"per-rank bucket {k} ({rb.bucket.names[0]}…)")
                    except Exception as exc:  # noqa: BLE001
                        failed = f"per-rank bucket {k} on trainer rank 0: {type(exc).__name__}: {exc}"
                if not piped:
                    settle()
                engine_in += rb.bucket.nbytes
                stats.tensors += len(rb.bucket.entries)
                stats.buckets += 1
                del rb
            if stats.buckets and piped:
                settle()
        finally:
            it.close()
            if pending is not None:
                self._abandon(pending, "the sync failed on trainer rank 0", self._deadline())
        # bytes: what was exported (the HF tensors, as for full buckets; quantized: fp8 weights
        # and their scales); each engine rank's share of them is engine_rank_bytes_in
        quantized = quantize.sync_metas(ctx.module, cfg) if getattr(cfg, "quantization", None) else metas
        stats.bytes = sum(m.nbytes for m in quantized if layout.accepts(m.name.removesuffix("_scale_inv")))
        shard = st.engine_shard_bytes
        if getattr(cfg, "quantization", None):
            held = quantize.held_layout(ctx.module, layout, cfg.quantization)    # the config's ignored layers too
            shard = held.engine_bytes((cfg.dtype or metas[0].dtype).itemsize)
        stats.extra.update(split)
        stats.extra.update(reshard_path=st.path, engine_rank_bytes_in=engine_in,
                           engine_rank_shard_bytes=shard, trainer_rank_bytes_in=st.bytes_in,
                           trainer_rank_bytes_written=st.bytes_written)

    def _flushes(self) -> bool:
        """Whether the bucket being launched asks the engines to flush their cache: the sync's last
        (``_last_bucket``), unless requests are held in place (``pause_mode="in_place"``: SGLang
        refuses the flush then)."""
        return self._last_bucket and getattr(self.config, "pause_mode", None) != "in_place"

    def _launch_ranks(self, engines: list, rb: Any, what: str) -> _Pending:
        """Requests first (each engine's workers block in their receive), then one isend per
        engine TP rank of that rank's buffer."""
        cfg, bkt = self.config, rb.bucket
        entries = [(e.name, e.dtype, tuple(e.shape)) for e in bkt.entries]
        wire = per_rank_bucket_plan(entries)
        if wire != bkt:     # the receiver lays the buffer out by this rule: it must be the plan's
            raise RuntimeError(f"{what}: the per-rank bucket's layout differs from the "
                               f"{PER_RANK_BUCKET!r} wire layout ({wire.nbytes} vs {bkt.nbytes} bytes)")
        body = dict(names=bkt.names, dtypes=[dtype_name(e.dtype) for e in bkt.entries],
                    shapes=[list(e.shape) for e in bkt.entries], group_name=cfg.dist_group_name,
                    flush_cache=self._flushes(), load_format=PER_RANK_BUCKET)
        futures: list = []
        works: list = []
        try:
            for e in engines:
                futures.append(self._calls.submit(e.update_weights_from_distributed, **body))
            if bkt.nbytes:
                for offset in self.offsets:
                    for r in range(len(rb.buffers)):
                        works.append(dist.isend(rb.buffers[r], group=self.pg, group_dst=offset + r))
        except BaseException as exc:   # a send error or a Ctrl-C: the engines are in their receive
            self._launch_failed(_Pending(what, works, futures, p2p=True, keep=rb.buffers), exc)
            raise
        return _Pending(what, works, futures, p2p=True, keep=rb.buffers)

    def _send(self, ctx: SyncContext, engines: list, plan: list[Bucket], device: torch.device,
              stats: SyncStats) -> None:
        cfg, group = self.config, ctx.group
        me = dist.get_rank(group) if dist.is_initialized() else 0
        size = max((b.nbytes for b in plan), default=0)
        buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        turn = [0]

        def alloc(nbytes: int) -> torch.Tensor:   # two buffers in turn: k+1 fills while k is sent
            buf = buffers[turn[0] % 2]
            turn[0] += 1
            return buf[:nbytes]

        received = Received()       # this rank's gathers: stats' trainer_rank_bytes_in
        it = export.iter_buckets(ctx.module, cfg.bucket_bytes, dtype=cfg.dtype,
                                 fsdp1_state_dict=cfg.fsdp1_state_dict, alloc=alloc, plan=plan,
                                 dst=0 if dist.is_initialized() else None, received=received)
        quant = self._quant     # trainer rank 0 only: it holds the gathered bucket
        if quant is not None:   # quantized into two buffers of their own, in turn like the above
            qsize = max((quant.plan(b).nbytes for b in plan), default=0)
            qbufs = [torch.empty(qsize, dtype=torch.uint8, device=device) for _ in range(2)]
            qturn = [0]

            def qalloc(nbytes: int) -> torch.Tensor:
                buf = qbufs[qturn[0] % 2]
                qturn[0] += 1
                return buf[:nbytes]
        pending: _Pending | None = None
        failed: str | None = None     # rank 0's own failure (quantizing, launching): agreed below
        try:
            for k, (bkt, flat) in enumerate(it):      # gathers bucket k (k-1 is still on the wire)
                if k:   # every rank: bucket k-1's outcome (rank 0 waits for it here)
                    err, pending = (self._finish(pending) if pending is not None else None), None
                    _agree(err or failed, group, "distributed weight sync")
                if me == 0 and failed is None:
                    try:     # the peers are in the gather: a failure here is agreed, never raised alone
                        if quant is not None:
                            bkt, flat = quant.bucket(bkt, flat, qalloc)
                        self._last_bucket = k == len(plan) - 1
                        pending = self._launch(engines, bkt, flat, f"bucket {k} ({bkt.names[0]}…)")
                    except Exception as exc:  # noqa: BLE001
                        failed = f"bucket {k} on trainer rank 0: {type(exc).__name__}: {exc}"
                stats.bytes += bkt.payload_bytes
                stats.tensors += len(bkt.entries)
                stats.buckets += 1
                del flat
            stats.extra["trainer_rank_bytes_in"] = received.bytes_in   # rank 0: every other piece
            if plan:     # every rank: one agree per bucket, the last one here
                err, pending = (self._finish(pending) if pending is not None else None), None
                _agree(err or failed, group, "distributed weight sync")
            if getattr(cfg, "quantization", None):   # every rank reports what rank 0 sent
                stats.bytes = sum(m.nbytes for m in quantize.sync_metas(ctx.module, cfg))
        finally:
            it.close()
            if pending is not None:          # an exception of our own between launch and finish
                self._abandon(pending, "the sync failed on trainer rank 0", self._deadline())

    def _launch(self, engines: list, bkt: Bucket, flat: torch.Tensor, what: str) -> _Pending:
        """Requests first (each engine blocks in its receive), then the broadcast(s), async."""
        cfg = self.config
        per_tensor = cfg.dist_format == "per_tensor"
        body = dict(names=bkt.names, dtypes=[dtype_name(e.dtype) for e in bkt.entries],
                    shapes=[list(e.shape) for e in bkt.entries], group_name=cfg.dist_group_name,
                    flush_cache=self._flushes(), load_format=None if per_tensor else "flattened_bucket")
        futures: list = []
        works: list = []
        try:
            for e in engines:
                futures.append(self._calls.submit(e.update_weights_from_distributed, **body))
            if per_tensor:
                # a float8 tensor goes as its bytes (gloo has no float8 type; the receiver does the same)
                works += [dist.broadcast(flat[e.start:e.end] if e.dtype.itemsize == 1 and e.dtype.is_floating_point
                                        else flat[e.start:e.end].view(e.dtype), src=0, group=self.pg,
                                        async_op=True) for e in bkt.entries if e.nbytes]
            elif bkt.nbytes:
                works.append(dist.broadcast(flat, src=0, group=self.pg, async_op=True))
        except BaseException as exc:   # a Ctrl-C too: the engines are already in their receive
            self._launch_failed(_Pending(what, works, futures), exc)
            raise
        return _Pending(what, works, futures)

    def _finish(self, p: _Pending) -> str | None:
        """Wait for one bucket: broadcasts done and every engine answered. An engine's error ends
        the wait at once (a refusing engine never joins the broadcast)."""
        deadline = time.monotonic() + self.config.dist_timeout_s
        while True:
            refused = [(i, e) for i, e in enumerate(map(_refusal, p.futures)) if e is not None]
            if refused:
                i, exc = refused[0]
                self._release_refused(p, deadline)
                return self._abandon(p, f"engine {i} refused {p.what}: {type(exc).__name__}: {exc}",
                                     deadline)
            sent = p.p2p or all(w.is_completed() for w in p.works)
            if sent and all(f.done() for f in p.futures):
                break
            if time.monotonic() > deadline:
                silent = [i for i, f in enumerate(p.futures) if not f.done()]
                who = ", ".join(fleet.describe(self.engines[i] if i < len(self.engines) else None, i)
                                for i in silent)
                return self._abandon(p, f"{p.what}: {who or 'no engine'} never answered "
                                        f"update_weights_from_distributed within dist_timeout_s="
                                        f"{self.config.dist_timeout_s}s (broadcast done: {sent}); "
                                        f"a hung engine TP worker? Its abort and group teardown "
                                        f"were skipped")
            time.sleep(_POLL_S)
        try:
            for i, f in enumerate(p.futures):
                check_answer(f.result(), f"engine {i} update_weights_from_distributed")
            for w in p.works:    # every engine has its bytes: the sends are done, or nearly
                w.wait(datetime.timedelta(seconds=self.config.dist_timeout_s)) if p.p2p else w.wait()
        except Exception as exc:  # noqa: BLE001
            return self._abandon(p, f"{p.what}: {type(exc).__name__}: {exc}", deadline)
        return None

    def _release_refused(self, p: _Pending, deadline: float) -> None:
        """An engine refused a bucket: it never joins the broadcast, and gloo's broadcast is a
        tree (trainer -> engine rank 1 -> engine rank 3, ...), so the engines below it wait in a
        receive, and those above it in their send to it, that cannot complete: the failed sync
        waited ``dist_timeout_s`` for their answers (30 s where the refusal came at once). Every
        refusing engine is told to leave its group now (its request has ended: its lock is
        free), which closes its connections, so those receives and sends fail at once; then our
        end is destroyed (that waits for a broadcast of ours still pending, which their leaving
        ends), and `_abandon` waits for the answers. One that has left is not told again by
        `_drop_group`; where one could not leave, `_abandon` alone runs, as before."""
        name, calls = self.config.dist_group_name, {}
        for i, f in enumerate(p.futures):
            if _refusal(f) is not None and i < len(self.engines):
                calls[i] = self._calls.submit(self.engines[i].destroy_weights_update_group, name)
        cf.wait(list(calls.values()), timeout=max(0.0, deadline - time.monotonic()))
        for i, f in calls.items():
            try:
                if not f.done():
                    raise TimeoutError(f"no answer within dist_timeout_s={self.config.dist_timeout_s}s")
                check_answer(f.result(), "destroy_weights_update_group")
                self._left.add(i)
            except Exception as exc:  # noqa: BLE001 - the engines' own timeouts end their receive
                log.warning("fsdp_sync: %s refused %s; telling it to leave the weight-update group "
                            "%r: %s", fleet.describe(self.engines[i], i), p.what, name, exc)
        if calls and self._left == set(calls):
            self._drop_ours(p, f"{p.what} was refused")

    def _abandon(self, p: _Pending, message: str, deadline: float | None = None) -> str:
        """A failed bucket: abort our end of the group (the pending broadcast with it) and mark
        the group for remaking; the engines end their receive (error or timeout) on their own,
        and their answers are waited for until ``deadline`` (the bucket's: ``dist_timeout_s``;
        None: not at all, the deadline is past), so that the abort after the failure reaches an
        engine whose request was merely in flight when another refused. One whose request still
        runs then is marked stuck: that abort and the teardown would wait for its lock, so they
        skip it; its call's daemon thread (`update_group.EngineCalls`) keeps neither a later call
        nor the process's exit waiting."""
        self.broken = True
        if self.pg is not None:
            try:
                self.pg.abort()
            except Exception:  # noqa: BLE001
                pass
        running = [f for f in p.futures if not f.done()]
        if running and deadline is not None:
            cf.wait(running, timeout=max(0.0, deadline - time.monotonic()))
        self._stuck = {i for i, f in enumerate(p.futures) if not f.done()}
        return message

    def _launch_failed(self, p: _Pending, exc: BaseException) -> None:
        """A bucket's launch raised (a send error, a Ctrl-C) after the engines were asked to
        receive it: they wait in their receive for bytes that will not come, holding their locks,
        and the caller has no pending bucket to abandon. Our end of the group is destroyed now, so
        their receive fails at once (gloo's ``abort()`` closes no connection: only the group's
        destruction does, once nothing holds it: the sends' works, the traceback's finished
        frames), then their answers are waited for (`_abandon`). The group is marked for
        remaking; `_drop_group` still tells the engines to destroy theirs.

        Before, the abort that followed waited for the engines' locks until their receive timed
        out (``update_recv_timeout_s``, 60 s by default), the group was never marked broken, and
        every later sync failed at once ("Connection closed by peer") until a new manager. Where
        a backend's receive does not notice our end go, the engine's own timeout ends it."""
        traceback.clear_frames(exc.__traceback__)    # e.g. dist.isend's frame holds ``group=pg``
        self._drop_ours(p, f"{p.what} failed to go out")
        self._abandon(p, "", self._deadline())

    def _drop_ours(self, p: _Pending, why: str) -> None:
        """Destroy our end of the group with a bucket in flight (its works dropped first: they
        hold it), so every engine worker still in its receive fails at once; the group is marked
        for remaking and `_drop_group` still tells the engines to destroy theirs."""
        self.broken = True
        pg, self.pg = self.pg, None      # self.engines kept: `_drop_group` tells them
        p.works.clear()
        if pg is not None:
            destroy_ours(pg, f"the weight-update group {self.config.dist_group_name!r} after {why}")
        del pg

    def _deadline(self) -> float:
        """When engine answers waited for from now are given up on (``dist_timeout_s``)."""
        return time.monotonic() + self.config.dist_timeout_s

    def _end(self, engines: list, ok: bool, ctx: SyncContext) -> list[str]:
        """Commit (``ok``) or abort the update on every engine (`fleet.end_all`: after an abort,
        the engines that kept part of it); after a failure a broken group is torn down on both
        ends."""
        stuck, self._stuck = self._stuck, set()
        kept = fleet.end_all(engines, commit=ok, version=ctx.version, skip=stuck)
        if not ok and self.broken:
            self._stuck = stuck
            try:
                self._drop_group(engines)
            finally:
                self._stuck = set()
        return kept


def _release_orphaned(held: dict, name: str) -> None:
    """A transport collected with its group open (its manager never closed): destroy our end of
    the group so its name is free again. The engines are not called (a finalizer must not block);
    the next opening of that name replaces their group."""
    pg, held["pg"], held["store"] = held["pg"], None, None
    if pg is not None and destroy_ours(pg, f"the weight-update group {name!r} of a dropped transport"):
        log.warning("fsdp_sync: a distributed transport was dropped without close(): destroyed its "
                    "weight-update group %r", name)


def _refusal(f: cf.Future) -> BaseException | None:
    """A finished engine call's error: raised, or answered (SGLang's in-process ``(False, msg)``)."""
    if not f.done():
        return None
    if f.exception() is not None:
        return f.exception()
    try:
        check_answer(f.result(), "update_weights_from_distributed")
    except Exception as exc:  # noqa: BLE001 - the answer's refusal
        return exc
    return None


def _agree(err: Any, group: Any, what: str) -> None:
    if dist.is_initialized():
        agree(err, group, what=what)
    elif err is not None:
        from ..topology import SyncError
        raise SyncError(f"{what} failed: {err}")


def _module_device(module: torch.nn.Module) -> torch.device:
    for p in module.parameters():
        return torch.device("cuda", torch.cuda.current_device()) if p.device.type == "cuda" else p.device
    return torch.device("cpu")
