"""Ray as the launcher (issue 36 item 1): verl places its workers with Ray, and a user may launch a
torchrun-style script on Ray actors. ``examples/ray_launch.py`` gives each actor torchrun's rank
environment and runs ``examples/torchrun_rollout.py --method distributed`` in it (trainer rank 0
owns the engine and broadcasts over the weight-update group, whose store rank 0 hosts); the example
checks the engine's weights against the trainer's bit for bit after every sync.

In this tier because Ray is here (verl depends on it); the default tier has no Ray."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from fsdp_sync.memory import temp_dirs

pytestmark = pytest.mark.verl
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["distributed"])
def test_torchrun_script_on_ray_actors(method):
    import shutil

    # Ray SIGKILLs its actors at shutdown: what multiprocessing made in their temp dir goes with
    # a directory of the test's own instead of piling up in /tmp (short: Ray's AF_UNIX paths)
    scratch = Path(tempfile.mkdtemp(prefix="fsr", dir="/tmp"))
    try:
        _run(method, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(method: str, scratch: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    env["TMPDIR"] = str(scratch)
    started = time.time() - 1.0
    before = temp_dirs()
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "ray_launch.py"), "--nproc", "2",
                             str(EXAMPLES / "torchrun_rollout.py"), "--method", method, "--steps", "2"],
                            cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"ray_launch.py --method {method} ran past 280 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    steps = [line for line in out.splitlines() if "engine == trainer" in line]
    assert [s.split(":")[0] for s in steps] == ["[rank 0] step 0", "[rank 0] step 1"], out[-4000:]
    ms = [float(s.split(" bytes in ")[1].split(" ms")[0]) for s in steps]
    print(f"ray_launch --method {method}: syncs {ms} ms")
    assert ms[0] < 30_000, ms          # the first sync makes the group: seconds, not timeouts
    left = sorted(d for d in temp_dirs() - before
                  if os.path.exists(d) and os.stat(d).st_ctime >= started)
    assert not left, f"the Ray actors left {left} in {tempfile.gettempdir()}"
