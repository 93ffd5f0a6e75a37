"""``fsdp-sync faults --resume --json FILE`` where FILE is not a fault report (cli3 audit D6): one
line naming --json and what the file is, exit code 2, before any cell runs.

Before: a JSONDecodeError, a KeyError 'results' or an AttributeError ('list' object has no
attribute 'get') traceback, exit code 1; a report run with other timeouts: exit 1."""

from __future__ import annotations

import json
import subprocess

import pytest

from fsdp_sync.cli import app as cli

from _util import cli_here

ONE_CELL = ["faults", "--methods", "tensor", "--stages", "prepare", "--victims", "trainer1", "--faults", "raise",
            "--no-progress", "--resume", "--json"]
TIMEOUTS = {"pg_s": 6.0, "call_s": 4.0, "recv_s": 6.0, "cell_s": 150.0, "slack_s": 3.0}
CELL = {"method": "tensor", "stage": "prepare", "victim": "trainer1", "fault": "raise", "possible": True,
        "ok": True}

NOT_A_REPORT = {
    "not-json": ("not json\n", ["which is not JSON", "line 1 column 1"]),
    "no-results": (json.dumps({"timeouts": TIMEOUTS}), ["not a fault report", "'results'", "keys ['timeouts']"]),
    "a-list": ("[1, 2]", ["not a fault report", "a JSON list"]),
    "a-result-not-a-cell": (json.dumps({"timeouts": TIMEOUTS, "results": [CELL, {"method": "tensor"}]}),
                            ["results[1] is not a fault cell", "method, stage, victim, fault"]),
    "other-timeouts": (json.dumps({"timeouts": dict(TIMEOUTS, pg_s=9.0), "results": [CELL]}),
                       ["was run with timeouts", "'pg_s': 9.0", "give the same ones or another --json"]),
}


def _run_here(argv: list[str], capsys) -> subprocess.CompletedProcess:
    return cli_here(capsys, *argv)


@pytest.fixture
def no_cells(monkeypatch):
    from fsdp_sync.cli import faults

    def started(*a, **k):
        raise AssertionError("the matrix ran")

    monkeypatch.setattr(faults, "run_matrix", started)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(NOT_A_REPORT))
def test_resume_from_a_file_that_is_no_fault_report_is_one_line_naming_json(case, tmp_path, capsys, no_cells):
    text, words = NOT_A_REPORT[case]
    path = tmp_path / "report.json"
    path.write_text(text)
    got = _run_here([*ONE_CELL, str(path)], capsys)
    err = got.stderr.strip()
    assert got.returncode == 2 and "Traceback" not in got.stderr, (got.returncode, got.stderr[-2000:])
    assert len(err.splitlines()) == 1 and err.startswith("fsdp-sync faults: error: argument --json: "), err
    for w in [str(path), *words]:
        assert w in err, (w, err)
    assert path.read_text() == text          # refused: the file is as it was


@pytest.mark.timeout(60)
def test_a_callers_own_args_get_the_same_line_from_cmd_faults(tmp_path, capsys, no_cells):
    """`cmd_faults` with a namespace that skipped the parser's checks: the same one line, exit 2."""
    from fsdp_sync.cli import faults

    path = tmp_path / "report.json"
    path.write_text("[1, 2]")
    args = cli.build_parser().parse_args([*ONE_CELL, str(path)])
    capsys.readouterr()
    assert faults.cmd_faults(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fsdp-sync faults: error: argument --json: ") and "a JSON list" in err, err


@pytest.mark.timeout(60)
def test_a_fault_report_is_resumed_and_a_missing_one_starts_afresh(tmp_path, monkeypatch):
    """What --resume takes: the passed cells of a report with the same timeouts; no file yet: none."""
    from fsdp_sync.cli import faults

    path = tmp_path / "report.json"
    assert faults.resumed_results(str(path), faults.Timeouts()) == {}
    path.write_text(json.dumps({"timeouts": TIMEOUTS, "results": [CELL, dict(CELL, fault="kill", ok=False)]}))
    done = faults.resumed_results(str(path), faults.Timeouts(cell_s=99.0))     # cell_s: only the hang limit
    assert list(done) == [("tensor", "prepare", "trainer1", "raise")]
    args = cli.parse_args([*ONE_CELL, str(path)])        # accepted by the checks
    assert args.resume and args.json == str(path)
