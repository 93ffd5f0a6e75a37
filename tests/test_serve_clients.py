"""An HTTP client of `fsdp-sync serve` leaves nothing behind that holds its stdio (issue 21 item 5).

A client that sends one bucket update (`SGLangEngine(base_url=...)`) makes CPU shared memory, which
starts its process's ``torch_shm_manager``; the served engine opened the client's payload and keeps
its connection to that manager until the server exits, so the manager outlives the client. It
inherited the client's stderr, so ``client 2>&1 | tail`` never ended. The client's pipe must now
reach EOF when the client exits."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer

ROOT = Path(__file__).resolve().parent.parent
CLIENT = """
import sys, torch
from fsdp_sync.engines.sglang import SGLangEngine
c = SGLangEngine(base_url=sys.argv[1], tp_size=1, max_retries=0)
shape = tuple(c.get_weights_by_name("model.norm.weight").shape)
c.update_weights_from_bucket([("model.norm.weight", torch.full(shape, 3.0))])
print("updated", flush=True)
print("to stderr", file=sys.stderr, flush=True)
"""


def _managers() -> set[int]:
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "torch_shm_manager"}


@pytest.mark.timeout(120)
def test_a_clients_shm_manager_does_not_hold_its_stdio():
    with ReferenceEngine("tiny", tp_size=1) as eng, EngineServer(eng) as srv:
        before = _managers()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.Popen([sys.executable, "-c", CLIENT, srv.url], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=90)     # EOF on the pipe: nobody else holds it
        assert proc.returncode == 0 and "updated" in out and "to stderr" in out, out
        assert time.monotonic() - t0 < 60
        assert float(eng.get_weights_by_name("model.norm.weight")[0]) == 3.0
        # the client's manager lives on while the server holds its segment, but holds no pipe
        for pid in _managers() - before:
            try:
                fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            except (FileNotFoundError, ProcessLookupError):
                continue                          # it has exited
            assert not any(f.startswith("pipe:") for f in fds - {os.readlink(f"/proc/{pid}/fd/1")}
                           ), (pid, fds)
