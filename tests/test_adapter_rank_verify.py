"""An adapter sync's verify compares every TP rank's piece of each adapter tensor with the same
block of the trainer's (`lora_sync.verify_adapter` over the engine's ``lora_rank_pieces``): an
engine rank holding its piece wrong is named, replicas included (lora_A of a column-parallel
module is on every rank; the full tensor read back shows one copy only, so only the per-rank
comparison can see the other rank's).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.lora_sync import verify_adapter
from fsdp_sync.models import build_model, load_config

pytestmark = pytest.mark.timeout(120)

A = "model.layers.0.self_attn.q_proj.lora_A.weight"     # replicated on both TP ranks
B = "model.layers.0.self_attn.q_proj.lora_B.weight"     # rows split: rank 1 holds the second half


def _adapter(model, r=4):
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "v_proj.weight")):
            base = f"base_model.model.{name[:-len('.weight')]}"
            out[f"{base}.lora_A.weight"] = torch.randn(r, p.shape[1], generator=g) * 0.1
            out[f"{base}.lora_B.weight"] = torch.randn(p.shape[0], r, generator=g) * 0.1
    return out, {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                 "bias": "none"}


class _OneRankWrong:
    """The engine, with TP rank 1's copy of ``A`` off by 1e-3 where it reports it
    (what a worker that loaded its replica wrong would hold); the full tensor reads rank 0's."""

    def __init__(self, engine):
        self.engine = engine

    def lora_tensors(self, name):
        return self.engine.lora_tensors(name)

    def lora_rank_pieces(self, name):
        pieces = self.engine.lora_rank_pieces(name)
        pieces[1][A] = [(src, t.clone().add_(1e-3)) for src, t in pieces[1][A]]
        return pieces


@pytest.fixture(scope="module")
def loaded():
    cfg = load_config("tiny")
    model = build_model(cfg, seed=0)
    tensors, config = _adapter(model)
    with ReferenceEngine(model_config=cfg, tp_size=2, max_lora_rank=8, dtype=torch.float32) as eng:
        eng.update_weights_from_tensor(list(model.state_dict().items()))
        eng.load_lora_adapter_from_tensors("a", tensors, config)
        yield eng, tensors


def test_the_engine_as_sent_passes(loaded):
    eng, tensors = loaded
    assert verify_adapter(eng, "a", tensors) is None
    assert verify_adapter(_OneRankWrong(eng), "a", tensors) is not None


def test_a_replica_wrong_on_one_rank_is_named_with_its_rank(loaded):
    eng, tensors = loaded
    err = verify_adapter(_OneRankWrong(eng), "a", tensors)
    assert err is not None and f"tensor {A!r} on TP rank 1 differs from the trainer's" in err, err


def test_a_piece_of_one_rank_that_differs_names_that_rank(loaded):
    eng, tensors = loaded
    changed = dict(tensors)
    b = tensors[f"base_model.model.{B}"].clone()
    b[-1, 0] += 0.5                                    # a row only TP rank 1 holds
    changed[f"base_model.model.{B}"] = b
    err = verify_adapter(eng, "a", changed)
    assert err is not None and f"tensor {B!r} on TP rank 1 differs" in err and "0.5" in err, err
