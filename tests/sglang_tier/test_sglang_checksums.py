"""`engines.sglang.checksums.gpu_hash` (torch) against SGLang's own GPU tensor hash: its Triton
kernels (``sglang/kernels/ops/memory/gpu_tensor_hash.py``) run by Triton's interpreter on CPU
(`sglang_hash.py`, a subprocess of its own: ``TRITON_INTERPRET`` must be set before triton is
imported). Several tiles, a partial last tile, an odd byte count (zero-padded to words), a
non-contiguous view, several tree-reduction rounds, one word and an empty tensor.

The CPU hash (sha256) is checked against SGLang's WeightChecker in `test_sglang_layout`.
Not checked here: the kernel compiled for a GPU (the interpreter runs the same program with numpy
integer semantics; a GPU run needs a CUDA device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

HERE = Path(__file__).resolve().parent


@pytest.mark.timeout(200)
def test_gpu_hash_equals_sglangs_triton_kernel():
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent))
    proc = subprocess.run([sys.executable, "-W", "ignore", str(HERE / "sglang_hash.py")],
                          capture_output=True, text=True, timeout=180, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, f"sglang_hash.py failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    rows = json.loads(line[len("RESULT "):])
    assert len(rows) == 7
    for label, theirs, ours in rows:
        assert theirs == ours, (label, theirs, ours)
    assert len({theirs for _, theirs, _ in rows}) == 7      # distinct inputs, distinct hashes
