"""``examples/accelerate_rollout.py`` under the accelerate configs users bring (H6 audit; the
FSDP2 config, both methods, is `test_launchers.test_accelerate_launch_example`):

- ``examples/accelerate_fsdp1.yaml`` (``fsdp_version: 1``): ``prepare`` returns the FSDP1 root
  wrapper, which the example hands to the manager as it is (shared/FACTS-accelerate.md); the
  engine equals the trainer bit for bit after every sync;
- the FSDP2 config launched as written on a CPU machine, without the test-only helper: accelerate
  does not apply FSDP on CPU (each rank would train its own copy), so the example stops at once,
  saying so, on every rank, before any engine starts.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from _util import run_output

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour of accelerate")


def _env() -> dict:
    env = dict(os.environ)
    env.pop("FSDP_SYNC_WORKERS_START", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _launch(config: str, *args: str, helper: bool, timeout: float):
    pytest.importorskip("accelerate", reason="the `accelerate` extra (pip install -e '.[accelerate]')")
    script = [str(ROOT / "tests" / "accelerate_cpu_run.py")] if helper else []
    with tempfile.TemporaryDirectory(prefix="accel") as tmp:   # torchelastic's logs: removed after
        return run_output([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                           str(EXAMPLES / config), *script, str(EXAMPLES / "accelerate_rollout.py"), *args],
                          timeout=timeout, cwd=ROOT, env={**_env(), "TMPDIR": tmp})


@pytest.mark.timeout(260)
def test_the_fsdp1_config_syncs_bit_exact():
    r = _launch("accelerate_fsdp1.yaml", "--steps", "2", helper=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    steps = [line for line in out.splitlines() if "engine == trainer" in line]
    assert [s.split(":")[0] for s in steps] == ["step 0", "step 1"], out[-4000:]
    assert all("(FullyShardedDataParallel)" in s for s in steps), steps     # really FSDP1


@pytest.mark.timeout(150)
def test_on_cpu_without_the_helper_the_example_says_accelerate_did_not_shard():
    r = _launch("accelerate_fsdp2.yaml", "--steps", "1", helper=False, timeout=130)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-4000:]
    said = "accelerate did not apply FSDP here (distributed type NO): on a CPU machine it never does"
    assert out.count(said) == 2, out[-4000:]                                 # every rank, at once
    assert "engine == trainer" not in out and "step 0" not in out, out[-4000:]
