"""`tied.head_refusal` refuses a trainer head whose SHAPE is not the embedding's under a tied
config, before comparing any bytes: the same elements in another shape (flattened, bit for bit
equal) are not the embedding, and a head of another element count is refused by name, not with a
broadcasting error from the compare (h22 mutation pass: dropping the shape check survived).
In process: whole tensors and one-rank pieces, no collective."""

from __future__ import annotations

import types

import pytest
import torch

from fsdp_sync.weights import tied
from fsdp_sync.weights.gather import Pieces


def _item(name, t, *, pieces):
    it = types.SimpleNamespace(name=name, shape=tuple(t.shape), src_dtype=t.dtype,
                               full=None, dtensor=None, pieces=None)
    if pieces:
        it.pieces = Pieces(t.reshape(-1).clone(), (t.numel(),), None, 0)
    else:
        it.full = t
    return it


@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize("shape", [(8, 12), (13, 8)])
def test_a_head_of_another_shape_is_refused_naming_both_shapes(shape, pieces):
    emb = torch.arange(12 * 8, dtype=torch.float32).view(12, 8)
    head = torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)   # (8, 12): emb's bytes
    why = tied.head_refusal([_item(tied.EMBED, emb, pieces=False), _item(tied.HEAD, head, pieces=pieces)],
                            tied=True)
    assert why is not None and f"it has shape {shape}" in why and "(12, 8)" in why, why
    assert tied.head_refusal([_item(tied.EMBED, emb, pieces=False), _item(tied.HEAD, head, pieces=pieces)],
                             tied=False) is None
