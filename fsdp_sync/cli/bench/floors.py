"""The floors a bench row is judged against, measured in the same job on the same groups, and the
row's layout figures: what any sync of these bytes must at least cost (a bare all-gather, a bare
all-to-all, the copies), each timed as its row's sync is: ``warmup`` runs not counted, then the
median of ``repeats`` (the job's own two figures). ``moved``: a dict each floor fills with the bytes
it moved (what a row's ``floor_bytes`` reports: the figures a reader checks its floor against).

Collective: every trainer rank calls each function. Not here: the sync itself or the rows (`main`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from ...topology import cpu_group, released_by_backend

__all__ = ["median_seconds", "bucket_pieces", "floor_seconds", "copy_seconds", "floor_shared_seconds",
           "floor_all_to_all_seconds", "layout_figures", "tensor_by_tensor_bytes_in"]


def median_seconds(body: Callable[[], None], dev: str, repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``body`` over ``repeats`` runs after ``warmup`` runs (not counted), as a
    bench row times its syncs: the ranks start each run together (a barrier) and a run ends when
    the device is done with it."""
    import torch.distributed as dist

    times = []
    for _ in range(warmup + repeats):
        dist.barrier(group=cpu_group())
        t0 = time.perf_counter()
        body()
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def bucket_pieces(total: int, bucket: int) -> list[int]:
    """``total`` bytes cut into bucket-sized pieces, the last one what is left: a floor moves the
    row's bytes, not whole buckets (a last piece padded to a bucket moved up to a bucket more)."""
    bucket = max(1, bucket)
    return [bucket] * (total // bucket) + ([total % bucket] if total % bucket else [])


# On a GPU a floor's copies go through one pair of buffers of at most this size, again and again:
# device-to-device bandwidth does not depend on the size past a few MiB, and a 7B model's
# full-size pairs beside the trainer and the engine would not fit in its memory.
CUDA_COPY_CHUNK = 1 << 30


class _Copy:
    """``dst.copy_(src)`` of ``nbytes`` on ``dev`` (pre-touched): whole on CPU, in chunks on CUDA."""

    def __init__(self, nbytes: int, dev: str) -> None:
        size = max(1, min(nbytes, CUDA_COPY_CHUNK) if dev == "cuda" else nbytes)
        self.src = torch.ones(size, dtype=torch.uint8, device=dev)
        self.dst = torch.zeros_like(self.src)
        self.nbytes = max(nbytes, 1)

    def __call__(self) -> None:
        left = self.nbytes
        while left > 0:
            n = min(left, self.src.numel())
            self.dst[:n].copy_(self.src[:n])
            left -= n


def floor_seconds(total_bytes: int, bucket_bytes: int, tp: int, device: str, repeats: int, *,
                  shard: int | None = None, warmup: int = 1, moved: dict | None = None) -> float:
    """A bare all-gather of ``total_bytes`` over the world in bucket-sized pieces, plus one copy of
    a TP rank's shard (``shard``, the bytes an engine rank holds (an FP8 row's: its FP8 shard);
    default ``total_bytes / tp``): what any sync must at least do."""
    import torch.distributed as dist

    from ...weights.gather import all_gather

    world = dist.get_world_size()
    dev = "cuda" if device == "cuda" else "cpu"
    per_rank = [-(-p // world) for p in bucket_pieces(total_bytes, bucket_bytes)]   # each rank's part
    send = torch.empty(max(per_rank, default=0), dtype=torch.uint8, device=dev)
    recv = torch.empty(send.numel() * world, dtype=torch.uint8, device=dev)
    # touched once, as a loaded engine's weights are
    copy = _Copy(shard if shard is not None else total_bytes // tp, dev)
    if moved is not None:    # the gathers' output (a piece's last rank may be padded: < world bytes)
        moved.update(all_gather=sum(per_rank) * world, engine_copy=copy.nbytes)

    def body() -> None:
        for k in per_rank:       # the sync's own gather call (no deprecation warning)
            all_gather(recv[:k * world], send[:k], None)
        copy()

    try:
        return median_seconds(body, dev, repeats, warmup)
    finally:
        del copy, send, recv
        if dev == "cuda":
            torch.cuda.empty_cache()


def copy_seconds(nbytes: int, device: str, repeats: int) -> float:
    """One copy of ``nbytes`` on rank 0's device (device to device on CUDA, a memcpy on CPU), on
    pre-touched memory, the other ranks idle: the least that moving these bytes once costs.
    Collective (every rank calls it); the figure is rank 0's. The copy is the floors' `_Copy`: in
    1 GiB chunks on CUDA, where a full-size pair of a 7B model's bytes (2 x 15 GB) beside its
    trainer and engine would not fit on rank 0's GPU."""
    import torch.distributed as dist

    dev = "cuda" if device == "cuda" else "cpu"
    copy = _Copy(nbytes, dev) if dist.get_rank() == 0 else None

    def body() -> None:
        if copy is not None:
            copy()

    try:
        return median_seconds(body, dev, repeats)
    finally:
        del copy
        if dev == "cuda":
            torch.cuda.empty_cache()


def floor_shared_seconds(total_bytes: int, tp: int, device: str, repeats: int,
                          shard: int | None = None, *, warmup: int = 1, moved: dict | None = None) -> float:
    """The floor of a sync that shares host memory instead of all-gathering: every rank copies its
    shard (``total_bytes / world``) once, then one copy of a TP rank's shard (``shard``, default
    ``total_bytes / tp``; the engine layout's own shard bytes when known).
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    dev = "cuda" if device == "cuda" else "cpu"
    own = _Copy(total_bytes // world, dev)
    engine = _Copy(shard if shard is not None else total_bytes // tp, dev)
    if moved is not None:
        moved.update(own_copy=own.nbytes, engine_copy=engine.nbytes)

    def body() -> None:
        own()
        dist.barrier(group=cpu_group())
        engine()

    try:
        return median_seconds(body, dev, repeats, warmup)
    finally:
        del own, engine
        if dev == "cuda":
            torch.cuda.empty_cache()


def floor_all_to_all_seconds(bytes_in: int, bucket_bytes: int, shard: int, device: str,
                              repeats: int, total_bytes: int = 0, *, warmup: int = 1,
                              moved: dict | None = None) -> float:
    """The floor of the cross-host per-rank path: the one-host floor's copies (every rank copies
    its own FSDP shard, ``total_bytes / world``, once: the part it keeps into the engine rank's
    buffer, the rest into what it sends; then one copy of an engine rank's shard, the engine's
    load) plus bare ``all_to_all_single`` exchanges in which every rank receives ``bytes_in``
    bytes (the most any trainer rank received in the sync), in bucket-sized pieces."""
    import torch.distributed as dist

    world = dist.get_world_size()
    dev = "cuda" if device == "cuda" else "cpu"
    per_peer = max(1, min(bucket_bytes, max(bytes_in, 1)) // max(world - 1, 1))
    n = max(1, -(-bytes_in // (per_peer * max(world - 1, 1))))
    sizes = [0 if r == dist.get_rank() else per_peer for r in range(world)]
    send = torch.ones(sum(sizes), dtype=torch.uint8, device=dev)
    recv = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
    # the copies as the other floors make them (`_Copy`: in chunks on CUDA, where full-size pairs
    # of a 7B model's shard beside the trainer and the engine did not fit), freed after
    own = _Copy(total_bytes // world, dev)
    engine = _Copy(shard, dev)
    if moved is not None:
        moved.update(own_copy=own.nbytes, all_to_all_in=n * per_peer * (world - 1), engine_copy=engine.nbytes)

    def body() -> None:
        own()
        for _ in range(n):
            dist.all_to_all_single(recv, send, sizes, sizes)
        engine()

    try:
        return median_seconds(body, dev, repeats, warmup)
    finally:
        del own, engine, send, recv
        if dev == "cuda":
            torch.cuda.empty_cache()


def tensor_by_tensor_bytes_in(cfg: Any, metas: list, world: int) -> int:
    """The most one trainer rank receives gathering every tensor alone over FSDP2's ``world``
    ranks (`export.iter_params`: the tensor method's per_tensor and bucketed strategies, whose
    stats do not count it), from the sizes as `fsdp_sync.plan` counts a gather: each tensor a
    bucket of its own (`gather.bucket_bytes_in`: uneven pieces in 16-byte aligned slots)."""
    from ...plan import meta_model
    from ...plan_bytes import fsdp_counts, gather_bytes_in
    from ...weights.bucket import plan_buckets

    if world == 1:
        return 0
    return gather_bytes_in(plan_buckets(metas, 1), fsdp_counts(meta_model(cfg)[1], world, 2), world)


def layout_figures(model: Any, cfg: Any, job: Any, stats: Any, share: bool) -> dict:
    """The row's layout fields (collective: every rank calls it): ``engine_rank_bytes_in`` (what
    one engine rank was handed: its per-rank buffers, or every full bucket), ``engine_rank_shard_bytes``
    (its own shard in the engine layout), ``trainer_rank_bytes_in`` (the most any trainer rank
    received, as its sync's stats counted it: the all-to-all, the all-gather (the others' pieces,
    as packed and broadcast), the gather to rank 0; 0 on the one-host path; a tensor-by-tensor
    gather's, which its stats do not count: `tensor_by_tensor_bytes_in`), ``share_host_memory``:
    whether the sync took the host-shared path, not whether it was asked to (``share``): a
    transport that cannot share (one rank, CUDA tensors, several hosts, no shared memory) gathers
    instead, silently; per-rank buckets say so in ``reshard_path``, full ones by receiving bytes."""
    import torch.distributed as dist

    from ...weights.export import param_metas
    from ...weights.fp8_config import held_layout
    from ...weights.layout import layout_for

    dtype = getattr(torch, job.dtype)
    model_bytes = sum(m.nbytes for m in param_metas(model, dtype))
    extra = dict(stats.extra)
    layout = extra.get("layout", "full")
    held = held_layout(cfg, layout_for(cfg, job.tp, job.ep), getattr(job, "quantization", None))
    shard = held.engine_bytes(dtype.itemsize)
    world = dist.get_world_size()
    # what this rank's sync received (its stats: the all-to-all, the all-gather or the gather to
    # rank 0, counted from the pieces it took in), the most of any rank below
    mine = int(extra.get("trainer_rank_bytes_in", 0))
    if "trainer_rank_bytes_in" not in extra:
        mine = tensor_by_tensor_bytes_in(cfg, param_metas(model, dtype), world)
    engine_in = int(extra["engine_rank_bytes_in"]) if layout == "engine" else int(stats.bytes)
    t = torch.tensor([mine], dtype=torch.int64)
    with released_by_backend(t):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
    bytes_in = int(t.item())
    took = bool(share) and world > 1 and (extra.get("reshard_path") == "host-shared" if layout == "engine"
                                          else bytes_in == 0)
    return {"layout": layout, "pipelined": bool(extra.get("pipelined", False)), "engine_rank_bytes_in": engine_in,
            "engine_rank_shard_bytes": shard, "trainer_rank_bytes_in": bytes_in,
            "reshard_path": extra.get("reshard_path"), "share_host_memory": took,
            "model_bytes": model_bytes}
