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
