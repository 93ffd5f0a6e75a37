"""A custom weight loader for SGLang that loads fsdp_sync's per-rank buckets (`reshard`).

Start SGLang with ``--custom-weight-loader fsdp_sync.engines.sglang.loader.load_rank_buckets`` and send
``update_weights_from_tensor(named_tensors, load_format="fsdp_sync.engines.sglang.loader.load_rank_buckets")``
with, per bucket, ONE named tensor::

    (bucket_name(rank_bucket.bucket), LocalSerializedTensor(values=[payload of buffers[i] for i in TP ranks]))

SGLang's TP rank i deserializes its own payload (a flat uint8 tensor: its shard of the bucket, in
SGLang's own parameter layout), moves it to its device and calls
``load_rank_buckets(model, [(name, flat)])``. The name carries the bucket's entries (engine
parameter name, dtype, shape, byte range) as compact JSON after `BUCKET_PREFIX`: SGLang's
``_unwrap_tensor`` only passes tensors through (it calls ``.to(device)``), and its payload
allow-list admits no metadata objects, so the metadata rides in the name, identical for every
rank (every rank's shard has the same shapes). Plain ``(engine name, tensor)`` pairs are loaded
like ``load_format="direct"``.

Each entry is copied into ``model.named_parameters()[name]`` (what SGLang's ``direct`` format and
its ``default_weight_loader`` do: a shard of exactly the parameter's shape). Every name, shape and
dtype of a call is checked before the first copy, so a refused call changes nothing; the error
names the parameter, the TP rank's values and what to do.

Imports only torch and `bucket`: it runs inside the SGLang process, which imports it by path.
Not here: making payloads (`handles`), calling the engine (`engines.sglang`), pipelining.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

import torch

from ...weights.bucket import Bucket, BucketEntry, dtype_name, unflatten

__all__ = ["BUCKET_PREFIX", "LOADER", "bucket_name", "entries_from_name", "load_rank_buckets"]

BUCKET_PREFIX = "fsdp_sync.rank_bucket:"
LOADER = "fsdp_sync.engines.sglang.loader.load_rank_buckets"
"""The import path to pass as ``--custom-weight-loader`` and as ``load_format``."""


def bucket_name(bucket: Bucket) -> str:
    """The tensor name that carries ``bucket``'s layout to `load_rank_buckets`."""
    rows = [[e.name, dtype_name(e.dtype), list(e.shape), e.start, e.end] for e in bucket.entries]
    return BUCKET_PREFIX + json.dumps(rows, separators=(",", ":"))


def entries_from_name(name: str) -> list[BucketEntry]:
    if not name.startswith(BUCKET_PREFIX):
        raise ValueError(f"not an fsdp_sync bucket name: {name[:60]!r}")
    out = []
    for row in json.loads(name[len(BUCKET_PREFIX):]):
        pname, dt, shape, start, end = row
        dtype = getattr(torch, dt, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dt!r} for {pname!r} in an fsdp_sync bucket")
        out.append(BucketEntry(pname, dtype, tuple(shape), int(start), int(end)))
    return out


def _pairs(named_tensors: Iterable[tuple[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, t in named_tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fsdp_sync loader: value of {name[:60]!r} must be a tensor, got {type(t).__name__}")
        if name.startswith(BUCKET_PREFIX):
            if t.dtype != torch.uint8 or t.dim() != 1:
                raise ValueError(f"fsdp_sync loader: a bucket is a 1-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
            out.extend(unflatten(t, entries_from_name(name)))
        else:
            out.append((name, t))
    return out


@torch.no_grad()
def load_rank_buckets(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Any]]) -> None:
    """SGLang's custom-loader entry point: copy this TP rank's shards into ``model``'s parameters."""
    params = dict(model.named_parameters())
    pairs = _pairs(named_tensors)
    seen: set[str] = set()
    for name, t in pairs:   # check everything before the first copy: a refused call changes nothing
        p = params.get(name)
        if p is None:
            hint = (" (a tied lm_head is the embedding: do not send it)" if name == "lm_head.weight" else "")
            raise KeyError(f"fsdp_sync loader: unknown parameter {name!r}; this model's parameters are e.g. "
                           f"{list(params)[:3]}{hint}")
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"fsdp_sync loader: expected shape {tuple(p.shape)} for {name!r} (this TP rank's "
                             f"shard), got {tuple(t.shape)}: was the layout planned for another tp_size?")
        if t.dtype != p.dtype:
            raise TypeError(f"fsdp_sync loader: expected dtype {dtype_name(p.dtype)} for {name!r}, got "
                            f"{dtype_name(t.dtype)}: export with dtype={dtype_name(p.dtype)}")
        if name in seen:
            raise ValueError(f"fsdp_sync loader: {name!r} appears twice in one call")
        seen.add(name)
    for name, t in pairs:
        params[name].data.copy_(t)
