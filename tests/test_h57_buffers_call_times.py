"""H57's audit: the sync's reused bucket buffers (`transport.buffers`) and its per-call time
figures (`transport.call_times`), in process (no engine, no workers).

- ``lag`` (an engine whose ranks may still read a bucket after it answered): a bucket's buffer is
  not handed out again to the very next bucket, only to the one after (mutants: the swap of
  `ReusedBuffer.give_back` dropped, `BufferPool.give_back` putting a bucket back at once; both
  survived every test: the next bucket would be packed over one an engine rank still reads).
- a pooled buffer is never lent twice at once (mutant: ``free.remove`` dropped).
- buffers are sized for the planned largest bucket, so a small first bucket does not make the
  next, planned-size one allocate again.
- `CallTimes`: each phase is the time since the phase before, rows and sums agree, the sums go on
  past `CallTimes.LIMIT` rows, a lap with no row only restarts the clock.
"""

from __future__ import annotations

import torch

from fsdp_sync.transport import SyncStats
from fsdp_sync.transport import call_times as call_times_mod
from fsdp_sync.transport.buffers import BufferPool, ReusedBuffer

CPU = torch.device("cpu")


def test_a_lagging_reused_buffer_skips_one_bucket_before_it_is_taken_again():
    buf = ReusedBuffer(256, CPU, lag=True)
    a = buf.take(200)
    buf.give_back()
    b = buf.take(200)                    # the engine may still read ``a``: not packed over it
    assert b.data_ptr() != a.data_ptr()
    buf.give_back()                      # ``b`` answered: every rank is done with ``a``
    c = buf.take(200)
    assert c.data_ptr() == a.data_ptr()
    buf.give_back()
    assert buf.take(200).data_ptr() == b.data_ptr()    # two buffers take turns, no third
    buf.give_back()


def test_a_lagging_pool_hands_a_bucket_s_buffers_out_only_after_the_next_bucket():
    pool = BufferPool(1024, CPU, lag=True)
    a1, a2 = pool.take(1000), pool.take(1000)
    pool.give_back([a1[:10], a2])        # sliced views give their buffers back too
    b1, b2 = pool.take(1000), pool.take(1000)
    assert {b1.data_ptr(), b2.data_ptr()}.isdisjoint({a1.data_ptr(), a2.data_ptr()})
    pool.give_back([b1, b2])
    c = {pool.take(1000).data_ptr(), pool.take(1000).data_ptr()}
    assert c == {a1.data_ptr(), a2.data_ptr()}
    pool.close()


def test_a_pooled_buffer_is_never_lent_twice_at_once_and_is_sized_for_the_planned_bucket():
    pool = BufferPool(1024, CPU)
    small = pool.take(10)                # sized for the planned largest bucket, not this one
    assert small.numel() >= 1024
    pool.give_back([small])
    a = pool.take(1000)
    assert a.data_ptr() == small.data_ptr()
    b = pool.take(1000)                  # ``a`` is lent: a second bucket gets another buffer
    assert b.data_ptr() != a.data_ptr()
    pool.give_back([a, b])
    pool.give_back([a])                  # given back twice: still one entry in the pool
    assert len(pool.free) == 2
    pool.close()

    pool = BufferPool(1024, CPU)
    planned = pool.take(1024)
    pool.give_back([planned])
    assert pool.take(1025).numel() >= 1025            # a byte too big: not the planned buffer
    pool.close()

    buf = ReusedBuffer(1024, CPU)
    first = buf.take(10)
    buf.give_back()
    assert buf.take(1024).data_ptr() == first.data_ptr()
    buf.give_back()
    assert buf.take(1025).numel() == 1025              # a byte more than it holds: a new one
    buf.give_back()


class _Call:
    def __init__(self, what: str) -> None:
        self.what = what


def test_call_times_phases_follow_each_other_and_add_up(monkeypatch):
    clock = iter(float(2 ** i) for i in range(200))       # each lap a distinct power of two
    monkeypatch.setattr(call_times_mod.time, "perf_counter", lambda: next(clock))
    stats = SyncStats()
    times = call_times_mod.CallTimes(stats)               # t = 1
    row = times.made(_Call("bucket 0"))                   # 2 - 1
    times.lap(row, "engine_s")                            # 4 - 2
    times.lap(None, "agree_s")                            # 8 - 4: not this call's
    times.lap(row, "release_s")                           # 16 - 8
    times.lap(row, "release_s")                           # 32 - 16: adds up in the row
    row2 = times.made(_Call("bucket 1"))                  # 64 - 32
    assert stats.extra["calls"] == [
        {"what": "bucket 0", "make_s": 1.0, "engine_s": 2.0, "release_s": 24.0},
        {"what": "bucket 1", "make_s": 32.0}]
    assert row2 is stats.extra["calls"][1]
    assert stats.extra["call_seconds"] == {"make_s": 33.0, "gather_s": 0.0, "engine_s": 2.0,
                                           "agree_s": 0.0, "release_s": 24.0}


def test_call_times_keep_summing_past_the_rows_they_list(monkeypatch):
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(call_times_mod.time, "perf_counter", lambda: float(next(ticks)))
    monkeypatch.setattr(call_times_mod.CallTimes, "LIMIT", 3)
    stats = SyncStats()
    times = call_times_mod.CallTimes(stats)
    for i in range(5):
        row = times.made(_Call(f"bucket {i}"))
        times.lap(row, "gather_s")
    assert [r["what"] for r in stats.extra["calls"]] == ["bucket 0", "bucket 1", "bucket 2"]
    assert stats.extra["call_seconds"]["make_s"] == 5.0 and stats.extra["call_seconds"]["gather_s"] == 5.0
