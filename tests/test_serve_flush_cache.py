"""``/flush_cache`` of `fsdp-sync serve` answers as SGLang 0.5.23's does (serve3 audit, D1).

SGLang flushes only while no request runs or waits and otherwise answers 400 at once
(``Scheduler.flush_cache`` / ``SchedulerFlushWrapper``); its ``?timeout=`` waits that long for idle
without holding new requests back. Before, serve's flush waited for every running request without
limit (not bounded by ``--update-wait-s``) and admitted no new ``/generate`` meanwhile.
"""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from fsdp_sync.engines.base import EngineStateError
from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.engines.reference.serve_cache import FLUSHED
from fsdp_sync.models import load_config

pytestmark = pytest.mark.timeout(90)
LONG = {"input_ids": [11, 27, 93, 5],
        "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}
SHORT = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def server():
    cfg = load_config("tiny")
    cfg.max_position_embeddings = 4096     # room for LONG, which the tests end themselves
    with ReferenceEngine(cfg, tp_size=1, kv_cache_tokens=4096, seed=3) as eng:
        with EngineServer(eng, update_wait_s=0.5) as srv:
            yield srv


def call(srv, method, path, body=None, timeout=10.0):
    """(status, answer, seconds); the answer is JSON or text."""
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
        out = json.loads(text) if resp.getheader("Content-Type") == "application/json" else text
        detail = resp.getheader("X-Fsdp-Sync-Detail")
        if detail is not None:      # a refused flush: SGLang's bare text, serve's reason beside it
            out = {"text": text, "message": f"{text.strip()} {detail}"}
        return resp.status, out, time.monotonic() - t0
    finally:
        conn.close()


class Background:
    def __init__(self, fn, *args):
        self.box: list = []
        self.thread = threading.Thread(target=lambda: self.box.append(fn(*args)), daemon=True)
        self.thread.start()

    def get(self, timeout=30.0):
        self.thread.join(timeout)
        assert self.box, "no answer"
        return self.box[0]


def wait_until(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture
def long_request(server):
    """A /generate that runs until the test aborts it (or 3000 tokens)."""
    bg = Background(call, server, "POST", "/generate", LONG, 60.0)
    wait_until(lambda: server.engine.scheduler_stats()["running"] == 1)
    try:
        yield bg
    finally:
        call(server, "POST", "/abort_request", {"abort_all": True})
        status, out, _ = bg.get()
        assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort", (status, out)
        wait_until(lambda: server.engine.scheduler_stats()["running"] == 0)


def test_a_flush_while_a_request_runs_is_refused_at_once_and_holds_nothing_back(server, long_request):
    for method in ("POST", "GET"):            # verl's HttpServerAdapter flushes with a GET
        status, out, took = call(server, method, "/flush_cache", timeout=5.0)
        assert status == 400 and took < 2.0, (status, out, took)    # before: waited for LONG
        assert out["text"] == "Flush cache failed.\n"          # SGLang's body
        assert "Flush cache failed" in out["message"] and "1 request(s) running" in out["message"]
    status, out, took = call(server, "POST", "/generate", SHORT)        # admitted beside LONG
    assert status == 200 and len(out["output_ids"]) == 2 and took < 5.0, (status, out, took)
    t0 = time.monotonic()
    with pytest.raises(EngineStateError, match="Flush cache failed"):   # in process too
        server.engine.flush_cache()
    assert time.monotonic() - t0 < 2.0
    assert server.engine.scheduler_stats()["running"] == 1               # LONG went on


def test_a_flush_with_a_timeout_waits_for_idle_and_admits_new_requests(server, long_request):
    first = Background(call, server, "POST", "/flush_cache?timeout=1.5", None, 10.0)
    wait_until(lambda: server.engine._sched._flush_waiting)
    status, out, took = call(server, "POST", "/generate", SHORT, timeout=5.0)   # not held back
    assert status == 200 and len(out["output_ids"]) == 2, (status, out)
    assert not first.box                                                   # still waiting
    status, out, _ = call(server, "POST", "/flush_cache?timeout=5", timeout=5.0)
    assert status == 400 and "Another flush_cache is already in progress" in out["message"], out
    status, out, took = first.get()
    assert status == 400 and "Timed out waiting for idle state" in out["message"], out
    assert 1.4 < took < 5.0, took
    # a flush that waits long enough is done once the request ends
    waiting = Background(call, server, "POST", "/flush_cache?timeout=30", None, 40.0)
    wait_until(lambda: server.engine._sched._flush_waiting)
    call(server, "POST", "/abort_request", {"abort_all": True})
    status, out, took = waiting.get()
    assert (status, out) == (200, FLUSHED) and took < 20.0, (status, out, took)


def test_a_flush_when_idle_is_done_and_its_timeout_is_checked(server):
    assert call(server, "POST", "/flush_cache")[:2] == (200, FLUSHED)
    assert call(server, "GET", "/flush_cache?timeout=2")[:2] == (200, FLUSHED)  # idle: at once
    for bad in ("-1", "abc", "nan", "inf"):
        status, out, _ = call(server, "POST", f"/flush_cache?timeout={bad}")
        assert status == 400 and "'timeout'" in out["message"], (bad, status, out)
    with pytest.raises(ValueError, match="timeout_s must be a number of seconds >= 0, got -1"):
        server.engine.flush_cache(timeout_s=-1)


def test_a_flush_waits_for_the_engine_no_longer_than_update_wait_s(server):
    """Another call holding the engine (an update, say): 503 past ``--update-wait-s``, nothing
    done; before, the flush waited as long as the holder did."""
    with server.engine._lock:
        status, out, took = call(server, "POST", "/flush_cache", timeout=5.0)
    assert status == 503 and out["retryable"] is True and "wait limit" in out["message"], out
    assert 0.4 < took < 3.0, took
    assert call(server, "POST", "/flush_cache")[:2] == (200, FLUSHED)


def test_paused_requests_count_as_sglang_counts_them(server):
    """Rows paused in place hold the KV cache: refused (SGLang's rule); retracted ones do not."""
    r = Background(call, server, "POST", "/generate", LONG, 60.0)
    try:
        wait_until(lambda: server.engine.scheduler_stats()["running"] == 1)
        assert call(server, "POST", "/pause_generation", {"mode": "in_place"})[0] == 200
        status, out, _ = call(server, "POST", "/flush_cache")
        assert status == 400 and "paused in place hold the KV cache" in out["message"], out
        assert call(server, "POST", "/continue_generation")[0] == 200
        assert call(server, "POST", "/pause_generation", {"mode": "retract"})[0] == 200
        assert server.engine.scheduler_stats()["waiting"] == 1
        assert call(server, "POST", "/flush_cache")[:2] == (200, FLUSHED)
        # with a timeout SGLang waits for the waiting queue too (its deferred check is strict)
        status, out, _ = call(server, "POST", "/flush_cache?timeout=0.2")
        assert status == 400 and "Timed out waiting for idle state" in out["message"], out
    finally:
        call(server, "POST", "/abort_request", {"abort_all": True})
        call(server, "POST", "/continue_generation")
        status, out, _ = r.get()
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort", out
