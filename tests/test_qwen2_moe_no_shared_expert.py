"""Qwen2-MoE with ``shared_expert_intermediate_size: 0`` is refused where its layout is first needed.

transformers' ``Qwen2MoeSparseMoeBlock`` builds a zero-width ``shared_expert`` and a live
``shared_expert_gate`` ([1, hidden_size]) in every MoE layer whatever the size; SGLang's Qwen2-MoE
builds none and skips those names. fsdp_sync's layout had no such parameters: the sync failed late,
at the engine, with "unknown parameter 'model.layers.0.mlp.shared_expert.gate_proj.weight'" (found
by audit H22). Now the layout (the reference engine, the engine layout, verify, plan) refuses the
config up front, naming the key and its value. No real checkpoint has one."""

from __future__ import annotations

import pytest

from fsdp_sync.models import load_config
from fsdp_sync.weights.layout import layout_for


def test_a_qwen2_moe_without_a_shared_expert_is_refused_naming_the_key():
    cfg = load_config("tiny-qwen2-moe", shared_expert_intermediate_size=0)
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size 0 is not supported.*"
                                         r"shared_expert_intermediate_size > 0"):
        layout_for(cfg, 1)
    shared = load_config("tiny-qwen2-moe")      # the recipe's shared expert: laid out as before
    names = layout_for(shared, 1).engine_shapes()
    assert any("shared_expert_gate" in n for n in names)
