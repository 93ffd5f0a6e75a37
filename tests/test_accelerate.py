"""accelerate-prepared FSDP1 and FSDP2 models (mixed precision, activation checkpointing, tied
embeddings) on 2 CPU ranks, and HSDP on 4: export and a full sync into a TP-2 ReferenceEngine are bit-exact
against torch's ``get_model_state_dict(full_state_dict=True, cpu_offload=False)``; the modules a
user may hand over by mistake (``unwrap_model`` of FSDP1, an inner unit) are refused with an error
that says what to pass. accelerate is made to shard on CPU by the test-only `accelerate_cpu`."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="the `accelerate` extra (pip install -e '.[accelerate]')")

import _accel_ranks  # noqa: E402
from fsdp_sync.cli.launch import run_ranks, spawn_env  # noqa: E402

CASES = [
    {"name": "fsdp2", "version": 2, "mp": "bf16", "ac": True},
    {"name": "fsdp1", "version": 1, "mp": "bf16", "ac": True},
    # use_orig_params=False: the inner module holds the root's FlatParameter itself
    {"name": "fsdp1-flat", "version": 1, "orig": False, "refusals_only": True},
]


@pytest.fixture(scope="module")
def results():
    return run_ranks(_accel_ranks.accelerate_ranks, 2, CASES, env=spawn_env(), timeout_s=200)


@pytest.mark.timeout(240)
def test_accelerate_hsdp_export_bit_exact():
    """HSDP (dp_replicate 2 x dp_shard 2: accelerate drops a size-1 dim, so 4 ranks): export of the
    2-D-mesh DTensors, per tensor and bucketed, against torch's full state dict."""
    case = {"name": "hsdp", "version": 2, "hsdp": True, "export_only": True}
    for rank, res in enumerate(run_ranks(_accel_ranks.accelerate_ranks, 4, [case], env=spawn_env(),
                                         timeout_s=200)):
        r = res["hsdp"]
        assert r["problems"] == [], f"rank {rank}: {r['problems']}"
        assert r["placements"] == "(Replicate(), Shard(dim=0))", r["placements"]
        assert r["loss_after"] < r["loss"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_accelerate_bit_exact_or_refused(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert r["problems"] == [], f"rank {rank}: {r['problems']}"
        if case == "fsdp2":
            # really what accelerate builds on GPU: FSDP2, sharded, bf16 compute, checkpointing
            assert r["kind"] == "FSDPQwen2ForCausalLM" and r["unwrap_is_model"]
            assert r["placements"] == "(Shard(dim=0),)"
            assert r["param_dtype"] == "torch.bfloat16" and r["checkpoint_wrapped"]
        else:
            assert r["kind"] == "FullyShardedDataParallel" and r["units"] == 3   # root + 2 layers
            assert "accelerator.prepare" in r["unwrap_error"] and "FullyShardedDataParallel" in r["unwrap_error"]
        if case == "fsdp1":
            assert r["param_dtype"] == "torch.bfloat16" and r["checkpoint_wrapped"]
        if case != "fsdp1-flat":
            assert r["loss_after"] < r["loss"], "training did not go on after the sync"
