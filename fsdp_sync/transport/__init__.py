"""How exported weights reach the engine: one module per SGLang update method, one small protocol.

    tensor.py        colocated: handle tuples (CPU shared memory / CUDA IPC), gathered to infer-TP
                     rank 0, ``update_weights_from_tensor`` (strategies per_tensor/bucketed/flattened)
    distributed.py   disaggregated: buckets gathered to trainer rank 0, broadcast over SGLang's
                     weight-update group, ``update_weights_from_distributed``
    disk.py          a versioned safetensors checkpoint per sync, ``update_weights_from_disk``

    update_group.py  trainer rank 0 opens SGLang's weight-update group for distributed.py (the
                     group's wire form, which both ends use, is `fsdp_sync.wire`)
    sessions.py      begin_weight_update that takes over a session a dead trainer left open, and
                     which engines a disk load goes inside a session on (those that stage it)
    disk_load.py     disk.py's load step: the load format, one engine or a fleet

A transport is any object with the attributes and methods of `Transport`. There is no base class
to inherit from: the manager only calls ``sync(ctx)`` and ``close()`` and reads ``colocated``.
`make_transport(config)` builds the one ``config.method`` names (disk imported only then).

Not here: export and bucket planning (shared by all three, in `export` and `bucket`), and the
stages around the sync (the manager).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Iterator, Protocol

import torch

__all__ = ["Transport", "SyncContext", "SyncStats", "METHODS", "make_transport", "timed_items"]

METHODS = ("tensor", "distributed", "disk")


@dataclass
class SyncStats:
    """What the last sync moved: bytes are the rollout-dtype bytes of every exported tensor.

    ``tensors`` counts the tensors as the engine received them: the trainer's (Hugging Face
    named) tensors where whole tensors go (``layout="full"``), the engine's own fused parameters
    as one engine rank gets them where per-rank buckets or files go (``layout="engine"``, disk
    included: one ``qkv_proj`` for q, k and v, one ``gate_up_proj``), so one model's count
    differs between the layouts."""

    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    engine_calls: int = 0
    extra: dict = field(default_factory=dict)   # method-specific figures (e.g. disk: path, files)


@dataclass
class SyncContext:
    """Everything one sync needs, handed to `Transport.sync` on every trainer rank.

    topo: the ``("dp", "infer_tp")`` `SyncTopology` for the tensor method; None when the manager
        was built without a mesh (distributed, disk), where ``group`` is the trainer's group.
    engines: on the rank that calls the engine (tensor: infer-TP rank 0 of each group;
        distributed/disk: trainer rank 0) the engine handles, one per rollout replica; [] elsewhere.
    step: the sync's number, counted from 0 by the manager (disk names ``step_<N>`` by it).
    version: the weight version the engines commit with this sync (`fsdp_sync.fleet`), or None.
    commit_failed: set by the transport on the engine-holding rank when engines failed while
        committing (a `fleet.CommitError`: which committed, which did not); None otherwise.
    reload: a replica brought in between syncs (`recover`, `add_engine`) gets ``version`` as the
        replicas in service hold it, never new weights: disk loads the directory they loaded
        (not the one published last, nor one written now). The tensor and distributed methods
        send the trainer's weights; the manager asks them only inside its ``with`` block, after
        that block's sync committed ``version``, so those are the same weights.
    """

    module: torch.nn.Module
    config: Any                  # SyncConfig
    topo: Any | None             # SyncTopology | None
    group: Any | None            # the trainer ranks' ProcessGroup (None: the default group)
    engines: list
    step: int
    stats: SyncStats
    version: str | None = None
    commit_failed: Any = None
    reload: bool = False


class Transport(Protocol):
    """One update method. ``colocated`` is the rule the manager skips stages by: the engine-memory
    stages (resume weights / kv_cache, release on exit) run only for a colocated transport."""

    method: ClassVar[str]
    colocated: ClassVar[bool]

    def sync(self, ctx: SyncContext) -> None: ...

    def close(self) -> None: ...


def make_transport(config: Any) -> Transport:
    """The transport of ``config.method`` (a `SyncConfig`); disk is imported only when asked for."""
    method = getattr(config, "method", "tensor")
    if method == "tensor":
        from .tensor import TensorTransport
        return TensorTransport(config)
    if method == "distributed":
        from .distributed import DistributedTransport
        return DistributedTransport(config)
    if method == "disk":
        from .disk import DiskTransport
        return DiskTransport(config)
    raise ValueError(f"unknown update method {method!r}; expected one of {METHODS}")


def timed_items(stream: Iterable, seconds: dict, key: str) -> Iterator[Any]:
    """``stream``'s items, the time spent making each (the producer's share of a pipelined sync,
    e.g. the export of the next bucket) added to ``seconds[key]``. The last item handed out is
    not held here while the next is made (a bucket's buffer may be reused for it)."""
    items = iter(stream)
    end = object()
    while True:
        t0 = time.perf_counter()
        item = next(items, end)
        seconds[key] += time.perf_counter() - t0
        if item is end:
            return
        yield item
        item = None
