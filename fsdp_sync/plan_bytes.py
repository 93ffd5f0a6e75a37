"""The byte counts of `fsdp_sync.plan`: how the trainer ranks hold every exported tensor (FSDP2's
``Shard(0)``, FSDP1's flat parameters), what the busiest trainer rank receives on each path (an
FSDP1 state dict's unsharding, the all-gather or gather of full buckets, the all-to-all of per-rank
buckets), the disk method's files, and the FP8 quantizer's load, each from the planners and the
counting rules the sync itself runs (`gather.bucket_bytes_in`, `reshard.exchange_bytes`,
`hf_checkpoint.safetensors_file_bytes`), on the meta device.

Not here: the job, the memory rule and the fit (`fsdp_sync.plan`), the time estimate.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["fsdp_counts", "fsdp1_unit_numels", "state_dict_bytes_in", "gather_bytes_in", "exchange_in",
           "disk_bytes", "quantizer_load", "largest_quantized_bucket", "sync_quantized_bucket",
           "quantize_scratch", "sync_quantize_scratch"]


def _chunk(rows: int, per_row: int, world: int) -> tuple[int, ...]:
    """FSDP2's ``Shard(0)``: torch.chunk's split of ``rows`` (trailing ranks may get none)."""
    c = -(-rows // world) if rows else 0
    return tuple(max(0, min(c, rows - r * c)) * per_row for r in range(world))


def _params(module: torch.nn.Module) -> list:
    return list(dict((id(p), (n, p)) for n, p in module.named_parameters()).values())


def _fsdp1_groups(module: torch.nn.Module, params: list) -> list[list[str]]:
    """The parameter names of each FSDP1 unit as the CLI's trainer wraps: one per decoder layer,
    and the root's (every parameter outside the layers)."""
    layers = {id(m) for m in getattr(getattr(module, "model", None), "layers", [])}
    units: dict[int, list] = {}
    for mod_name, m in module.named_modules():
        if id(m) in layers:
            for pn, _ in m.named_parameters():
                units.setdefault(id(m), []).append(f"{mod_name}.{pn}")
    in_layer = {n for names in units.values() for n in names}
    shape = {n for n, _ in params}
    groups = list(units.values()) + [[n for n, _ in params if n not in in_layer]]
    return [[n for n in names if n in shape] for names in groups]


def fsdp1_unit_numels(module: torch.nn.Module) -> list[int]:
    """Elements of each FSDP1 unit's flat parameter (unpadded), as `_fsdp1_groups` wraps them."""
    params = _params(module)
    shape = {n: p.shape for n, p in params}
    return [sum(math.prod(shape[n]) for n in names) for names in _fsdp1_groups(module, params)]


def state_dict_bytes_in(module: torch.nn.Module, world: int, kind: str, itemsize: int) -> int:
    """What one trainer rank receives while torch builds an FSDP1 ``kind`` state dict
    (`export.state_dict_bytes_in`): "full" and "sharded" all-gather every unit's flat parameter,
    padded to a multiple of the world, in the trainer's dtype; "local" nothing."""
    if kind == "local" or world == 1:
        return 0
    return sum((world - 1) * -(-n // world) * itemsize for n in fsdp1_unit_numels(module) if n)


def fsdp_counts(module: torch.nn.Module, world: int, fsdp: int) -> dict[str, tuple[int, ...]]:
    """Elements of every exported HF tensor on each trainer rank, in rank order. FSDP2 (and an
    FSDP1 "sharded" state dict's ShardedTensors, cut the same way): every parameter split on dim 0
    (``Shard(0)``); a fused expert tensor's per-expert parts are ranges of it (`experts.hub_parts`).
    FSDP1 (``use_orig_params``, one unit per decoder layer, as the CLI's trainer wraps): each
    unit's parameters concatenated in order into one flat parameter padded to a multiple of the
    world and split evenly."""
    from .weights.experts import hub_parts, model_type_of
    from .weights.export import hf_name

    mt = model_type_of(module)
    params = _params(module)
    if fsdp == 2:
        whole = {n: _chunk(p.shape[0] if p.dim() else 1, math.prod(p.shape[1:]) if p.dim() else 1, world)
                 for n, p in params}
    else:
        whole = {}
        shape = {n: p.shape for n, p in params}
        for names in _fsdp1_groups(module, params):
            total = sum(math.prod(shape[n]) for n in names)
            per = -(-total // world) if total else 0
            off = 0
            for n in names:
                k = math.prod(shape[n])
                whole[n] = tuple(max(0, min(off + k, (r + 1) * per) - max(off, r * per)) for r in range(world))
                off += k
    out: dict[str, tuple[int, ...]] = {}
    for n, p in params:
        name, c = hf_name(n), whole[n]
        parts = hub_parts(name, tuple(p.shape), mt)
        if parts is None:
            out[name] = c
            continue
        starts = [sum(c[:r]) for r in range(world)]
        for sub, shape, off in parts:
            k = math.prod(shape)
            out[sub] = tuple(max(0, min(off + k, a + x) - max(off, a)) for a, x in zip(starts, c))
    return out


def gather_bytes_in(plan: list, counts: dict, world: int, dst: int | None = None) -> int:
    """The most one trainer rank receives gathering the full buckets of ``plan`` (every rank
    all-gathers; ``dst``: to that rank only), as the sync's gather counts it
    (`gather.bucket_bytes_in`: whole tensors one rank holds broadcast from it, uneven pieces
    packed in slots as wide as the largest)."""
    from .weights.gather import bucket_bytes_in

    if world == 1:
        return 0
    per_rank = [0] * world
    for b in plan:
        pairs = [(e, tuple(counts[e.name])) for e in b.entries]
        for r in range(world):
            per_rank[r] += bucket_bytes_in(pairs, r, dst)
    return max(per_rank)


def exchange_in(reshard: Any, layout: Any, dtype: torch.dtype, counts: dict, owners: Any) -> int:
    """The most one trainer rank receives in the per-rank buckets' all-to-all."""
    return max(i for i, _ in reshard.exchange_bytes(layout, dtype.itemsize, counts, owners))


def _block(src: tuple, shape: tuple) -> tuple[int, int, int, int]:
    from .weights.layout import block_of

    return block_of(src, tuple(shape))


def disk_bytes(job: Any, layout: Any, held: Any, quant: Any, metas: list, dtype: torch.dtype,
               counts: dict, shared: bool, gathers: bool, reshard: Any, bk: Any) -> dict:
    """The disk method's files: their sizes (headers included) and what each engine rank reads;
    per-rank files: what the busiest trainer rank receives in their all-to-all (``gathers``: the
    trainer ranks hold pieces to exchange, not every tensor whole)."""
    from .weights.hf_checkpoint import rank_tensor_name, safetensors_file_bytes

    if job.layout == "engine":
        plan = reshard.plan_rank_buckets(layout, dtype, job.bucket_bytes)
        files = [quant.plan(b, engine=True) if quant else b for b in plan]
        tied = bool(layout.spec.tie_word_embeddings)
        per_file = [safetensors_file_bytes(b.entries, rename=lambda n: rank_tensor_name(n, tied)) for b in files]
        world = job.ranks
        path = "host-shared" if shared else ("all-to-all" if gathers else "local")
        owners = [[i % world] for i in range(job.tp)]
        trainer_in = exchange_in(reshard, layout, dtype, counts, owners) if path == "all-to-all" else 0
        return {"buckets": len(plan), "files": len(plan) * job.tp, "file_bytes": sum(per_file) * job.tp,
                "engine_rank_bytes_in": sum(per_file), "trainer_rank_bytes_in": trainer_in,
                "reshard_path": path}
    plan = bk.plan_buckets(metas, job.bucket_bytes)
    files = [quant.plan(b) if quant else b for b in plan]
    sizes = [safetensors_file_bytes(b.entries) for b in files]
    reads = []
    for r in range(job.tp):
        n = sum(sizes[r::job.tp])            # its share of the files, read whole (and hashed)
        for k, b in enumerate(files):
            if k % job.tp == r:
                continue
            for e in b.entries:              # of the others, only its slices
                for pl in held.placements(e.name, r):
                    r0, r1, c0, c1 = _block(pl.src, e.shape)
                    n += (r1 - r0) * (c1 - c0) * e.dtype.itemsize
        reads.append(n)
    return {"buckets": len(plan), "files": len(plan), "file_bytes": sum(sizes), "engine_rank_bytes_in": max(reads)}


def quantizer_load(job: Any, layout: Any, dtype: torch.dtype, metas: list, quant: Any, reshard: Any,
                   bk: Any, path: str | None = None) -> dict:
    """What the busiest trainer rank passes through the FP8 quantizer in one sync, as the
    transports quantize: layout full, each gathered bucket whole (the tensor method: on every
    rank; the distributed method: on rank 0; the disk method: each writer its own buckets, bucket
    k by writer k mod ranks: the most any writer takes); layout engine, each per-rank bucket of the
    engine ranks the rank serves (the tensor method: its own infer-TP rank's; the distributed
    method: rank 0, every engine rank's; the disk method: its share of them, by
    `transport.disk_ranked`'s rule: engine rank i's file of bucket k by writer i mod ranks on the
    ``path`` "all-to-all", by writer (k tp + i) mod ranks where every rank holds every buffer).
    ``quantize_bytes_in``: the buckets' bytes in the rollout dtype (quantized or passed through);
    ``quantized_tensors``: the tensors quantized (the names the sync's stats use)."""
    world, tp, m = job.ranks, job.tp, job.method
    if job.layout == "engine":
        per = job.bucket_bytes // tp if m == "distributed" else job.bucket_bytes
        buckets = reshard.plan_rank_buckets(layout, dtype, max(1, per))
        if m == "disk" and path in ("host-shared", "local"):
            load = [[0, 0] for _ in range(world)]
            for k, b in enumerate(buckets):
                for i in range(tp):
                    mine = load[(k * tp + i) % world]
                    mine[0] += sum(e.end - e.start for e in b.entries)
                    mine[1] += sum(e.name in quant.engine for e in b.entries)
            return {"quantize_bytes_in": max(x[0] for x in load), "quantized_tensors": max(x[1] for x in load)}
        entries = [e for b in buckets for e in b.entries]
        one = (sum(e.end - e.start for e in entries), sum(e.name in quant.engine for e in entries))
        times = {"tensor": 1, "distributed": tp}.get(m, math.ceil(tp / world))
        return {"quantize_bytes_in": int(one[0] * times), "quantized_tensors": math.ceil(one[1] * times)}
    if m != "disk":
        return {"quantize_bytes_in": sum(x.nbytes for x in metas),
                "quantized_tensors": sum(x.name in quant.hf for x in metas)}
    plan = bk.plan_buckets(metas, job.bucket_bytes)
    writers = [plan[w::world] for w in range(world)]
    return {"quantize_bytes_in": max(sum(b.payload_bytes for b in mine) for mine in writers),
            "quantized_tensors": max(sum(e.name in quant.hf for b in mine for e in b.entries)
                                     for mine in writers)}


def largest_quantized_bucket(method: str, layout_name: str, layout: Any, metas: list, quant: Any,
                             dtype: torch.dtype, bucket: int) -> int | None:
    """The largest quantized bucket of a sync at ``bucket``, as the transports size their FP8
    buffers: over the bucket plan they quantize (an unquantized embedding or lm_head keeps its
    bytes); per-rank buckets (``layout_name`` "engine") of ``layout`` (the rollout's TP layout map,
    unquantized), the distributed method a buffer per engine rank, each for its largest part.
    None where there is no quantizer or for the disk method (`plan.quantized_bucket_bytes`)."""
    from .weights import bucket as bk
    from .weights import reshard

    if quant is None or method == "disk":
        return None
    if layout_name == "engine":
        tp = layout.tp if method == "distributed" else 1
        plan = reshard.plan_rank_buckets(layout, dtype, max(1, bucket // tp))
        return tp * max((quant.plan(b, engine=True).nbytes for b in plan), default=0)
    full = bk.plan_tight(metas, bucket) if method == "distributed" else bk.plan_buckets(metas, bucket)
    return max((quant.plan(b).nbytes for b in full), default=0)


def quantize_scratch(layout_name: str, layout: Any, quant: Any, dtype: torch.dtype) -> int:
    """The most the FP8 quantizer allocates beside its outputs while it quantizes one tensor of
    the sync (`fp8.quantize_scratch_bytes` of the largest): per-rank buckets (``layout_name``
    "engine") quantize each engine rank's piece of a weight (``layout``'s engine shapes), full
    buckets the whole Hugging Face tensor. 0 without a quantizer."""
    from .weights.fp8 import quantize_scratch_bytes

    if quant is None:
        return 0
    if layout_name == "engine":
        shapes = layout.engine_shapes()
        names = quant.engine
    else:
        shapes, names = layout.hf_shapes, quant.hf
    return max((quantize_scratch_bytes(tuple(shapes[n]), dtype.itemsize, quant.block) for n in names), default=0)


def sync_quantized_bucket(cfg: Any, module: torch.nn.Module, method: str, layout_name: str, bucket: int,
                          dtype: torch.dtype, tp: int, ep: int = 1) -> int | None:
    """`largest_quantized_bucket` of an FP8 sync of ``module`` (Hugging Face config ``cfg``) into
    engines of TP ``tp`` and EP ``ep``: what the bench holds its FP8 rows to, the plan's figure."""
    from .weights.export import param_metas
    from .weights.fp8_config import held_layout
    from .weights.layout import layout_for
    from .weights.quantize import StreamQuantizer

    layout = layout_for(cfg, tp, ep)
    quant = StreamQuantizer(held_layout(cfg, layout, "fp8"), tight=method == "distributed")
    return largest_quantized_bucket(method, layout_name, layout, param_metas(module, dtype), quant, dtype, bucket)


def sync_quantize_scratch(cfg: Any, layout_name: str, dtype: torch.dtype, tp: int, ep: int = 1) -> int:
    """`quantize_scratch` of an FP8 sync of a model of Hugging Face config ``cfg`` into engines of
    TP ``tp`` and EP ``ep``: what the bench holds its FP8 rows to, the plan's figure."""
    from .weights.fp8_config import held_layout
    from .weights.layout import layout_for
    from .weights.quantize import StreamQuantizer

    layout = layout_for(cfg, tp, ep)
    return quantize_scratch(layout_name, layout, StreamQuantizer(held_layout(cfg, layout, "fp8")), dtype)
