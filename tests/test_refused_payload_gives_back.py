"""A tagged payload refused while it is unpickled, after its storage was mapped (here: a tensor view
one element past its shared-memory segment), gives back the reference the mapping took. Before, the
reference stayed taken: the payload's state word still read fresh, so the producer's release
revoked it and gave back the pickling's reference only, and the segment stayed in /dev/shm until
the producer exited (found by the third mutation pass). A consumer of another process opens it, as
an engine worker does."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from fsdp_sync.weights import handles
from fsdp_sync.weights.handles import make_payloads

from _util import ROOT

CHILD = ("import sys\nfrom fsdp_sync.weights.handles import HandleError, open_payload\n"
         "try:\n    open_payload(sys.stdin.buffer.read(), 0)\n    print('opened')\n"
         "except HandleError as exc:\n    print('refused:', exc)\n")


def _segments() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_"))


def test_a_payload_refused_after_mapping_leaves_no_segment(monkeypatch):
    before = _segments()
    orig = handles.torch_reduce_tensor

    def reduce(t):
        fn, args = orig()(t)
        if t.dtype == torch.float32:        # the weight's view: one element past its 4
            return fn, (args[0], args[1], (0, (5,), (1,), False))
        return fn, args

    monkeypatch.setattr(handles, "torch_reduce_tensor", lambda: reduce)
    ps = make_payloads({"w": torch.arange(4, dtype=torch.float32)}, 1)       # tagged, the default
    monkeypatch.setattr(handles, "torch_reduce_tensor", orig)
    try:
        out = subprocess.run([sys.executable, "-c", CHILD], input=ps.payloads[0], capture_output=True,
                             timeout=60, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert out.stdout.decode().startswith("refused:") and "view" in out.stdout.decode(), out
    finally:
        ps.release(require_ack=False)
        del ps
    assert _segments() == before
