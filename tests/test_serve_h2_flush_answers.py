"""``/flush_cache`` answers SGLang 0.5.23's status and body, done or refused (audit H2, item 3).

SGLang's ``http_server.flush_cache`` answers a bare-text ``Response``: 200 with two lines when the
flush is done, 400 with the scheduler's message (``Timed out waiting for idle state.``, ``Another
flush_cache is already in progress.``) or ``Flush cache failed.`` and a newline when refused.
Before, serve answered ``Cache flushed.`` alone when done and a JSON ``{success, message,
retryable}`` when refused; a client comparing the text with SGLang's read another answer. Why the
engine refused stays in a header.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer

pytestmark = pytest.mark.timeout(120)

DONE = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or "
        "waiting requests, the operation will not be performed.)\n")
LONG = {"input_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                     "max_new_tokens": 3000}}


@pytest.fixture(scope="module")
def server():
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=4096, seed=6) as eng:
        eng.config.max_position_embeddings = 4096      # room for LONG (RoPE: no weights change)
        with EngineServer(eng) as srv:
            yield srv


def call(srv, method, path, body=None, timeout=60.0):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(), dict(resp.getheaders())
    finally:
        conn.close()


def wait_until(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_done_and_refused_flushes_answer_sglangs_status_and_text(server):
    assert call(server, "POST", "/flush_cache")[:2] == (200, DONE)        # before: "Cache flushed.\n"
    assert call(server, "GET", "/flush_cache?timeout=1")[:2] == (200, DONE)
    box: list = []
    bg = threading.Thread(target=lambda: box.append(call(server, "POST", "/generate", LONG)), daemon=True)
    bg.start()
    try:
        wait_until(lambda: server.engine.scheduler_stats()["running"] == 1)
        status, text, headers = call(server, "POST", "/flush_cache")
        assert (status, text) == (400, "Flush cache failed.\n"), (status, text)   # before: JSON
        assert "1 request(s) running" in headers["X-Fsdp-Sync-Detail"], headers

        waiting: list = []
        first = threading.Thread(target=lambda: waiting.append(
            call(server, "POST", "/flush_cache?timeout=1.5")), daemon=True)
        first.start()
        wait_until(lambda: server.engine._sched._flush_waiting)
        assert call(server, "POST", "/flush_cache?timeout=5")[:2] == (
            400, "Another flush_cache is already in progress.")
        first.join(10)
        assert waiting[0][:2] == (400, "Timed out waiting for idle state.")
    finally:
        call(server, "POST", "/abort_request", {"abort_all": True})
        bg.join(60)
    assert box and box[0][0] == 200
    wait_until(lambda: server.engine.scheduler_stats()["running"] == 0)
    assert call(server, "POST", "/flush_cache")[:2] == (200, DONE)


@pytest.mark.parametrize("keepalive_s", [0.0, 30.0])      # urllib's path and the kept-alive one
def test_sglang_engines_flush_refusal_says_why(server, keepalive_s):
    """`SGLangEngine`'s HTTP client against serve: a refused flush's reason (the detail header)
    is in the error it raises, where a flush after a verl sync that gives up (`flush_retry`)
    reports it. Before (R6 review) the error read SGLang's bare "Flush cache failed." alone."""
    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.engines.sglang.client import HttpClient, SGLangHTTPError

    http = HttpClient(server.url, api_key=None, timeout_s=60.0, max_retries=0, backoff_s=0.1,
                      backoff_max_s=0.1, proxies=None, keepalive_s=keepalive_s)
    engine = SGLangEngine(base_url=server.url, max_retries=0)
    bg = threading.Thread(target=lambda: call(server, "POST", "/generate", LONG), daemon=True)
    bg.start()
    try:
        wait_until(lambda: server.engine.scheduler_stats()["running"] == 1)
        why = r"HTTP 400: Flush cache failed\. \(.*1 request\(s\) running"
        with pytest.raises(SGLangHTTPError, match=why):
            http.request("POST", "/flush_cache", idempotent=True)
        with pytest.raises(SGLangHTTPError, match=why):
            engine.flush_cache()
    finally:
        call(server, "POST", "/abort_request", {"abort_all": True})
        bg.join(60)
    engine.flush_cache()                  # idle again: goes through
