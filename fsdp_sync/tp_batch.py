"""A rollout batch across the infer-TP group, for the sharding manager's `preprocess_data` /
`postprocess_data`: `gather` all-gathers each TP rank's batch so every rank of the group runs the
same prompts, and says how many samples each rank gave; `keep_own` takes this rank's part back.

A batch is a dict of tensors (concatenated along dim 0) and lists or tuples (concatenated), with
the same keys on every rank, each key of one kind on every rank (a tensor everywhere, of one dtype
and one shape past dim 0, or a list everywhere), one size across its fields; or a verl
``DataProto`` (``concat``, ``chunk``/``slice``) on every rank. Sizes may differ per rank. Tensors
travel as CPU copies (a CUDA tensor sent as is would unpickle on the sender's device index) and the
gathered batch is put on the caller's device: each field where that field is on this rank, a
DataProto where its tensors are (left on the CPU if they span devices). A batch
that does not fit is refused on every rank alike, naming the field and the ranks: every check runs
on the gathered batches, which every rank holds, never on a rank's own alone (a rank that raised
where another did not would leave the other waiting in its next collective). `keep_own` splits by
the gathered sizes (or k times them, k samples per prompt) and refuses a batch that fits neither;
only a batch no `gather` preceded is split evenly.

Not here: the mesh and its groups (`topology`), the with block (`manager`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from .topology import cpu_group

__all__ = ["gather", "keep_own"]


class _Refused:
    """What a rank whose batch is not a dict or a DataProto gathers instead: every rank refuses."""

    def __init__(self, kind: str) -> None:
        self.kind = kind


def _data_proto(batch: Any) -> bool:
    return hasattr(batch, "chunk") and hasattr(type(batch), "concat")


def gather(topo: Any, batch: Any) -> tuple[Any, list[int] | None]:
    """``(the group's batch in TP-rank order, each rank's size)``; with no TP group (or TP 1)
    the batch itself and None."""
    if topo is None or topo.tp_size == 1:
        return batch, None
    mine = _on_host(batch) if isinstance(batch, dict) or _data_proto(batch) else _Refused(type(batch).__name__)
    parts: list = [None] * topo.tp_size
    dist.all_gather_object(parts, mine, group=cpu_group(topo.tp_group))
    where = f" ({topo.describe()})"
    kinds = ["dict" if isinstance(p, dict) else p.kind if isinstance(p, _Refused) else type(p).__name__
             for p in parts]
    bad = {r: k for r, k in enumerate(kinds) if isinstance(parts[r], _Refused)}
    if bad:
        raise TypeError("preprocess_data takes a dict of tensors/lists or a DataProto; got "
                        + ", ".join(f"{k} on infer-TP rank {r}" for r, k in bad.items()) + where)
    if len(set(kinds)) > 1:
        raise TypeError(f"preprocess_data: the infer-TP ranks' batches are of different types "
                        f"({_by_rank(kinds)}); give every rank the same kind of batch{where}")
    if not isinstance(parts[0], dict):
        whole = type(parts[0]).concat(parts)
        device = _proto_device(batch)
        return (whole.to(device) if device is not None else whole), [len(p) for p in parts]
    keys = [sorted(map(str, p)) for p in parts]
    if any(k != keys[0] for k in keys):
        diff = {r: sorted(set(k) ^ set(keys[0])) for r, k in enumerate(keys) if k != keys[0]}
        raise ValueError(f"preprocess_data: the infer-TP ranks' batches have different keys: "
                         f"rank 0 has {keys[0]}, " + ", ".join(
                             f"rank {r} differs in {d}" for r, d in diff.items()) + where)
    for key in parts[0]:
        _check_field(key, [p[key] for p in parts], where)
    sizes = [_batch_size(p, r) for r, p in enumerate(parts)]
    return ({key: torch.cat([p[key] for p in parts], dim=0).to(batch[key].device)
             if isinstance(value, torch.Tensor) else [x for p in parts for x in p[key]]
             for key, value in parts[0].items()}, sizes)


def _on_host(batch: Any) -> Any:
    """What this rank sends: its batch with its tensors copied to the CPU (a CPU tensor as is).
    An object collective pickles, and a CUDA tensor unpickles onto the device index it left:
    rank 1's ``cuda:1`` rows would land on ``cuda:1`` in rank 0 (a context on another rank's GPU,
    and rows ``torch.cat`` cannot join to rank 0's on ``cuda:0``). The gathered batch goes back
    onto the caller's device. The caller's batch is not changed."""
    if isinstance(batch, dict):
        return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    tensors = getattr(batch, "batch", None)                  # a DataProto's TensorDict, or None
    if tensors is None or not dataclasses.is_dataclass(batch):
        return batch
    return dataclasses.replace(batch, batch=tensors.cpu())  # verl's DataProto.to moves in place


def _proto_device(batch: Any) -> torch.device | None:
    """The device of a DataProto's tensors (None: no tensors, or already on the CPU as sent)."""
    tensors = getattr(batch, "batch", None)
    if tensors is None or not dataclasses.is_dataclass(batch):
        return None
    device = getattr(tensors, "device", None)                # a TensorDict's, when it was given one
    if device is None:
        devices = {v.device for v in tensors.values(include_nested=True, leaves_only=True)}
        device = devices.pop() if len(devices) == 1 else None
    return None if device is None or torch.device(device).type == "cpu" else torch.device(device)


def _by_rank(values: list) -> str:
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))


def _field_kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__


def _check_field(key: Any, values: list, where: str) -> None:
    """Field ``key`` of every rank's batch (``values[r]``) can be put end to end exactly."""
    kinds = [_field_kind(v) for v in values]
    odd = [r for r, k in enumerate(kinds) if k not in ("tensor", "list")]
    if odd:
        raise ValueError(f"preprocess_data: field {key!r} is neither a tensor nor a list on infer-TP "
                         f"ranks {odd} ({', '.join(kinds[r] for r in odd)}); a batch field is a tensor "
                         f"(one row per sample) or a list (one entry per sample){where}")
    if len(set(kinds)) > 1:
        raise ValueError(f"preprocess_data: field {key!r} is a tensor on some infer-TP ranks and a list "
                         f"on others ({_by_rank(kinds)}); give it the same kind on every rank{where}")
    if kinds[0] != "tensor":
        return
    scalar = [r for r, v in enumerate(values) if v.dim() == 0]
    if scalar:
        raise ValueError(f"preprocess_data: field {key!r} is a 0-dim tensor on infer-TP ranks {scalar}; "
                         f"a batch field holds one row per sample along dim 0 (a value for the whole "
                         f"batch does not belong in it){where}")
    for what, of in (("dtype", lambda v: str(v.dtype).removeprefix("torch.")),
                     ("shape past dim 0", lambda v: tuple(v.shape[1:]))):   # all sent from the CPU
        seen = [of(v) for v in values]
        if len(set(seen)) > 1:
            raise ValueError(f"preprocess_data: field {key!r} differs in {what} across the infer-TP "
                             f"ranks ({_by_rank(seen)}); its rows are put end to end, so they must "
                             f"agree{where}")


def _batch_size(batch: dict, rank: int) -> int:
    sizes = {k: (v.shape[0] if isinstance(v, torch.Tensor) else len(v)) for k, v in batch.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"preprocess_data: infer-TP rank {rank}'s batch fields differ in size "
                         f"{sizes}; every field holds one entry per sample")
    return next(iter(sizes.values()), 0)


def keep_own(topo: Any, batch: Any, sizes: list[int] | None) -> Any:
    """This rank's part of ``batch``: by ``sizes`` (what `gather` returned; k times them when
    each prompt became k samples), else (no `gather` before it) an even split. A batch of another
    size is refused: a split that is not the gathered one would hand a rank others' samples."""
    if topo is None or topo.tp_size == 1:
        return batch
    if isinstance(batch, dict):
        scalar = sorted(str(k) for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() == 0)
        if scalar:
            raise ValueError(f"postprocess_data: fields {scalar} are 0-dim tensors; a batch field holds "
                             f"one row per sample along dim 0")
        odd = {str(k): type(v).__name__ for k, v in batch.items()
               if not isinstance(v, (torch.Tensor, list, tuple))}
        if odd:
            raise ValueError(f"postprocess_data: fields {odd} are neither tensors nor lists")
        total = {k: (v.shape[0] if isinstance(v, torch.Tensor) else len(v)) for k, v in batch.items()}
    elif hasattr(batch, "chunk"):
        total = {"batch": len(batch)}
    else:
        raise TypeError(f"postprocess_data takes a dict of tensors or a DataProto, got "
                        f"{type(batch).__name__}")
    n = next(iter(total.values()), 0)
    if len(set(total.values())) > 1:
        raise ValueError(f"postprocess_data: batch fields differ in size {total}")
    if sizes is None:
        if n % topo.tp_size:
            raise ValueError(f"postprocess_data: {n} samples do not split into {topo.tp_size} "
                             f"infer-TP parts")
        sizes = [n // topo.tp_size] * topo.tp_size
    else:
        gathered = sum(sizes)
        if n != gathered:
            if not gathered or n % gathered:
                raise ValueError(f"postprocess_data: {n} samples are neither the {gathered} that "
                                 f"preprocess_data gathered (per infer-TP rank {sizes}) nor a "
                                 f"multiple of them (k samples per prompt); a batch filtered or "
                                 f"reordered since cannot be split back ({topo.describe()})")
            sizes = [x * (n // gathered) for x in sizes]   # k samples per gathered prompt
    start = sum(sizes[:topo.tp_rank])
    end = start + sizes[topo.tp_rank]
    if isinstance(batch, dict):
        return {key: value[start:end] for key, value in batch.items()}
    if len(set(sizes)) == 1:
        return batch.chunk(topo.tp_size)[topo.tp_rank]
    return batch.slice(start, end) if hasattr(batch, "slice") else batch[start:end]
