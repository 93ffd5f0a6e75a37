"""A sync verified against SGLang (per-rank hashes of fused engine parameters) widens its chosen
tensors to whole engine parameters (`verify._whole_engine_params`) from the split-independent map
(`layout.names_layout`). It asked `layout_for(config, 1)`, whose one kept entry is the run's TP
layout: every such verified sync evicted it, and the next sync built its TP layout (and reverse
maps) again (H81's find; 0.44 s a sync for qwen3-235b-a22b at TP 8 on this host)."""

from __future__ import annotations

from fsdp_sync import verify
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights.layout import layout_for


def test_widening_to_whole_engine_parameters_leaves_the_runs_tp_layout_in_place():
    cfg = load_config("tiny")
    module = build_model(cfg)
    tp2 = layout_for(cfg, 2)
    chosen = ["model.layers.0.self_attn.q_proj.weight"]
    got = verify._whole_engine_params(module, chosen, True)
    # q with k and v (one fused qkv_proj in the engine), nothing else
    assert sorted(got) == sorted(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"), got
    assert layout_for(cfg, 2) is tp2
