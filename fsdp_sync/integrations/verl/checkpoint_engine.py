"""fsdp_sync as a verl checkpoint engine: the backend verl's disaggregated modes sync weights through.

verl 0.9.1's `CheckpointEngineManager` moves weights from the actor worker group to standalone
rollout replicas (``separate_async``, fully async, one-step-off) through a `CheckpointEngine`
picked by name. This module registers one named ``"fsdp_sync"``; select it with

    actor_rollout_ref.rollout.checkpoint_engine.backend=fsdp_sync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=fsdp_sync.integrations.verl.checkpoint_engine
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.fsdp_sync.timeout_s=600   # optional

verl imports ``custom_backend_module`` in the driver and in every actor and rollout worker before
it builds the engine, so the registration below runs wherever the engine is needed.

How one sync goes, in the order the manager calls (every call, every sync):

- ``prepare`` on every worker: actor rank 0 (``is_master=True``) opens a rendezvous (its
  outward address, the port of a store it listens on from its first prepare on, a fresh group
  name) and returns it;
  the others return no master.
  Each worker also returns the group it still holds from an earlier sync, if any.
- ``build_topology`` on the driver: actor rank 0 is group rank 0 (the only sender), rollout
  worker i is group rank ``1 + i``; actor ranks > 0 get rank -1 and stay out of the group (they
  still walk the weight stream: producing a weight is collective over the actor group). When
  every member still holds one same group at the rank and world size it would get now, that
  group is kept (``keep``); otherwise all make the new one (replicas added or removed, a worker
  restarted, a failed sync: a worker where the last sync failed reports no group, finalized or not).
- ``init_process_group`` on every worker: kept, nothing to do; else a process group outside both
  worlds, made by `fsdp_sync.wire.new_update_group` (on the store actor rank 0 hosts since prepare),
  ``gloo`` on CPU and ``cpu:gloo,cuda:nccl`` on CUDA (the small bucket headers go over gloo, the
  buckets over NCCL).
- ``send_weights`` on actor ranks / ``receive_weights`` on rollout workers, concurrently: the
  sender packs the (name, tensor) stream in order into flattened buckets of at most
  ``bucket_size`` bytes (`weights.bucket.BucketPacker`: `plan_buckets`' rule, 16-byte aligned
  offsets) and broadcasts each: a header (JSON: names, dtypes, shapes, byte ranges, the step) then
  the bucket. Two staging buffers: bucket k+1 is filled while bucket k is on the wire. A tensor
  larger than a bucket is broadcast from its own storage (no staging copy). Each receiver yields
  ``(name, tensor)`` in the sender's order, with the sender's dtype and shape, bit for bit.
- ``finalize`` on every worker: the buffers are dropped; the group stays for the next sync
  (verl's ``nccl`` engine does the same: ``rebuild_group=False``), unless this sync failed on
  this worker or ``rebuild_group=True``, which destroy it.

Memory: the sender holds two staging buffers (``2 x bucket_size``) and at most one tensor larger
than a bucket while it is on the wire. A receiver allocates each bucket as it arrives and yields
views into it: at most two buckets are held by this engine at once (the one being yielded, the
next one arriving on a thread), and a yielded tensor keeps its bucket alive only as long as the
consumer holds it, so a consumer may keep tensors as long as it likes (verl's SGLang adapter holds
up to a bucket of them before it sends) without a copy and without seeing them overwritten.

Per-rank buckets are not possible through this API: `receive_weights` must yield full Hugging Face
tensors, because the rollout worker's server adapter (`ServerAdapter.update_weights`) hands each
one to its inference engine's ``load_weights``, which cuts the TP shard itself. Every rollout
worker therefore receives the full stream; it goes out as ONE broadcast per bucket to all of them
(fsdp_sync's own per-rank path, ``layout="engine"`` in `transport.distributed`, needs an engine
that accepts pre-cut buffers, which verl's adapters do not).

Errors: a sender that fails mid-stream (a tensor of an unsupported dtype, a name twice, its
generator raising) broadcasts an error header before raising, so every receiver raises the same
message at once instead of waiting out the timeout. A rollout worker whose consumer stops
mid-stream (its adapter failed) raises the consumer's error while its receive thread takes the rest
of the stream and drops it: the sender's broadcasts wait for every receiver, so without that the
sender and every other worker failed at ``timeout_s`` with a timeout naming no worker. Every
collective on the group is bounded by ``timeout_s``. That drain starts when the consumer's
iterator is closed: one taken with ``async for`` that is dropped without ``aclose`` (its frame
kept by a traceback, as Ray keeps one) is closed only when Python collects it, and a rollout
process that died takes nothing more at all. Then the sender fails at ``timeout_s`` (a killed
process: at once, where gloo sees its socket close) and names the worker(s) that fell behind:
each receiver counts the bucket headers it took in the group's store (one store write per
bucket), under its host and pid, and a sender whose broadcast failed compares the counts
(`_Board`), then drops the group (its error header cannot go out), so the other workers' receive
fails at once instead of at their ``timeout_s``.

Not here: the rollout adapter and verl's colocated path (`fsdp_sync.integrations.verl`), the
bucket rule (`weights.bucket`), how the group is made (`wire`). verl is imported here only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import socket
import threading
import time
import traceback
import uuid
from typing import Any, AsyncGenerator

import torch
import torch.distributed as dist

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from ...topology import released_by_backend
from ...transport.distributed import outward_address
from ...weights.bucket import (SUPPORTED_DTYPES, Bucket, BucketPacker, TensorMeta, dtype_name,
                              entries_from_metadata, unflatten)
from ...wire import destroy_update_group, host_store, join_store, new_update_group

__all__ = ["BACKEND", "FsdpSyncCheckpointEngine", "ReceivedWeights"]

log = logging.getLogger("fsdp_sync")

BACKEND = "fsdp_sync"
"""The name this engine is registered under: ``rollout.checkpoint_engine.backend``."""

_DTYPES = {dtype_name(d): d for d in SUPPORTED_DTYPES}
_NOT_IN_GROUP = -1


def _resolve_device(device: str | None) -> torch.device:
    """Where this engine's buckets live: ``device``, else CUDA when there is one, else CPU. A CUDA
    device without an index gets the calling thread's current one, read once here. CUDA's current
    device is per thread and a new thread starts on GPU 0; under
    ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`` (verl recommends it for TP >= 8) every GPU of
    the node is visible and verl picks the worker's with ``set_device`` in the thread that builds
    the worker only (``single_controller/base/worker.py`` ~274-281; `CheckpointEngineWorker`
    builds this engine right after, in that thread). So every later call, in any thread, names
    this device rather than relying on the thread's current one."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available()
                                                            else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _group_backend(device_type: str) -> str:
    return "gloo" if device_type == "cpu" else f"cpu:gloo,{device_type}:nccl"


@CheckpointEngineRegistry.register(BACKEND)
class FsdpSyncCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over fsdp_sync's flattened buckets and a broadcast group (see the
    module for the protocol, memory and errors).

    Args (``engine_kwargs.fsdp_sync.*`` in verl's config, except the first two):
        bucket_size: bytes per bucket (verl passes ``update_weights_bucket_megabytes << 20``).
        is_master: True on actor rank 0 only (verl passes it on the actor side).
        timeout_s: bound on the rendezvous and on every collective of a sync.
        rebuild_group: make the group anew at every sync (default False: keep it while the
            workers and their ranks stay the same).
        device: where buckets live, ``"cuda"`` / ``"cuda:N"`` / ``"cpu"``; default CUDA when there
            is one. ``"cuda"`` is the constructing thread's current GPU (verl's worker sets it
            there), resolved here once and used by every thread of the engine. All workers must
            agree on the type (the group's backend follows it).
        master_address: the address receivers reach actor rank 0 at; default its outward address.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0,
                 device: str | None = None, master_address: str | None = None,
                 rebuild_group: bool = False) -> None:
        if not isinstance(bucket_size, int) or bucket_size <= 0:
            raise ValueError(f"fsdp_sync checkpoint engine: bucket_size must be a positive number of "
                             f"bytes, got {bucket_size!r}")
        if not timeout_s or timeout_s <= 0:
            raise ValueError(f"fsdp_sync checkpoint engine: timeout_s must be positive, got {timeout_s!r}")
        self.bucket_size = bucket_size
        self.is_master = bool(is_master)
        self.timeout_s = float(timeout_s)
        self.device = _resolve_device(device)
        self.master_address = master_address
        self.rank: int | None = None
        self.world_size: int | None = None
        self.pg: Any = None
        self.rebuild_group = bool(rebuild_group)
        self.held: dict | None = None       # the live group: group_name, rank, world_size
        self.kept = False                   # this sync runs on the group of an earlier one
        self.failed = False                 # this sync failed here: the group goes at finalize
        self._master: dict | None = None
        self._store: Any = None             # actor rank 0: the groups' store (`wire.host_store`), kept
        self._board: _Board | None = None   # who took how many buckets (the group's store)
        self.last_stats: dict = {}

    # ------------------------------------------------------------------ group
    def prepare(self) -> dict:
        """Actor rank 0: a rendezvous for this sync (address, port, group name, backend); every
        worker: the group it holds (None if none, or if the last sync failed here)."""
        master = None
        if self.is_master:
            # listening before its port is handed out (a port picked free and bound only at
            # init_process_group could be taken in between on a busy machine); opened once and
            # shared by every group this engine makes (each under its own name's prefix)
            if self._store is None:
                self._store = host_store(None, self.timeout_s)
            master = {"address": self.master_address or outward_address(), "port": self._store.port,
                      "group_name": f"fsdp_sync_verl_{uuid.uuid4().hex[:12]}",
                      "device_type": self.device.type, "bucket_size": self.bucket_size}
            self._master = master
        # a group a failed sync ran on is never offered again (its state is unknown), also where
        # no finalize came after the failure: init_process_group then drops it and makes a new one
        held = (dict(self.held) if self.pg is not None and self.held and not self.rebuild_group
                and not self.failed else None)
        return {"master": master, "held": held}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple[dict[str, list], dict[str, list]]:
        """Actor rank 0 sends (group rank 0), rollout worker i receives (group rank 1 + i); actor
        ranks > 0 get rank -1 (out of the group)."""
        if len(metadata) != actor_wg_world_size + rollout_world_size:
            raise ValueError(f"fsdp_sync checkpoint engine: expected {actor_wg_world_size} actor + "
                             f"{rollout_world_size} rollout metadata, got {len(metadata)}")
        masters = [i for i, m in enumerate(metadata) if isinstance(m, dict) and m.get("master")]
        if masters != [0]:
            raise ValueError(f"fsdp_sync checkpoint engine: actor rank 0, and only it, must be the "
                             f"master (is_master=True); workers reporting a master: {masters} (actor "
                             f"ranks are 0..{actor_wg_world_size - 1}, then the rollout workers)")
        world = 1 + rollout_world_size
        members = {0: 0, **{actor_wg_world_size + i: 1 + i for i in range(rollout_world_size)}}
        held = [m.get("held") if isinstance(m, dict) else None for m in metadata]
        name = held[0]["group_name"] if held[0] else None
        keep = name is not None and all(
            held[i] and (held[i]["group_name"], held[i]["rank"], held[i]["world_size"]) == (name, r, world)
            for i, r in members.items())
        master = dict(metadata[0]["master"], keep=keep)
        if keep:
            master["group_name"] = name
        actor = {"rank": [0] + [_NOT_IN_GROUP] * (actor_wg_world_size - 1),
                 "world_size": [world] * actor_wg_world_size, "master": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: dict) -> None:
        """Join the sync's group (blocks until every member has joined, at most ``timeout_s``),
        or keep the one held (``master["keep"]``: every member holds it, build_topology said)."""
        self.rank = self.world_size = None     # set once this worker is in the group
        self.kept = self.failed = False
        if rank == _NOT_IN_GROUP:
            self._drop_group()
            self.rank, self.world_size = rank, world_size
            return
        mine = {"group_name": master["group_name"], "rank": rank, "world_size": world_size}
        if master.get("keep") and self.pg is not None and self.held == mine:
            self.rank, self.world_size, self.kept = rank, world_size, True
            if self._board is not None:
                self._board.next_sync()
            return
        if master["device_type"] != self.device.type:
            raise ValueError(f"fsdp_sync checkpoint engine: the sender's buckets are on "
                             f"{master['device_type']} but this worker's (rank {rank}) are on "
                             f"{self.device.type}; set engine_kwargs.fsdp_sync.device the same on "
                             f"both sides")
        if master["bucket_size"] != self.bucket_size:
            log.info("fsdp_sync checkpoint engine: rank %d bucket_size %d, the sender's %d (the "
                     "sender's rules)", rank, self.bucket_size, master["bucket_size"])
        if self.pg is not None:      # another group (or a sync that never reached finalize)
            self._drop_group()
        store = self._store       # prepare's, used only to make a new group as rank 0
        if rank != 0 or store is None or store.port != master["port"]:
            store = None
        try:
            self.pg = new_update_group(backend=_group_backend(self.device.type),
                                       master_address=master["address"], master_port=master["port"],
                                       world_size=world_size, rank=rank, store=store,
                                       group_name=master["group_name"], timeout_s=self.timeout_s)
        except Exception as exc:
            raise RuntimeError(f"fsdp_sync checkpoint engine: rank {rank} of {world_size} could not "
                               f"join group {master['group_name']!r} at {master['address']}:"
                               f"{master['port']} within {self.timeout_s}s: {exc}") from exc
        self.rank, self.world_size, self.held = rank, world_size, mine
        self._board = _Board.open(store, master, rank, world_size, self.timeout_s)

    def finalize(self) -> None:
        """Drop the buffers (the manager calls this after every sync); destroy the group only
        if this sync failed here or ``rebuild_group`` is set (see the module)."""
        if self.failed or self.rebuild_group:
            self._drop_group()
        self._master = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _drop_group(self) -> None:
        pg, self.pg, self.held, self._board = self.pg, None, None, None
        if pg is not None:
            try:
                destroy_update_group(pg)
            except Exception as exc:  # noqa: BLE001 - a dead peer cannot stop the teardown
                log.warning("fsdp_sync checkpoint engine: destroying the group: %s", exc)

    def _require_group(self, what: str) -> None:
        if self.rank is None:
            raise RuntimeError(f"fsdp_sync checkpoint engine: {what} before init_process_group "
                               f"(verl's CheckpointEngineManager calls prepare, build_topology and "
                               f"init_process_group first)")

    # ------------------------------------------------------------------ send
    @torch.no_grad()
    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict | None:
        """Actor side: every actor rank walks ``weights``; rank 0 broadcasts it in buckets.
        Returns this sync's figures on rank 0 (verl merges them into the step's metrics)."""
        self._require_group("send_weights")
        if self.rank != 0:
            if self.rank != _NOT_IN_GROUP:
                raise RuntimeError(f"fsdp_sync checkpoint engine: send_weights on group rank "
                                   f"{self.rank}; only actor rank 0 (group rank 0) sends")
            async for _ in ensure_async_iterator(weights):
                pass
            return None
        sender = _Sender(self.pg, self.bucket_size, self.device, global_steps)
        stream = ensure_async_iterator(weights)
        try:
            async for name, tensor in stream:
                sender.add(name, tensor)
            sender.close()
        except Exception as exc:
            self.failed = True
            if not sender.wire_failed:    # else the group may be out of step: dropped below
                sender.fail(f"{type(exc).__name__}: {exc}")
            # the other actor ranks are still walking the stream, whose every weight is a
            # collective over the actor group: walk it to the end with them, or they hang there
            try:
                async for _ in stream:
                    pass
            except Exception:  # noqa: BLE001 - the stream itself failed: nothing left to walk
                pass
            behind = (self._board.behind(min(self.timeout_s, 10.0))
                      if sender.wire_failed and self._board is not None else None)
            if sender.wire_failed:
                # a broadcast failed part way (one receiver got a header, another not): an error
                # header sent after it was read as the rest of the last one (garbled JSON). The
                # other workers learn of the failure as the group's sockets close instead, at
                # once, not at their timeout_s.
                # gloo closes them when the last reference goes: the sender's, and the failed
                # frames' (a Work holds the group's context) in the traceback that is raised
                traceback.clear_frames(exc.__traceback__)
                sender.pg = None
                self._drop_group()
            if behind:      # a broadcast failed: which worker(s) stopped taking the stream
                raise RuntimeError(f"fsdp_sync checkpoint engine: the sender (actor rank 0) failed "
                                   f"at bucket {sender.buckets} of step {global_steps}: "
                                   f"{type(exc).__name__}: {exc}; {behind}") from exc
            raise
        self.last_stats = dict(sender.stats(), group_kept=float(self.kept))
        log.info("fsdp_sync checkpoint engine: sent %d tensors, %.1f MiB in %d buckets in %.3fs",
                 *(self.last_stats[k] for k in ("tensors", "mib", "buckets", "seconds")))
        return {f"checkpoint_engine/fsdp_sync/{k}": float(v) for k, v in self.last_stats.items()}

    # ------------------------------------------------------------------ receive
    def receive_weights(self, global_steps: int | None = None) -> "ReceivedWeights":
        """Rollout side: the ``(name, tensor)`` stream as the sender put it in, in its order.

        An iterable of both kinds (`ReceivedWeights`): verl's own server adapters take it with
        ``async for`` (through ``ensure_async_iterator``), one that loops with ``for`` gets the
        same tensors (its event loop then waits with it, as with verl's ``naive`` engine)."""
        self._require_group("receive_weights")
        if self.rank is None or self.rank < 1:
            raise RuntimeError(f"fsdp_sync checkpoint engine: receive_weights on group rank "
                               f"{self.rank}; rollout workers are ranks 1..{self.world_size}")
        return ReceivedWeights(self, global_steps)


class ReceivedWeights:
    """One sync's received stream, for ``for`` and ``async for`` alike (walk it once): each bucket
    is checked (the sender's step against ``global_steps``), and given back as views."""

    views_stay_valid = True
    """A yielded tensor is never overwritten, however long it is held (each bucket is received
    into a fresh buffer): a consumer need not copy it (`stream.reuses_memory`)."""

    def __init__(self, engine: FsdpSyncCheckpointEngine, global_steps: int | None) -> None:
        self.engine, self.global_steps = engine, global_steps
        self.receiver = _Receiver(engine.pg, engine.device, engine.timeout_s, engine.rank,
                                  engine._board)
        self.t0, self.n, self.nbytes = time.perf_counter(), 0, 0
        self.done = False

    def _bucket(self, item: tuple[dict, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        header, flat = item
        step = header.get("step")
        if self.global_steps is not None and step is not None and step != self.global_steps:
            raise RuntimeError(f"fsdp_sync checkpoint engine: rank {self.engine.rank} expected the "
                               f"weights of step {self.global_steps}, the sender sent step {step}")
        self.n += len(header["entries"])
        self.nbytes += flat.numel()
        return unflatten(flat, header["entries"])

    def _end(self) -> None:
        if not self.done:        # stopped early or by an error: the group's state is unknown
            self.engine.failed = True
        self.receiver.stop()
        self.engine.last_stats = {"tensors": self.n, "mib": self.nbytes / 2**20,
                                  "seconds": time.perf_counter() - self.t0}

    @torch.no_grad()
    def __iter__(self):
        self.receiver.start()
        try:
            while True:
                item = self.receiver.next()
                yield from self._bucket(item)
                last = item[0]["last"]
                del item
                self.receiver.done_with_bucket()   # the consumer has moved past this bucket
                if last:
                    self.done = True
                    return
        finally:
            self._end()

    def __aiter__(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        return self._aiter()

    async def _aiter(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        self.receiver.start()
        try:
            while True:
                item = await asyncio.to_thread(self.receiver.next)
                for name, tensor in self._bucket(item):
                    yield name, tensor
                last = item[0]["last"]
                del item
                self.receiver.done_with_bucket()
                if last:
                    self.done = True
                    return
        finally:
            self._end()


class _Sender:
    """Actor rank 0's side of one sync: two staging buffers, one bucket on the wire at a time."""

    def __init__(self, pg: Any, bucket_size: int, device: torch.device, step: int | None) -> None:
        self.pg, self.bucket_size, self.device, self.step = pg, bucket_size, device, step
        self.packer = BucketPacker(bucket_size)
        self.buffers: list[torch.Tensor] = []      # allocated at the first tensor that needs one
        self.turn = 0                              # the buffer being filled
        self.direct: torch.Tensor | None = None    # a tensor larger than a bucket, sent from itself
        self.inflight: Any = None                  # (work, what it keeps alive)
        self.t0 = time.perf_counter()
        self.n = self.buckets = self.nbytes = 0
        self.sent_header = False
        self.wire_failed = False                   # a broadcast on the group raised

    def add(self, name: str, tensor: Any) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor for {name!r}, got {type(tensor).__name__}")
        closed, entry = self.packer.add(TensorMeta.of(name, tensor))   # dtype and name checks
        if closed is not None:
            self._ship(closed, last=False)
        src = tensor.detach().reshape(-1)
        if entry.start == 0 and entry.nbytes > self.bucket_size:
            self.direct = src.to(self.device).contiguous().view(torch.uint8)
        else:
            buf = self._buffer()
            buf[entry.start:entry.end].copy_(src.view(torch.uint8) if src.is_contiguous()
                                             else src.contiguous().view(torch.uint8))
        self.n += 1

    def close(self) -> None:
        bucket = self.packer.finish()
        self._ship(bucket or Bucket((), 0), last=True)
        self._wait()

    def fail(self, message: str) -> None:
        """Tell every receiver the sync failed (best effort: the group may be the failure)."""
        try:
            self._wait()
            self._header({"error": message, "last": True, "step": self.step})
        except Exception as exc:  # noqa: BLE001 - the original error is what the caller raises
            log.warning("fsdp_sync checkpoint engine: could not tell the receivers of the failure "
                        "(%s); they end at their timeout", exc)

    def stats(self) -> dict:
        return {"tensors": self.n, "buckets": self.buckets, "mib": self.nbytes / 2**20,
                "seconds": time.perf_counter() - self.t0}

    def _buffer(self) -> torch.Tensor:
        if not self.buffers:
            self.buffers = [torch.empty(self.bucket_size, dtype=torch.uint8, device=self.device)
                            for _ in range(2)]
        return self.buffers[self.turn]

    def _ship(self, bucket: Bucket, last: bool) -> None:
        """Bucket k: wait for bucket k-1 (the other buffer is free again), header, then the bucket
        itself, async; the next tensors go into the other buffer meanwhile."""
        if self.direct is not None:
            flat, self.direct = self.direct, None
        else:
            flat = self._buffer()[:bucket.nbytes] if bucket.nbytes else None
            self.turn ^= 1
        self._wait()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()   # the copies into flat, before NCCL reads it
        entries = [[e.name, dtype_name(e.dtype), list(e.shape), e.start, e.end] for e in bucket.entries]
        self._header({"entries": entries, "nbytes": bucket.nbytes, "last": last, "step": self.step})
        if bucket.nbytes:
            self.wire_failed = True
            self.inflight = (dist.broadcast(flat, group_src=0, group=self.pg, async_op=True), flat)
            self.wire_failed = False
        self.buckets += 1 if bucket.entries else 0
        self.nbytes += bucket.nbytes

    def _header(self, header: dict) -> None:
        self.wire_failed = True
        _broadcast_header(self.pg, header)
        self.wire_failed = False

    def _wait(self) -> None:
        if self.inflight is not None:
            work, _keep = self.inflight
            self.inflight = None
            self.wire_failed = True
            work.wait()
            self.wire_failed = False


def _broadcast_header(pg: Any, header: dict | None) -> dict:
    """Group rank 0 sends ``header`` (JSON), the others receive and return it. CPU tensors: on a
    ``cpu:gloo,cuda:nccl`` group they go over gloo."""
    if header is not None:
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        size = torch.tensor([raw.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    with released_by_backend(size):     # gloo lets go of them before they die (topology)
        dist.broadcast(size, group_src=0, group=pg)
    if header is None:
        raw = torch.empty(int(size.item()), dtype=torch.uint8)
    with released_by_backend(raw):
        dist.broadcast(raw, group_src=0, group=pg)
    return header if header is not None else json.loads(bytes(raw.numpy()).decode())


class _Receiver:
    """A rollout worker's side of one sync: a thread receives buckets (header, then the bucket
    into a fresh buffer) while the consumer works on the previous one; two buckets at most. The
    thread runs on the engine's device (a new thread's current CUDA device is GPU 0)."""

    def __init__(self, pg: Any, device: torch.device, timeout_s: float, rank: int,
                 board: "_Board | None" = None) -> None:
        self.pg, self.device, self.timeout_s, self.rank = pg, device, timeout_s, rank
        self.board = board
        self.slots = threading.Semaphore(2)
        self.q: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fsdp_sync-ckpt-recv", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def next(self) -> tuple[dict, torch.Tensor]:
        try:
            item = self.q.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"fsdp_sync checkpoint engine: rank {self.rank} received no bucket "
                               f"within timeout_s={self.timeout_s}s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def done_with_bucket(self) -> None:
        self.slots.release()

    def stop(self) -> None:
        """The consumer is done, or gave up mid-stream (its adapter failed): the thread receives
        the rest of the stream and drops it, so the sender's broadcasts, which wait for every
        receiver, go on and the other rollout workers get their whole stream (the consumer's own
        error is what this worker raises) instead of all failing at the sender's timeout. It ends
        at the last bucket, at the sender's error header, when the group is destroyed (finalize)
        or at the group's timeout."""
        self.stopping.set()
        self.slots.release()

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            took, wire = 0, False
            while True:
                if self.board is not None:
                    self.board.took(took)       # the sender names a worker that falls behind
                if not self.stopping.is_set():
                    self.slots.acquire()        # stop() releases one: no wait once stopping
                wire = True
                header = _broadcast_header(self.pg, None)
                wire = False
                took += 1
                if header.get("error"):
                    raise RuntimeError(f"fsdp_sync checkpoint engine: the sender (actor rank 0) "
                                       f"failed: {header['error']}")
                entries = _read_entries(header)
                flat = torch.empty(int(header["nbytes"]), dtype=torch.uint8, device=self.device)
                if flat.numel():
                    wire = True
                    dist.broadcast(flat, group_src=0, group=self.pg)
                    wire = False
                    if self.device.type == "cuda":
                        torch.cuda.current_stream(self.device).synchronize()
                if not self.stopping.is_set():     # else dropped: nobody takes it
                    self.q.put(({"entries": entries, "last": bool(header["last"]),
                                 "step": header.get("step")}, flat))
                del flat
                if header["last"]:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
            if wire and isinstance(exc, Exception):
                failed = RuntimeError(
                    f"fsdp_sync checkpoint engine: rank {self.rank}: receiving from the sender "
                    f"(actor rank 0) failed: {type(exc).__name__}: {exc}; the sync failed on the "
                    f"sender or on another rollout worker (the sender's error names a worker that "
                    f"fell behind)")
                failed.__cause__ = exc
                exc = failed
            self.q.put(exc)


def _read_entries(header: dict) -> list:
    """The bucket's entries, checked as any producer's (`bucket.entries_from_metadata`)."""
    try:
        raw = header["entries"]
        entries = entries_from_metadata([
            {"name": n, "dtype": _DTYPES.get(d, d), "shape": tuple(s), "start_idx": a, "end_idx": b}
            for n, d, s, a, b in raw])
    except (KeyError, TypeError, ValueError) as exc:
        raise RuntimeError(f"fsdp_sync checkpoint engine: a bad bucket header from the sender: "
                           f"{exc}") from exc
    if entries and max(e.end for e in entries) > int(header["nbytes"]):
        raise RuntimeError(f"fsdp_sync checkpoint engine: bucket header entries end past its "
                           f"{header['nbytes']} bytes")
    return entries


class _Board:
    """Who took how many bucket headers of the group's current sync, in the group's store (the
    one actor rank 0 hosts; each receiver keeps a client): each receiver writes its count before
    it waits for the next header, so a receiver whose process died, or whose consumer stopped
    without closing its iterator, stays behind the others. A sync is numbered by the syncs run on
    the group (every member runs each one, and a failed sync drops the group everywhere)."""

    def __init__(self, store: Any, group_name: str, rank: int, world_size: int) -> None:
        self.store = dist.PrefixStore(f"fsdp_sync_ckpt_board/{group_name}", store)
        self.rank, self.world_size, self.sync = rank, world_size, 0

    @classmethod
    def open(cls, store: Any, master: dict, rank: int, world_size: int,
             timeout_s: float) -> "_Board | None":
        """The board of a group just made (None where the store cannot be reached: nothing is
        named then, nothing else changes)."""
        try:
            if store is None:
                store = join_store(master["address"], master["port"], None, timeout_s)
            board = cls(store, master["group_name"], rank, world_size)
            if rank > 0:
                board.store.set(f"who/{rank}", f"host {socket.gethostname()}, pid {os.getpid()}")
            return board
        except Exception as exc:  # noqa: BLE001 - bookkeeping only
            log.warning("fsdp_sync checkpoint engine: rank %d has no progress board (%s)", rank, exc)
            return None

    def next_sync(self) -> None:
        self.sync += 1

    def took(self, n: int) -> None:
        try:
            self.store.set(f"{self.sync}/{self.rank}", str(n))
            if n == 0 and self.sync:
                self.store.delete_key(f"{self.sync - 1}/{self.rank}")
        except Exception:  # noqa: BLE001 - bookkeeping only: the receive itself tells of a failure
            pass

    def _counts(self) -> dict[int, int]:
        keys = {r: f"{self.sync}/{r}" for r in range(1, self.world_size)}
        return {r: int(self.store.get(k)) if self.store.check([k]) else -1 for r, k in keys.items()}

    def behind(self, settle_s: float) -> str | None:
        """On the sender, after a broadcast failed: the workers behind the others, named, or None
        (every one took as many). Waits up to ``settle_s`` for the others' counts to move past a
        header the failed broadcast did hand them."""
        deadline = time.monotonic() + settle_s
        try:
            while True:
                counts = self._counts()
                if max(counts.values()) > min(counts.values()) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            most = max(counts.values())
            late = [r for r, c in counts.items() if c < most]
            if not late:
                return None
            who = {r: self.store.get(f"who/{r}").decode() if self.store.check([f"who/{r}"])
                   else "not known" for r in late}
        except Exception as exc:  # noqa: BLE001 - bookkeeping only: the sender's error is raised
            log.warning("fsdp_sync checkpoint engine: reading the progress board: %s", exc)
            return None
        named = "; ".join(f"rollout worker {r - 1} (group rank {r}, {who[r]}) " + (
            f"took {counts[r]} bucket(s) of this sync" if counts[r] >= 0 else
            "never began receiving this sync") for r in late)
        return (f"{named}, the others took {most}: that worker's process died, or its rollout adapter "
                f"stopped taking the received stream without closing it; see its log (rollout "
                f"worker i is the i-th worker of verl's rollout replicas, in order)")
