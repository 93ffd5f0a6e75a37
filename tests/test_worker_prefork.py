"""`procs.prefork_worker_server`: a `run_ranks` rank under ``FSDP_SYNC_WORKERS_START=forkserver``
(as this suite runs them) forks its engine workers' forkserver from itself when it starts, instead of
multiprocessing starting a fresh interpreter at the first worker, which imports torch once more
(2.2-2.8 s of a core, once per rank job that starts an engine: about 80 in `make test`).

Checked: the server is the rank's only child at its start and a fork of it (the rank's command
line, the rank its parent); the engine's workers are that server's children; the engine generates
the same greedy tokens as one whose workers come from this test process's own forkserver; the
server is gone once the job ends; a rank started without the setting forks nothing; and a process
that initialized CUDA, asked for its GPUs (torch then marks its forks bad for CUDA), or runs another
thread, forks nothing either."""

from __future__ import annotations

import time

import psutil
import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.engines import ReferenceEngine

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7]]


def _job(rank: int, world: int) -> dict:
    me = psutil.Process()
    at_start = [c.pid for c in me.children()]
    forks = [c.pid for c in me.children() if c.cmdline() == me.cmdline()]
    engine = ReferenceEngine(model_config="tiny", tp_size=2, pg_timeout_s=30)
    try:
        parents = [psutil.Process(p.pid).parent() for p in engine._w.procs]
        return {"pid": me.pid, "at_start": at_start, "forks": forks,
                "parents": [p.pid for p in parents],
                "parents_parent": [p.ppid() for p in parents],
                "tokens": engine.generate(PROMPTS, 6)}
    finally:
        engine.shutdown()


@pytest.mark.timeout(120)
def test_a_ranks_workers_fork_from_a_server_forked_from_the_rank():
    (out,) = run_ranks(_job, 1, timeout_s=100, env=spawn_env({"FSDP_SYNC_WORKERS_START": "forkserver"}))
    assert len(out["at_start"]) == 1 and out["forks"] == out["at_start"], out
    server = out["at_start"][0]
    assert out["parents"] == [server, server], out           # both TP workers forked by it
    assert out["parents_parent"] == [out["pid"]] * 2, out     # and it by the rank
    with ReferenceEngine(model_config="tiny", tp_size=2, pg_timeout_s=30) as here:
        assert out["tokens"] == here.generate(PROMPTS, 6)
    deadline = time.monotonic() + 5
    while psutil.pid_exists(server) and psutil.Process(server).status() != psutil.STATUS_ZOMBIE \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE


@pytest.mark.timeout(120)
def test_without_the_forkserver_start_a_rank_forks_nothing():
    (out,) = run_ranks(_job, 1, timeout_s=100, env=spawn_env({"FSDP_SYNC_WORKERS_START": "fresh"}))
    assert out["at_start"] == [] and out["forks"] == [], out
    assert out["parents"] == [out["pid"]] * 2, out            # fresh interpreters, the rank's own



CHECK = """
import os, threading, torch
from fsdp_sync.engines.reference import procs
os.environ["FSDP_SYNC_WORKERS_START"] = "forkserver"
real = torch.cuda.is_initialized
torch.cuda.is_initialized = lambda: True    # as after the first CUDA call of a GPU rank
print("cuda", procs.prefork_worker_server())
torch.cuda.is_initialized = real
real_version, real_probe = torch.version.cuda, getattr(torch._C, "_cuda_isInBadFork", None)
torch.version.cuda = real_version or "13.0"     # a CUDA build whose forks torch marks bad, as after
torch._C._cuda_isInBadFork = lambda: True       # torch.cuda.is_available() (is_initialized: False)
print("asked", procs.prefork_worker_server())
torch.version.cuda = real_version
if real_probe is None:
    del torch._C._cuda_isInBadFork
else:
    torch._C._cuda_isInBadFork = real_probe
stop = threading.Event()
t = threading.Thread(target=stop.wait, args=(30,))
t.start()
print("thread", procs.prefork_worker_server())
stop.set()
t.join()
print("plain", procs.prefork_worker_server())
"""


@pytest.mark.timeout(120)
def test_no_fork_once_cuda_is_initialized_or_another_thread_runs():
    """A process that initialized CUDA (a GPU rank past its first CUDA call) must not fork the
    server its workers come from: a fork of it cannot use the GPU. Nor may one with another thread
    (a fork keeps only the calling one, and whatever locks the others held). Then, with neither,
    it does."""
    import sys

    from _util import run_output

    r = run_output([sys.executable, "-c", CHECK], timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["cuda", "False", "asked", "False", "thread", "False", "plain", "True"], \
        (r.stdout, r.stderr[-1000:])


REAL = """
import os, sys, torch
from fsdp_sync.engines.reference import procs
os.environ["FSDP_SYNC_WORKERS_START"] = "forkserver"
if sys.argv[1] == "asked":
    torch.cuda.is_available()
print(sys.argv[1], torch.cuda.is_initialized(), procs.prefork_worker_server())
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch (no GPU needed)")
@pytest.mark.parametrize("asked", [False, True], ids=["plain", "after_is_available"])
def test_no_fork_once_the_process_asked_for_its_gpus(asked):
    """torch's own marking, not a fake: on a CUDA build, ``torch.cuda.is_available()`` (which asks
    the driver for its GPUs) leaves ``is_initialized()`` False but makes every later fork of the
    process a bad fork for CUDA, so engine workers forked from a server forked then could not use
    the GPU. Such a rank starts no server; one that never asked does. Runs on the GPU machine's
    build, with or without a GPU (torch 2.11.0+cu130 on a CPU host: see docs/gpu.md)."""
    import sys

    from _util import run_output

    arg = "asked" if asked else "plain"
    r = run_output([sys.executable, "-c", REAL, arg], timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == [arg, "False", str(not asked)], (r.stdout, r.stderr[-1000:])
