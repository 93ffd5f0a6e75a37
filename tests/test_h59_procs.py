"""H59's audit of the reference engine's worker processes (`engines.reference.procs`): what
mutants survived the suite.

- A worker started as a fresh interpreter (the default outside the test suite, which forks them
  from a forkserver) that dies mid-call is seen through its sentinel (EOF: no hang), its exit
  code names the signal, and `WorkerSet.stop` (twice: idempotent) leaves no process and no fd.
  The workers here run a stdlib target (``multiprocessing.connection:wait`` on their pipe), so no
  torch import: a fraction of a second each.
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
def test_a_fresh_worker_killed_mid_call_is_seen_and_stop_leaves_nothing(monkeypatch):
    monkeypatch.setenv("FSDP_SYNC_WORKERS_START", "fresh")
    ws = procs.WorkerSet()
    for r in range(2):      # each blocks reading its pipe, as a worker in a call waits on a peer
        p, c = procs.start("multiprocessing.connection:wait", (None,), f"fsdp_sync-engine-tp{r}")
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
        assert ws.procs[1].exitcode == -signal.SIGKILL
        assert procs.signame(ws.procs[1].exitcode) == ", SIGKILL" and procs.signame(1) == ""
    finally:
        ws.stop(grace_s=5.0)
    pids = [p.pid for p in ws.procs]
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
