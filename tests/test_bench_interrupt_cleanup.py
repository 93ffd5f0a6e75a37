"""What a command stopped part-way leaves and says (cli3 audit): a bench job stopped part-way
leaves no disk row's checkpoint behind (D4); Ctrl-C is one line and exit code 130, not 1-3
tracebacks; the demo's --timeout-s help says what a stopped run keeps (D7).

D4 before: rank 0 makes each disk row's checkpoint directory (``fsdp-sync-bench-disk-*`` in the
temp directory) and removes it after a barrier that a rank killed, failed or interrupted never
reaches; the launcher then terminates the ranks, and the versions stay (1.2 MB for the tiny model,
GBs for a real one). Now each job's ranks get a temp directory the parent owns (``TMPDIR``),
removed when the job ends however it ends. (Checked by hand too: ``fsdp-sync bench --methods disk``
given SIGINT as a terminal does, mid-row: exit 130 in 3-5 s, nothing left in its TMPDIR.)"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest


def _bench_dirs(root: str) -> list[str]:
    return sorted(str(p) for p in Path(root).rglob("fsdp-sync-bench*"))


@pytest.mark.timeout(150)
def test_a_disk_job_whose_rank_dies_mid_sync_leaves_no_checkpoint(monkeypatch):
    """Rank 1 SIGKILLs itself as the first disk sync starts (rank 0 has made the row's
    directory and waits in the sync's collectives): the job fails, and nothing named
    fsdp-sync-bench* is left in this process's temp directory (nor anything else: conftest)."""
    from fsdp_sync.cli.bench.main import BenchSpec, run_bench

    monkeypatch.setenv("FSDP_SYNC_FAULT", "trainer:1:sync_weights:kill")
    root = tempfile.gettempdir()
    before = _bench_dirs(root)
    spec = BenchSpec(models=("tiny",), methods=("disk",), ranks=(2,), tp=(2,), repeats=3, warmup=0)
    with pytest.raises(RuntimeError) as info:       # the failed job (RankError, BenchIncomplete)
        run_bench(spec, timeout_s=120)
    # rank 1's death, or rank 0's error on losing it (its barrier before the removal fails)
    assert str(info.value).startswith(("rank 1 exited with code", "rank 0 failed")), str(info.value)[-2000:]
    assert _bench_dirs(root) == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, where, name", [
    (["demo"], "fsdp_sync.cli.demo", "run_demo"),
    (["bench", "--models", "tiny"], "fsdp_sync.cli.bench.main", "run_bench"),
    (["faults", "--methods", "tensor", "--stages", "prepare", "--victims", "trainer1", "--faults", "raise"],
     "fsdp_sync.cli.faults", "run_matrix"),
], ids=["demo", "bench", "faults"])
def test_ctrl_c_is_one_line_and_exit_code_130(argv, where, name, capsys, monkeypatch):
    """Ctrl-C while a command runs (its runner raises KeyboardInterrupt, as `run_ranks` does once
    it has stopped the ranks): ``fsdp-sync <command>: interrupted`` on stderr, exit code 130, not
    the command's traceback (before: 1-3 tracebacks, exit by SIGINT)."""
    import importlib

    from fsdp_sync.cli import app as cli

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(where), name, interrupted)
    capsys.readouterr()
    try:
        rc = cli.main(argv)
    except KeyboardInterrupt:
        pytest.fail(f"KeyboardInterrupt came out of fsdp-sync {argv[0]} (a traceback, exit by SIGINT)")
    assert rc == 130
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"fsdp-sync {argv[0]}: interrupted"], err


def test_demo_timeout_help_says_the_finished_steps_are_kept(capsys):
    """A demo stopped by --timeout-s (or a failed rank) shows and writes the steps every rank
    finished (tests/test_demo_methods.py checks it); its help said "no step's result is kept"
    (cli3 audit D7)."""
    from fsdp_sync.cli import app as cli

    with pytest.raises(SystemExit):
        cli.parse_args(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "no step's result is kept" not in text
    assert "the steps every rank finished are kept: shown and written to --json" in text, text
