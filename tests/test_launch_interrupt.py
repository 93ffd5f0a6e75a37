"""Ctrl-C during a `run_ranks` job (cli3 audit D5): the job is left at once and its ranks are
stopped, even those in a collective, which would otherwise wait out their process-group timeout.

Before: the launcher joined each rank 10 s (an interrupt leaves no failure), so ``fsdp-sync
demo`` took 7-29 s to return; a second Ctrl-C broke off that join before any rank was
terminated, and the interpreter's exit waited for the ranks (not daemons) to their 60 s timeout.
The job runs in a subprocess (a SIGINT to pytest's own process would end the test run); its ranks
write their pids, so the test checks each is gone, not only the subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from _util import ROOT

HERE = Path(__file__).resolve().parent


def sit_in_a_collective(rank: int, world: int, marks: str) -> None:
    """Rank 0 waits in a barrier, rank 1 for a tensor rank 0 never sends: both inside gloo, where
    a Ctrl-C does not reach Python; only the process group's timeout (60 s) would end them."""
    import torch
    import torch.distributed as dist

    Path(marks, f"rank{rank}").write_text(str(os.getpid()))
    if rank == 0:
        dist.barrier()
    else:
        dist.recv(torch.zeros(1), src=0)


# The job restores Python's Ctrl-C handler first: started from a shell's background job (``make
# test &``, nohup) pytest and every child inherit SIGINT ignored, and Python then installs no
# handler of its own; a launcher started from a terminal, as a user's, has it.
_JOB = """
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from fsdp_sync.cli.launch import run_ranks
from test_launch_interrupt import sit_in_a_collective
run_ranks(sit_in_a_collective, 2, sys.argv[1], timeout_s=120, pg_timeout_s=60)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["parent", "terminal-twice"])
def test_ctrl_c_stops_a_job_whose_ranks_sit_in_a_collective_within_seconds(how, tmp_path):
    """``parent``: SIGINT to the launcher alone (the ranks are not interrupted, as after a first
    Ctrl-C they already took); ``terminal-twice``: Ctrl-C as a terminal sends it, to the whole
    process group, then again 0.3 s later."""
    marks = tmp_path / "marks"
    marks.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]), OMP_NUM_THREADS="1",
               FSDP_SYNC_RANKS_START="spawn", TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", _JOB, str(marks)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(pids) < 2:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the ranks did not start within 60 s"
            pids = [int(p.read_text()) for p in marks.glob("rank*") if p.read_text()]
            time.sleep(0.1)
        time.sleep(1.0)                      # rank 0 is in its barrier
        t0 = time.monotonic()
        if how == "parent":
            os.kill(proc.pid, signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.3)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the launcher still ran 30 s after Ctrl-C")
        took = time.monotonic() - t0
        assert proc.returncode in (-signal.SIGINT, 130), (proc.returncode, out[-3000:])
        assert "KeyboardInterrupt" in out, out[-3000:]
        assert took < 5.0, f"the launcher took {took:.1f} s to return after Ctrl-C"
        left = [p for p in pids if not _gone(p)]
        assert not left, f"ranks {left} still run after the launcher returned"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)     # the job's ranks: this test started them


def test_a_ctrl_c_while_finished_ranks_exit_is_held_and_delivered_after_they_are_stopped():
    """The normal path keeps its behaviour: a Ctrl-C that lands while the ranks of a job that
    finished are joined still arrives, once they are stopped, as a KeyboardInterrupt."""
    from fsdp_sync.cli import launch

    before = signal.getsignal(signal.SIGINT)
    if before is not signal.default_int_handler:
        pytest.skip(f"this process's SIGINT handler is {before!r}, not Python's KeyboardInterrupt")

    class Slow:
        def __init__(self):
            self.alive, self.stopped = True, False

        def is_alive(self):
            return self.alive

        def join(self, timeout=None):
            time.sleep(min(timeout or 0.0, 0.05))

        def terminate(self):
            self.alive, self.stopped = False, True

        kill = terminate

    p = Slow()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with launch._HeldInterrupts(drop=False) as held:
            os.kill(os.getpid(), signal.SIGINT)        # held: no KeyboardInterrupt here
            launch._stop([p], 10.0, held)
    assert p.stopped and time.monotonic() - t0 < 2.0
    assert signal.getsignal(signal.SIGINT) is before
