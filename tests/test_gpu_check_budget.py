"""`scripts/gpu_check.sh` runs within its budget (issue 35 item 3: 8 minutes on a bare GPU machine):
its `step` function (scripts/gpu_check_steps.sh, sourced) cuts each step's limit to what is left
of GPU_CHECK_BUDGET_S and skips, recording rc 125, a step that no longer fits. Checked here with
commands that take known times (no GPU needed): the whole run stays inside a 30 s budget although
its steps ask for 3 x 60 s."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(60)
def test_steps_never_run_past_the_budget(tmp_path):
    script = f"""
        set -uo pipefail
        OUT={tmp_path}; STEPS={tmp_path}/steps.tsv; : > "$STEPS"
        GPU_CHECK_BUDGET_S=30
        . scripts/gpu_check_steps.sh
        step quick 60 sleep 1
        step long 60 sleep 100
        step late 60 true
        GPU_CHECK_ONLY="quick" step other 60 true
    """
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=55)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [line.split("\t") for line in (tmp_path / "steps.tsv").read_text().splitlines()]
    assert [(name, rc) for name, rc, _ in rows] == [("quick", "0"), ("long", "124"), ("late", "125")], rows
    assert float(rows[1][2]) <= 30 - 15 + 1, rows          # cut to the budget's remainder
    assert wall < 30, f"{wall:.1f} s for a 30 s budget"
    assert "skipped" in r.stdout and "GPU_CHECK_BUDGET_S" in r.stdout
