"""Parameters SGLang keeps in float32 whatever ``--dtype`` says (``e_score_correction_bias`` of
DeepSeek-V2/V3, GLM-MoE, Kimi; ``A_log`` of Qwen3-Next: `weights.float32_params`) reach SGLang in
float32 from fsdp_sync's verl adapter, bit for bit, as verl's own adapter sends them; the rest is
cast to ``rollout.dtype`` as before (verl3 audit, item 2; `make test-verl`). Before, every floating
tensor was cast to bfloat16: 8 distinct correction-bias values arrived as 2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


@pytest.mark.parametrize("strategy", ["flattened", "bucketed"])
def test_sglangs_float32_parameters_are_sent_in_float32_bit_for_bit(strategy):
    import fake_sglang
    import verl_ranks

    from fsdp_sync.cli.launch import run_ranks

    gen = torch.Generator().manual_seed(0)
    bias = 30.0 + torch.rand(8, generator=gen) * 0.2      # GLM's: a spread of a few bf16 steps
    named = [("model.layers.3.mlp.gate.weight", torch.randn(8, 16, generator=gen)),
             ("model.layers.3.mlp.gate.e_score_correction_bias", bias),
             ("model.layers.0.linear_attn.A_log", torch.randn(4, generator=gen)),
             ("model.layers.0.linear_attn.dt_bias", torch.randn(4, generator=gen))]
    cfg = {"_target_": "verl.workers.config.RolloutConfig", "name": "sglang", "dtype": "bfloat16",
           "free_cache_engine": True, "tensor_model_parallel_size": 1,
           "checkpoint_engine": {"update_weights_bucket_megabytes": 1},
           "custom": {"fsdp_sync": {"enable": True, "strategy": strategy}}}
    with fake_sglang.FakeSGLangServer(tp_size=1) as server:
        cfg["custom"]["fsdp_sync"]["base_url"] = server.url
        run_ranks(verl_ranks.sync_named, 1, cfg, named, timeout_s=100)
        got = dict(server.engine.weights)
    for name, t in named:
        if name.endswith(("e_score_correction_bias", "A_log")):
            assert got[name].dtype == torch.float32 and torch.equal(got[name], t), name
        else:
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t.to(torch.bfloat16)), name
    assert got["model.layers.3.mlp.gate.e_score_correction_bias"].unique().numel() == 8
