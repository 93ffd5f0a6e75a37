"""Qwen2-MoE's ``decoder_sparse_step``: layer i holds experts where ``(i + 1) % step == 0`` (and i
is not in ``mlp_only_layers``), as transformers' ``Qwen2MoeDecoderLayer`` and SGLang build it: at
step 2 of 4 layers, layers 1 and 3. The layout map has the model's own layers, the trainer's
export is its names and shapes, and a sync into the reference engine at TP 2 loads every tensor
bit for bit and computes transformers' logits.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights import export
from fsdp_sync.weights.layout import ModelSpec, layout_for

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7]]


def _moe_layers(model) -> tuple[int, ...]:
    return tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("step,dense,want", [(2, [], (1, 3)), (2, [3], (1,)), (4, [], (3,))])
def test_sparse_step_places_experts_where_transformers_does(step, dense, want):
    cfg = load_config("tiny-qwen2-moe", num_hidden_layers=4, decoder_sparse_step=step, mlp_only_layers=dense)
    model = build_model(cfg, seed=3)
    assert _moe_layers(model) == want
    assert ModelSpec.from_config(cfg).moe_layers == want
    lay = layout_for(cfg, 2)
    named = dict(export.iter_params(model))
    assert set(named) == set(lay.hf_names())
    assert all(tuple(named[n].shape) == s for n, s in lay.hf_shapes.items())


@pytest.mark.timeout(120)
def test_sparse_step_2_syncs_bit_exact_into_the_engine_with_transformers_logits():
    from fsdp_sync.engines import ReferenceEngine

    cfg = load_config("tiny-qwen2-moe", num_hidden_layers=4, decoder_sparse_step=2)
    model = build_model(cfg, seed=7).eval()
    named = dict(export.iter_params(model))
    with ReferenceEngine(cfg, tp_size=2, kv_cache_tokens=256) as eng:
        eng.update_weights_from_tensor(list(named.items()))
        for n, t in named.items():
            assert torch.equal(eng.get_weights_by_name(n), t), n
        with torch.no_grad():
            for p, got in zip(PROMPTS, eng.forward_logits(PROMPTS, all_positions=True)):
                assert (got - model(input_ids=torch.tensor([p])).logits[0].float()).abs().max() < 1e-5
