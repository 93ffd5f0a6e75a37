"""The tied-head check of a reference worker's weight update (`staging.UpdateStager`).

An engine whose config ties ``lm_head`` to ``embed_tokens`` has no head of its own: a sent
``lm_head.weight`` is dropped, so it must equal the embedding the engine will serve, bit for bit,
or the engine would serve other logits than the trainer's (an untied trainer). Equal means the
same bits (a NaN equals a NaN; -0.0 is not 0.0), not ``torch.equal``'s values.

The embedding it is compared with is the one the update leaves: this call's (wherever in the call
it comes, before or after the head), else one an earlier call of the open transaction sent, else,
inside a transaction, one a later call sends: the head's pieces are kept as digests (no copy of
the sender's buffer) until it comes, or until ``end_weight_update`` compares them with the loaded
embedding (`TiedHeads.check_pending`, one round the engine runs only when some are pending).
Outside a transaction the loaded embedding is the one.

Not here: staging and committing the writes (`staging`), the trainer side's own refusal of an
untied model before anything is sent (`weights.tied`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from .errors import KIND_UPDATE, WorkerError

__all__ = ["EMBED", "HEAD", "TiedHeads", "same_bits", "digest"]

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same dtype, shape and bits (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bits(a), _bits(b.to(a.device)))


def digest(t: torch.Tensor) -> bytes:
    """A sha256 of ``t``'s dtype, shape and bytes: what `same_bits` compares, kept without a copy."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    flat = t.detach().contiguous().cpu().reshape(-1)
    if flat.numel():
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.digest()


def _latest(writes: list, pl: Any) -> torch.Tensor | None:
    """The last of ``writes`` to this rank's embedding piece ``pl``, as the piece (a ``direct``
    write holds the whole engine shard)."""
    for x in reversed(writes):
        if EMBED in x.covers and x.engine == pl.engine and isinstance(x.src, torch.Tensor):
            if x.dst == pl.dst:
                return x.src
            if x.dst == (slice(None),):
                return x.src[pl.dst]
    return None


class TiedHeads:
    """Checks the heads of one worker's update calls (`stage` collects them as it goes)."""

    def __init__(self, stager: Any) -> None:
        self.s = stager
        self.call: list[torch.Tensor] = []      # this call's lm_head.weight (checked after the call)

    def _refusal(self, rank: int, where: str) -> WorkerError:
        return WorkerError(KIND_UPDATE, f"{HEAD!r} differs from {EMBED!r} ({where}) on TP rank {rank}, "
                                        f"but this engine ties them (tie_word_embeddings=True) and would "
                                        f"drop it: the sender's model is untied; start the engine from "
                                        f"the trainer's config", HEAD)

    def check_call(self, writes: list) -> int:
        """After a call's items are all seen: each head of the call against the embedding the
        update leaves, and the heads earlier calls of the transaction left pending against this
        call's embedding. Returns how many heads stay pending (the transaction's, compared at its
        end by `check_pending`)."""
        s = self.s
        heads, self.call = self.call, []
        txn = s.txn
        if not heads and not (txn is not None and txn.heads):
            return 0
        w = s.w
        for pl in s.placements(EMBED):
            key = (pl.engine, repr(pl.dst))
            latest = _latest(writes, pl)
            if latest is not None and txn is not None and key in txn.heads:
                if txn.heads.pop(key) != digest(latest):        # an earlier call's head, this call's embedding
                    raise self._refusal(w.rank, "a head an earlier call of this update sent")
            if latest is None and txn is not None and txn.staging:
                latest = _latest(txn.writes, pl)
            if latest is None and txn is not None and not txn.staging and txn.embedded:
                latest = w.model.params[pl.engine][pl.dst]      # written in place by an earlier call
            for head in heads:
                if latest is not None:
                    if not same_bits(head[pl.src], latest):
                        raise self._refusal(w.rank, "this update's embedding")
                elif txn is not None:       # a later call of the transaction may bring the embedding
                    txn.heads[key] = digest(head[pl.src])
                elif not w.memory.weights_released and pl.engine in w.model.params:
                    if not same_bits(head[pl.src], w.model.params[pl.engine][pl.dst]):
                        raise self._refusal(w.rank, "the loaded embedding")
        if txn is not None and any(EMBED in x.covers for x in writes):
            txn.embedded = True
        return len(txn.heads) if txn is not None else 0

    def check_pending(self) -> dict:
        """At ``end_weight_update``, before the commit: heads no later call's embedding met
        against the loaded embedding (the one the transaction leaves: it sent none)."""
        s = self.s
        txn = s.txn
        if txn is None or txn.aborted or not txn.heads:
            return {}
        w = s.w
        for pl in s.placements(EMBED):
            want = txn.heads.get((pl.engine, repr(pl.dst)))
            if want is not None and pl.engine in w.model.params and not w.memory.weights_released:
                if digest(w.model.params[pl.engine][pl.dst]) != want:
                    raise self._refusal(w.rank, "the loaded embedding: this update sent none")
        txn.heads.clear()
        return {}
