"""Audit H26 of `fsdp-sync bench`: in process, no ranks launched.

- ``--verify`` on a CUDA sweep was refused by `verify.verify_rows` only after the whole sweep ran
  (a ValueError traceback, the sweep's JSON never written); now `check_bench_args` refuses it
  before anything starts, naming --verify.
- the layout targets' ``seconds_vs_full`` (and ``trainer_in_vs_full``) divided the judged engine
  row by whichever full-layout row of its path came last in the sweep (the largest bucket, or the
  last job's), not by the fastest one, as the engine row itself is the fastest of its path.
"""

from __future__ import annotations

import argparse

import pytest

from fsdp_sync.cli import args as ca
from fsdp_sync.cli.bench.main import add_bench_parser, check_bench_args
from fsdp_sync.cli.bench.targets import check_targets


def test_verify_on_a_cuda_sweep_is_refused_before_the_sweep_runs(monkeypatch):
    monkeypatch.setattr(ca, "device", lambda text: text)             # as if a GPU were there
    monkeypatch.setattr(ca, "check_gpus", lambda *a, **k: None)
    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    add_bench_parser(sub)
    argv = ["--models", "tiny", "--device", "cuda", "--verify", "full"]
    args = sub.choices["bench"].parse_args(argv)
    with pytest.raises(ValueError, match=r"--verify full measures on CPU only.*runs on cuda"):
        check_bench_args(args, {"models", "device", "verify"})


def _row(layout: str, seconds: float, bucket: int, bytes_in: int) -> dict:
    return {"strategy": "flattened", "method": "tensor", "layout": layout, "share_host_memory": False,
            "seconds": seconds, "bucket_bytes": bucket, "floor_seconds": 1.0, "floor_shared_seconds": None,
            "baseline_seconds": 3.0, "peak_extra_bytes": 1, "memory_budget_bytes": 10,
            "engine_rank_bytes_in": 50, "engine_rank_shard_bytes": 50, "trainer_rank_bytes_in": bytes_in,
            "pipelined": layout == "engine"}


def test_layout_targets_set_the_engine_row_beside_the_fastest_full_row():
    rows = [_row("full", 1.0, 4 << 20, 100), _row("full", 2.0, 64 << 20, 200),   # the last is the slowest
            _row("engine", 1.05, 4 << 20, 50)]
    d = check_targets(rows)["layout"]["all-to-all"]
    assert d["seconds_vs_full"] == pytest.approx(1.05), d
    assert d["trainer_in_vs_full"] == pytest.approx(0.5), d


def test_each_targets_threshold_is_its_own():
    # the tensor target: <= 1.3 x its floor (1.4 is not met), speed-up >= 3, memory <= 1
    t = check_targets([_row("full", 1.4, 4 << 20, 100)])
    assert t["met"] == {"speedup": False, "floor": False, "memory": True}, t
    assert check_targets([_row("full", 1.0, 4 << 20, 100)])["all_met"] is True
    # per-rank buckets: the one-host path <= 1.5 x its floor, the all-to-all path <= 1.05 x
    shared = dict(_row("engine", 1.4, 4 << 20, 0), share_host_memory=True, floor_shared_seconds=1.0)
    lay = check_targets([shared, _row("engine", 1.1, 4 << 20, 50)])["layout"]
    assert lay["one-host"]["met"]["floor"] is True and lay["all-to-all"]["met"]["floor"] is False, lay
    # the distributed method: its fastest flattened row against its per-tensor format (2x: not met)
    dist = dict(_row("full", 1.0, 4 << 20, 100), method="distributed", strategy="distributed:flattened_bucket",
                baseline_seconds=2.0)
    d = check_targets([dist])["distributed"]
    assert d["speedup_vs_per_tensor"] == 2.0 and d["met"] == {"speedup": False, "floor": True, "memory": True}, d


class _Sampler:
    def __init__(self, samples):
        self.t0, self.samples = 100.0, samples


def test_peak_is_the_rise_inside_the_sync_stage_above_the_last_sample_before_it():
    from fsdp_sync.cli.bench.sampling import rises

    # a wake-up's spike before the stage (900, freed again), the stage's own rise (150 -> 400),
    # the KV cache woken after it (1000): only 400 - 150 is the sync's
    samples = [(0.0, [100]), (0.5, [900]), (1.0, [150]), (2.0, [160]), (3.0, [400]), (5.0, [1000])]
    timeline = [{"name": "wake_up_weights", "started": 100.2, "seconds": 0.6},
                {"name": "sync_weights", "started": 101.5, "seconds": 2.0}]
    assert rises(timeline, _Sampler(samples)) == [250]


def test_a_device_counts_the_workers_shared_pages_once(monkeypatch):
    from fsdp_sync.cli.bench import sampling

    status = {1: {"rss": 1000}, 2: {"rss": 500, "shmem": 200}}
    monkeypatch.setattr(sampling, "_status", lambda pid: status[pid])
    assert sampling.device_bytes(1, 2) == 1300 and sampling.device_bytes(1, None) == 1000


def test_a_failed_verify_run_still_writes_the_sweeps_rows(monkeypatch, tmp_path, capsys):
    import json

    from fsdp_sync.cli.bench import main, verify
    from fsdp_sync.cli.launch import RankError

    def failed(spec, modes):
        raise RankError("rank 1 failed: VerifyError: engine rank 0 tensor model.norm.weight differs\n...")

    swept = {"spec": {"models": ["tiny"]}, "rows": [], "wall_seconds": 1.0, "machine": {}}
    monkeypatch.setattr(main, "run_bench", lambda spec: dict(swept))
    monkeypatch.setattr(verify, "verify_rows", failed)
    out = tmp_path / "bench.json"
    args = argparse.Namespace(lora_r=None, spec=main.BenchSpec(models=("tiny",)), verify=("full",),
                              json=str(out), plot=None, preset=None)
    assert main.cmd_bench(args) == 1
    got = json.loads(out.read_text())
    assert got["spec"] == swept["spec"] and got["incomplete"].startswith("--verify: rank 1 failed"), got
    assert "VerifyError" in capsys.readouterr().err


def test_a_floors_median_leaves_its_warm_up_runs_out(monkeypatch):
    import types

    import torch.distributed as dist

    from fsdp_sync.cli.bench import floors

    monkeypatch.setattr(floors, "cpu_group", lambda *a: None)
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: None)
    # run k takes ticks[k] seconds: a cold first run of 100 s, then 1, 2, 3
    ticks = iter([0, 100, 100, 101, 101, 103, 103, 106])
    monkeypatch.setattr(floors, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert floors.median_seconds(lambda: None, "cpu", 3, warmup=1) == 2


def test_a_stage_no_sample_fell_in_is_not_charged_a_later_stages_memory():
    from fsdp_sync.cli.bench.sampling import rises

    # a 0.1 s stage between samples: the level it left (200), not the KV cache woken after it (1000)
    samples = [(0.0, [100]), (1.0, [150]), (1.7, [200]), (5.0, [1000])]
    timeline = [{"name": "sync_weights", "started": 101.5, "seconds": 0.1}]
    assert rises(timeline, _Sampler(samples)) == [50]


def test_the_shared_floor_copies_the_engines_own_shard(monkeypatch):
    import torch.distributed as dist

    from fsdp_sync.cli.bench import floors

    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(floors, "median_seconds", lambda body, dev, repeats, warmup: 0.5)
    moved: dict = {}
    # an FP8 row's engine shard (300) is not the rollout dtype's total / tp (500)
    assert floors.floor_shared_seconds(1000, 2, "cpu", 3, 300, moved=moved) == 0.5
    assert moved == {"own_copy": 500, "engine_copy": 300}
