"""Cases the fp8 / fp8_config / quantize / verify tests left open, found by a mutation pass (H6 audit):
each test here fails with the mutant named in its docstring and passes on the code as it is."""

from __future__ import annotations

import pytest
import torch


def _layout(recipe="tiny-fp8", tp=1, **kw):
    from fsdp_sync.models import load_config
    from fsdp_sync.weights.layout import layout_for

    return layout_for(load_config(recipe, **kw), tp)


def test_an_ignored_entry_matches_whole_dotted_parts_only():
    """SGLang's ``_module_path_match``: ``model.layers.1`` is layer 1, not layer 10 too, and
    ``mlp.gate`` (a MoE router's name in some configs) is not ``mlp.gate_proj``. Mutant: a plain
    substring match (``ignored in module``)."""
    from fsdp_sync.weights import fp8

    layout = _layout(num_hidden_layers=11)
    everything = set(fp8.quantized_names(layout))
    kept = set(fp8.quantized_names(layout, ["model.layers.1"]))
    assert sorted(everything - kept) == sorted(n for n in everything if n.startswith("model.layers.1.")), \
        sorted(everything - kept)
    assert any(n.startswith("model.layers.10.") for n in kept)
    assert set(fp8.quantized_names(layout, ["mlp.gate"])) == everything
    assert set(fp8.quantized_names(layout, ["layers.1.mlp"])) == everything - {
        "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"}


def test_a_static_activation_scheme_is_refused_by_the_sync_and_the_plan():
    """Block FP8 quantizes activations dynamically; SGLang refuses a static scheme with a block
    size, so does the reference engine (`quant.resolve`), and the sync must say so before it
    quantizes anything (`fp8_config.config_refusal`, `fp8_config.ignored_layers`). Mutant: the
    activation_scheme check dropped."""
    from fsdp_sync.models import load_config
    from fsdp_sync.weights import fp8_config
    from fsdp_sync.weights.layout import layout_for

    qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}
    cfg = load_config("tiny-fp8", quantization_config=qc)
    why = fp8_config.config_refusal(cfg, "fp8")
    assert why and "activation_scheme 'static'" in why and "dynamically" in why, why
    with pytest.raises(ValueError, match="activation_scheme 'static'"):
        fp8_config.held_layout(cfg, layout_for(cfg, 1), "fp8")
    assert fp8_config.config_refusal(load_config("tiny-fp8", quantization_config={**qc, "activation_scheme": "dynamic"}),
                                     "fp8") is None
    assert fp8_config.config_refusal(load_config("tiny-fp8", quantization_config={k: v for k, v in qc.items()
                                                                                  if k != "activation_scheme"}), "fp8") is None
