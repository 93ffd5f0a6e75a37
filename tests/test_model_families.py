"""What a model config asks of the engines beyond its tensors' shapes, single-process.

- Rope scaling (Llama 3's ``rope_type: llama3``, YaRN), another activation or sliding-window layers
  change no tensor's place: the layout map takes them (SGLang's per-rank buckets, its verify and
  ``fsdp-sync plan`` work for a Llama-3.x model) with the sharding of the same model without them,
  while the reference engine, whose forward computes none of them, refuses them by name before a
  worker starts (the engine, ``serve``'s and ``demo``'s checks).
"""

from __future__ import annotations

import json
import types

import pytest

pytestmark = pytest.mark.timeout(120)

LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "tie_word_embeddings": False, "hidden_act": "silu",
          "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 256, "rope_type": "llama3"}}


def _llama(tmp_path, name="llama3", **changes):
    d = {**LLAMA3, **changes}
    (tmp_path / name).mkdir()
    path = tmp_path / name / "config.json"
    path.write_text(json.dumps({k: v for k, v in d.items() if v is not None}))
    return path


def _sharding(layout):
    return (layout.hf_shapes, layout.engine_shapes(),
            [[layout.placements(n, r) for n in layout.hf_names()] for r in range(layout.tp)])


def test_rope_scaling_keeps_the_layout_and_the_reference_engine_refuses_it(tmp_path):
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import load_config
    from fsdp_sync.weights.layout import layout_for

    cfg = load_config(str(_llama(tmp_path)))
    plain = load_config(str(_llama(tmp_path, "plain", rope_scaling=None)))
    for tp in (1, 2, 4):
        got = layout_for(cfg, tp)
        assert "rope_type 'llama3'" in got.spec.unsupported
        assert _sharding(got) == _sharding(layout_for(plain, tp)), tp
    yarn = load_config("tiny-qwen3-moe", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 256})
    assert "rope_type 'yarn'" in layout_for(yarn, 2).spec.unsupported
    with pytest.raises(ValueError, match=r"reference engine cannot compute this llama model .*"
                                         r"expected the default rope, got rope_type 'llama3'"):
        ReferenceEngine(model_config=cfg, tp_size=2, kv_cache_tokens=64)
    for what, c in (("hidden_act 'silu', got 'gelu'", load_config("tiny", hidden_act="gelu")),
                    ("mixtral sliding_window 4096", load_config("tiny-mixtral", sliding_window=4096))):
        assert what in layout_for(c, 1).spec.unsupported
        with pytest.raises(ValueError, match=what):
            ReferenceEngine(model_config=c, tp_size=1, kv_cache_tokens=64)


def test_plan_and_sglang_verify_take_a_llama3_model_demo_refuses_it(tmp_path, capsys):
    from fsdp_sync import cli, verify
    from fsdp_sync.cli.demo_check import check_model
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.models import build_model, load_config

    path = _llama(tmp_path)
    rc = cli.main(["plan", "--config-json", str(path), "--tp", "2", "--ranks", "2", "--layout", "engine",
                   "--engine", "sglang"])
    out = capsys.readouterr()
    assert rc == 0 and "refused" not in out.out and "rope" not in out.err, out
    # SGLang's checksum check knows which bytes each of its TP ranks holds
    module = build_model(load_config(str(path)), seed=0)
    answer = {"ranks": [{"checksums": {}, "parallelism_info": {"tp_rank": r, "tp_size": 2}} for r in range(2)]}
    checker = verify._sglang_checker(module, SyncConfig(), types.SimpleNamespace(tp_size=2),
                                     {"answer": answer, "algorithm": "cpu"}, ["model.norm.weight"])
    assert checker.hf_names() == {"model.norm.weight"}
    with pytest.raises(ValueError, match=r"argument --model: .*rope_type 'llama3'"):
        check_model(str(path), 2, 1, None)
