"""A regular (non-editable) install ships the model recipes (issue 9 item 6).

Builds a wheel from a copy of the project (no network: ``--no-deps --no-build-isolation``), checks
its file list, unpacks it into a folder outside the repository and loads recipes from that copy in
a fresh interpreter whose path holds the unpacked wheel and the venv's dependencies, never this
checkout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile

import pytest

from _util import ROOT

_PROBE = r"""
import json, sys
import fsdp_sync, fsdp_sync.models as m
from fsdp_sync.cli.bench.main import PRESETS, sweep_recipe
from fsdp_sync.cli.bench.main import BenchSpec
cfg = m.load_config("small")
models = {mm for p in PRESETS.values() for mm in p.get("models", [])}
print(json.dumps({"file": fsdp_sync.__file__, "recipes": m.model_recipes(),
                  "sweep": BenchSpec.from_recipe(sweep_recipe("bucket_sweep")).models,
                  "dir": [n for n in ("FSDPShardingManager", "SyncConfig") if n in dir(fsdp_sync)],
                  "small_hidden": cfg.hidden_size,
                  "preset_models": {mm: m.load_config(mm).model_type for mm in sorted(models)}}))
"""


@pytest.mark.timeout(120)
def test_wheel_ships_the_model_recipes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "fsdp_sync", src / "fsdp_sync",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--no-index", "-q", "-w", str(dist), str(src)], check=True, timeout=100,
                   capture_output=True)
    (wheel,) = dist.glob("fsdp_sync-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n for n in names if n.startswith("fsdp_sync/recipes/models/"))
    assert {"fsdp_sync/recipes/models/small.yaml", "fsdp_sync/recipes/models/tiny.yaml",
            "fsdp_sync/recipes/models/qwen2-160m.yaml"} <= set(shipped), shipped
    sweeps = {n for n in names if n.startswith("fsdp_sync/recipes/memory_tuning/")}
    assert {"fsdp_sync/recipes/memory_tuning/bucket_sweep.yaml",
            "fsdp_sync/recipes/memory_tuning/targets.yaml"} <= sweeps, sweeps     # issue 21 item 12
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # the venv's packages for the dependencies (torch, transformers, ...), the wheel for fsdp_sync
    deps = [p for p in sys.path if p.endswith("site-packages")]
    env = {"PYTHONPATH": ":".join([str(site), *deps]), "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path), "PYTHONNOUSERSITE": "1"}
    proc = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path[:0] = "
                           f"{[str(site), *deps]!r}\n" + _PROBE], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(site)), got["file"]          # the installed copy, not the clone
    assert {"small", "tiny", "tiny-tied", "qwen2-160m"} <= set(got["recipes"])
    assert got["small_hidden"] > 0
    assert got["sweep"] and got["dir"] == ["FSDPShardingManager", "SyncConfig"]
    assert got["preset_models"] and all(v for v in got["preset_models"].values())


def test_dir_shows_the_public_api():
    """Issue 21 item 12: dir(fsdp_sync) showed only `import_module`."""
    code = ("import fsdp_sync; d = dir(fsdp_sync); print(sorted(d)); "
            "assert all(callable(getattr(fsdp_sync, n)) or n == '__version__' or "
            "type(getattr(fsdp_sync, n)).__name__ == 'module' for n in d)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    names = eval(out.stdout)                       # noqa: S307 - our own print of a list of str
    assert {"FSDPShardingManager", "SyncConfig", "make_mesh", "SyncError", "engines",
            "weights"} <= set(names) and "import_module" not in names, names
