"""verl's FP8 rollout leaves the ignored layers unquantized, and so does fsdp_sync's adapter
(verl3 audit, item 1; `make test-verl`).

verl starts SGLang with ``ignored_layers`` = ``SGLANG_FP8_IGNORED_LAYERS`` + the model's
``quantization_config.ignored_layers`` / ``modules_to_not_convert`` (``build_sglang_fp8_quant_config``)
and its quantizer (``SGLangFP8QuantizerHelper``) skips them. The adapter quantized them anyway:
FP8 weights and ``weight_scale_inv`` into SGLang's bf16 layers. Now its quantizer sends exactly
verl's set of FP8 tensors, and a list that SGLang and verl's quantizer read differently (``re:``,
another case, one expert) is refused, saying what to write instead.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

ENV = "SGLANG_FP8_IGNORED_LAYERS"


def _rollout(name: str = "sglang", **fs) -> dict:
    return {"name": name, "dtype": "bfloat16", "free_cache_engine": True, "quantization": "fp8",
            "tensor_model_parallel_size": 1,
            "checkpoint_engine": {"update_weights_bucket_megabytes": 1},
            "custom": {"fsdp_sync": dict(enable=True, base_url="http://127.0.0.1:1", **fs)}}


def _adapter(hf, name: str = "sglang"):
    import verl  # noqa: F401  (the plug-in)
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.base import get_rollout_class

    config = omega_conf_to_dataclass(OmegaConf.create(_rollout(name)), RolloutConfig)
    return get_rollout_class(config.name, config.mode)(
        config=config, model_config=types.SimpleNamespace(hf_config=hf), device_mesh=None)


def _hf(model_type: str, qc=None):
    from fsdp_sync.models import load_config

    hf = load_config("tiny-fp8", model_type=model_type)
    if qc is not None:
        hf.quantization_config = qc
    return hf


CASES = {
    "env: a layer's MLP": ("qwen2", "model.layers.0.mlp", None),
    "config: self_attn, and o_proj without 'model.'": (
        "qwen2", "", {"ignored_layers": ["model.layers.1.self_attn"],
                      "modules_to_not_convert": ["layers.0.self_attn.o_proj"]}),
    "env and config: one projection, a whole layer": (
        "qwen2", " model.layers.0.mlp.down_proj ,", {"ignored_layers": ["model.layers.1"]}),
    "moe: a layer's experts and an attention": (
        "qwen3_moe", "model.layers.1.mlp.experts", {"modules_to_not_convert": ["layers.0.self_attn"]}),
    "nothing ignored": ("qwen3_moe", "", None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_adapter_quantizes_exactly_the_tensors_verls_quantizer_does(case, monkeypatch):
    from verl.utils.fp8_utils import FP8QuantizerHelper
    from verl.utils.sglang.sglang_fp8_utils import SGLangFP8QuantizerHelper, build_sglang_fp8_quant_config

    from fsdp_sync.weights.layout import layout_for

    model_type, env, qc = CASES[case]
    monkeypatch.setenv(ENV, env)
    hf = _hf(model_type, qc)
    helper = SGLangFP8QuantizerHelper(build_sglang_fp8_quant_config(hf))   # verl's, as it syncs
    names = layout_for(hf, 1).hf_names()
    verls = {n for n in names if helper.should_quantize_param(n)}
    ours = _adapter(hf)._quantizer(types.SimpleNamespace(tp_size=1)).hf
    assert ours == verls, (sorted(ours - verls)[:4], sorted(verls - ours)[:4])
    everything = [n for n in names if FP8QuantizerHelper({}).should_quantize_param(n)]
    assert (len(ours) < len(everything)) == bool(env or qc), (len(ours), len(everything))


@pytest.mark.parametrize("entry, why", [
    ("re:model\\.layers\\.0\\..*", "regular"),
    ("Model.Layers.0.mlp", "otherwise"),                      # verl lowercases, SGLang does not
    ("model.layers.1.mlp.experts.3", "otherwise"),            # SGLang: every expert of the layer
])
def test_a_list_sglang_and_verl_read_differently_is_refused_saying_what_to_write(entry, why, monkeypatch):
    monkeypatch.setenv(ENV, entry)
    with pytest.raises(ValueError, match=why) as err:
        adapter = _adapter(_hf("qwen3_moe"))
        adapter._quantizer(types.SimpleNamespace(tp_size=1))
    assert "SGLANG_FP8_IGNORED_LAYERS" in str(err.value) and "module paths" in str(err.value), err.value
    assert "'model.layers.0.mlp'" in str(err.value), err.value


def test_the_reference_rollout_refuses_sglangs_variable_and_reads_config_json(monkeypatch):
    from fsdp_sync.integrations.verl import fp8_ignored

    monkeypatch.setenv(ENV, "model.layers.0.mlp")
    with pytest.raises(ValueError, match="fsdp-sync serve does not read it"):
        fp8_ignored.ignored_layers("fsdp_sync_ref", _hf("qwen2"))
    monkeypatch.delenv(ENV)
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
          "ignored_layers": ["model.layers.0.mlp"]}
    assert fp8_ignored.ignored_layers("fsdp_sync_ref", _hf("qwen2", qc)) == ("model.layers.0.mlp",)


def test_an_ignored_mlp_reaches_sglang_in_bf16_with_no_scale():
    """The repro of the audit: SGLANG_FP8_IGNORED_LAYERS=model.layers.0.mlp, one sync through the
    SGLang stand-in: layer 0's MLP arrives bfloat16 without a weight_scale_inv, the rest FP8."""
    import fake_sglang
    import verl_ranks

    from fsdp_sync.cli.launch import run_ranks

    with fake_sglang.FakeSGLangServer(tp_size=1) as server:
        cfg = dict(_rollout(), _target_="verl.workers.config.RolloutConfig")
        cfg["custom"]["fsdp_sync"]["base_url"] = server.url
        # env=: a forkserver started before this test forks ranks with its own environment
        stats = run_ranks(verl_ranks.sync_fp8_tiny, 1, cfg, "qwen2", None, timeout_s=100,
                          env={ENV: "model.layers.0.mlp"})[0]
        got = dict(server.engine.weights)
    assert stats["quantized_tensors"] == 11, stats          # 14 linears, 3 in layer 0's MLP
    for p in ("gate_proj", "up_proj", "down_proj"):
        assert got[f"model.layers.0.mlp.{p}.weight"].dtype == torch.bfloat16
        assert f"model.layers.0.mlp.{p}.weight_scale_inv" not in got
        assert got[f"model.layers.1.mlp.{p}.weight"].dtype == torch.float8_e4m3fn
        assert got[f"model.layers.1.mlp.{p}.weight_scale_inv"].dtype == torch.float32
    assert got["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
