"""The reference engine's scheduler gives back every KV-cache slot it took, to the workers as
to itself: mutants of `engines.reference.scheduler` that no test killed (H51's pass).

- `Scheduler._take_drops` not sending an aborted running row's id in the next step's ``remove``:
  the engine gave the row's slots back, but the workers kept decoding it into them, and the next
  request placed there read its keys and values among its own (other greedy tokens).
- `Scheduler.pause` (``retract``) not giving back the retracted rows' slots: each retract leaked
  their KV cache, until requests queued forever for room the cache had.
- `_Slots.give` not merging a freed run with its free neighbours: the cache fragmented, and a
  row needing more than any one run waited forever although the cache was empty.

One TP-1 engine with its start-up weights serves the module; the abort and the retract land
while generation is paused in place (`Scheduler.pause_after`), so no step races them."""

from __future__ import annotations

import threading
import time

import pytest

from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.reference.scheduler import _Slots

pytestmark = pytest.mark.timeout(120)

KV = 64
LONG = [201, 3, 64, 64, 17, 88, 42, 9, 120, 5, 6, 7, 8, 300, 301, 302, 11, 27, 93, 5]
SP = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def eng():
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=KV, call_timeout_s=60) as e:
        yield e


def wait_until(pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def paused_after_three(e, prompts, sp) -> tuple[threading.Thread, dict]:
    """``prompts`` generating in a thread, returned once paused in place after their third token."""
    e._sched.pause_after(3)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", e.generate_requests(prompts, sp)), daemon=True)
    t.start()
    wait_until(lambda: e._sched.paused == "in_place")
    return t, out


def test_an_aborted_running_row_leaves_the_workers_batch_and_its_slots_to_the_next_request(eng):
    alone = eng.generate_requests([LONG], SP)[0]["output_ids"]
    t, out = paused_after_three(eng, [[5, 6, 7]], {**SP, "max_new_tokens": 30})
    (row,) = eng._sched._running
    eng._sched.abort(row.call, 0, "the caller gave up")
    wait_until(lambda: row.finish is not None)
    eng.continue_generation()
    t.join(30)
    assert out["r"][0]["finish_reason"]["type"] == "abort" and len(out["r"][0]["output_ids"]) == 3
    assert eng.scheduler_stats()["kv_free"] == KV
    # the slots the aborted row held go to this request (first fit): its tokens are its own
    assert eng.generate_requests([LONG], SP)[0]["output_ids"] == alone


def test_retracted_rows_give_their_slots_back(eng):
    t, out = paused_after_three(eng, [[5, 6, 7], [8, 9]], SP)
    eng.pause_generation(mode="retract")
    assert eng.scheduler_stats()["kv_free"] == KV        # both rows' KV given up, none held
    eng.continue_generation()
    t.join(30)
    assert [len(r["output_ids"]) for r in out["r"]] == [12, 12]
    assert eng.scheduler_stats()["kv_free"] == KV


def test_freed_runs_merge_with_their_free_neighbours():
    s = _Slots(10)
    a, b, c = s.take(3), s.take(3), s.take(4)
    assert (a, b, c, s.take(1)) == (0, 3, 6, None)
    s.give(a, 3)
    s.give(c, 4)
    s.give(b, 3)                          # joins both neighbours: one run of the whole cache
    assert s.free == [(0, 10)] and s.take(10) == 0
