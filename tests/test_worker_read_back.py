"""What the reference engine reads back is what it holds: `rank_pieces` returns every TP rank's
piece of a tensor, replicas included (not only the owner's), in the engine's dtype (bfloat16 too,
not its raw bytes), and a tied ``lm_head.weight`` reads back as the embedding it is. Verification
(`verify`, `test_adapter_rank_verify`) compares against these, so a missing replica or a wrong
dtype would pass a rank it never looked at. One TP-2 engine per test, tiny models."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.models import load_config


@pytest.mark.timeout(150)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rank_pieces_returns_every_ranks_replica_not_only_the_owners(dtype):
    with ReferenceEngine(model_config=load_config("tiny"), tp_size=2, dtype=dtype) as e:
        got = e.rank_pieces("model.norm.weight")     # replicated: both TP ranks hold all of it
        full = e.get_weights_by_name("model.norm.weight")
        assert sorted(got) == [0, 1]
        for r, pieces in got.items():
            assert pieces, f"TP rank {r} returned no piece of a tensor it holds"
            for src, p in pieces:
                assert p.dtype == full.dtype == dtype and torch.equal(p, full[src]), (r, p.dtype)


@pytest.mark.timeout(150)
def test_a_tied_lm_head_reads_back_as_the_embedding():
    with ReferenceEngine(model_config=load_config("tiny-tied"), tp_size=2) as e:
        emb = e.get_weights_by_name("model.embed_tokens.weight")
        head = e.get_weights_by_name("lm_head.weight")
        assert head.shape == emb.shape and torch.equal(head, emb)
        assert emb.abs().sum() > 0
