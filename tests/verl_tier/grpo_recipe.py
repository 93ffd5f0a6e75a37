"""Running recipes/verl/run_tiny_grpo_cpu.sh (verl's own trainer with fsdp_sync) from a test, and
checking that it left nothing behind: shared by test_verl_trainer.py and
test_verl_trainer_lora.py, two files so that `make test-verl` (`-n 2 --dist loadfile`) runs the two
trainer runs side by side."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "recipes" / "verl" / "run_tiny_grpo_cpu.sh"
STEP = re.compile(r"step:(\d+) - (.*)")


def _marked(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("FSDP_SYNC_TEST_RUN") == marker and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _orphaned(names: set[str]) -> list[str]:
    """The ``/dev/shm`` entries of ``names`` that still exist and no live process has open or
    mapped: leftovers, as opposed to the segments of other jobs running on this machine."""
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    held.add(target[9:].split(" ")[0])
            with open(f"/proc/{pid}/maps") as f:
                held.update(line.split("/dev/shm/", 1)[1].split(" ")[0].strip()
                            for line in f if "/dev/shm/" in line)
        except OSError:
            continue
    return sorted(n for n in names if os.path.exists(f"/dev/shm/{n}") and n not in held)


def _steps(log: str) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for m in STEP.finditer(log):
        metrics = {}
        for part in m.group(2).split(" - "):
            key, _, value = part.partition(":")
            num = re.search(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?", value)
            if num:
                metrics[key.strip()] = float(num.group(0))
        steps[int(m.group(1))] = metrics
    return steps


def _temp_dirs(since: float = 0.0) -> set[str]:
    """What a run left in the temp directory: multiprocessing's and torch_shm_manager's
    directories no live process holds (`memory.temp_dirs`) and the run script's own TMPDIR, made
    at ``since`` or later (a directory older than the run is another job's, orphaned meanwhile:
    on a shared machine other test runs come and go)."""
    from fsdp_sync.memory import temp_dirs

    found = temp_dirs() | {str(p) for p in Path(tempfile.gettempdir()).glob("fsr-tmp.*")}
    out = set()
    for d in found:
        try:
            if os.stat(d).st_ctime >= since:
                out.add(d)
        except OSError:
            continue
    return out


def run_recipe(tmp_path, tiny_dir, overrides: list[str], check) -> None:
    """Run the tiny GRPO recipe with ``overrides`` (assets in ``tiny_dir``, made by the first run
    of the session), call ``check(log, steps, syncs, wall)`` on a successful run (``syncs``: the
    adapter's metrics-file records), then check that nothing is left behind (see the module
    docstring). Ray's dashboard is left out (``include_dashboard=false``): nothing here reads it,
    and its head process and modules are seconds of CPU in every run."""
    marker = uuid.uuid4().hex
    ray_tmp = tempfile.mkdtemp(prefix="fsr", dir="/tmp")   # Ray's socket paths must stay short
    shm_before = set(os.listdir("/dev/shm"))
    started = time.time() - 1.0
    tmp_before = _temp_dirs()
    metrics_file = tmp_path / "sync.jsonl"
    env = dict(os.environ, PYTHON=sys.executable, TINY_DIR=str(tiny_dir),
               RAY_TMPDIR=ray_tmp, FSDP_SYNC_TEST_RUN=marker,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            ["bash", str(RUN), f"+actor_rollout_ref.rollout.custom.fsdp_sync.metrics_file={metrics_file}",
             f"+actor_rollout_ref.rollout.custom.fsdp_sync.log_dir={tmp_path}",
             "+ray_kwargs.ray_init.include_dashboard=false", *overrides],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=780)
        wall = time.monotonic() - t0
        log = proc.stdout + proc.stderr
        (tmp_path / "run.log").write_text(log)
        assert proc.returncode == 0, log[-6000:]
        steps = _steps(log)
        assert sorted(steps) == [1, 2, 3], log[-4000:]
        syncs = [json.loads(line) for line in metrics_file.read_text().splitlines()]
        check(log, steps, syncs, wall)
        url = re.search(r" on http://127\.0\.0\.1:(\d+) ",
                        (tmp_path / "fsdp_sync_serve_0_0.log").read_text())
        assert url, "serve's log has no URL line"
        port = int(url.group(1))
    finally:
        deadline = time.monotonic() + 60
        left = _marked(marker)
        while left and time.monotonic() < deadline:
            time.sleep(1)
            left = _marked(marker)
        lingered = []
        for p in left:      # named before the kill (a killed one is a zombie: no cmdline)
            try:
                lingered.append((p.pid, p.name(), p.cmdline()[:4]))
            except psutil.Error:
                lingered.append((p.pid, "(gone)", []))
            p.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not left, f"still running 60 s after the run ended: {lingered}"
    listening = [c for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    assert not listening, f"port {port} (serve) still listened on: {listening}"
    left_shm = _orphaned(set(os.listdir("/dev/shm")) - shm_before)
    if left_shm:
        # other jobs on a shared machine make segments too, and one may be unheld for a moment
        # while its processes start or stop: a leftover of this run is still there, still
        # unheld, a few seconds later
        time.sleep(5)
        left_shm = sorted(set(left_shm) & set(_orphaned(set(left_shm))))
    assert not left_shm, f"shared-memory segments left behind: {left_shm}"
    # Ray SIGKILLs its workers: the run script's own TMPDIR takes what multiprocessing left there
    left_tmp = sorted(_temp_dirs(since=started) - tmp_before)
    assert not left_tmp, f"temp directories left behind by the run: {left_tmp}"


