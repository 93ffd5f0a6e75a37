"""The optional SGLang tier: collected only under `make test-sglang` (FSDP_SYNC_SGLANG_TIER=1).

A plain `pytest` / `make test` ignores this directory, so the default tier never needs sglang.
When the tier is asked for, sglang must import: a missing or broken install is an error here,
never a skip, so the tier cannot pass without having run.
"""

from __future__ import annotations

import os

TIER = os.environ.get("FSDP_SYNC_SGLANG_TIER") == "1"

if not TIER:
    collect_ignore_glob = ["test_*.py"]
else:
    import sglang  # noqa: F401  (fails the run loudly when sglang is not installed)

