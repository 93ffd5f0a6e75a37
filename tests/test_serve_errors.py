"""`fsdp-sync serve` answers with the status of whose fault an error is, and bounds its waits (issue
36 items 3, 5, 8 and 9).

- Server faults are 5xx, not 400: a worker killed while requests run, a request in flight at
  SIGTERM, ``/health_generate`` and ``/generate`` with the weights released answer 503 with
  ``"retryable": true`` (a streamed request gets a chunk with code 503), so clients and routers
  retry elsewhere; the client's mistakes stay 4xx with ``"retryable": false``.
- ``init_weights_update_group`` checks its body (``{"backend": "foo"}`` used to wait ~120 s in a
  rendezvous), and a ``begin_weight_update`` that cannot start within ``--update-wait-s`` answers
  503 and is never applied afterwards (it used to block 100 s and open a session later).
- A POST with neither Content-Length nor chunked encoding is an empty body (was 411); a chunked
  body is read (was 411), bounded as a sized one, and a malformed one is a 400.
- DELETE / PUT answer a JSON 405 (was the stdlib's 501 HTML page), but for PUT /generate, which
  SGLang takes as POST; an unknown parameter name is quoted once.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.engines.reference.serve_cache import FLUSHED
from fsdp_sync.models import load_config
from _util import start_serve

pytestmark = pytest.mark.timeout(180)
LONG = {"max_new_tokens": 2000, "temperature": 0.0, "ignore_eos": True}


def _config():
    cfg = load_config("tiny")
    cfg.max_position_embeddings = 4096     # room for requests long enough to be caught in flight
    return cfg


@pytest.fixture(scope="module")
def engine():
    with ReferenceEngine(_config(), tp_size=2, kv_cache_tokens=4096, seed=4,
                         update_recv_timeout_s=8.0) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with EngineServer(engine, update_wait_s=1.0) as srv:
        yield srv


def request(srv, method: str, path: str, body=None, *, raw_body: bytes | None = None,
            headers: dict | None = None, timeout: float = 60):
    """``(status, headers, parsed body)``; ``raw_body``/``headers`` are sent exactly as given
    (no Content-Length added: `http.client.request` would add one)."""
    host, port = (srv.host, srv.port) if not isinstance(srv, str) else srv.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        data = raw_body if body is None else json.dumps(body).encode()
        hdrs = dict(headers or {})
        if body is not None:
            hdrs.update({"Content-Type": "application/json", "Content-Length": str(len(data))})
        for k, v in hdrs.items():
            conn.putheader(k, v)
        conn.endheaders(data)
        resp = conn.getresponse()
        text = resp.read().decode()
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        return resp.status, dict(resp.getheaders()), parsed
    finally:
        conn.close()


def stream_chunks(srv, body: dict, started: threading.Event, out: list) -> None:
    """POST a streamed /generate; append each SSE chunk to ``out``; set ``started`` on the first."""
    host, port = (srv.host, srv.port) if not isinstance(srv, str) else srv.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/generate", json.dumps(dict(body, stream=True)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        for line in resp:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
                started.set()
    except OSError as exc:
        out.append({"connection": repr(exc)})
    finally:
        started.set()
        conn.close()


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    box: list = []
    t = threading.Thread(target=lambda: box.append(fn(*args)), daemon=True)
    t.start()
    return t, box


# --------------------------------------------------------------------------- item 8, item 9

def test_bodyless_posts_are_empty_bodies(server):
    for path, want in (("/pause_generation", {"message": "Generation paused successfully.", "status": "ok"}),
                       ("/continue_generation", {"message": "Generation continued successfully.",
                                                 "status": "ok"}),
                       ("/flush_cache", FLUSHED)):
        status, _, out = request(server, "POST", path)        # no Content-Length, no chunked
        assert (status, out) == (200, want), (path, status, out)
    assert server.engine.generation_paused is None


def chunked(data: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for n in sizes:
        out += f"{n:x};ext=1\r\n".encode() + data[at:at + n] + b"\r\n"
        at += n
    assert at == len(data)
    return out + b"0\r\nX-Trailer: t\r\n\r\n"


def test_chunked_bodies_are_read_and_bounded(server):
    body = json.dumps({"input_ids": [[1, 2, 3]], "sampling_params": {"max_new_tokens": 4,
                                                                     "temperature": 0.0}}).encode()
    te = {"Transfer-Encoding": "chunked", "Content-Type": "application/json"}
    want = request(server, "POST", "/generate", json.loads(body))
    assert want[0] == 200 and len(want[2][0]["output_ids"]) == 4, want
    got = request(server, "POST", "/generate", raw_body=chunked(body, [5, 1, len(body) - 6]), headers=te)
    assert (got[0], got[2][0]["output_ids"]) == (200, want[2][0]["output_ids"]), got
    # a bodyless route takes an empty chunked body
    assert request(server, "POST", "/flush_cache", raw_body=b"0\r\n\r\n", headers=te)[:1] == (200,)
    # refused, each naming why; the connection is closed (the rest of the body is never read)
    over = f"{server.max_body_bytes + 1:x}\r\n".encode() + b" " * 4096     # refused from its size line
    for raw_body, headers, status, needle in (
            (b"zz\r\n{}\r\n0\r\n\r\n", te, 400, "bad chunk size"),
            (b"2\r\n{}XX0\r\n\r\n", te, 400, "a chunk of 2 bytes is cut short or not followed by CRLF"),
            (over, te, 413, "--max-body-mb"),
            (body, {"Transfer-Encoding": "gzip"}, 501, "Transfer-Encoding 'gzip'")):
        s, h, out = request(server, "POST", "/generate", raw_body=raw_body, headers=headers)
        assert s == status and needle in out["message"], (needle, s, out)
        assert h.get("Connection") == "close" or status == 400, h


def test_other_methods_get_json_405_and_names_are_quoted_once(server):
    for method in ("DELETE", "PATCH"):
        status, headers, out = request(server, method, "/generate")
        assert status == 405 and headers["Content-Type"] == "application/json", (method, status, out)
        assert headers["Allow"] == "POST, PUT", headers
        assert "/generate takes POST or PUT, not " + method in out["message"], out
    # SGLang takes PUT /generate as POST (was a 405 here)
    status, _, out = request(server, "PUT", "/generate", {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 2, "temperature": 0.0}})
    assert status == 200 and len(out["output_ids"]) == 2, out
    status, headers, out = request(server, "PUT", "/update_weights_from_tensor", {})
    assert status == 405 and headers["Allow"] == "POST", out
    status, headers, out = request(server, "DELETE", "/flush_cache")
    assert status == 405 and headers["Allow"] == "GET, POST", out
    status, _, out = request(server, "DELETE", "/no_such_route")
    assert (status, out) == (404, {"detail": "Not Found"})
    status, headers, out = request(server, "FOO", "/generate")    # the stdlib's own refusal: JSON too
    assert status == 501 and headers["Content-Type"] == "application/json", out
    assert out["success"] is False and "FOO" in out["message"]
    status, _, out = request(server, "POST", "/get_weights_by_name", {"name": "nope"})
    assert status == 400 and out["message"].startswith("unknown parameter 'nope'; "), out
    status, _, out = request(server, "POST", "/fsdp_sync/tensor_checksums", {"names": ["nope"]})
    assert status == 400 and out["message"].startswith("unknown parameter(s) ['nope']"), out


# --------------------------------------------------------------------------- item 3

def test_released_weights_are_a_503_and_client_mistakes_stay_400(engine, server):
    weights = list(engine.named_full_tensors())
    status, _, out = request(server, "POST", "/generate", {"input_ids": [1, 2], "sampling_params": {
        "max_new_tokens": 5000}})
    assert status == 400 and out["retryable"] is False, out                  # the client's mistake
    status, _, out = request(server, "POST", "/end_weight_update", {})
    assert status == 400 and "without begin" in out["message"] and out["retryable"] is False, out
    engine.release_memory_occupation(["weights"])
    try:
        status, _, out = request(server, "GET", "/health_generate")
        assert status == 503 and "weights are released" in out["message"] and out["retryable"], out
        status, _, out = request(server, "POST", "/generate", {"input_ids": [1, 2]})
        assert status == 503 and "EngineUnavailableError" in out["message"] and out["retryable"], out
        started, chunks = threading.Event(), []
        stream_chunks(server, {"input_ids": [1, 2]}, started, chunks)
        err = chunks[-1]["error"]
        assert err["code"] == 503 and err["retryable"] is True, chunks
        assert err["type"] == "service_unavailable" and "weights are released" in err["message"]
    finally:
        engine.resume_memory_occupation(["weights"])
        engine.update_weights_from_tensor(weights)
    assert request(server, "GET", "/health_generate")[0] == 200


@pytest.mark.timeout(240)
def test_a_worker_killed_under_running_requests_is_a_503():
    with ReferenceEngine(_config(), tp_size=2, kv_cache_tokens=4096, seed=4) as eng, \
            EngineServer(eng) as srv:
        plain, box = in_thread(request, srv, "POST", "/generate", {"input_ids": [5, 6], "sampling_params": LONG})
        started, chunks = threading.Event(), []
        streamed = threading.Thread(target=stream_chunks, args=(srv, {"input_ids": [7, 8], "sampling_params": LONG},
                                                                 started, chunks), daemon=True)
        streamed.start()
        assert started.wait(60) and "error" not in chunks[0], chunks
        os.kill(eng.worker_pids[1], signal.SIGKILL)
        plain.join(60)
        streamed.join(60)
        status, _, out = box[0]
        assert status == 503 and "WorkerDiedError" in out["message"] and out["retryable"] is True, out
        err = chunks[-1]["error"]
        assert err["code"] == 503 and err["retryable"] is True and "WorkerDiedError" in err["message"], chunks[-1]


@pytest.mark.timeout(240)
def test_a_request_in_flight_at_sigterm_is_a_503(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(_config().to_json_string())
    proc, url = start_serve("--model", str(cfg), "--kv-cache-tokens", "4096", stderr=subprocess.PIPE)
    try:
        plain, box = in_thread(request, url, "POST", "/generate", {"input_ids": [5, 6], "sampling_params": LONG})
        started, chunks = threading.Event(), []
        streamed = threading.Thread(target=stream_chunks, args=(url, {"input_ids": [7, 8], "sampling_params": LONG},
                                                                 started, chunks), daemon=True)
        streamed.start()
        assert started.wait(60) and "error" not in chunks[0], chunks
        time.sleep(0.5)                                 # both are running on the engine now
        proc.send_signal(signal.SIGTERM)
        plain.join(60)
        streamed.join(60)
        out_text, err_text = proc.communicate(timeout=60)
        assert proc.returncode == 0, (out_text, err_text)
        status, _, out = box[0]
        assert status == 503 and "EngineClosedError" in out["message"] and out["retryable"] is True, out
        err = chunks[-1]["error"]
        assert err["code"] == 503 and "EngineClosedError" in err["message"], chunks[-1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# --------------------------------------------------------------------------- item 5

GROUP = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 3,
         "group_name": "g", "backend": "gloo"}


def test_init_weights_update_group_checks_its_body(engine, server):
    bad = [({"backend": "foo"}, "field 'backend' must be one of ['gloo'] for this cpu engine, got 'foo'"),
           ({"backend": "nccl"}, "field 'backend'"),
           ({"rank_offset": 0}, "field 'rank_offset' must be >= 1"),
           ({"world_size": 2}, "field 'world_size' 2 cannot hold this server's 2 TP worker(s) as ranks 1..2"),
           ({"master_port": 0}, "field 'master_port' must be in 1..65535, got 0"),
           ({"master_address": "no.such.host.invalid"}, "field 'master_address': cannot resolve"),
           ({"group_name": ""}, "field 'group_name' must not be empty"),
           ({"world_size": "3"}, "field 'world_size' must be int, got str")]
    for change, words in bad:
        t0 = time.monotonic()
        status, _, out = request(server, "POST", "/init_weights_update_group", dict(GROUP, **change))
        assert status == 400 and words in out["message"], (change, status, out)
        assert time.monotonic() - t0 < 5, change          # refused before any worker tries to join
    assert engine._update_groups == {}
    with pytest.raises(ValueError, match="backend 'foo'"):           # in process too
        engine.init_weights_update_group("127.0.0.1", 29555, 1, 3, "g", backend="foo")


def test_a_begin_that_cannot_start_in_time_is_503_and_never_applied(engine, server):
    # a group whose trainer never comes: the workers wait in the rendezvous (update_recv_timeout_s 8)
    # on a port held, bound but not listening, by this test: nobody else can serve it meanwhile
    nobody = _held_port()
    t_join = time.monotonic()
    joining, joined = in_thread(request, server, "POST", "/init_weights_update_group",
                                dict(GROUP, master_port=nobody.getsockname()[1]))
    time.sleep(0.5)
    t0 = time.monotonic()
    status, _, out = request(server, "POST", "/begin_weight_update", {})
    waited = time.monotonic() - t0
    assert status == 503 and out["retryable"] is True and waited < 4, (status, out, waited)
    joining.join(60)
    assert joined[0][0] == 400, joined                    # the rendezvous timed out: the client's
    # within the engine's timeout (8 s), not torch's two tries and a sleep (2-3x: 160 s for 60)
    assert time.monotonic() - t_join < 8.0 * 1.6 and "nothing accepted a connection" in joined[0][2]["message"], joined
    assert engine._in_txn is False                        # the refused begin did not open later

    # requests still running at the limit: the same (the engine's own wait is bounded too)
    gen, _ = in_thread(request, server, "POST", "/generate", {"input_ids": [1, 2], "sampling_params": LONG})
    deadline = time.monotonic() + 30
    while not engine._sched.holds_kv():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    status, _, out = request(server, "POST", "/begin_weight_update", {})
    assert status == 503 and "running request" in out["message"] and out["retryable"], out
    assert request(server, "POST", "/abort_request", {"abort_all": True})[0] == 200
    gen.join(60)
    assert engine._in_txn is False
    assert request(server, "POST", "/begin_weight_update", {})[0] == 200        # nothing left open
    assert request(server, "POST", "/end_weight_update", {})[0] == 200
    nobody.close()


def _held_port():
    """A socket bound to a free port and not listening: a connection there is refused, and no
    other process can bind (and serve) the port while the socket lives."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


# --------------------------------------------------------------------------- the generation limit

def test_the_generation_limit_leaves_health_control_and_updates_answered(engine):
    """``max_concurrent`` bounds generation only: with every generation slot held, a third
    ``/generate`` gets 503 naming the limit while ``/health``, ``/ready``, ``/get_model_info`` and
    the control routes answer 200; stalled uploads (a body announced and never sent) hold no slot.
    Before, every route took a slot before its body was read: at the limit ``/health`` and
    ``/abort_request`` were 503, and 2 stalled uploads shut the server to everything."""
    with EngineServer(engine, max_concurrent=2, socket_timeout_s=30) as srv:
        stalled = []
        for _ in range(3):          # more stalled uploads than slots: none may hold one
            conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
            conn.putrequest("POST", "/generate")
            conn.putheader("Content-Length", "100")
            conn.endheaders(b"{")
            stalled.append(conn)
        time.sleep(0.3)
        gens = [in_thread(request, srv, "POST", "/generate", {"input_ids": [1, 2 + i], "sampling_params": LONG})
                for i in range(2)]
        deadline = time.monotonic() + 30
        while len(srv._live) < 2:
            assert time.monotonic() < deadline, srv._live
            time.sleep(0.05)
        # held in place (a control route, answered at the limit), so neither ends meanwhile
        assert request(srv, "POST", "/pause_generation", {"mode": "in_place"})[0] == 200
        status, _, out = request(srv, "POST", "/generate", {"input_ids": [3], "sampling_params": {"max_new_tokens": 1}})
        assert status == 503 and "2 generation requests" in out["message"] and out["retryable"], out
        for method, path, body in (("GET", "/health", None), ("GET", "/get_model_info", None),
                                   ("GET", "/get_server_info", None), ("POST", "/continue_generation", {}),
                                   ("POST", "/abort_request", {"abort_all": True}), ("GET", "/ready", None)):
            status, _, out = request(srv, method, path, body)
            assert status == 200, (path, status, out)
        for t, box in gens:
            t.join(60)
            assert box and box[0][0] == 200 and box[0][2]["meta_info"]["finish_reason"]["type"] == "abort", box
        status, _, out = request(srv, "POST", "/generate", {"input_ids": [3], "sampling_params": {"max_new_tokens": 1}})
        assert status == 200, out                       # the slots came back
        for conn in stalled:
            conn.close()


def test_json_nested_too_deeply_is_a_400(server):
    deep = b'{"input_ids":' + b"[" * 100000 + b"]" * 100000 + b"}"
    status, _, out = request(server, "POST", "/generate", raw_body=deep,
                             headers={"Content-Type": "application/json", "Content-Length": str(len(deep))})
    assert status == 400 and "nested too deeply" in out["message"] and not out["retryable"], (status, out)
    assert request(server, "GET", "/health")[0] == 200


def test_hits_count_known_routes_by_name_and_every_other_path_under_one_key():
    """`EngineServer.hits` (`get_server_info`'s generate_requests, the bench's http_requests) kept a
    key per path requested, 404s included: a scanner's 20000 paths made 20000 keys."""
    import types

    with EngineServer(types.SimpleNamespace(tp_size=1)) as srv:
        for i in range(50):
            assert request(srv, "GET", f"/scan/{i:03d}")[0] == 404
        assert request(srv, "GET", "/health?probe=1")[0] == 200
        assert request(srv, "POST", "/get_server_info", {})[0] == 200
        assert dict(srv.hits) == {"<unknown>": 50, "/health": 1, "/get_server_info": 1}
