"""A running row aborted by its caller leaves the workers' batch too (`Scheduler._take_drops`
sends its id in the next step's ``remove``). Mutant that no test killed: the engine finished the
row and gave its KV-cache slots back, but the workers kept decoding it into those slots; the
next request placed there read the stale row's keys and values among its own and generated
other tokens than it does alone. One TP-1 engine with its start-up weights; the abort lands
while generation is paused in place (`Scheduler.pause_after`), so no step races it."""

from __future__ import annotations

import threading
import time

import pytest

from fsdp_sync.engines import ReferenceEngine

pytestmark = pytest.mark.timeout(120)

LONG = [201, 3, 64, 64, 17, 88, 42, 9, 120, 5, 6, 7, 8, 300, 301, 302, 11, 27, 93, 5]


def wait_until(pred, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_an_aborted_running_row_leaves_the_workers_batch_and_its_slots_to_the_next_request():
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=64, call_timeout_s=60) as e:
        alone = e.generate_requests([LONG], sp)[0]["output_ids"]
        e._sched.pause_after(3)                      # paused in place after its third token
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("r", e.generate_requests(
            [[5, 6, 7]], {**sp, "max_new_tokens": 30})), daemon=True)
        t.start()
        wait_until(lambda: e._sched.paused == "in_place")
        (row,) = e._sched._running
        e._sched.abort(row.call, 0, "the caller gave up")
        wait_until(lambda: row.finish is not None)
        e.continue_generation()
        t.join(30)
        assert out["r"][0]["finish_reason"]["type"] == "abort" and len(out["r"][0]["output_ids"]) == 3
        assert e._sched.stats()["kv_free"] == 64
        # the slots the aborted row held go to this request (first fit): its tokens are its own
        assert e.generate_requests([LONG], sp)[0]["output_ids"] == alone
