"""``fsdp-sync bench``: flags the sweep would ignore or cannot run are refused before any rank
starts (one line naming them, exit 2) (cli3 audit D2, D3).

Before: ``--methods distributed,disk --strategies bucketed`` ran (exit 0) and its rows were the
methods' own formats, the header saying "strategies bucketed"; ``--engine http --layout engine``
ran about 40 s, then failed in a 48-line RankError traceback (the SGLangEngine client takes no
per-rank buckets) and wrote no JSON: every row measured was lost, as with any rank failure."""

from __future__ import annotations

import subprocess

import pytest

from fsdp_sync.cli import app as cli


def _run_here(argv: list[str], capsys) -> subprocess.CompletedProcess:
    capsys.readouterr()
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, rc, out, err)


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

