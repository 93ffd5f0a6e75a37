"""Tests that kill mutants of the reference engine's core that the suite let live (H1 mutation
pass over engines/reference/engine.py, scheduler.py, procs.py, worker.py, staging.py). Each says
which mutant it kills: the bug it stands for, and what a user would see."""

from __future__ import annotations

import threading
import time
import warnings

import pytest

from fsdp_sync.engines import EngineUnavailableError, ReferenceEngine
from fsdp_sync.models import build_model, load_config
from fsdp_sync.weights.handles import UnreleasedPayloadWarning

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[11, 27, 93, 5], [7, 8]]


def _state(seed: int) -> list:
    return list(build_model(load_config("tiny"), seed=seed).state_dict().items())


def _engine(tp: int = 1) -> ReferenceEngine:
    return ReferenceEngine("tiny", tp_size=tp, kv_cache_tokens=512, call_timeout_s=60, pg_timeout_s=30)


def _in_thread(fn, timeout: float):
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["value"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return out.get("value", TimeoutError(f"still running after {timeout}s"))


def test_an_update_refused_at_its_wait_limit_holds_no_request_back():
    """scheduler.exclusive, mutant: the hold an update took is not given back when its wait for
    running requests ends in a refusal (`wait_limit`). Every later request then waited forever."""
    with _engine() as e:
        first = threading.Thread(target=e.generate, args=([[1, 2, 3]] * 8, 250), kwargs={"ignore_eos": True},
                                 daemon=True)
        first.start()
        deadline = time.monotonic() + 60
        while e._sched.stats()["steps"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert e._sched.stats()["running"] >= 1
        with e.wait_limit(0), pytest.raises(EngineUnavailableError, match="did not finish within the wait"):
            e.update_weights_from_tensor(_state(3))
        first.join(60)
        assert not first.is_alive()
        assert e._sched.stats()["updates_waiting"] == 0
        got = _in_thread(lambda: e.generate(PROMPTS, 3), 30)
        assert isinstance(got, list) and [len(t) for t in got] == [3, 3], got


def test_an_update_interrupted_while_staging_leaves_nothing_staged_on_any_rank():
    """engine._two_phase, mutant: an interrupt (Ctrl-C) while the workers stage is not followed by
    an abort round, so every worker keeps its staged call: the next update was refused ("an earlier
    update on this rank was neither committed nor aborted") although the engine was healthy."""
    old, new = _state(7), _state(9)
    with _engine(tp=2) as ref:
        ref.update_weights_from_tensor(new)
        want = ref.shard_checksums()
    with _engine(tp=2) as e:
        e.update_weights_from_tensor(old)
        before = e.shard_checksums()
        real = e._collect
        fired = []

        def interrupted(seq, ranks, what, timeout):
            got = real(seq, ranks, what, timeout)
            if what.startswith("update_weights_from_tensor") and "(" not in what[27:] and not fired:
                fired.append(what)
                raise KeyboardInterrupt          # after every worker staged, before the commit
            return got

        e._collect = interrupted
        with pytest.raises(KeyboardInterrupt):
            e.update_weights_from_tensor(new)
        assert fired and e.dead_reason() is None
        assert e.shard_checksums() == before
        e.update_weights_from_tensor(new)        # the next update goes through
        assert e.shard_checksums() == want


def test_an_update_releases_its_payloads_itself():
    """engine._update_from_tensor, mutant: the call's payload sets are not released after the
    workers answered, and only the garbage collector gave their shared memory back (on CUDA a
    sender's IPC blocks then wait for it), with an UnreleasedPayloadWarning each."""
    with _engine(tp=2) as e:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            e.update_weights_from_tensor(_state(5))
            e.update_weights_from_tensor([(n, t) for n, t in _state(6)][:3])
        assert not [w for w in seen if issubclass(w.category, UnreleasedPayloadWarning)]


def test_a_row_that_fills_the_kv_cache_exactly_runs():
    """scheduler._Slots.take, mutant: a free run exactly as long as a row needs is not taken (``>``
    for ``>=``), so a request that fits the KV cache exactly waited forever."""
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=24, call_timeout_s=60) as e:
        prompt = [3, 1, 4, 1]
        n = e.kv_cache_tokens - len(prompt) + 1          # prompt + n - 1 slots: all of them
        got = _in_thread(lambda: e.generate([prompt], n, ignore_eos=True), 30)
        assert isinstance(got, list) and len(got[0]) == n, got
        assert e._sched.stats()["kv_free"] == e.kv_cache_tokens


def test_an_end_that_fails_inside_its_commit_breaks_the_engine(monkeypatch):
    """engine._end_failed, mutant: a rank whose end failed after its body began (it may have written
    part of the staged weights) is counted as having dropped its transaction, and the caller was
    told "nothing was committed; the engine keeps its previous weights" while it served whatever
    that rank had written."""
    from fsdp_sync.engines import EngineError, WeightUpdateError, WorkerDiedError
    from fsdp_sync.faultpoint import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "worker:0:end_apply:raise")
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=60) as e:
        e.update_weights_from_tensor(_state(7))      # valid weights: the transaction stages aside
        e.begin_weight_update()
        e.update_weights_from_tensor(_state(9))
        with pytest.raises(EngineError, match=r"TP ranks \[0\] may have written part of the update") as err:
            e.end_weight_update()
        assert not isinstance(err.value, WeightUpdateError)
        assert "inconsistent" in (e.dead_reason() or "")
        with pytest.raises(WorkerDiedError):
            e.generate(PROMPTS, 1)


def test_an_abort_asked_during_the_step_that_ends_the_row_changes_nothing():
    """scheduler._take_drops, mutant: a row aborted while the step that ends it runs is finished a
    second time at the next step; its call's count of rows left then reached 0 early, and the call
    returned while its other row was still generating (cut short, no finish reason)."""
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=60) as e:
        real, done = e._call, []

        def aborting(cmd, args=None, **kw):
            if cmd == "gen_step" and not done:   # row 0 is admitted in this step, and ends in it
                done.append(1)
                row = next(r for r in e._sched._running if r.index == 0)
                e._sched.abort(row.call, 0, "aborted too late")
            return real(cmd, args, **kw)

        e._call = aborting
        sps = [{"max_new_tokens": 1, "ignore_eos": True}, {"max_new_tokens": 6, "ignore_eos": True}]
        got = _in_thread(lambda: e.generate_requests([[5, 6, 7], [8, 9]], sps), 30)
        assert done and isinstance(got, list), got
        assert [len(r["output_ids"]) for r in got] == [1, 6]
        assert [r["finish_reason"]["type"] for r in got] == ["length", "length"]


def test_shutdown_ends_a_silent_worker_without_a_grace_wait(monkeypatch):
    """procs.WorkerSet.stop, mutant: a worker that let a call time out (it reads no more) is given
    the same grace period as the others to read its shutdown; each stalled worker cost that long."""
    import psutil

    from fsdp_sync.engines import EngineError
    from fsdp_sync.faultpoint import FAULT_ENV

    monkeypatch.setenv(FAULT_ENV, "worker:1:stage:stall")
    e = ReferenceEngine("tiny", tp_size=2, kv_cache_tokens=16, call_timeout_s=2.0, pg_timeout_s=30)
    pids = list(e.worker_pids)
    try:
        with pytest.raises(EngineError, match=r"TP ranks \[1\] did not answer"):
            e.update_weights_from_tensor(_state(3))
    finally:
        t0 = time.monotonic()
        e.shutdown()
        took = time.monotonic() - t0
    assert took < 3.5, took          # the grace period is 5 s
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_an_abort_while_paused_in_place_steps_no_other_row():
    """scheduler._step, mutant: the step an abort runs while generation is paused (to drop the row)
    also admitted and decoded the other rows: paused in place, they went on generating, with
    whatever weights were being loaded under the pause."""
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=60) as e:
        e._sched.pause_after(3)                  # paused in place at the end of step 3
        got: dict = {}
        t = threading.Thread(target=lambda: got.setdefault("out", e.generate([[5, 6, 7], [8, 9]], 12,
                                                                            ignore_eos=True)), daemon=True)
        t.start()
        deadline = time.monotonic() + 60
        while e._sched.paused != "in_place" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert e._sched.paused == "in_place"
        rows = sorted(e._sched._running, key=lambda r: r.index)
        assert [len(r.output) for r in rows] == [3, 3]
        e._sched.abort(rows[0].call, 0, "dropped while paused")
        deadline = time.monotonic() + 10
        while rows[0].finish is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
        assert rows[0].finish is not None and len(rows[1].output) == 3     # the other row stood still
        e.continue_generation()
        t.join(30)
        assert [len(x) for x in got["out"]] == [3, 12]
