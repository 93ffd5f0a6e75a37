"""What a command stopped part-way keeps, and says (cli3 audit): Ctrl-C is one line and exit code
130, not 1-3 tracebacks; the demo's --timeout-s help (D7)."""

from __future__ import annotations

import pytest


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
