"""H59's audit of the reference engine's worker processes (`engines.reference.procs`): what
mutants survived the suite.

- A worker started as a fresh interpreter (the default outside the test suite, which forks them
  from a forkserver) that dies mid-call is seen through its sentinel (EOF: no hang), its exit
  code names the signal, and `WorkerSet.stop` (twice: idempotent) leaves no process and no fd.
  The workers here run a three-line target that reads its pipe, so no torch import: a fraction
  of a second each.
(The tied-head gap is tested in test_tied_head.py, beside its engine fixture.)
"""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import wait

import pytest

from fsdp_sync.engines.reference import procs


def _open_files() -> set[str]:
    """What this process's fds point at (``pipe:[inode]``, ``socket:[inode]``, paths): compared
    by what they are, not by count, so another thread's fds (gloo's, pytest's) do not matter."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass                            # closed meanwhile (the listing's own fd)
    return out


@pytest.mark.timeout(60)
def test_a_fresh_worker_killed_mid_call_is_seen_and_stop_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("FSDP_SYNC_WORKERS_START", "fresh")
    (tmp_path / "h59_worker.py").write_text(     # waits on its pipe for the shutdown
        "def serve(conn):\n    conn.recv_bytes()\n")
    monkeypatch.syspath_prepend(str(tmp_path))    # the child takes this sys.path
    ws = procs.WorkerSet()
    for r in range(2):      # each blocks reading its pipe, as a worker in a call waits on a peer
        p, c = procs.start("h59_worker:serve", (), f"fsdp_sync-engine-tp{r}")
        ws.procs.append(p)
        ws.conns.append(c)
    ours = {os.readlink(f"/proc/self/fd/{fd}")
            for fd in [p.sentinel for p in ws.procs] + [c.fileno() for c in ws.conns]}
    assert len(ours) == 4           # two pipes, two sockets
    try:
        assert all(p.is_alive() for p in ws.procs)
        assert wait([p.sentinel for p in ws.procs], timeout=0.2) == []     # running: not ready
        os.kill(ws.procs[1].pid, signal.SIGKILL)
        # the sentinel's only write end was the child's: its death makes it readable, at once
        assert wait([p.sentinel for p in ws.procs], timeout=30) == [ws.procs[1].sentinel]
        ws.procs[1].join(timeout=30)
        assert ws.procs[1].exitcode == -signal.SIGKILL and ws.procs[0].is_alive()
        assert procs.signame(ws.procs[1].exitcode) == ", SIGKILL" and procs.signame(1) == ""
    finally:
        ws.stop(grace_s=5.0)
    pids = [p.pid for p in ws.procs]
    assert ws.procs[0].exitcode == 0         # it read the shutdown
    assert all(not p.is_alive() for p in ws.procs) and ws.closed
    ws.stop()                               # again: nothing to do, nothing raised
    assert all(p.sentinel == -1 for p in ws.procs)
    for pid in pids:                        # reaped: no zombie left
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    assert not ours & _open_files()         # the sentinels and pipes are closed


def test_only_a_dead_owners_unbound_forkserver_dir_is_removed():
    """`remove_dead_temp_dirs` keeps a live owner's directory even with no socket in it yet (a
    process between `claim_temp_dir` and its forkserver), and a dead owner's in which a live
    process still has a socket bound (its forkserver, reparented); each check alone (mutants P8,
    P9) passed test_launchers' killed-tree test, where the live owner's socket kept its directory."""
    import shutil
    import socket
    import subprocess
    import sys
    import tempfile

    root = tempfile.mkdtemp(prefix="h59", dir="/tmp")      # short: an AF_UNIX path goes in it
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    sock = socket.socket(socket.AF_UNIX)
    try:
        pre = procs.TEMP_DIR_PREFIX
        live = os.path.join(root, f"{pre}{os.getpid()}-live")
        dead = os.path.join(root, f"{pre}{gone.pid}-dead")
        held = os.path.join(root, f"{pre}{gone.pid}-held")
        for d in (live, dead, held):
            os.mkdir(d)
        sock.bind(os.path.join(held, "listener-x"))
        assert procs.remove_dead_temp_dirs(root) == [dead]
        assert sorted(os.listdir(root)) == sorted(os.path.basename(d) for d in (live, held))
    finally:
        sock.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_cpu_kv_cache_from_mem_fraction_is_a_tp_ranks_share_of_the_host():
    """On CPU the TP ranks share the host's memory: each sizes its KV cache from ``mem_fraction``
    of 1/tp of it (mutant R7, the whole host for every rank, survived every test: TP 2 at 0.5 would
    ask for the whole host). `regions.MemoryRegions._kv_budget` on a stand-in worker: no process."""
    from types import SimpleNamespace

    import psutil
    import torch

    from fsdp_sync.engines.reference.errors import WorkerError
    from fsdp_sync.engines.reference.regions import MemoryRegions

    spec = SimpleNamespace(num_layers=2, head_dim=8)
    total = psutil.virtual_memory().total

    def budget(tp: int, frac: float, weights: int) -> int:
        w = SimpleNamespace(opts={"mem_fraction": frac}, device=torch.device("cpu"), tp=tp, rank=1,
                            dtype=torch.float32, layout=SimpleNamespace(spec=spec, kv_local=2),
                            model=SimpleNamespace(nbytes=lambda: weights))
        r = MemoryRegions.__new__(MemoryRegions)
        r.w = w
        return r._kv_budget()

    per_token = 2 * 2 * 2 * 8 * 4
    for tp in (1, 2, 4):
        assert budget(tp, 0.25, 1 << 20) == int((0.25 * total / tp - (1 << 20)) // per_token)
    # weights that fill a rank's share leave no room: refused naming the rank
    with pytest.raises(WorkerError, match="leaves no room for a KV cache .* on TP rank 1"):
        budget(2, 0.5, int(0.5 * total / 2) + 1)
