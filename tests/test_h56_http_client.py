"""`HttpClient` against a scripted HTTP server in this process: only idempotent calls are retried
(a weight update or a session call is sent once, whatever the answer or the failure), an error
names the route, the status and the server's message, a refused connection (nothing reached the
server: an update's payloads certainly unopened) is told apart from a connection that dropped or
timed out (unknown), and a retried call gives up after ``1 + retries`` attempts saying so.

No SGLang and no engine: the server answers what each test scripts, and counts what it got.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fsdp_sync.engines.sglang.client import (HttpClient, NotFound, SGLangHTTPError,
                                             SGLangUpdateError, with_detail)


class _Server:
    """Answers each path from its script: a list of ``(status, body)``, or ``"drop"`` (read the
    request, close without answering); the last entry repeats. ``hits`` counts requests."""

    def __init__(self, script: dict) -> None:
        self.script = {k: list(v) for k, v in script.items()}
        self.hits: Counter[str] = Counter()
        self.bodies: dict[str, list] = {}
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                owner.bodies.setdefault(self.path, []).append(json.loads(raw) if raw else None)
                self._answer()

            def do_GET(self):
                self._answer()

            def _answer(self):
                owner.hits[self.path] += 1
                steps = owner.script.get(self.path) or [(404, '{"detail": "Not Found"}')]
                step = steps.pop(0) if len(steps) > 1 else steps[0]
                if step == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                status, body, *late = step
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if late:          # says it will close, and closes only a moment later
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
                if late:
                    self.wfile.flush()
                    time.sleep(late[0])

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def _client(url: str, *, retries: int = 2, keepalive_s: float = 2.0, timeout_s: float = 10.0):
    return HttpClient(url, api_key=None, timeout_s=timeout_s, max_retries=retries, backoff_s=0.0,
                      backoff_max_s=0.0, proxies=None, keepalive_s=keepalive_s)


MESSAGE = '{"success": false, "message": "scheduler busy: try later"}'


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keepalive_s", [2.0, 0.0])
def test_a_weight_update_answered_503_is_sent_once_and_the_error_names_route_status_message(keepalive_s):
    with _Server({"/update_weights_from_tensor": [(503, MESSAGE)],
                  "/get_weight_version": [(503, MESSAGE), (200, '"v1"')]}) as srv:
        http = _client(srv.url, keepalive_s=keepalive_s)
        with pytest.raises(SGLangUpdateError) as ei:
            http.json("POST", "/update_weights_from_tensor", {"x": 1}, error=SGLangUpdateError)
        assert srv.hits["/update_weights_from_tensor"] == 1       # never re-sent
        e = ei.value
        assert e.status == 503 and e.call == "update_weights_from_tensor"
        assert "/update_weights_from_tensor" in str(e) and "HTTP 503" in str(e)
        assert "scheduler busy: try later" in str(e)
        assert e.opened is None                                   # a 5xx may come after loading
        # an idempotent call is retried past the same answer
        assert http.json("GET", "/get_weight_version", idempotent=True) == "v1"
        assert srv.hits["/get_weight_version"] == 2
        http.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["/begin_weight_update", "/update_weights_from_tensor"])
def test_a_call_whose_connection_drops_is_not_re_sent_and_its_opening_is_unknown(path):
    with _Server({path: ["drop", (200, '{"success": true}')]}) as srv:
        http = _client(srv.url)
        with pytest.raises(SGLangUpdateError) as ei:
            http.json("POST", path, {}, error=SGLangUpdateError)
        assert srv.hits[path] == 1
        assert ei.value.status is None and "no answer" in str(ei.value)
        assert ei.value.opened is None                            # it reached the server
        http.close()


@pytest.mark.timeout(60)
def test_an_idempotent_call_gives_up_after_one_plus_retries_attempts_saying_so():
    with _Server({"/get_server_info": ["drop"], "/health": [(500, "boom")]}) as srv:
        http = _client(srv.url, retries=2)
        with pytest.raises(SGLangHTTPError, match=r"gave up after 3 attempts") as ei:
            http.request("GET", "/get_server_info", idempotent=True)
        assert srv.hits["/get_server_info"] == 3 and ei.value.status is None
        with pytest.raises(SGLangHTTPError, match=r"HTTP 500: boom \(gave up after 1 attempts\)"):
            http.request("GET", "/health", idempotent=True, retries=0)
        assert srv.hits["/health"] == 1
        with pytest.raises(SGLangHTTPError, match=r"gave up after 1 attempts"):
            http.request("GET", "/health", idempotent=True, retries=-3)   # no negative attempts
        assert srv.hits["/health"] == 2
        http.close()


@pytest.mark.timeout(60)
def test_a_missing_route_is_not_found_not_retried():
    with _Server({}) as srv:
        http = _client(srv.url)
        with pytest.raises(NotFound) as ei:
            http.request("GET", "/get_weight_version", idempotent=True)
        assert srv.hits["/get_weight_version"] == 1
        assert ei.value.error.status == 404 and "/get_weight_version" in str(ei.value)
        http.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keepalive_s", [2.0, 0.0])
def test_a_refused_connection_is_told_apart_from_a_timeout(keepalive_s):
    # refused: a port nothing listens on (bound, never listening: connect is refused at once)
    with socket.socket() as idle:
        idle.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{idle.getsockname()[1]}"
        http = _client(url, keepalive_s=keepalive_s, retries=0)
        with pytest.raises(SGLangUpdateError) as ei:
            http.json("POST", "/update_weights_from_tensor", {}, error=SGLangUpdateError)
        assert ei.value.opened is False and "ConnectionRefusedError" in str(ei.value)
        assert "/update_weights_from_tensor" in str(ei.value)
    # timeout: a server that accepts (backlog) and never answers
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(4)
        url = f"http://127.0.0.1:{mute.getsockname()[1]}"
        http = _client(url, keepalive_s=keepalive_s, retries=0, timeout_s=0.3)
        with pytest.raises(SGLangUpdateError) as ei:
            http.json("POST", "/update_weights_from_tensor", {}, error=SGLangUpdateError)
        assert ei.value.opened is None and "timed out" in str(ei.value)
        assert "ConnectionRefusedError" not in str(ei.value)
        http.close()


def test_the_detail_header_is_added_to_an_error_body_only():
    assert with_detail('{"ok": 1}', 200, "why") == '{"ok": 1}'
    assert with_detail("Flush cache failed.\n", 400, "requests running") == \
        "Flush cache failed. (requests running)"
    assert with_detail("x", 500, None) == "x"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["drop", (503, "upstream starting")])
def test_a_begin_that_got_no_handlers_answer_does_not_mark_the_session_api_present(first):
    # SGLang 0.5.20 (no session routes) behind a URL whose first begin got no answer from SGLang
    # (a dropped connection, a router's 503 while it starts): the next begin's 404 is the probe's
    # answer (no session API: skipped), not "begin_weight_update disappeared" on every later sync
    from fsdp_sync.engines.sglang import SGLangEngine

    with _Server({"/begin_weight_update": [first, (404, '{"detail": "Not Found"}')]}) as srv:
        eng = SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0)
        try:
            with pytest.raises(SGLangHTTPError):
                eng.begin_weight_update()
            assert eng.session_api is None
            eng.begin_weight_update()                 # skipped: this server has no session
            assert eng.session_api is False and srv.hits["/begin_weight_update"] == 2
            eng.begin_weight_update()
            assert srv.hits["/begin_weight_update"] == 2    # detected once
        finally:
            eng.shutdown()


@pytest.mark.timeout(60)
def test_a_begin_refused_by_the_handler_marks_the_session_api_present():
    # SGLang's own refusal (400, {"success": false}): the route exists; a later 404 is news
    from fsdp_sync.engines.base import EngineStateError
    from fsdp_sync.engines.sglang import SGLangEngine
    from fsdp_sync.engines.sglang.client import SGLangError

    refusal = '{"success": false, "message": "a weight-update session is already open"}'
    with _Server({"/begin_weight_update": [(400, refusal), (404, '{"detail": "Not Found"}')]}) as srv:
        eng = SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0)
        try:
            with pytest.raises(EngineStateError, match="already open"):
                eng.begin_weight_update()
            assert eng.session_api is True
            with pytest.raises(SGLangError, match="disappeared"):
                eng.begin_weight_update()
        finally:
            eng.shutdown()


@pytest.mark.parametrize("kw", [{"timeout_s": 0}, {"timeout_s": -1.0}, {"timeout_s": None},
                                {"retry_backoff_s": -0.5}])
def test_a_timeout_or_backoff_that_cannot_work_is_refused_naming_it(kw):
    # timeout_s=0 made every socket non-blocking: each call failed "no answer: BlockingIOError"
    from fsdp_sync.engines.sglang import SGLangEngine

    name = next(iter(kw)).replace("retry_", "")
    with pytest.raises(ValueError, match=name):
        SGLangEngine(base_url="http://127.0.0.1:9", tp_size=1, **kw)


@pytest.mark.timeout(60)
def test_an_abort_says_whether_the_server_dropped_the_update(caplog):
    # fsdp-sync serve drops it ("aborted": true); one that says it could not, and SGLang (whose
    # answer has no such field: it applied each bucket), leave the engine partial: False, warned
    from fsdp_sync.engines.sglang import SGLangEngine

    answers = ['{"success": true, "aborted": true}',
               '{"success": true, "aborted": false, "message": "already committed"}',
               '{"success": true, "message": "Succeeded"}']
    with _Server({"/end_weight_update": [(200, a) for a in answers]}) as srv:
        eng = SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0)
        eng.session_api = True
        try:
            with caplog.at_level("WARNING", logger="fsdp_sync.engines.sglang.session_calls"):
                assert eng.end_weight_update(abort=True) is True
                assert not caplog.records
                assert eng.end_weight_update(abort=True) is False
                assert "already committed" in caplog.text
                assert eng.end_weight_update(abort=True) is False
                assert "cannot drop a failed update" in caplog.text
            assert srv.bodies["/end_weight_update"] == [{"abort": True}] * 3
            assert srv.hits["/end_weight_update"] == 3
        finally:
            eng.shutdown()


@pytest.mark.timeout(60)
def test_end_names_the_weights_once_through_the_body_or_update_weight_version():
    # a server that says it took the name (fsdp-sync serve) gets no /update_weight_version; one
    # that does not (SGLang 0.5.23) gets it right after the commit
    from fsdp_sync.engines.sglang import SGLangEngine

    ok = '{"success": true, "message": "ok"}'
    with _Server({"/end_weight_update": [(200, '{"success": true, "weight_version": "v2"}'), (200, ok)],
                  "/update_weight_version": [(200, ok)]}) as srv:
        eng = SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0)
        eng.session_api = True
        try:
            eng.end_weight_update("v2")
            assert srv.hits["/update_weight_version"] == 0
            eng.end_weight_update("v3")
            assert srv.bodies["/update_weight_version"] == [{"new_version": "v3",
                                                            "abort_all_requests": False}]
            assert srv.bodies["/end_weight_update"] == [{"weight_version": "v2"},
                                                        {"weight_version": "v3"}]
            with pytest.raises(ValueError, match="not both"):
                eng.end_weight_update("v4", abort=True)
            assert srv.hits["/end_weight_update"] == 2
        finally:
            eng.shutdown()
        from fsdp_sync.engines.base import EngineClosedError
        with pytest.raises(EngineClosedError, match="begin_weight_update"):
            eng.begin_weight_update()
        assert srv.hits["/begin_weight_update"] == 0


@pytest.mark.timeout(60)
def test_whether_disk_loads_are_staged_is_asked_again_after_an_unreadable_info():
    from fsdp_sync.engines.sglang import SGLangEngine

    info = '{"version": "fsdp_sync-serve", "tp_size": 1}'
    with _Server({"/server_info": ["drop", (200, info)]}) as srv:
        eng = SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0)
        try:
            assert eng.stages_disk_loads is False          # unknown this time: as SGLang
            assert eng.stages_disk_loads is True           # asked again, and kept
            assert eng.stages_disk_loads is True and srv.hits["/server_info"] == 2
        finally:
            eng.shutdown()


def test_an_in_process_abort_reports_what_the_engines_end_answered():
    from fsdp_sync.engines.sglang import SGLangEngine

    class Engine:
        def __init__(self, dropped):
            self.dropped, self.calls = dropped, []

        def end_weight_update(self, abort: bool = False):
            self.calls.append(abort)
            return self.dropped

    # (an end answering False is a refusal: check_answer raises it, as every session call's)
    for dropped, want in ((None, True), (True, True)):
        inner = Engine(dropped)
        eng = SGLangEngine(inner, tp_size=1)
        eng.session_api = True
        assert eng.end_weight_update(abort=True) is want
        assert inner.calls == [True]


def test_backoff_doubles_from_backoff_s_up_to_backoff_max_s(monkeypatch):
    from fsdp_sync.engines.sglang import client as client_mod

    slept: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", slept.append)
    with _Server({"/health": [(503, "starting")]}) as srv:
        http = HttpClient(srv.url, api_key=None, timeout_s=10.0, max_retries=4, backoff_s=0.5,
                          backoff_max_s=1.5, proxies=None)
        with pytest.raises(SGLangHTTPError, match="gave up after 5 attempts"):
            http.request("GET", "/health", idempotent=True)
        http.close()
    assert slept == [0.5, 1.0, 1.5, 1.5]


def test_what_says_an_update_certainly_opened_nothing():
    from fsdp_sync.engines.sglang.client import (NO_SESSION_MARK, check_answer, lease_answered,
                                                 validation_refusal)

    pydantic = '{"object": "error", "message": "field required", "type": "Bad Request", "code": 400}'
    assert validation_refusal(400, pydantic)
    assert not validation_refusal(400, '{"object": "error", "type": "Internal", "code": 400}')
    assert not validation_refusal(400, '{"success": false, "message": "x"}')
    with pytest.raises(SGLangUpdateError) as ei:
        check_answer("update_weights_from_tensor", {"success": False,
                     "message": f"update {NO_SESSION_MARK} and end"}, error=SGLangUpdateError)
    assert ei.value.opened is False
    with pytest.raises(SGLangUpdateError) as ei:
        check_answer("update_weights_from_tensor", {"success": False, "message": "OOM"},
                     error=SGLangUpdateError)
    assert ei.value.opened is None
    with pytest.raises(SGLangUpdateError, match="is the URL an SGLang server"):
        check_answer("update_weights_from_tensor", {"status": "ok"}, error=SGLangUpdateError,
                     require_success=True)

    class Lease:
        payloads = [object(), object()]

        def release(self, *, require_ack, unopened):
            self.unopened = list(unopened)

    for opened, want in ((False, [0, 1]), (None, []), (True, [])):
        lease = Lease()
        with pytest.raises(SGLangUpdateError):
            with lease_answered(lease):
                raise SGLangUpdateError("x", opened=opened)
        assert lease.unopened == want


@pytest.mark.timeout(60)
def test_a_connection_the_server_said_it_closes_is_not_reused():
    # "Connection: close", the socket closed a moment later: the next call (not idempotent, so
    # never re-sent) must go on a new connection, not the one about to be closed under it
    with _Server({"/flush_cache": [(200, "{}", 0.5)], "/begin_weight_update": [(200, '{"success": true}')]}) as srv:
        http = _client(srv.url, retries=0)
        http.request("POST", "/flush_cache")
        assert http.json("POST", "/begin_weight_update", {}) == {"success": True}
        assert http.connections == 2 and srv.hits["/begin_weight_update"] == 1
        http.close()
