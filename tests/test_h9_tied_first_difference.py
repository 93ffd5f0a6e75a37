"""`tied.head_refusal` names the FIRST element where the trainer's head differs from the embedding,
also on the chunked gather path where several chunks differ (H9 mutation pass: keeping the last
differing chunk's answer instead survived, as every test had one difference only).

In-process: the head held as pieces of a one-rank group (no collective) beside a whole
embedding takes the chunked path; `tied.CHUNK_BYTES` is made small so the tensor spans chunks."""

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


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(tied, "CHUNK_BYTES", 64)       # 16 float32 elements a chunk


def test_the_first_difference_is_named_where_several_chunks_differ(small_chunks):
    emb = torch.arange(12 * 8, dtype=torch.float32).view(12, 8)
    head = emb.clone()
    head[1, 3] += 0.5            # element 11: chunk 0
    head[9, 2] -= 2.0            # element 74: chunk 4
    items = [_item(tied.EMBED, emb, pieces=False), _item(tied.HEAD, head, pieces=True)]
    why = tied.head_refusal(items, tied=True)
    assert why is not None and "first difference at [1, 3]: 11.5 against 11" in why, why
    # one difference only, past the first chunks: found too
    head2 = emb.clone()
    head2[11, 7] = -1.0
    why2 = tied.head_refusal([_item(tied.EMBED, emb, pieces=False), _item(tied.HEAD, head2, pieces=True)],
                             tied=True)
    assert why2 is not None and "first difference at [11, 7]" in why2, why2
    # bit-equal: nothing to refuse
    same = [_item(tied.EMBED, emb, pieces=False), _item(tied.HEAD, emb.clone(), pieces=True)]
    assert tied.head_refusal(same, tied=True) is None


# h22 mutation pass: `tied.head_refusal` refuses a trainer head whose SHAPE is not the embedding's under a tied
# config, before comparing any bytes: the same elements in another shape (flattened, bit for bit
# equal) are not the embedding, and a head of another element count is refused by name, not with a
# broadcasting error from the compare (h22 mutation pass: dropping the shape check survived).
# In process: whole tensors and one-rank pieces, no collective.
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
