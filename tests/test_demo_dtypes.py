"""The demo in a 16-bit rollout dtype compares like with like and passes (issue 9 item 5): the
engine against the trainer's weights cast to that dtype, at a tolerance of a few units of the
dtype's rounding, tokens teacher-forced."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.demo import ATOL_EPS, DemoOptions, run_demo


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dtype, steps", [("bfloat16", 2), ("float16", 1)])
def test_demo_in_a_16_bit_rollout_dtype_passes(dtype, steps):
    result = run_demo(DemoOptions(dtype=dtype, steps=steps, progress=False, max_new_tokens=8),
                      timeout_s=220)
    assert len(result["steps"]) == steps
    eps = torch.finfo(getattr(torch, dtype)).eps
    for s in result["steps"]:
        assert s["atol"] >= ATOL_EPS * eps and s["atol"] <= ATOL_EPS * eps * 64, s["atol"]
        assert s["max_abs_logit_diff"] <= s["atol"], s
        assert s["tokens_match"] and s["changed_since_last_step"], s
    assert result["ok"]
