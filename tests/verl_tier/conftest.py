"""The verl tier: collected only under `make test-verl` (FSDP_SYNC_VERL_TIER=1, in .venv-verl).

A plain `pytest` / `make test` ignores this directory, so the default tier never needs verl.
When the tier is asked for, verl must import and fsdp_sync's plug-in must be installed: a missing
or broken install is an error here, never a skip, so the tier cannot pass without having run.
"""

from __future__ import annotations

import os
import sys

TIER = os.environ.get("FSDP_SYNC_VERL_TIER") == "1"

if not TIER:
    collect_ignore_glob = ["test_*.py"]
else:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import verl  # noqa: F401  (fails the run loudly when verl is not installed)
