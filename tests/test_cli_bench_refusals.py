"""``fsdp-sync bench``: flags the sweep would ignore or cannot run are refused before any rank
starts (one line naming them, exit 2), and a job that fails part-way reports the rows measured
before it (cli3 audit D2, D3).

Before: ``--methods distributed,disk --strategies bucketed`` ran (exit 0) and its rows were the
methods' own formats, the header saying "strategies bucketed"; ``--engine http --layout engine``
ran about 40 s, then failed in a 48-line RankError traceback (the SGLangEngine client takes no
per-rank buckets) and wrote no JSON: every row measured was lost, as with any rank failure."""

from __future__ import annotations

import json
import subprocess

import pytest

from fsdp_sync.cli import app as cli

from _util import cli_here


def _run_here(argv: list[str], capsys) -> subprocess.CompletedProcess:
    return cli_here(capsys, *argv)


@pytest.fixture
def no_ranks(monkeypatch):
    from fsdp_sync.cli.bench import main as bench_main

    def started(*a, **k):
        raise AssertionError("bench started its ranks")

    monkeypatch.setattr(bench_main, "run_bench", started)


REFUSED = {
    "strategies-without-tensor": (["--methods", "distributed,disk", "--strategies", "bucketed"],
                                  ["--strategies bucketed", "--methods distributed,disk", "no tensor rows"]),
    "strategies-with-a-recipe-without-tensor": (["--recipe", "distributed_layouts", "--strategies", "per_tensor"],
                                                ["--strategies per_tensor", "--methods distributed"]),
    "http-engine-layout": (["--strategies", "flattened", "--layout", "full,engine", "--engine", "http"],
                           ["--engine http --layout full,engine", "no per-rank buckets", "--layout full or auto"]),
    "http-preset-targets": (["--preset", "targets", "--engine", "http"],
                            ["--engine http --preset targets (layouts full,engine)", "--engine direct"]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_flag_the_sweep_would_ignore_or_cannot_run_is_refused_before_any_rank(case, capsys, no_ranks):
    argv, words = REFUSED[case]
    got = _run_here(["bench", "--models", "tiny", *argv] if "--preset" not in argv else ["bench", *argv], capsys)
    err = got.stderr.strip()
    assert got.returncode == 2 and "Traceback" not in got.stderr, (got.returncode, got.stderr[-2000:])
    assert len(err.splitlines()) == 1 and err.startswith("fsdp-sync bench: error: "), err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.timeout(60)
def test_what_the_sweep_does_run_is_still_accepted(no_ranks):
    """No over-refusal: a recipe's own strategies beside methods without tensor (the shipped
    distributed_layouts sweep), the http engine with full/auto layouts or without flattened rows."""
    for argv in (["--recipe", "distributed_layouts"],
                 ["--models", "tiny", "--engine", "http", "--layout", "full,auto"],
                 ["--models", "tiny", "--engine", "http", "--layout", "engine", "--strategies", "per_tensor"],
                 ["--models", "tiny", "--methods", "tensor,disk", "--strategies", "bucketed"]):
        cli.parse_args(["bench", *argv])


@pytest.mark.timeout(150)
def test_a_rank_failure_reports_the_rows_measured_before_it_in_one_line(tmp_path, capsys, monkeypatch):
    """Rank 1 raises in the first sync of the second row (the per_tensor row runs first: 1
    warm-up, 3 timed and 1 sampled sync): the per_tensor row is shown and written, stderr holds
    one line naming the failure, exit code 1."""
    monkeypatch.setenv("FSDP_SYNC_FAULT", "trainer:1:sync_weights:raise")
    monkeypatch.setenv("FSDP_SYNC_FAULT_AFTER", "5")
    out = tmp_path / "rows.json"
    got = _run_here(["bench", "--models", "tiny", "--strategies", "per_tensor,flattened", "--repeats", "3",
                     "--json", str(out)], capsys)
    err = got.stderr.strip()
    assert got.returncode == 1 and "Traceback" not in got.stderr, (got.returncode, got.stderr[-3000:])
    assert len(err.splitlines()) == 1 and err.startswith("fsdp-sync bench: error: rank "), err
    assert "InjectedFault" in err and "1 row(s) measured before it" in err and str(out) in err, err
    result = json.loads(out.read_text())
    assert result["incomplete"].startswith("rank "), result["incomplete"]
    (row,) = result["rows"]
    assert (row["method"], row["strategy"], row["engine"]) == ("tensor", "per_tensor", "direct")
    assert row["baseline_seconds"] == row["seconds"] > 0 and len(row["repeats"]) == 3
    assert row["exported_tensors"] > 0 and "per_tensor" in got.stdout      # and the table shows it
