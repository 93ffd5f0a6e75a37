"""H64: fsdp_sync's verl CPU platform (`integrations.verl.cpu_platform`) is active only where it
should be (`make test-verl`): in a process without ``VERL_PLATFORM=cpu`` the plug-in that verl
loads on ``import verl`` registers no "cpu" platform, leaves verl's process-group set-up and
``VERL_ENGINE_DEVICE`` alone, and verl's own detection never picks CPU; with it, verl's platform is
`CPUPlatform` (device "cpu", gloo), the global group is ``cpu:gloo`` unless verl names one, and a
second `install` wraps nothing twice. (Each case is a fresh process importing verl: about a minute
of a loaded 2-core machine, so two.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
import json, os, sys
import verl                                   # loads fsdp_sync's plug-in (verl.plugins entry point)
import verl.utils.distributed as verl_dist
from verl.plugin.platform import PlatformRegistry, platform_manager
from fsdp_sync.integrations.verl import cpu_platform

out = {"registered": "cpu" in PlatformRegistry.registered_names(),
       "init_module": verl_dist.initialize_global_process_group_ray.__module__,
       "engine_device": os.environ.get("VERL_ENGINE_DEVICE"),
       "detected": platform_manager._detect_platform_name(),
       "requested": cpu_platform.requested()}
if out["registered"]:
    from verl.utils.device import get_device_id, get_device_name, get_nccl_backend
    out.update(device_id=get_device_id(), device_name=get_device_name(),
               backend=get_nccl_backend(), platform=type(platform_manager.get_platform()).__name__)
    # the group set-up as installed, over a stand-in for verl's own (the closure calls it)
    seen = []
    wrapped = verl_dist.initialize_global_process_group_ray
    cell = next(c for c in wrapped.__closure__ if callable(c.cell_contents))
    cell.cell_contents = lambda timeout_second=None, backend=None: seen.append((timeout_second, backend))
    wrapped()
    wrapped(timeout_second=7, backend="cpu:gloo,cuda:nccl")
    cpu_platform.install()                     # again: idempotent
    out.update(calls=seen, same=verl_dist.initialize_global_process_group_ray is wrapped)
print("RESULT " + json.dumps(out))
"""


def run(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_ENGINE_DEVICE")}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", **env_extra)
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_without_verl_platform_cpu_nothing_is_installed():
    got = run({})
    assert got == {"registered": False, "init_module": "verl.utils.distributed", "engine_device": None,
                   "detected": "nvidia", "requested": False}, got


def test_with_verl_platform_cpu_verl_runs_on_cpu_over_gloo():
    got = run({"VERL_PLATFORM": " CPU "})       # read as verl reads it: stripped, any case
    assert got["registered"] and got["requested"] and got["detected"] == "cpu", got
    assert got["platform"] == "CPUPlatform" and got["device_id"] == "cpu", got
    assert got["device_name"] == "cpu" and got["backend"] == "gloo", got
    assert got["engine_device"] == "cuda", got           # verl's FSDP engines are registered for cuda
    assert got["calls"] == [[None, "cpu:gloo"], [7, "cpu:gloo,cuda:nccl"]], got
    assert got["same"], got
