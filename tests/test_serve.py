"""`fsdp-sync serve`: the reference engine over SGLang's HTTP routes, and its safety rules.

A `ReferenceEngine` (2 TP workers) is served in a thread for the module; `SGLangEngine(base_url=)`
drives it unchanged, and raw requests try what a careless or hostile client sends. The endpoints
whose engine methods this branch's `ReferenceEngine` may lack (distributed and disk updates) are
checked against a recording stand-in engine: arguments by SGLang's names, refusals before the
engine is reached. One test starts the real command (`python -m fsdp_sync.cli serve`).
"""

from __future__ import annotations

import http.client
import json
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from fsdp_sync.engines.base import EngineStateError
from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.sglang import SGLangEngine, SGLangError, SGLangHTTPError, SGLangUpdateError
from fsdp_sync.engines.reference.serve import EngineServer
from _util import start_serve

ROOT = Path(__file__).resolve().parent.parent
KEY = "s3cret-key"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine():
    with ReferenceEngine("tiny", tp_size=2, seed=3) as eng:
        yield eng


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    allowed = tmp_path_factory.mktemp("allowed")
    with EngineServer(engine, api_key=KEY, allowed_disk_dirs=[str(allowed)],
                      max_body_bytes=1 << 20, update_wait_s=5.0) as srv:
        srv.allowed = allowed
        yield srv


def raw(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
        key: str | None = KEY) -> tuple[int, str]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        hdrs = dict(headers or {})
        if key is not None:
            hdrs["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def post(server, path: str, obj, **kw) -> tuple[int, dict | str]:
    status, text = raw(server, "POST", path, json.dumps(obj).encode(),
                       {"Content-Type": "application/json"}, **kw)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def model_tensors(engine, fill=None, seed=0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in engine.hf_names():
        shape = engine.layout.full_shape(n)
        out.append((n, torch.full(shape, float(fill)) if fill is not None
                    else torch.randn(shape, generator=g)))
    return out


def test_sglang_client_drives_the_served_engine_bit_exact(engine, server):
    client = SGLangEngine(base_url=server.url, api_key=KEY, max_retries=0)
    assert client.tp_size == 2 and client.health()
    new = model_tensors(engine, seed=11)
    new[0][1].view(-1)[:3] = torch.tensor([float("nan"), -0.0, float("inf")])   # data, not errors
    client.begin_weight_update()
    client.update_weights_from_bucket(new[: len(new) // 2], flush_cache=False)
    client.update_weights_from_bucket(new[len(new) // 2:])
    client.end_weight_update()
    assert client.session_api is True
    for name, t in new:
        got = engine.get_weights_by_name(name)
        assert got.view(torch.int32).equal(t.view(torch.int32)), name   # bits, NaN and -0.0 too
    prompts = [[1, 2, 3], [7, 5]]
    assert client.generate(prompts, max_new_tokens=5) == engine.generate(prompts, max_new_tokens=5)
    # load_format None over HTTP: one serialized list per TP rank, opened by the server
    plus = [(n, t + 1) for n, t in new[1:3]]
    client.update_weights_from_tensor(plus)
    for name, t in plus:
        assert engine.get_weights_by_name(name).equal(t)
    first = client.get_weights_by_name(new[1][0], truncate_size=2)
    assert first.equal(plus[0][1][:2])
    client.release_memory_occupation(["kv_cache"])
    client.resume_memory_occupation(["kv_cache"])
    client.flush_cache()
    status, info = raw(server, "GET", "/get_model_info")
    assert status == 200 and json.loads(info)["is_generation"] is True


def test_api_key_is_required_when_set(engine, server):
    assert raw(server, "GET", "/get_model_info", key=None)[0] == 401
    assert raw(server, "GET", "/get_model_info", key="wrong")[0] == 401
    assert raw(server, "GET", "/health", key=None)[0] == 200           # liveness stays open
    before = engine.get_weights_by_name("model.norm.weight")
    status, out = post(server, "/update_weights_from_tensor",
                       {"serialized_named_tensors": ["x", "y"], "load_format": "flattened_bucket"},
                       key=None)
    assert status == 401 and out["success"] is False and "API key" in out["message"]
    # a refused request's unread body is not taken for the next request on the connection
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        conn.request("POST", "/flush_cache", body=b'POST /end_weight_update HTTP/1.1\r\n\r\n')
        resp = conn.getresponse()
        assert resp.status == 401 and resp.getheader("Connection") == "close"
        resp.read()
    finally:
        conn.close()
    with pytest.raises(SGLangError):
        SGLangEngine(base_url=server.url, max_retries=0)                 # asks tp_size: refused
    assert engine.get_weights_by_name("model.norm.weight").equal(before)


def test_bad_requests_are_refused_and_the_server_lives(engine, server):
    before = engine.weights_checksum()
    j = {"Content-Type": "application/json"}
    cases = [
        (raw(server, "POST", "/generate", b"{not json", j), 400, "malformed JSON"),
        (raw(server, "POST", "/generate", b"[1, 2]", j), 400, "must be an object"),
        (post(server, "/update_weights_from_tensor", {"serialized_named_tensors": "abc"}), 400,
         "'serialized_named_tensors'"),
        (post(server, "/update_weights_from_tensor",
              {"serialized_named_tensors": ["a", "b"], "flush_cache": "yes"}), 400, "'flush_cache'"),
        (post(server, "/update_weights_from_tensor",
              {"serialized_named_tensors": ["a"], "load_format": "flattened_bucket"}), 400, "2 base64"),
        (post(server, "/update_weights_from_tensor",
              {"serialized_named_tensors": ["a", "b"], "load_format": "pickle"}), 400, "load_format"),
        (post(server, "/release_memory_occupation", {"tags": 5}), 400, "'tags'"),
        (post(server, "/update_weights_from_disk", {"model_path": str(server.allowed), "flush_cache": "yes"}),
         400, "'flush_cache'"),
        (post(server, "/generate", {"input_ids": [["a"]]}), 400, "'input_ids'"),
        (post(server, "/generate", {"input_ids": [[1]], "sampling_params": {"frequency_penalty": 0.5}}),
         400, "sampling_params.frequency_penalty=0.5 is not supported"),
        (post(server, "/generate", {"input_ids": [[1]], "sampling_params": {"top_k": 0}}), 400,
         "sampling_params.top_k must be -1 (off) or an integer >= 1, got 0"),
        (post(server, "/generate", {"input_ids": [[1]], "sampling_params": {"stop_token_ids": ["a"]}}),
         400, "sampling_params.stop_token_ids must be a list of token ids, got ['a']"),
        (post(server, "/generate", {"input_ids": [[1]], "return_hidden_states": True}), 400,
         "'return_hidden_states'"),
        (post(server, "/generate", {"input_ids": [[1]], "sampling_params": {"stop": ["\n"]}}), 400,
         "stop_token_ids"),
        (post(server, "/generate", {"input_ids": [[1]], "sampling_params": {"max_new_tokens": 10**6}}),
         400, "maximum context length"),
        (post(server, "/generate", {"text": "hello"}), 400, "tokenizer"),
        (post(server, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "1"}),
         400, "'truncate_size'"),
        (post(server, "/get_weights_by_name", {"name": "nope"}), 400, "unknown parameter"),
        (raw(server, "POST", "/generate", b"zz\r\n", {"Transfer-Encoding": "chunked"}), 400, "chunk size"),
        (raw(server, "GET", "/generate"), 405, "POST"),
        (raw(server, "GET", "/no_such_route"), 404, "Not Found"),
    ]
    for (status, text), want, needle in cases:
        text = text if isinstance(text, str) else json.dumps(text)
        assert status == want and needle in text, (want, needle, status, text[:200])
    # a payload naming a global outside the allow-list: refused by the unpickler, nothing loaded
    evil = pickle.dumps([("model.norm.weight", os.system)])
    import base64
    status, out = post(server, "/update_weights_from_tensor",
                       {"serialized_named_tensors": [base64.b64encode(evil).decode()] * 2})
    assert status == 400 and "allow-list" in out["message"], out
    # a body far over the limit is refused from its Content-Length, never read
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        t0 = time.monotonic()
        conn.putrequest("POST", "/update_weights_from_tensor")
        conn.putheader("Authorization", f"Bearer {KEY}")
        conn.putheader("Content-Length", str(10 << 30))
        conn.endheaders()
        conn.send(b"{" + b" " * 4096)
        resp = conn.getresponse()
        assert resp.status == 413 and "limit" in resp.read().decode()
        assert time.monotonic() - t0 < 10
    finally:
        conn.close()
    status, text = raw(server, "POST", "/generate", b" " * ((1 << 20) + 1), j)
    assert status == 413
    assert engine.weights_checksum() == before
    assert raw(server, "GET", "/health")[0] == 200


def test_concurrent_updates_never_interleave(engine, server):
    """Four clients push the whole model at once, each a different constant: afterwards every
    tensor holds the same client's value, and no update failed halfway."""
    clients = [SGLangEngine(base_url=server.url, api_key=KEY, tp_size=2, max_retries=0)
               for _ in range(4)]
    errors: list = []

    def push(k: int) -> None:
        try:
            clients[k].update_weights_from_bucket(model_tensors(engine, fill=k + 1))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=push, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    values = {float(engine.get_weights_by_name(n).view(-1)[0]) for n in engine.hf_names()}
    assert len(values) == 1 and values <= {1.0, 2.0, 3.0, 4.0}, values
    # one update session at a time: a second begin is refused while the first is open
    clients[0].begin_weight_update()
    try:
        with pytest.raises(EngineStateError, match="twice"):
            clients[1].begin_weight_update()
    finally:
        clients[0].end_weight_update()


class _Recorder:
    """A stand-in engine: records calls by SGLang's names; updates can be made slow."""

    tp_size = 2

    def __init__(self) -> None:
        self.calls: list = []
        self.running = 0
        self.max_running = 0
        self.delay = 0.0
        self.lock = threading.Lock()

    def _enter(self, name, kwargs):
        with self.lock:
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            self.calls.append((name, kwargs))
        time.sleep(self.delay)
        with self.lock:
            self.running -= 1

    def update_weights_from_disk(self, model_path, load_format=None):
        self._enter("update_weights_from_disk", {"model_path": model_path, "load_format": load_format})
        return True, "loaded"

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="nccl"):
        self.calls.append(("init_weights_update_group", dict(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend)))

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        self._enter("update_weights_from_distributed", dict(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name,
            flush_cache=flush_cache, load_format=load_format))

    def destroy_weights_update_group(self, group_name="weight_update_group"):
        self.calls.append(("destroy_weights_update_group", {"group_name": group_name}))
        return False, f"unknown group {group_name!r}"


def test_disk_and_distributed_endpoints(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "weight_v000001").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (allowed / "escape").symlink_to(outside)
    rec = _Recorder()
    with EngineServer(_Recorder()) as closed_srv:   # no --allowed-disk-dir: every path refused
        status, out = post(closed_srv, "/update_weights_from_disk",
                           {"model_path": str(allowed / "weight_v000001")}, key=None)
        assert status == 403 and "--allowed-disk-dir" in out["message"]
        assert closed_srv.engine.calls == []
    with EngineServer(rec, allowed_disk_dirs=[str(allowed)], update_wait_s=0.3) as srv:
        for path, want in ((str(outside), 403), (str(allowed / "escape"), 403),
                           (str(allowed / ".." / "outside"), 403), (str(allowed / "missing"), 400),
                           (123, 400)):
            status, out = post(srv, "/update_weights_from_disk", {"model_path": path}, key=None)
            assert status == want and out["success"] is False, (path, status, out)
        assert rec.calls == []
        status, out = post(srv, "/update_weights_from_disk",
                           {"model_path": str(allowed / "weight_v000001"), "load_format": None,
                            "abort_all_requests": False, "weight_version": "v1"}, key=None)
        assert (status, out["success"], out["num_paused_requests"]) == (200, True, 0)
        assert rec.calls[-1] == ("update_weights_from_disk", {
            "model_path": str((allowed / "weight_v000001").resolve()), "load_format": None})
        status, out = post(srv, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1,
            "world_size": 3, "group_name": "g", "backend": "gloo"}, key=None)
        assert status == 200 and rec.calls[-1][1]["backend"] == "gloo"
        assert post(srv, "/init_weights_update_group", {"master_address": "127.0.0.1",
                    "master_port": "x", "rank_offset": 1, "world_size": 3}, key=None)[0] == 400
        body = {"names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[2, 3], [4]],
                "group_name": "g", "flush_cache": False, "load_format": "flattened_bucket"}
        status, out = post(srv, "/update_weights_from_distributed", body, key=None)
        assert status == 200 and rec.calls[-1] == ("update_weights_from_distributed", body)
        assert post(srv, "/update_weights_from_distributed", dict(body, shapes=[[2, -3], [4]]),
                    key=None)[0] == 400
        status, out = post(srv, "/destroy_weights_update_group", {"group_name": "zz"}, key=None)
        assert status == 400 and out == {"success": False, "message": "unknown group 'zz'"}

        # one update at a time: slow updates are serialized; one that waits too long gets 503
        rec.delay = 0.5
        results: list = []
        path = {"model_path": str(allowed / "weight_v000001")}
        threads = [threading.Thread(target=lambda: results.append(
            post(srv, "/update_weights_from_disk", path, key=None)[0])) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert rec.max_running == 1
        assert sorted(results)[0] == 200 and 503 in results, results
    with EngineServer(object()) as bare:              # an engine without the method: 404
        status, out = post(bare, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1,
            "world_size": 3}, key=None)
        assert status == 404 and "has no init_weights_update_group" in out["message"]


def test_serve_command_binds_loopback_and_stops_cleanly():
    proc, url = start_serve("--api-key", KEY)
    try:
        client = SGLangEngine(base_url=url, api_key=KEY, max_retries=0)
        assert client.tp_size == 1
        names = ["model.norm.weight"]
        shape = (int(client.get_weights_by_name(names[0]).numel()),)
        with pytest.raises((SGLangHTTPError, SGLangUpdateError)):
            SGLangEngine(base_url=url, tp_size=1, max_retries=0).update_weights_from_bucket(
                [(names[0], torch.ones(shape))])
        client.update_weights_from_bucket([(names[0], torch.full(shape, 2.5))])
        assert client.get_weights_by_name(names[0]).equal(torch.full(shape, 2.5))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "stopped" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_sglang_get_routes_and_empty_tags_mean_all(engine, server):
    """Issue 21 item 2: SGLang takes GET as well as POST on /flush_cache, /release_memory_occupation,
    /resume_memory_occupation and /get_weights_by_name (verl's HttpServerAdapter.flush_cache is a
    GET: a 405 made it retry, log "Failed to flush cache" and go on), and its scheduler reads
    ``tags: []`` (or null) as every tag (serve released nothing for [])."""
    def held() -> list[tuple[int, int]]:
        return [(w["weights_bytes"], w["kv_cache_bytes"]) for w in engine.memory_stats()["workers"]]

    before = held()
    assert all(w > 0 and kv > 0 for w, kv in before), before
    weights = list(engine.named_full_tensors())      # released weights come back as zeros
    flushed = server.hits["/flush_cache"]
    assert raw(server, "GET", "/flush_cache")[0] == 200
    assert server.hits["/flush_cache"] == flushed + 1
    status, out = raw(server, "GET", "/release_memory_occupation", json.dumps({"tags": []}).encode(),
                      {"Content-Type": "application/json"})
    assert status == 200 and json.loads(out)["success"], out
    assert held() == [(0, 0)] * len(before)                     # [] released weights AND kv cache
    status, out = post(server, "/resume_memory_occupation", {"tags": []})
    assert status == 200 and out["success"], out
    assert held() == before
    status, out = raw(server, "GET", "/resume_memory_occupation")           # no body: null tags
    assert status == 200
    engine.update_weights_from_tensor(weights)
    status, text = raw(server, "GET", "/get_weights_by_name",
                       json.dumps({"name": "model.norm.weight"}).encode(),
                       {"Content-Type": "application/json"})
    assert status == 200 and torch.tensor(json.loads(text)).equal(
        engine.get_weights_by_name("model.norm.weight")), text
    assert raw(server, "GET", "/update_weights_from_tensor")[0] == 405      # updates stay POST


def test_openai_model_list_and_lora_routes_are_sglangs(engine, server):
    """verl's AsyncHttpServerAdapter has ``available_models`` (GET /v1/models, SGLang's OpenAI
    card list) and LoRA routes: the served model's card (no adapter loaded), and a 400 naming the
    missing field for a LoRA call without it (the routes themselves: test_serve_lora)."""
    status, text = raw(server, "GET", "/v1/models")
    assert status == 200, text
    models = json.loads(text)
    assert models["object"] == "list" and [c["object"] for c in models["data"]] == ["model"]
    assert models["data"][0]["max_model_len"] == engine.config.max_position_embeddings
    for route, field in (("/load_lora_adapter", "lora_path"), ("/load_lora_adapter_from_tensors",
                                                                "config_dict"), ("/unload_lora_adapter", "lora_name")):
        status, out = post(server, route, {} if field == "lora_name" else {"lora_name": "x"})
        assert status == 400 and field in out["message"], (route, out)
