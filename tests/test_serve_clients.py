"""An HTTP client of `fsdp-sync serve` leaves nothing behind (issue 21 item 5).

A client that sends one bucket update (`SGLangEngine(base_url=...)`) makes CPU shared memory, which
starts its process's ``torch_shm_manager``. The served engine opened the client's payload through
torch's rebuild, which connected the server (and its workers) to that manager for good, so the
manager outlived the client until serve stopped: one process per client run. It also inherited the
client's stderr, so ``client 2>&1 | tail`` never ended. The client's pipe must now reach EOF when
the client exits, and its manager must be gone seconds later while serve still runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from _util import start_serve

ROOT = Path(__file__).resolve().parent.parent
CLIENT = """
import sys, psutil, torch
from fsdp_sync.engines.sglang import SGLangEngine
c = SGLangEngine(base_url=sys.argv[1], tp_size=1, max_retries=0)
shape = tuple(c.get_weights_by_name("model.norm.weight").shape)
c.update_weights_from_bucket([("model.norm.weight", torch.full(shape, 3.0))])
mine = [p.pid for p in psutil.Process().children() if p.name() == "torch_shm_manager"]
print("managers", *mine, flush=True)
print("updated", flush=True)
print("to stderr", file=sys.stderr, flush=True)
"""


@pytest.mark.timeout(120)
def test_a_clients_shm_manager_does_not_hold_its_stdio():
    with ReferenceEngine("tiny", tp_size=1) as eng, EngineServer(eng) as srv:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.Popen([sys.executable, "-c", CLIENT, srv.url], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=90)     # EOF on the pipe: nobody else holds it
        assert proc.returncode == 0 and "updated" in out and "to stderr" in out, out
        assert time.monotonic() - t0 < 60
        assert float(eng.get_weights_by_name("model.norm.weight")[0]) == 3.0
        # the client's manager lives on while the server holds its segment, but holds no pipe
        # (the client names its own: another test process's managers may run beside it)
        mine = {int(x) for line in out.splitlines() if line.startswith("managers") for x in line.split()[1:]}
        assert mine, out                          # the bucket update made shared memory
        for pid in mine:
            try:
                fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
                stdout = os.readlink(f"/proc/{pid}/fd/1")   # inside: it may exit between the two reads
            except (FileNotFoundError, ProcessLookupError):
                continue                          # it has exited
            assert not any(f.startswith("pipe:") for f in fds - {stdout}), (pid, fds)


# One bucket update (the workers open it) and one direct update (the server process opens it);
# then the client names its own torch_shm_manager(s) before it exits.
CLIENT_MANAGERS = """
import sys, psutil, torch
from fsdp_sync.engines.sglang import SGLangEngine
c = SGLangEngine(base_url=sys.argv[1], tp_size=2, max_retries=0)
shape = tuple(c.get_weights_by_name("model.norm.weight").shape)
c.update_weights_from_bucket([("model.norm.weight", torch.full(shape, 3.0))])
c.update_weights_from_tensor([("model.norm.weight", torch.full(shape, 4.0))])
assert float(c.get_weights_by_name("model.norm.weight").flatten()[0]) == 4.0
mine = [p.pid for p in psutil.Process().children() if p.name() == "torch_shm_manager"]
print("managers", *mine, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(180)
def test_a_clients_shm_manager_exits_with_the_client_while_serve_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    serve, url = start_serve("--tp", "2", env=env)
    try:
        client = subprocess.run([sys.executable, "-c", CLIENT_MANAGERS, url], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stdout + client.stderr
        mine = [int(p) for p in client.stdout.split("managers", 1)[1].split()]
        assert mine, client.stdout                 # the client did start one
        # a manager exits 2 s after its last client leaves; it has only the client's own
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in mine) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert serve.poll() is None                # serve still runs ...
        left = [p for p in mine if _alive(p)]
        assert not left, f"the client's torch_shm_manager {left} outlives it while serve runs"
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait(timeout=10)
