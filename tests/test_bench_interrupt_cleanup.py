"""What a command stopped part-way keeps, and says (cli3 audit): the demo's --timeout-s help (D7)."""

from __future__ import annotations

import pytest


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
