"""Is the trainer's ``lm_head`` the embedding where the model's config ties them?

A config with ``tie_word_embeddings=True`` tells every reader (the reference engine, SGLang, a
``from_pretrained`` of a written checkpoint) that the output head IS ``model.embed_tokens.weight``:
an ``lm_head.weight`` beside it is not loaded. The export yields a tied weight once (one Parameter,
under its first name), so ``lm_head.weight`` is in the stream only where the trainer holds a head
of its own (untied after loading, to train it apart): sent or written for a tied engine it would
be dropped, and the engine would serve other logits than the trainer's. `head_refusal` says so
before anything is sent or written, unless the two are bit for bit the same (two Parameters with
equal values: a copy never trained apart, which serves the trainer's logits).

What it costs, chosen from how the two tensors are held (the same choice on every rank):

- no ``lm_head.weight`` exported (one Parameter, or an untied config): nothing (`needs_check`
  reads only names, from the metas every sync has);
- both whole on this rank (a plain module, FSDP1 ``"full"``): one compare, no collective;
- both split alike over one shard group (FSDP2 ``Shard(0)``: equal shapes, equal splits): each
  rank compares its own shards, no data moves; the caller's status all-reduce joins the answers;
- otherwise (FSDP1 flat parameters that hold them at other offsets, a DTensor that needs
  ``full_tensor()``): both are gathered, pieces `CHUNK_BYTES` at a time, every rank comparing
  the same chunk (collective: every rank of the shard group calls it with the same items).

Not here: what is exported (`export`), refusing names the layout does not know (`reshard`), the
engine's own check of a sent head (`engines.reference.staging`).
"""

from __future__ import annotations

from typing import Any

import torch

from . import export as _export
from .gather import Pieces, gather_pieces, materialize, sub_pieces

__all__ = ["HEAD", "EMBED", "CHUNK_BYTES", "ties", "needs_check", "head_refusal", "module_refusal"]

HEAD = "lm_head.weight"
EMBED = "model.embed_tokens.weight"
CHUNK_BYTES = 64 << 20
"""At most this many bytes of each tensor gathered at once on the gather path."""

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def ties(config: Any) -> bool:
    """The config ties lm_head to embed_tokens (read as `layout.ModelSpec` reads it)."""
    return bool(getattr(config, "tie_word_embeddings", False))


def needs_check(names: Any, tied: bool) -> bool:
    """Whether `head_refusal` has anything to compare: a tied config and an exported head."""
    return bool(tied) and HEAD in set(names)


def head_refusal(items: list, tied: bool) -> str | None:
    """This rank's refusal (text) of an exported ``lm_head.weight`` that differs from the
    embedding under a tied config, or None. ``items``: `export.resolve`'s, data not yet dropped.
    Collective on the gather path (module docstring): every rank of the shard group calls it
    with the same items, and passes the answer to one status all-reduce (`topology.agree`)."""
    by_name = {it.name: it for it in items}
    head, emb = by_name.get(HEAD), by_name.get(EMBED)
    if not tied or head is None or emb is None:
        return None          # nothing dropped, or a missing embedding the names check reports
    if tuple(head.shape) != tuple(emb.shape):
        return _refusal(f"it has shape {tuple(head.shape)}, {EMBED!r} {tuple(emb.shape)}")
    dtype = emb.src_dtype
    with torch.no_grad():
        hp, ep = head.pieces, emb.pieces
        if head.full is not None and emb.full is not None:
            diff = _first_diff(head.full, emb.full, dtype, 0)
        elif hp is not None and ep is not None and hp.counts == ep.counts and hp.group is ep.group:
            diff = _first_diff(hp.local, ep.local, dtype, sum(hp.counts[:hp.rank]))
        elif head.dtensor is not None or emb.dtensor is not None:
            diff = _first_diff(materialize(head, dtype), materialize(emb, dtype), dtype, 0)
        else:
            diff = _chunked(head, emb, dtype)
    if diff is None:
        return None
    at, a, b = diff
    index = list(_unravel(at, tuple(head.shape)))
    return _refusal(f"first difference at {index}: {a:.6g} against {b:.6g}")


def module_refusal(module: Any, *, fsdp1_state_dict: str, dtype: torch.dtype | None) -> str | None:
    """`head_refusal` for a module about to be streamed with `export` (the full layouts): its
    items are resolved only where `needs_check` (a tied config and a head of its own), so a
    module whose head IS its embedding costs one look at the cached metas. Collective where it
    resolves (`export.resolve`: every rank of the shard group calls it)."""
    tied = ties(getattr(module, "config", None))
    if not needs_check((m.name for m in _export.param_metas(module, dtype)), tied):
        return None
    return head_refusal(_export.resolve(module, fsdp1_state_dict, dtype), tied)


def _refusal(how: str) -> str:
    return (f"{HEAD!r} differs from {EMBED!r} in the trainer ({how}), but the model's config ties "
            f"them (tie_word_embeddings=True), so the engine would drop {HEAD!r} and serve the "
            f"embedding as its head: other logits than the trainer's; nothing was sent or written. "
            f"Untie the config (tie_word_embeddings=False in the trainer's model.config, and start "
            f"the engine from it) or tie the trainer's weights (one Parameter: "
            f"model.lm_head.weight = model.model.embed_tokens.weight, or model.tie_weights(), "
            f"before wrapping)")


def _bits(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t = t.detach().reshape(-1)
    if t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous().view(_INT[dtype.itemsize])


def _first_diff(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, offset: int) -> tuple | None:
    """``(element, a's value, b's value)`` of the first element whose bits differ, or None."""
    if a.dtype == b.dtype == dtype and a.data_ptr() == b.data_ptr() and a.shape == b.shape \
            and a.stride() == b.stride():
        return None          # two Parameters over the same memory: equal without a read
    x, y = _bits(a, dtype), _bits(b, dtype)
    if torch.equal(x, y):
        return None
    i = int((x != y).nonzero()[0, 0])
    va, vb = a.detach().reshape(-1)[i], b.detach().reshape(-1)[i]
    return offset + i, va.float().item(), vb.float().item()


def _chunked(head: Any, emb: Any, dtype: torch.dtype) -> tuple | None:
    """Both tensors (pieces, or whole here) gathered a chunk at a time and compared; every rank
    runs every chunk's gathers (none stops early: its peers would wait in the next one)."""
    numel = 1
    for s in head.shape:
        numel *= int(s)
    step = max(1, CHUNK_BYTES // dtype.itemsize)
    found = None
    for off in range(0, numel, step):
        n = min(step, numel - off)
        diff = _first_diff(_part(head, off, n, dtype), _part(emb, off, n, dtype), dtype, off)
        found = found or diff
    return found


def _part(item: Any, off: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    if item.full is not None:
        return item.full.reshape(-1)[off:off + n]
    p: Pieces = item.pieces
    return gather_pieces(sub_pieces(p, off, n), (n,), dtype)


def _unravel(i: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        i, r = divmod(i, s)
        out.append(r)
    return tuple(reversed(out))
