"""`cli.launch.run_ranks`: a rank that dies without a result (whatever its exit code) fails the
job at once with a `RankError` naming it, a rank that fails to start stops those already started,
and every rank process is gone when it returns (audit H30: launch.py had no mutation pass; its
dead-rank check was only reached through whole syncs, whose messages the tests matched loosely;
its deadline's message is pinned by tests/test_demo_methods.py). `spawn_env` in process.

Each job is 2 gloo ranks of a few lines (forked from the suite's forkserver); the ranks that
must be stopped sit in ``time.sleep``, outside any collective, so nothing here waits on a
process-group timeout, and no assertion depends on how fast the machine is.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from fsdp_sync.cli.launch import RankError, run_ranks, spawn_env


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def dies_or_sleeps(rank: int, world: int, marks: str, how: dict) -> int:
    """Writes its pid, waits until every rank has (all are past the rendezvous: a rank leaving
    earlier could fail another's ``init_process_group``), then does what ``how`` says for its
    rank: an int (os._exit with that code, no result), ``sleep`` (far past any deadline here),
    or nothing (returns its rank)."""
    tmp = Path(marks, f".rank{rank}")
    tmp.write_text(f"{os.getpid()} {os.environ.get('H30_MARK')}")
    tmp.rename(Path(marks, f"rank{rank}"))
    until = time.monotonic() + 60
    while len(list(Path(marks).glob("rank*"))) < world and time.monotonic() < until:
        time.sleep(0.01)
    what = how.get(rank)
    if what == "sleep":
        time.sleep(300)
    elif isinstance(what, int):
        os._exit(what)
    return rank


def cause_and_symptom(rank: int, world: int, how: str) -> int:
    """Past a barrier (both ranks out of the rendezvous), rank 0 fails as ``how`` says while rank 1
    fails as a peer of a dead rank does: ``segv`` (rank 0 crashes with a segmentation fault, rank
    1's barrier then raises gloo's "Connection closed by peer") or ``late`` (rank 1 raises that message at once,
    rank 0 its own error 0.5 s later: the cause read second)."""
    import faulthandler

    import torch.distributed as dist

    dist.barrier()
    if rank == 0 and how == "segv":
        faulthandler._sigsegv()
    if rank == 0:
        time.sleep(0.5)
        raise ValueError(f"the cause (faulthandler on: {faulthandler.is_enabled()})")
    if how == "segv":
        dist.barrier()
    raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, lead", [
    ("segv", "rank 0 exited with code -11 without a result\n"),
    ("late", "rank 0 failed:\nTraceback"),
])
def test_the_rank_that_failed_first_leads_the_report(how, lead):
    """CI once reported only "rank 1 failed: ... Connection closed by peer" (tests/test_lora_sync_cache,
    make test): rank 0, the cause, had gone first, but rank 1's failure was read before it (or rank 0
    left no result). Now the job's report leads with the cause: a rank gone without a result (its
    exit code), else a failure that is not a peer's disappearance; the others follow, one line each.
    A rank that crashes prints where it was on its stderr (faulthandler, on in every rank)."""
    with pytest.raises(RankError) as info:
        run_ranks(cause_and_symptom, 2, how, timeout_s=60, pg_timeout_s=30, env=spawn_env())
    msg = str(info.value)
    assert msg.startswith(lead), msg
    if how == "late":
        assert "ValueError: the cause (faulthandler on: True)" in msg and msg.endswith(
            "rank 1 failed too: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1"), msg


def _pids(marks: Path, mark: str = "None") -> list[int]:
    """The pids the ranks wrote, each checked to have had the job's ``env`` (``H30_MARK``)."""
    got = [p.read_text().split() for p in sorted(marks.glob("rank*"))]
    assert all(m == mark for _, m in got), got
    return [int(pid) for pid, _ in got]


@pytest.mark.timeout(120)
def test_a_rank_that_exits_without_a_result_fails_the_job_naming_it(tmp_path):
    """Rank 1 leaves by os._exit(0) (no traceback, no result) while rank 0 sleeps: the job fails
    at once naming rank 1 and its exit code, and rank 0 is stopped. Before, only a non-zero
    code counted as dead: the job waited out its 100 s deadline, then blamed ranks [0, 1]."""
    with pytest.raises(RankError) as info:
        run_ranks(dies_or_sleeps, 2, str(tmp_path), {0: "sleep", 1: 0}, timeout_s=100,
                  env=spawn_env({"H30_MARK": "m"}))
    assert str(info.value) == "rank 1 exited with code 0 without a result"
    pids = _pids(tmp_path, "m")      # rank 1 left once both had written theirs, with the job's env
    assert len(pids) == 2 and all(_gone(p) for p in pids), pids


@pytest.mark.timeout(120)
def test_a_rank_that_fails_to_start_stops_those_already_started(monkeypatch, tmp_path):
    """Rank 1's start raises (a Ctrl-C or an OSError there): rank 0, already started and waiting in
    the rendezvous for rank 1, is stopped before the error leaves run_ranks. Before, the starts
    were outside the launcher's cleanup: rank 0 stayed until its process-group timeout, and the
    interpreter's exit waited for it (not a daemon)."""
    from fsdp_sync.cli import launch

    made, real = [], launch._context

    class _Ctx:
        def __init__(self, ctx):
            self.ctx = ctx

        def __getattr__(self, name):
            return getattr(self.ctx, name)

        def Process(self, *a, **kw):
            p = self.ctx.Process(*a, **kw)
            made.append(p)
            if kw["name"].endswith("rank1"):
                def start():
                    raise OSError("cannot start rank 1 (injected)")
                p.start = start
            return p

    monkeypatch.setattr(launch, "_context", lambda: _Ctx(real()))
    try:
        with pytest.raises(OSError, match="injected"):
            run_ranks(dies_or_sleeps, 2, str(tmp_path), {}, timeout_s=100, pg_timeout_s=60, env=spawn_env())
        assert len(made) == 2 and made[0].pid is not None
        assert not made[0].is_alive(), "rank 0 was left in the rendezvous"
    finally:
        if made and made[0].is_alive():
            made[0].kill()
            made[0].join()


def test_spawn_env_carries_fault_settings_and_the_callers_extra(monkeypatch):
    """Ranks forked from a forkserver started earlier see only what spawn_env hands them: this
    process's FSDP_SYNC_FAULT* settings (the fault tests' injections), one OMP thread unless set."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("FSDP_SYNC_FAULT", "trainer:1:sync:raise")
    monkeypatch.setenv("FSDP_SYNC_FAULT_AFTER", "2")
    monkeypatch.setenv("FSDP_SYNC_OTHER", "x")
    assert spawn_env() == {"OMP_NUM_THREADS": "1", "FSDP_SYNC_FAULT": "trainer:1:sync:raise", "FSDP_SYNC_FAULT_AFTER": "2"}
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert spawn_env()["OMP_NUM_THREADS"] == "4"
    assert spawn_env({"OMP_NUM_THREADS": "2", "A": "b"}) == {"OMP_NUM_THREADS": "2", "A": "b",
                                                              "FSDP_SYNC_FAULT": "trainer:1:sync:raise",
                                                              "FSDP_SYNC_FAULT_AFTER": "2"}


@pytest.mark.parametrize("drop", [True, False])
def test_a_ctrl_c_held_while_ranks_stop_is_dropped_only_when_the_job_is_already_left_by_one(drop):
    """`_HeldInterrupts`: a Ctrl-C held while the ranks are stopped is delivered afterwards, unless
    the job is already being left by an exception (the first Ctrl-C's): a second KeyboardInterrupt
    then replaced it mid-cleanup (a mutant delivering it always survived every test)."""
    import signal

    from fsdp_sync.cli.launch import _HeldInterrupts

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("this process's SIGINT handler is not Python's KeyboardInterrupt")
    delivered = False
    try:
        with _HeldInterrupts(drop=drop) as held:
            signal.raise_signal(signal.SIGINT)
            assert held.since < float("inf")        # held, not raised here
    except KeyboardInterrupt:
        delivered = True
    assert delivered is not drop
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
