"""The verl tier: collected only under `make test-verl` (FSDP_SYNC_VERL_TIER=1, in .venv-verl).

A plain `pytest` / `make test` ignores this directory, so the default tier never needs verl.
When the tier is asked for, verl must import and fsdp_sync's plug-in must be installed: a missing
or broken install is an error here, never a skip, so the tier cannot pass without having run.
"""

from __future__ import annotations

import os
import sys

import pytest

TIER = os.environ.get("FSDP_SYNC_VERL_TIER") == "1"

if not TIER:
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import verl  # noqa: F401  (fails the run loudly when verl is not installed)


@pytest.fixture(scope="session")
def tiny_grpo_dir(tmp_path_factory):
    """One TINY_DIR for every test that runs recipes/verl/run_tiny_grpo_cpu.sh: the first run makes
    the assets (the script's own `make_assets.py` step), the later ones reuse them, as a user's
    second run does (each making them again cost about 5 s of a 2-core machine). Nothing writes
    there but make_assets.py: a run's checkpoints and logs go to its own directory."""
    return tmp_path_factory.mktemp("tiny_grpo") / "tiny"
