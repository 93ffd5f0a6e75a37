"""The verl adapter's cache flush after a sync is retried as verl's own
``HttpServerAdapter.flush_cache`` retries it (review4 audit). Before, the adapter called
``engine.flush_cache()`` once: since the reference engine refuses a flush while requests run (as
SGLang does, 8456c4b), one request still ending failed the whole verl step after every byte of the
sync had been applied. Refused every time, the sync fails (it was logged and passed over: the
adapter's update calls flush nothing, so a prefix cache of the old weights stayed for later
requests to reuse)."""

from __future__ import annotations

import logging
import threading
import time

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


def test_a_refused_flush_is_tried_again_until_it_goes_through():
    slept = []
    eng = _Refusing(2)
    assert flush_after_sync(eng, sleep=slept.append) is None
    assert eng.calls == 3 and slept == [2.0, 2.0]


def test_a_flush_refused_every_time_fails_the_sync(caplog):
    eng = _Refusing(100)
    with caplog.at_level(logging.WARNING, logger="fsdp_sync"):
        with pytest.raises(SyncError, match=r"refused 12 times, 2 s apart \(last: RuntimeError: "
                                            r"Flush cache failed.*prefix cache.*POST /flush_cache"):
            flush_after_sync(eng, sleep=lambda s: None)
    assert eng.calls == ATTEMPTS == 12
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 12


def test_an_interrupt_is_not_retried():
    class _Interrupted:
        calls = 0

        def flush_cache(self):
            self.calls += 1
            raise KeyboardInterrupt

    eng = _Interrupted()
    with pytest.raises(KeyboardInterrupt):
        flush_after_sync(eng, sleep=lambda s: None)
    assert eng.calls == 1


@pytest.mark.timeout(120)
def test_the_reference_engine_flushes_once_its_last_request_ends():
    """The real refusal: a flush while a request runs is refused at once, retried, and goes
    through once the request has ended."""
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import EngineStateError
    from fsdp_sync.models import load_config

    cfg = load_config("tiny")
    cfg.max_position_embeddings = 2048           # room for a request that runs a few seconds
    with ReferenceEngine(cfg, tp_size=1, kv_cache_tokens=2048) as eng:
        done = threading.Event()

        def run():
            eng.generate_requests([[1, 2, 3]], {"max_new_tokens": 1500, "temperature": 0,
                                                 "ignore_eos": True})
            done.set()

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 30
        while not eng.scheduler_stats()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(EngineStateError, match="Flush cache failed"):
            eng.flush_cache()
        assert flush_after_sync(eng, delay_s=0.2, attempts=300) is None
        t.join(60)
        assert done.is_set()


# found by mutating flush_retry (audit H35): a flush refused every time sleeps between attempts only
# (11 waits for 12 tries, none after the last, so the sync's failure is not held back), at the
# caller's delay_s; one that goes through on the last attempt is taken
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
