"""`fsdp-sync plan --lora-r`: a LoRA adapter's syncs planned beside each base sync, byte for byte
what the sync itself sends (checked against the bench's LoRA job, which runs real syncs, and
against the adapter modules of a real model)."""

from __future__ import annotations

import json

import pytest
import torch

from _util import cli_here


def _sweep(**kw) -> dict:
    from fsdp_sync.cli.plan_recipe import DEFAULTS

    sweep = dict(DEFAULTS, models=("tiny",), cluster="h100-node")
    sweep.update(kw)
    return sweep


@pytest.mark.timeout(180)
def test_the_adapter_plan_equals_what_the_bench_job_sent():
    """One job of the bench (2 FSDP2 ranks, a TP-2 reference engine, r 4 on all 7 linear layers,
    real syncs): the first sync's bytes, the adapter's bytes, tensors, engine calls and kept buffer
    equal the plan's fields for the same job."""
    from fsdp_sync.cli.bench.lora import run_lora_bench
    from fsdp_sync.cli.plan import plan_rows
    from fsdp_sync.plan import load_cluster

    bench = run_lora_bench("tiny", 2, 2, r=4, alpha=8.0, repeats=1, bucket_mb=1.0, timeout_s=150)
    assert bench["ok"], bench
    full, adapter = bench["rows"]
    (row,) = plan_rows(_sweep(ranks=(2,), tp=(2,), bucket_mb=(1.0,), lora_r=4), load_cluster("h100-node"))
    assert row["first_sync_bytes"] == full["bytes"] and row["bytes"] + row["adapter_bytes"] == full["bytes"]
    assert row["adapter_bytes"] == adapter["bytes"] == adapter["adapter_bytes"] == 32768
    assert row["adapter_tensors"] == adapter["adapter_tensors"] == 28
    assert row["adapter_engine_calls"] == adapter["adapter_engine_calls"] == 1
    assert row["adapter_buffer_bytes"] == adapter["adapter_buffer_bytes"] > 0
    assert row["adapter_bytes_ratio"] == pytest.approx(adapter["bytes_ratio"], rel=1e-12)


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("down_proj",),
                                     ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")])
@pytest.mark.parametrize("model, dtype", [("tiny", "float32"), ("tiny-qwen3", "bfloat16")])
def test_adapter_bytes_are_the_lora_modules_of_a_real_model(model, dtype, targets):
    """The plan's adapter against `add_lora`'s modules on the real model, in the rollout dtype:
    names and shapes of every lora_A / lora_B, their bytes, and the engines the sync calls
    (the tensor method: one per TP group)."""
    from fsdp_sync.cli.lora_model import add_lora
    from fsdp_sync.cli.plan import plan_rows
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.plan import load_cluster
    from fsdp_sync.plan import meta_model
    from fsdp_sync.plan_lora import adapter_metas

    real = add_lora(build_model(load_config(model), seed=0), r=8, alpha=16, targets=targets)
    # peft's saved names: its state-dict names without the adapter's own level
    want = {n.replace(".default.", "."): tuple(p.shape) for n, p in real.named_parameters() if "lora_" in n}
    size = getattr(torch, dtype).itemsize
    metas = adapter_metas(meta_model(model)[1], 8, targets, getattr(torch, dtype))
    assert {m.name: tuple(m.shape) for m in metas} == want and len(want) == 2 * 2 * len(targets)
    (row,) = plan_rows(_sweep(models=(model,), ranks=(4,), tp=(2,), dtype=dtype, lora_r=8,
                              lora_targets=targets), load_cluster("h100-node"))
    assert row["adapter_bytes"] == sum(torch.Size(s).numel() for s in want.values()) * size
    assert row["adapter_tensors"] == len(want) and row["adapter_engine_calls"] == 2
    assert row["first_sync_bytes"] == row["bytes"] + row["adapter_bytes"]


def _plan(capsys, *argv: str):
    return cli_here(capsys, "plan", "--models", "tiny", "--ranks", "2", "--tp", "2", "--cluster", "h100-node",
                    *argv)


@pytest.mark.timeout(240)
def test_the_cli_plans_the_adapter_and_refuses_targets_by_name(tmp_path, capsys):
    """The command of docs/plan.md as written, then its figures from --json; the refusals."""
    proc = _plan(capsys, "--lora-r", "16", "--lora-targets", "q_proj,v_proj")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "adapter sync" in proc.stdout and "28.0 KiB" in proc.stdout, proc.stdout
    out = tmp_path / "plan.json"
    assert _plan(capsys, "--lora-r", "16", "--lora-targets", "q_proj,v_proj", "--json", str(out)).returncode == 0
    (row,) = json.loads(out.read_text())["rows"]
    # tiny: 2 layers, hidden 64, 4 heads of 16, 2 KV heads: q 64 -> 64, v 64 -> 32; r 16, float32
    assert row["adapter_bytes"] == 2 * (16 * (64 + 64) + 16 * (64 + 32)) * 4, row
    assert row["lora_targets"] == ["q_proj", "v_proj"] and row["adapter_tensors"] == 8
    bad = _plan(capsys, "--lora-r", "4", "--lora-targets", "q_proj,qkv_proj")
    assert bad.returncode == 2 and "LoRA targets ['qkv_proj'] name no linear layer" in bad.stderr, bad.stderr
    assert "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj" in bad.stderr, bad.stderr
    alone = _plan(capsys, "--lora-targets", "q_proj")
    assert alone.returncode == 2 and "add --lora-r to plan an adapter" in alone.stderr, alone.stderr
    recipe = tmp_path / "lora.yaml"
    recipe.write_text("plan:\n  models: [tiny]\n  cluster: h100-node\n  lora_r: 4\n  lora_targets: [q_proj, v_proj]\n")
    via = cli_here(capsys, "plan", "--recipe", str(recipe), "--json", str(out))
    assert via.returncode == 0, via.stdout + via.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["lora_r"] == 4 and row["lora_targets"] == ["q_proj", "v_proj"] and row["adapter_tensors"] == 8
