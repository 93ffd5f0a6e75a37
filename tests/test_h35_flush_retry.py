"""`integrations.flush_retry` limits, pinned where the neighbours' tests did not (audit H35, found by
mutating it): a flush refused every time sleeps between attempts only (11 waits for 12 tries, none
after the last, so the sync's failure is not held back), at the caller's ``delay_s``; one that
goes through on the last attempt is taken."""

from __future__ import annotations

import pytest

from fsdp_sync.integrations.flush_retry import ATTEMPTS, flush_after_sync
from fsdp_sync.topology import SyncError


class _Refusing:
    def __init__(self, refusals: int):
        self.refusals, self.calls = refusals, 0

    def flush_cache(self):
        self.calls += 1
        if self.calls <= self.refusals:
            raise RuntimeError("Flush cache failed: requests are running")


def test_refused_every_time_waits_between_attempts_only_at_the_callers_delay():
    slept, eng = [], _Refusing(100)
    with pytest.raises(SyncError, match=r"refused 3 times, 0.25 s apart"):
        flush_after_sync(eng, attempts=3, delay_s=0.25, sleep=slept.append)
    assert eng.calls == 3 and slept == [0.25, 0.25]
    slept.clear()
    with pytest.raises(SyncError, match=f"refused {ATTEMPTS} times"):
        flush_after_sync(_Refusing(100), sleep=slept.append)
    assert slept == [2.0] * (ATTEMPTS - 1)


def test_a_flush_that_goes_through_on_the_last_attempt_is_taken():
    slept, eng = [], _Refusing(ATTEMPTS - 1)
    assert flush_after_sync(eng, sleep=slept.append) is None
    assert eng.calls == ATTEMPTS and len(slept) == ATTEMPTS - 1
