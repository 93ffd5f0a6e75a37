"""`fsdp-sync plan` refuses what the planned engine refuses when the sync runs, in the words of the
code that refuses it (`plan_checks.engine_refusal`): before, it priced syncs that cannot run (12
rows of docs/plan.md's SGLang sweep were per-rank distributed and disk syncs)."""

from __future__ import annotations

import json

import pytest

from fsdp_sync.cli import app as cli
from fsdp_sync.plan import Cluster, PlanError, PlanJob, plan_row

CPU = Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)


@pytest.mark.parametrize("method, words", [
    ("distributed", ["accepts_distributed_rank_buckets is false", "--layout full"]),
    ("disk", ["accepts_rank_checkpoints", "update_weights_from_disk", "--layout full"])])
def test_sglang_takes_no_per_rank_distributed_buckets_or_disk_files(method, words):
    """SGLang's update_weights_from_distributed broadcasts full tensors and its disk update loads
    no per-rank files: the transports refuse layout='engine' for it (distributed.py, disk_ranked.py);
    the plan now does too. The reference engine takes both; SGLang takes the full layout."""
    from fsdp_sync.transport.disk_ranked import NO_RANK_CHECKPOINTS

    job = dict(model="tiny", method=method, layout="engine", ranks=2, tp=2, bucket_bytes=2**20)
    with pytest.raises(PlanError) as info:
        plan_row(PlanJob(**job, engine="sglang"), CPU)
    msg = str(info.value)
    assert msg.startswith(f"{method} (engine) tiny into --engine sglang: "), msg
    for w in words:
        assert w in msg, (w, msg)
    assert (NO_RANK_CHECKPOINTS in msg) == (method == "disk")
    assert info.value.suggested_bucket_bytes is None       # no bucket size makes it run
    assert plan_row(PlanJob(**job, engine="reference"), CPU)["layout"] == "engine"
    assert plan_row(PlanJob(**{**job, "layout": "full"}, engine="sglang"), CPU)["layout"] == "full"
    assert plan_row(PlanJob(**{**job, "method": "tensor"}, engine="sglang"), CPU)["layout"] == "engine"


def test_a_sweep_shows_the_refused_rows_and_exits_1_when_all_are(tmp_path, capsys):
    out = tmp_path / "plan.json"
    base = ["plan", "--models", "tiny-qwen3-moe", "--methods", "distributed,disk", "--ranks", "2", "--tp", "2",
            "--bucket-mb", "1", "--engine", "sglang", "--cluster", "h100-node", "--json", str(out)]
    assert cli.main(base + ["--layout", "engine"]) == 1
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["distributed", "disk"] and all(r["refused"] for r in rows), rows
    assert "accepts_distributed_rank_buckets" in text and "per-rank files" in text
    assert cli.main(base + ["--layout", "full,engine"]) == 0     # the full layout plans
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layout"], bool(r.get("refused"))) for r in rows] == [
        ("full", False), ("engine", True), ("full", False), ("engine", True)]


def test_sglang_refuses_a_tied_moe_model_whatever_the_method():
    """SGLang's Qwen3-MoE (and Qwen2-MoE, Mixtral) class builds an lm_head of its own and ignores
    tie_word_embeddings, so the sync refuses a tied one (`served_config.model_refusal`); the plan
    priced it. The reference engine serves it; an untied one plans into SGLang."""
    from fsdp_sync.engines.sglang.served_config import model_refusal
    from fsdp_sync.models import load_config

    tied = load_config("tiny-qwen3-moe", tie_word_embeddings=True)
    for method, layout in (("tensor", "full"), ("tensor", "engine"), ("distributed", "full"), ("disk", "full")):
        job = dict(model=tied, method=method, layout=layout, ranks=2, tp=2, bucket_bytes=2**20)
        with pytest.raises(PlanError) as info:
            plan_row(PlanJob(**job, engine="sglang"), CPU)
        assert str(info.value).endswith(model_refusal(tied)) and "tie_word_embeddings=True" in str(info.value)
        assert plan_row(PlanJob(**job, engine="reference"), CPU)["bytes"] > 0
    assert plan_row(PlanJob(load_config("tiny-qwen3-moe"), ranks=2, tp=2, engine="sglang"), CPU)["bytes"] > 0


def test_the_reference_engine_refuses_a_model_its_forward_cannot_compute():
    """The reference engine's forward knows silu, the default rope and full attention
    (`tp_model.check_runnable`): the engine and the bench refuse Llama 3's rope scaling; the plan
    priced it. SGLang computes it: it plans there."""
    from transformers import LlamaConfig

    llama3 = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    job = dict(model=llama3, method="tensor", layout="full", ranks=2, tp=2, bucket_bytes=2**20)
    with pytest.raises(PlanError, match="the reference engine cannot compute this llama model .* rope_type 'llama3'"):
        plan_row(PlanJob(**job, engine="reference"), CPU)
    assert plan_row(PlanJob(**job, engine="sglang"), CPU)["bytes"] > 0


def test_sglang_refuses_block_fp8_of_a_llama_model_through_its_own_loader():
    """SGLang's LlamaForCausalLM renames every weight_scale_inv in load_weights, so block FP8 of a
    Llama model loses its scales through SGLang's own loader (the disk and distributed methods, the
    tensor method's full tensors): the manager refuses the sync (`refusals.scales_dropped`); the
    plan priced it. Per-rank tensor buckets (fsdp_sync's loader), bf16, a Qwen2 model and the
    reference engine plan."""
    from fsdp_sync.engines.sglang.refusals import scales_dropped
    from fsdp_sync.models import load_config

    llama = load_config("tiny-fp8", model_type="llama")
    for method, layout in (("tensor", "full"), ("distributed", "full"), ("disk", "full")):
        job = dict(model=llama, method=method, layout=layout, ranks=2, tp=2, bucket_bytes=2**20,
                   dtype="bfloat16", quantization="fp8")
        with pytest.raises(PlanError) as info:
            plan_row(PlanJob(**job, engine="sglang"), CPU)
        assert str(info.value).endswith(scales_dropped("fp8", "llama", own_loader=True)), str(info.value)
        assert plan_row(PlanJob(**job, engine="reference"), CPU)["bytes"] > 0
        assert plan_row(PlanJob(**{**job, "quantization": None}, engine="sglang"), CPU)["bytes"] > 0
    job = dict(model=llama, ranks=2, tp=2, bucket_bytes=2**20, dtype="bfloat16", quantization="fp8")
    assert plan_row(PlanJob(**job, method="tensor", layout="engine", engine="sglang"), CPU)["bytes"] > 0
    assert plan_row(PlanJob(load_config("tiny-fp8"), method="disk", layout="full", ranks=2, tp=2,
                            bucket_bytes=2**20, dtype="bfloat16", quantization="fp8", engine="sglang"),
                    CPU)["bytes"] > 0
