"""A rollout batch across the infer-TP group, for the sharding manager's `preprocess_data` /
`postprocess_data`: `gather` all-gathers each TP rank's batch so every rank of the group runs the
same prompts, and says how many samples each rank gave; `keep_own` takes this rank's part back.

A batch is a dict of tensors (concatenated along dim 0) and lists (concatenated), with the same
keys on every rank and one size across its fields, or a verl ``DataProto`` (``concat``,
``chunk``/``slice``). Sizes may differ per rank. A bad batch raises on every rank.

Not here: the mesh and its groups (`topology`), the with block (`manager`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .topology import cpu_group

__all__ = ["gather", "keep_own"]


def gather(topo: Any, batch: Any) -> tuple[Any, list[int] | None]:
    """``(the group's batch in TP-rank order, each rank's size)``; with no TP group (or TP 1)
    the batch itself and None."""
    if topo is None or topo.tp_size == 1:
        return batch, None
    if not isinstance(batch, dict) and not (hasattr(batch, "chunk") and hasattr(type(batch), "concat")):
        raise TypeError(f"preprocess_data takes a dict of tensors/lists or a DataProto, got "
                        f"{type(batch).__name__}")
    parts: list = [None] * topo.tp_size
    dist.all_gather_object(parts, batch, group=cpu_group(topo.tp_group))
    if not isinstance(batch, dict):
        return type(batch).concat(parts), [len(p) for p in parts]
    keys = [sorted(map(str, p)) for p in parts]
    if any(k != keys[0] for k in keys):
        diff = {r: sorted(set(k) ^ set(keys[0])) for r, k in enumerate(keys) if k != keys[0]}
        raise ValueError(f"preprocess_data: the infer-TP ranks' batches have different keys: "
                         f"rank 0 has {keys[0]}, " + ", ".join(
                             f"rank {r} differs in {d}" for r, d in diff.items())
                         + f" ({topo.describe()})")
    sizes = [_batch_size(p, r) for r, p in enumerate(parts)]
    return ({key: torch.cat([p[key] for p in parts], dim=0) if isinstance(value, torch.Tensor)
             else [x for p in parts for x in p[key]]
             for key, value in batch.items()}, sizes)


def _batch_size(batch: dict, rank: int) -> int:
    sizes = {k: (v.shape[0] if isinstance(v, torch.Tensor) and v.dim() else len(v))
             for k, v in batch.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"preprocess_data: infer-TP rank {rank}'s batch fields differ in size "
                         f"{sizes}; every field holds one entry per sample")
    return next(iter(sizes.values()), 0)


def keep_own(topo: Any, batch: Any, sizes: list[int] | None) -> Any:
    """This rank's part of ``batch``: by ``sizes`` (what `gather` returned; k times them when
    each prompt became k samples), else an even split."""
    if topo is None or topo.tp_size == 1:
        return batch
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
