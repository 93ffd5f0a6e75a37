"""`cli.launch.run_ranks`: a rank that dies without a result, or runs past the job's deadline,
fails the job with a `RankError` naming it, and every rank process is gone when it returns
(audit H30: launch.py had no mutation pass; its dead-rank check and deadline were only reached
through whole syncs, whose messages the tests matched loosely). `spawn_env` in process.

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
    """Writes its pid, then does what ``how`` says for its rank: ``exit`` (os._exit with that
    code, no result), ``sleep`` (far past any deadline here), or returns its rank."""
    Path(marks, f"rank{rank}").write_text(f"{os.getpid()} {os.environ.get('H30_MARK')}")
    what = how.get(rank)
    if what == "sleep":
        time.sleep(300)
    elif isinstance(what, int):
        os._exit(what)
    return rank


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
                  env=spawn_env())
    assert str(info.value) == "rank 1 exited with code 0 without a result"
    pids = _pids(tmp_path)      # rank 0 may have been stopped before it wrote its own
    assert (tmp_path / "rank1").exists() and all(_gone(p) for p in pids), pids


@pytest.mark.timeout(120)
def test_a_rank_past_the_deadline_fails_the_job_naming_it_and_is_stopped(tmp_path):
    with pytest.raises(RankError) as info:
        run_ranks(dies_or_sleeps, 2, str(tmp_path), {1: "sleep"}, timeout_s=2.5,
                  env=spawn_env({"H30_MARK": "m"}))
    # rank 0 returned at once; under load it may not have reached the launcher before the deadline
    assert str(info.value) in ("ranks [1] passed the 2.5s deadline of dies_or_sleeps",
                               "ranks [0, 1] passed the 2.5s deadline of dies_or_sleeps")
    pids = _pids(tmp_path, "m")
    assert all(_gone(p) for p in pids), pids
    if str(info.value).startswith("ranks [1]"):     # rank 0 returned: it ran with the job's env
        assert (tmp_path / "rank0").exists()
