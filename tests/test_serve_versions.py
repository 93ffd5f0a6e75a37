"""In-flight weight updates over HTTP: `fsdp-sync serve`'s SGLang 0.5.23 routes for pause/continue and
weight versions, its out-of-service switch (503 on /health, /health_generate, /ready, /generate),
``weight_version`` / ``weight_versions`` in every /generate answer (streamed chunks too), concurrent
/generate requests batched by the engine, and `SGLangEngine`'s calls for all of it against a real
`EngineServer`, against an SGLang-like server without fsdp_sync's routes, and in process.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import time

import pytest

from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.engines.sglang import SGLangEngine, SGLangError
from fsdp_sync.models import build_model, load_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_sglang as fake  # noqa: E402

pytestmark = pytest.mark.timeout(120)

P1 = [11, 27, 93, 5]
P2 = [201, 3, 64, 64, 17, 88, 42, 9, 120]
LONG = 40           # tokens of a request that is held, then runs to its end


def sp(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def call(srv, method: str, path: str, body=None, timeout: float = 60):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        text = resp.read().decode()
        try:
            return resp.status, json.loads(text)
        except ValueError:
            return resp.status, text
    finally:
        conn.close()


class Bg(threading.Thread):
    def __init__(self, fn, *args) -> None:
        super().__init__(daemon=True)
        self.fn, self.args, self.result, self.error = fn, args, None, None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            self.error = exc

    def get(self, timeout: float = 60.0):
        self.join(timeout)
        assert not self.is_alive() and self.error is None, self.error
        return self.result


def wait_until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def held(eng, srv, prompt, n, after: int = 3) -> Bg:
    """A /generate in a thread that the engine pauses in place right after its ``after``-th step
    (`ReferenceEngine._pause_after_steps`): the test acts on it whatever the machine's speed."""
    eng._pause_after_steps(after)
    bg = Bg(call, srv, "POST", "/generate", {"input_ids": prompt, "sampling_params": sp(n)})
    bg.start()
    wait_until(lambda: eng.generation_paused == "in_place")
    return bg


@pytest.fixture(scope="module")
def models():
    cfg = load_config("tiny")
    return build_model(cfg, seed=0).eval(), build_model(cfg, seed=1).eval()


@pytest.fixture(scope="module")
def served(models):
    with ReferenceEngine("tiny", tp_size=1, kv_cache_tokens=1024) as eng:
        with EngineServer(eng) as srv:
            yield srv


@pytest.fixture
def srv(served, models):
    eng = served.engine
    eng.update_weights_from_tensor(list(models[0].state_dict().items()), weight_version="A")
    yield served
    eng.continue_generation()
    eng.set_serving(True)


def client(srv) -> SGLangEngine:
    return SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0, timeout_s=60)


# --------------------------------------------------------------------------- routes

def test_version_routes_and_meta_info(srv):
    assert call(srv, "GET", "/get_weight_version") == (200, {"weight_version": "A"})
    status, out = call(srv, "POST", "/update_weight_version", {"new_version": "v1"})
    assert (status, out) == (200, {"success": True, "message": "Weight version updated to v1",
                                   "new_version": "v1"})
    assert call(srv, "POST", "/get_weight_version", {}) == (200, {"weight_version": "v1"})
    assert call(srv, "GET", "/get_model_info")[1]["weight_version"] == "v1"
    assert srv.weight_version == srv.engine.weight_version == "v1"      # no counter of its own
    status, out = call(srv, "POST", "/generate", {"input_ids": P1, "sampling_params": sp(5)})
    assert status == 200 and out["meta_info"]["weight_version"] == "v1"
    assert out["meta_info"]["weight_versions"] == [{"version": "v1", "start": 0, "end": 5}]
    # a stream: every chunk carries the spans of the output so far
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
    conn.request("POST", "/generate", json.dumps({"input_ids": P1, "stream": True,
                                                  "sampling_params": sp(4)}),
                 {"Content-Type": "application/json"})
    raw = conn.getresponse().read().decode()
    conn.close()
    chunks = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
    assert len(chunks) == 4
    for c in chunks:
        n = len(c["output_ids"])
        assert c["meta_info"]["weight_versions"] == [{"version": "v1", "start": 0, "end": n}]
        assert c["meta_info"]["weight_version"] == "v1"
    # bad fields answer 400 naming them, and change nothing
    for path, body, word in (("/update_weight_version", {"new_version": 3}, "'new_version'"),
                             ("/update_weight_version", {}, "'new_version'"),
                             ("/update_weight_version", {"new_version": "x", "abort_all_requests": "y"},
                              "'abort_all_requests'"),
                             ("/pause_generation", {"mode": "sideways"}, "'sideways'"),
                             ("/pause_generation", {"mode": 1}, "'mode'"),
                             ("/continue_generation", {"torch_empty_cache": "y"}, "'torch_empty_cache'"),
                             ("/fsdp_sync/set_serving", {"serving": "no"}, "'serving'"),
                             ("/fsdp_sync/set_serving", {"serving": False, "reason": 5}, "'reason'"),
                             ("/end_weight_update", {"weight_version": 5}, "'weight_version'")):
        status, out = call(srv, "POST", path, body)
        assert status == 400 and word in out["message"], (path, status, out)
    assert srv.engine.weight_version == "v1" and srv.engine.serving_state is None
    assert srv.engine.generation_paused is None


def test_out_of_service_answers_503_where_a_router_looks(srv):
    c = client(srv)
    assert c.serving_state is None
    c.set_serving(False, "quarantined by the fleet")
    assert srv.engine.serving_state == "quarantined by the fleet"
    assert c.serving_state == "quarantined by the fleet"
    for method, path, body in (("GET", "/health", None), ("GET", "/health_generate", None),
                               ("GET", "/ready", None),
                               ("POST", "/generate", {"input_ids": P1, "sampling_params": sp(2)})):
        status, out = call(srv, method, path, body)
        assert status == 503 and out["message"] == "quarantined by the fleet", (path, status, out)
    # reads and weight updates still work: the trainer brings it back
    assert call(srv, "GET", "/get_model_info")[0] == 200
    c.begin_weight_update()
    c.end_weight_update(weight_version="A2")
    assert c.get_weight_version() == "A2"
    c.set_serving(True)
    assert c.serving_state is None
    for path in ("/health", "/health_generate", "/ready"):
        assert call(srv, "GET", path)[0] == 200, path


def test_pause_update_continue_over_http(srv, models):
    """A request in flight, paused with retract over HTTP; a session commits new weights with
    their version; after the continue its spans split where the new weights took over."""
    eng, c = srv.engine, client(srv)
    old = eng.generate_requests([P1], sp(LONG))[0]["output_ids"]
    r = held(eng, srv, P1, LONG)
    c.pause_generation("retract")
    assert eng.generation_paused == "retract" and eng.scheduler_stats()["running"] == 0
    assert call(srv, "GET", "/ready")[0] == 503                # SGLang's is_ready while paused
    assert call(srv, "GET", "/health_generate")[0] == 200      # answered without generating
    renames = srv.hits["/update_weight_version"]
    c.begin_weight_update()
    c.update_weights_from_bucket(list(models[1].state_dict().items()))
    c.end_weight_update(weight_version="B")
    assert srv.hits["/update_weight_version"] == renames      # serve took it with the commit
    assert c.get_weight_version() == "B" and eng.weight_version == "B"
    c.continue_generation()
    status, out = r.get()
    spans = out["meta_info"]["weight_versions"]
    j = spans[0]["end"]
    assert status == 200 and spans == [{"version": "A", "start": 0, "end": j},
                                       {"version": "B", "start": j, "end": LONG}]
    assert j == 3 and out["output_ids"][:j] == old[:j] and out["meta_info"]["weight_version"] == "B"
    # abort mode: the request comes back at once, aborted, with its tokens
    r = held(eng, srv, P2, LONG)
    c.pause_generation()
    status, out = r.get(10)
    assert status == 200 and out["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(out["output_ids"]) == 3
    c.continue_generation()
    assert call(srv, "GET", "/ready")[0] == 200


def test_concurrent_http_requests_share_steps(srv):
    """A second /generate arrives while the first runs (held there by an in-place pause, so the
    overlap does not depend on speed) and joins its batch; both give their lone greedy tokens."""
    eng = srv.engine
    alone1 = eng.generate_requests([P1], sp(LONG))[0]["output_ids"]
    alone2 = eng.generate_requests([P2], sp(8))[0]["output_ids"]
    a = held(eng, srv, P1, LONG)
    b = Bg(call, srv, "POST", "/generate", {"input_ids": P2, "sampling_params": sp(8)})
    b.start()
    wait_until(lambda: eng.scheduler_stats()["waiting"] == 1)
    first = eng.scheduler_stats()["steps"]
    eng.continue_generation()
    (sa, oa), (sb, ob) = a.get(), b.get()
    assert sa == sb == 200 and oa["output_ids"] == alone1 and ob["output_ids"] == alone2
    after = [r for r in eng.step_records() if r.index > first]
    assert len(after[0].prefill) == 1 and len(after[0].decode) == 1     # joined the running one
    assert sum(1 for r in after if len(r.decode) == 2) == 7             # then decoded beside it


# --------------------------------------------------------------------------- the client elsewhere

def test_adapter_against_sglang_0_5_23_routes():
    """A server with SGLang's routes only: the version comes from /get_model_info, an
    end_weight_update whose answer does not name the version is followed by /update_weight_version,
    and set_serving says to use the router."""
    with fake.FakeSGLangServer(tp_size=2) as f:
        c = SGLangEngine(base_url=f.url, tp_size=2, max_retries=0, timeout_s=10)
        f.script["/get_model_info"] = [(200, json.dumps({"weight_version": "w7"}))]
        assert c.get_weight_version() == "w7"
        assert [p for _, p, _ in f.requests[-2:]] == ["/get_weight_version", "/get_model_info"]
        ok = (200, json.dumps({"message": "ok", "status": "ok"}))
        f.script["/pause_generation"] = [ok]
        f.script["/continue_generation"] = [ok]
        c.pause_generation("in_place")
        c.continue_generation()
        assert f.requests[-2][1:] == ("/pause_generation", {"mode": "in_place"})
        f.script["/update_weight_version"] = [
            (200, json.dumps({"success": True, "message": "m", "new_version": "w8"}))]
        c.begin_weight_update()
        c.end_weight_update(weight_version="w8")
        assert [(p, b) for _, p, b in f.requests[-2:]] == [
            ("/end_weight_update", {"weight_version": "w8"}),
            ("/update_weight_version", {"new_version": "w8", "abort_all_requests": False})]
        with pytest.raises(SGLangError, match=r"not fsdp-sync serve.*DELETE /workers/\{id\}"):
            c.set_serving(False, "x")
        assert c.serving_state is None                        # /health 200
        with pytest.raises(ValueError, match="'sideways'"):
            c.pause_generation("sideways")


def test_adapter_in_process(srv):
    """`SGLangEngine` over an in-process engine: a `ReferenceEngine` has the calls; SGLang's
    in-process engine has none of them, which is said."""
    eng = srv.engine
    c = SGLangEngine(eng, tp_size=1)
    c.update_weight_version("ip1")
    assert c.get_weight_version() == "ip1"
    c.pause_generation("in_place")
    assert eng.generation_paused == "in_place"
    c.continue_generation()
    c.set_serving(False, "held")
    assert c.serving_state == "held"
    c.set_serving(True)
    c.begin_weight_update()
    c.end_weight_update(weight_version="ip2")
    assert eng.weight_version == "ip2"
    s = SGLangEngine(fake.FakeSGLangEngine(tp_size=2))
    with pytest.raises(SGLangError, match="HTTP only"):
        s.pause_generation()
    with pytest.raises(SGLangError, match="no weight_version"):
        s.end_weight_update(weight_version="v")
    assert s.serving_state is None
