"""`flush_after_sync` (the verl adapter's flush after a sync) against failures `SGLangEngine`'s
HTTP client retries itself (H75): a silent or failing server is not retried again ``ATTEMPTS``
times on top of the client's own retries. Before, each of the 12 attempts spent the client's
``(1 + max_retries) x timeout_s`` (4 x 600 s by default): about 8 h before the sync failed on a
hung server. A refusal (HTTP 400, requests still running) is still tried again."""

from __future__ import annotations

import pytest

from fsdp_sync.engines.sglang.client import SGLangHTTPError
from fsdp_sync.integrations.flush_retry import ATTEMPTS, flush_after_sync
from fsdp_sync.topology import SyncError


class _Failing:
    def __init__(self, status, text):
        self.status, self.text, self.calls = status, text, 0

    def flush_cache(self):
        self.calls += 1
        raise SGLangHTTPError(f"POST http://h:1/flush_cache: {self.text} (gave up after 4 attempts)",
                              call="flush_cache", status=self.status, body=self.text)


@pytest.mark.parametrize("status,text", [(None, "no answer: timeout: timed out"),
                                         (503, "HTTP 503: engine is dead"), (500, "HTTP 500: boom")])
def test_a_failure_the_client_retried_itself_fails_the_sync_at_once(status, text):
    eng, slept = _Failing(status, text), []
    with pytest.raises(SyncError, match=r"client's own retries are spent.*POST /flush_cache") as info:
        flush_after_sync(eng, sleep=slept.append)
    assert eng.calls == 1 and slept == [], (eng.calls, slept)      # before: 12 calls, 11 waits
    assert isinstance(info.value.__cause__, SGLangHTTPError)


def test_a_refusal_over_http_is_still_tried_again():
    eng = _Failing(400, "HTTP 400: Flush cache failed.")
    with pytest.raises(SyncError, match=f"refused {ATTEMPTS} times"):
        flush_after_sync(eng, sleep=lambda s: None)
    assert eng.calls == ATTEMPTS
