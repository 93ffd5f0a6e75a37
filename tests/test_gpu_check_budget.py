"""`scripts/gpu_check.sh` runs within its budget (issue 35 item 3: 8 minutes on a bare GPU machine):
its `step` function (scripts/gpu_check_steps.sh, sourced) cuts each step's limit to what is left
of GPU_CHECK_BUDGET_S and skips, recording rc 125, a step that no longer fits. Checked here with
commands that take known times (no GPU needed): the whole run stays inside a 30 s budget although
its steps ask for 3 x 60 s."""

from __future__ import annotations

import os
import subprocess
import sys
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


@pytest.mark.timeout(180)     # 10 s idle; past 60 s on a stress run beside six busy processes
def test_every_step_of_the_gpu_check_is_well_formed(tmp_path, monkeypatch):
    """A GPU machine is lent for minutes: a flag misspelled in scripts/gpu_check.sh would cost a
    step of them. Its dry run (GPU_CHECK_DRY_RUN=1: no GPU, nothing run) lists every step's
    command; each `fsdp-sync` step's flags go through the CLI's own parser and cross-flag checks
    (with CUDA reported present, as it is there), the payload step's Python compiles, and the
    other commands name what exists."""
    import torch

    from fsdp_sync.cli.app import parse_args

    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    r = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=50, env={**__import__("os").environ, "GPU_CHECK_DRY_RUN": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    steps = {}
    for line in (tmp_path / "dry_run.txt").read_bytes().split(b"\n"):
        if line:
            name, *cmd = [w.decode() for w in line.split(b"\0")[:-1]]
            steps[name] = cmd
    assert list(steps) == ["test_gpu", "payload", "demo", "bench_gpu", "bench_fp8", "fp8_ab", "bench_7b",
                           "plan", "plan_here", "kept", "profile"], list(steps)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    parsed = {}
    for name, cmd in steps.items():
        if cmd[1:3] == ["-m", "fsdp_sync.cli"]:
            args = parse_args(cmd[3:])            # exits 2, naming the flag, on a bad one
            parsed[name] = args.command
    assert parsed == {"demo": "demo", "bench_gpu": "bench", "bench_fp8": "bench", "bench_7b": "bench",
                      "plan": "plan", "plan_here": "plan"}, parsed
    payload = script.split("step payload", 1)[1].split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    compile(payload, "gpu_check.sh: payload", "exec")
    assert steps["profile"][1] == "dev/gpu_profile.py" and (ROOT / steps["profile"][1]).is_file()
    assert steps["kept"][1] == "dev/gpu_profile.py" and "--kept" in steps["kept"]
    compile((ROOT / "dev" / "gpu_profile.py").read_text(), "dev/gpu_profile.py", "exec")
    assert steps["fp8_ab"][1:] == ["dev/fp8_reductions_ab.py", "cuda"]
    # one layer a timed round: the scales' check is the same (every shape, once), the timing the
    # GPU's (28 layers a round on the CPU: 17 s of CPU for figures nobody reads)
    ab = subprocess.run([sys.executable, "dev/fp8_reductions_ab.py", "cpu", "--rounds", "1", "--layers", "1"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120,
                        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert ab.returncode == 0 and "scales equal" in ab.stdout, ab.stdout + ab.stderr
    make = subprocess.run(["make", "-n", *steps["test_gpu"][1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert make.returncode == 0 and "-m gpu" in make.stdout, make.stdout + make.stderr


@pytest.mark.timeout(150)
def test_the_profile_step_runs(tmp_path):
    """The GPU check's last two steps (dev/gpu_profile.py) on the CPU with the tiny model: both
    layouts' syncs, a line per bucket, the cProfile and torch.profiler tables; with ``--kept``, the
    syncs into an engine keeping the bucket buffers open and one opening them per bucket."""
    import os
    import sys

    out = tmp_path / "profile.txt"
    r = subprocess.run([sys.executable, "dev/gpu_profile.py", "--model", "tiny", "--device", "cpu",
                        "--bucket-mb", "0.05", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=140, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    text = out.read_text()
    for layout in ("engine", "full"):
        section = text.split(f"===== layout={layout}:", 1)[1].split("=====", 1)[0]
        calls = int(section.split(" engine calls", 1)[0].rsplit(" ", 1)[1])
        rows = [ln for ln in section.splitlines() if " make " in ln and " engine call " in ln]
        assert calls > 1 and len(rows) == calls, section[:2000]
        assert "--- cProfile, one sync" in section and "--- torch.profiler, one sync" in section
    assert "===== bucket buffers" not in text
    r = subprocess.run([sys.executable, "dev/gpu_profile.py", "--model", "tiny", "--device", "cpu",
                        "--bucket-mb", "0.05", "--kept", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=140, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    kept = out.read_text().split("===== bucket buffers, layout engine", 1)[1]
    assert " kept open " in kept and " opened per bucket " in kept and kept.count(" ms") == 4


def _payload_step(script: str) -> str:
    """The Python the check's `payload` step feeds to the interpreter (its heredoc)."""
    start = script.index("step payload ")
    body = script[script.index("\n", start) + 1:]
    return body[:body.index("\nEOF\n") + 1]


PRODUCER_AS_CUDA = """\
import os
import torch.multiprocessing
torch.multiprocessing.set_sharing_strategy("file_system")   # CPU payloads' strategy, not fds
from fsdp_sync.weights import handles
_producer, _open = os.getpid(), handles.open_payload
def _as_cuda(*args, **kw):        # CUDA refuses an IPC handle in the process that made it
    if os.getpid() == _producer:
        raise RuntimeError("CUDA error: invalid device context")
    return _open(*args, **kw)
handles.open_payload = _as_cuda
"""


@pytest.mark.timeout(60)
def test_the_payload_step_opens_its_payloads_in_another_process(tmp_path):
    """The H200 run (2026-11-29) failed the `payload` step: it opened the CUDA payloads it had just
    recorded in its own process, which CUDA refuses ('invalid device context'). The step runs here
    on CPU: its tensor on the CPU, and an open in the producer's process refused as CUDA refuses
    it; its child must open both payloads (protocols 5 and 2) and find the values."""
    step = _payload_step((ROOT / "scripts" / "gpu_check.sh").read_text())
    assert 'device="cuda"' in step
    src = PRODUCER_AS_CUDA + step.replace('device="cuda"', 'device="cpu"')
    r = subprocess.run([sys.executable, "-", str(tmp_path)], input=src, cwd=ROOT, capture_output=True,
                       text=True, timeout=50, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    for p in (5, 2):
        assert f"protocol {p}: opened in a child, sum 499500.0 on cpu" in r.stdout, r.stdout + r.stderr
        assert (tmp_path / f"cuda_payload_p{p}.bin").stat().st_size > 0
