"""`fsdp-sync bench --preset targets`: what the targets judge, and on which rows. Pure: the rows
are written here (no sync runs), so each case shows the rule it checks."""

from __future__ import annotations

import json

import pytest

from fsdp_sync.cli.bench.methods import engine_memory_budget, flag_over_budget, memory_budget
from fsdp_sync.cli.bench.targets import check_targets

from _util import cli_here

MiB = 2**20


def _tensor_row(**kw) -> dict:
    """A tensor-method row with the fields the table and the targets read."""
    row = {"method": "tensor", "strategy": "flattened", "model": "tiny", "params": 139840, "tensors": 27,
           "bytes": 559360, "bucket_bytes": MiB, "ranks": 1, "tp": 1, "multi_stage": True,
           "share_host_memory": False, "pipelined": False, "layout": "full", "seconds": 0.004,
           "floor_seconds": 0.0035, "floor_shared_seconds": 0.001, "ratio_to_copy": 10.0,
           "baseline_seconds": 0.03, "speedup_vs_baseline": 7.5, "peak_extra_bytes": 600_000,
           "memory_budget_bytes": 2_228_224, "engine_rank_bytes_in": 559360,
           "engine_rank_shard_bytes": 559360}
    row.update(kw)
    return row


def test_targets_are_not_judged_when_flags_change_the_targets_problem(tmp_path, capsys, monkeypatch):
    """Before: ``--preset targets --models tiny --ranks 1 --tp 1`` printed 'targets: speedup 6.66x
    (>=3: True) ... peak extra 0.27x budget (<=1: True)' and wrote "met" flags for a 0.1M-param model
    on one rank (/tmp/audit/bench2/tgt_tiny.out): only ``args.preset`` was looked at, not the sweep
    the flags made of it. Now the rows of another model, rank count, TP, ... are not judged."""
    from fsdp_sync.cli.bench import main as bench_main

    rows = [_tensor_row(strategy="per_tensor", seconds=0.03), _tensor_row()]
    seen = []

    def fake_run(spec, **kw):
        seen.append(spec)
        return {"spec": {}, "rows": [dict(r) for r in rows], "wall_seconds": 0.0, "machine": {}}

    monkeypatch.setattr(bench_main, "run_bench", fake_run)
    out = tmp_path / "t.json"
    res = cli_here(capsys, "bench", "--preset", "targets", "--models", "tiny", "--ranks", "1", "--tp", "1",
                   "--bucket-mb", "1", "--layout", "full", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert seen and seen[0].models == ("tiny",)
    t = json.loads(out.read_text())["targets"]
    assert t["judged"] is False and "met" not in t, t
    assert "--models tiny overrides the targets' qwen2-160m" in t["why"], t["why"]
    assert "--ranks 1" in t["why"] and "--tp 1" in t["why"] and "--bucket-mb" not in t["why"], t["why"]
    text = " ".join(res.stdout.split())
    assert "targets: not judged: --models tiny overrides the targets' qwen2-160m" in text, text
    assert "(≥3: True)" not in text, text


def test_targets_keep_their_verdict_when_flags_only_add_configurations():
    """The targets' own problem (model, ranks, TP, EP, dtype, quantization, device) with more
    bucket sizes or methods is judged: the verdict is on the fastest row of them."""
    from dataclasses import asdict

    from fsdp_sync.cli.bench.main import PRESETS, BenchSpec
    from fsdp_sync.cli.bench.targets import judge_targets

    preset = asdict(BenchSpec.from_mapping(PRESETS["targets"]))
    rows = [_tensor_row(strategy="per_tensor", seconds=0.03, ranks=2, tp=2), _tensor_row(ranks=2, tp=2)]
    wider = dict(preset, bucket_mb=(16.0, 64.0), methods=("tensor", "distributed"))
    t = judge_targets(rows, wider, preset)
    assert t["judged"] is True and set(t["met"]) == {"speedup", "floor", "memory"}, t
    for key, value in (("dtype", "bfloat16"), ("quantization", ("fp8",)), ("device", "cuda"), ("ep", (2,))):
        t = judge_targets(rows, dict(preset, **{key: value}), preset)
        assert t["judged"] is False and f"--{key} " in t["why"], (key, t)


def test_distributed_memory_target_holds_each_process_to_its_own_budget():
    """Before: the distributed target divided the largest process's peak (an engine worker's
    400 MiB: its staged shard) by the trainer's budget (282 MiB): 1.42x, not met, while
    `flag_over_budget` found every process within its own rule (/tmp/audit/bench2/dist_mem.py)."""
    b, largest, shard = 64 * MiB, 94 * MiB, 310 * MiB
    row = {"method": "distributed", "strategy": "distributed:flattened_bucket", "seconds": 1.0,
           "floor_seconds": 0.9, "baseline_seconds": 3.5,
           **memory_budget("distributed", b, largest),
           **engine_memory_budget("distributed", b, largest, shard, staged=True),
           "peak_extra_by_process": {"trainer rank 0": 187 * MiB, "trainer rank 1": 0,
                                     "engine worker 0": 400 * MiB}}
    row["peak_extra_bytes"] = max(row["peak_extra_by_process"].values())
    flag_over_budget([row])
    assert row["over_budget"] is False
    d = check_targets([row])["distributed"]
    assert d["met"]["memory"] is True, d
    assert d["peak_extra_over_budget"] == pytest.approx(400 / 404), d
    assert d["peak_extra_over_budget_of"] == "engine worker 0"
    # a trainer rank over the trainer's rule is still over, whatever the engine's budget
    over = dict(row, peak_extra_by_process={"trainer rank 0": 300 * MiB, "engine worker 0": 0})
    flag_over_budget([over])
    d = check_targets([over])["distributed"]
    assert over["over_budget"] is True and d["met"]["memory"] is False
    assert d["peak_extra_over_budget_of"] == "trainer rank 0"


def test_per_rank_layout_target_judges_the_fastest_row_of_each_path():
    """Before: the per-rank layout target kept the row nearest its floor, not the fastest row its
    docstring names: a 0.28 s row at 1.4x a noisier floor was judged (met) over a 0.20 s row at
    2.0x its floor (/tmp/audit/bench2/layout_pick.py)."""
    base = dict(method="tensor", engine_rank_bytes_in=100, engine_rank_shard_bytes=100, baseline_seconds=3.0,
                peak_extra_bytes=1, memory_budget_bytes=10, floor_seconds=1.0)
    rows = [dict(base, strategy="flattened", layout="full", share_host_memory=True, seconds=0.5,
                 floor_shared_seconds=0.1),
            dict(base, strategy="flattened", layout="engine", share_host_memory=True, pipelined=False,
                 seconds=0.20, floor_shared_seconds=0.10),
            dict(base, strategy="flattened", layout="engine", share_host_memory=True, pipelined=True,
                 seconds=0.28, floor_shared_seconds=0.20)]
    t = check_targets(rows)["layout"]["one-host"]
    assert t["pipelined"] is False and t["ratio_to_floor"] == pytest.approx(2.0), t
    assert t["met"]["floor"] is False
    # the order of the rows does not matter
    assert check_targets(rows[::-1])["layout"]["one-host"] == t
