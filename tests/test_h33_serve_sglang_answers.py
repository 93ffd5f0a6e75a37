"""`fsdp-sync serve` against SGLang 0.5.23's ``http_server`` where the two answered differently
(helper H33): ``/abort_request``'s answer and the ids an ``n`` > 1 ``/generate`` is taken in
under. The engine is `test_h12_serve_routes.Stub` (it records what reaches it, and its
``generate_requests`` runs until aborted), so no worker starts.

- ``/abort_request``: SGLang answers ``Response(status_code=200)``, an empty body, whatever it
  aborted; serve answered ``{"success": true, "message": "aborted N request(s)"}``, a body a client
  written against serve would read and SGLang never sends.
- ``n`` > 1: SGLang's ``GenerateReqInput._normalize_rid`` expands a string ``rid`` to ``rid_0`` ..
  ``rid_{prompts * n - 1}`` (a list stays as given) and ``TokenizerManager._init_req_state``
  refuses the request if one of them is running ("Duplicate request ID detected"); only after the
  prefix warm-up does it drop them for the samples' fresh ids. serve checked only the samples'
  fresh ids, so such a request ran beside the one holding its id.
"""

from __future__ import annotations

import threading

import pytest

from fsdp_sync.engines.reference.serve import EngineServer
from test_h12_serve_routes import Stub, call

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served():
    stub = Stub()
    with EngineServer(stub) as srv:
        yield srv, stub


def _in_thread(srv, body) -> tuple[threading.Thread, list]:
    box: list = []
    t = threading.Thread(target=lambda: box.append(call(srv, "/generate", body)))
    t.start()
    return t, box


def test_abort_request_answers_sglangs_empty_200(served):
    srv, stub = served
    assert call(srv, "/abort_request", {"rid": "nobody"}) == (200, "")
    assert call(srv, "/abort_request", {}) == (200, "")          # SGLang: ignored, logged
    t, box = _in_thread(srv, {"input_ids": [1, 2], "rid": "r"})
    try:
        assert stub.running.wait(10)
        assert call(srv, "/abort_request", {"rid": "r"}) == (200, "")     # before: a JSON body
    finally:
        call(srv, "/abort_request", {"abort_all": True})
        t.join(20)
    assert box and box[0][0] == 200 and box[0][1]["meta_info"]["finish_reason"]["type"] == "abort", box
    # a wrong field type is still a 400 naming it (SGLang's validation: 400 too)
    status, out = call(srv, "/abort_request", {"rid": 7})
    assert status == 400 and out["message"] == "field 'rid' must be str or NoneType, got int", out


@pytest.mark.parametrize("body", [
    {"input_ids": [5, 6], "rid": "job", "sampling_params": {"n": 2}},              # job_0, job_1
    {"input_ids": [[5], [6]], "rid": "job", "sampling_params": {"n": 2}},          # job_0 .. job_3
    {"input_ids": [[5], [6]], "rid": ["x", "job_1"], "sampling_params": {"n": 3}},
], ids=["single", "batch-string", "batch-list"])
def test_an_n_request_whose_intake_id_is_running_is_refused(served, body):
    srv, stub = served
    t, box = _in_thread(srv, {"input_ids": [1, 2], "rid": "job_1"})
    try:
        assert stub.running.wait(10)
        status, out = call(srv, "/generate", body)
        assert status == 400 and "field 'rid'" in out["message"] and "'job_1'" in out["message"], out
        assert [c for c in stub.calls if c[0] == "generate"] == [("generate", 1)]   # never reached it
    finally:
        call(srv, "/abort_request", {"abort_all": True})
        t.join(20)
    assert box and box[0][0] == 200, box


def test_an_n_requests_own_rid_is_free_once_its_samples_run(served):
    """SGLang drops an ``n`` > 1 request's intake ids after its warm-up: a request under its
    ``rid``, or under one of the expanded ids, runs beside it (serve holds only the samples' ids)."""
    srv, stub = served
    t1, box1 = _in_thread(srv, {"input_ids": [5, 6], "rid": "job", "sampling_params": {"n": 2}})
    threads, boxes = [t1], [box1]
    try:
        assert stub.running.wait(10)
        for rid in ("job", "job_0"):
            stub.running.clear()
            t, box = _in_thread(srv, {"input_ids": [1, 2], "rid": rid})
            threads.append(t)
            boxes.append(box)
            assert stub.running.wait(10), rid
    finally:
        call(srv, "/abort_request", {"abort_all": True})
        for t in threads:
            t.join(20)
    assert [b[0][0] if b else None for b in boxes] == [200, 200, 200], boxes
    assert [c for c in stub.calls if c[0] == "generate"] == [("generate", 1)] * 3


def test_a_lora_cards_root_is_where_it_was_loaded_from():
    """SGLang 0.5.23's ``/v1/models`` gives each adapter's card ``root=lora_ref.lora_path`` (the
    directory, ``"__tensor__"`` for tensors, as ``loaded_adapters`` says); serve put its name."""
    import http.client
    import json

    class LoRAStub(Stub):
        lora_adapters = {"disk": {"r": 8, "path": "/ckpt/disk"}, "pushed": {"r": 8}}

    with EngineServer(LoRAStub(), model_path="base") as srv:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
        conn.request("GET", "/v1/models")
        cards = json.loads(conn.getresponse().read())["data"]
        conn.close()
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [
        ("base", "base", None), ("disk", "/ckpt/disk", "base"), ("pushed", "__tensor__", "base")], cards


def test_model_info_has_the_keys_sglang_and_its_router_read():
    """SGLang 0.5.23's ``/model_info`` (``/get_model_info``) answers ``served_model_name`` (the model
    path unless ``--served-model-name``), ``architectures`` and ``preferred_sampling_params``;
    sglang-router's ``GetModelInfoResponse`` reads them. serve answered none of the three."""
    import http.client
    import json

    class Config:          # what serve reads of an HF config here
        model_type, architectures = "llama", ["LlamaForCausalLM"]

        def to_json_string(self) -> str:
            return json.dumps({"model_type": self.model_type, "architectures": self.architectures})

    class ConfigStub(Stub):
        config = Config()

    with EngineServer(ConfigStub(), model_path="/ckpt/base") as srv:
        answers = []
        for path in ("/get_model_info", "/model_info"):
            conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
            conn.request("GET", path)
            answers.append(json.loads(conn.getresponse().read()))
            conn.close()
    assert answers[0] == answers[1]
    info = answers[0]
    assert (info["model_path"], info["served_model_name"], info["architectures"]) == (
        "/ckpt/base", "/ckpt/base", ["LlamaForCausalLM"]), info
    assert info["preferred_sampling_params"] is None and info["is_generation"] is True, info


def test_an_abort_ends_its_own_id_not_every_id_it_begins():
    """Mutant (serve._abort_request): ids matched by prefix, as SGLang's scheduler matches them
    (``req.rid.startswith(recv_req.rid)``): an abort of ``"a"`` ended a running ``"ab"``. serve ends
    the id itself (its docstring); the flag is set before the answer goes out, so it is read at once."""
    stub = Stub()
    with EngineServer(stub) as srv:
        t, box = _in_thread(srv, {"input_ids": [1, 2], "rid": "ab"})
        try:
            assert stub.running.wait(10)
            assert call(srv, "/abort_request", {"rid": "a"}) == (200, "")
            assert not srv._live["ab"].is_set()
            assert call(srv, "/abort_request", {"rid": "ab"}) == (200, "")
            assert "ab" not in srv._live or srv._live["ab"].is_set()
        finally:
            call(srv, "/abort_request", {"abort_all": True})
            t.join(20)
    assert box and box[0][0] == 200, box


def test_a_body_of_exactly_the_limit_is_read_and_one_byte_more_is_413():
    """Mutant (serve._read_sized): ``n >= max_body_bytes`` refused a body the limit allows."""
    import http.client

    with EngineServer(Stub(), max_body_bytes=64) as srv:
        for size, status in ((64, 200), (65, 413)):
            body = '{"rid": "%s"}' % ("x" * (size - len('{"rid": ""}')))
            assert len(body) == size
            conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
            conn.request("POST", "/abort_request", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            text = resp.read().decode()
            conn.close()
            assert resp.status == status, (size, resp.status, text)
            if status == 413:
                assert "65 bytes" in text and "64" in text, text


class _ReadStub(Stub):
    """Records the reads that reach it."""

    def get_weights_by_name(self, name, truncate_size=100):
        import torch

        self.calls.append(("get_weights_by_name", name, truncate_size))
        return torch.zeros(2)

    def tensor_checksums(self, names=None):
        self.calls.append(("tensor_checksums", names))
        return {}


def test_reads_with_a_bad_field_are_refused_before_the_engine():
    """Mutants (serve._get_weights_by_name, serve._tensor_checksums): ``truncate_size`` -1 passed
    to the engine (SGLang slices ``[:-1]``: every row but the last, a silently short answer), and
    a ``names`` that is not a list of strings reached it (a string is read name by letter)."""
    stub = _ReadStub()
    with EngineServer(stub) as srv:
        status, out = call(srv, "/get_weights_by_name", {"name": "w", "truncate_size": -1})
        assert status == 400 and out["message"] == "truncate_size must be >= 0, got -1", out
        for names in ("model.norm.weight", [1], {"a": 1}):
            status, out = call(srv, "/fsdp_sync/tensor_checksums", {"names": names})
            assert status == 400 and "field 'names'" in out["message"], (names, out)
        assert stub.calls == []
        assert call(srv, "/get_weights_by_name", {"name": "w", "truncate_size": 0})[0] == 200
        assert call(srv, "/fsdp_sync/tensor_checksums", {"names": ["w"]}) == (200, {"checksums": {}})
        assert call(srv, "/fsdp_sync/tensor_checksums", {}) == (200, {"checksums": {}})
    assert stub.calls == [("get_weights_by_name", "w", 0), ("tensor_checksums", ["w"]),
                          ("tensor_checksums", None)]


class _QuickStub(Stub):
    """Answers every request at once, one token each."""

    def generate_requests(self, prompts, sampling, **kw):
        self.calls.append(("generate", len(prompts)))
        return [{"prompt_index": i, "output_ids": [7], "finish_reason": {"type": "length", "length": 1}}
                for i, s in enumerate(sampling) for _ in range(int(s.get("n", 1)))]


def test_a_finished_requests_rid_can_be_used_again():
    """Mutant (serve._generate): the ids of a finished request left in the running set: the next
    request under the same rid was refused as a duplicate (SGLang frees an id when its request
    ends), and every id ever served stayed in memory."""
    stub = _QuickStub()
    with EngineServer(stub) as srv:
        for body in ({"input_ids": [1], "rid": "r"}, {"input_ids": [2], "rid": "r"},
                     {"input_ids": [[1], [2]], "rid": ["r", "s"]},
                     {"input_ids": [1], "rid": "r", "sampling_params": {"n": 2}}):
            status, out = call(srv, "/generate", body)
            assert status == 200, (body, out)
        assert srv._live == {}
    assert [c for c in stub.calls if c[0] == "generate"] == [("generate", 1), ("generate", 1),
                                                             ("generate", 2), ("generate", 1)]


def test_a_flush_timeout_an_engine_cannot_wait_for_is_refused_not_dropped():
    """Mutant (serve_cache._flush_cache): the refusal of ``?timeout=S`` for an engine whose
    ``flush_cache`` takes no ``timeout_s`` dropped: the flush ran at once, the wait the client asked
    for silently not done (a refused flush then answered SGLang's "Flush cache failed.")."""
    class NoWait(Stub):
        def flush_cache(self):
            self.calls.append(("flush_cache",))

    stub = NoWait()
    with EngineServer(stub) as srv:
        status, out = call(srv, "/flush_cache?timeout=2", {})
        assert status == 400 and "query parameter 'timeout'" in out["message"], out
        assert stub.calls == []
        assert call(srv, "/flush_cache", {})[0] == 200
    assert stub.calls == [("flush_cache",)]


def test_a_commit_with_a_version_answers_the_version_taken():
    """Mutant (serve_updates._end_weight_update): the answer's ``weight_version`` dropped, so a
    client could not see the commit took its version (serve's own key; SGLang answers
    ``{success, message}``); a refused commit answers none."""
    class Versioned(Stub):
        version = "v0"

        def get_weight_version(self):
            return self.version

        def end_weight_update(self, *, abort=False, weight_version=None):
            if weight_version == "bad":
                return False, "refused"
            self.version = weight_version or self.version
            return True, "ok"

    with EngineServer(Versioned()) as srv:
        assert call(srv, "/end_weight_update", {"weight_version": "v2"}) == (
            200, {"success": True, "message": "ok", "weight_version": "v2"})
        assert call(srv, "/end_weight_update", {"weight_version": "bad"}) == (
            400, {"success": False, "message": "refused"})
        assert call(srv, "/end_weight_update", {}) == (200, {"success": True, "message": "ok"})


def test_an_adapter_with_added_tokens_is_refused_before_its_payloads_open():
    """Mutant (serve_lora._load_lora_from_tensors): the ``added_tokens_config`` refusal dropped:
    the adapter's extra token embeddings would be loaded without them (serve has no tokenizer to
    add them to)."""
    class LoRAStub(Stub):
        def load_lora_adapter_from_tensors(self, *a, **kw):
            self.calls.append(("load_lora_adapter_from_tensors",))

    stub = LoRAStub()
    body = {"lora_name": "a", "config_dict": {"r": 8}, "serialized_named_tensors": ["unopened"],
            "added_tokens_config": {"<x>": 7}}
    with EngineServer(stub) as srv:
        status, out = call(srv, "/load_lora_adapter_from_tensors", body)
    assert status == 400 and out["message"].startswith("field 'added_tokens_config'"), out
    assert stub.calls == []


def test_engine_keywords_pass_through_a_method_that_takes_any_and_a_missing_path_is_refused(tmp_path):
    """Mutants (http_fields): ``accepted_kwargs`` filtering a ``**kwargs`` method's keywords by
    name (an engine wrapper taking ``**kw`` lost ``weight_version``, ``flush_cache``, ...), and
    ``check_disk_path`` resolving without ``strict`` (a path inside an allowed directory that does
    not exist reached the engine, which SGLang takes for a Hub repo id to download)."""
    from fsdp_sync.engines.reference.http_fields import Refused, accepted_kwargs, check_disk_path

    kw = {"weight_version": "v1", "flush_cache": False}
    assert accepted_kwargs(lambda *a, **k: None, kw) == kw
    assert accepted_kwargs(lambda names, flush_cache=True: None, kw) == {"flush_cache": False}
    (tmp_path / "ckpt").mkdir()
    assert check_disk_path(str(tmp_path / "ckpt"), [tmp_path]) == (tmp_path / "ckpt").resolve()
    with pytest.raises(Refused, match="is not an existing local path") as e:
        check_disk_path(str(tmp_path / "nope"), [tmp_path])
    assert e.value.status == 400


@pytest.mark.parametrize("argv, words", [
    ("serve --update-recv-timeout-s 0", ["--update-recv-timeout-s", "> 0", "'0'"]),
    ("serve --update-recv-timeout-s inf", ["--update-recv-timeout-s", "finite", "'inf'"]),
    ("serve --update-wait-s -1", ["--update-wait-s", ">= 0", "'-1'"]),
])
def test_serve_refuses_a_wait_it_cannot_keep_in_one_line(argv, words, capsys):
    """Mutant (cli/serve._positive_seconds): ``v < 0`` for ``v <= 0``: ``--update-recv-timeout-s 0``
    was taken (a worker's wait in a weight-update group of 0 s, which no broadcast can meet) and
    the engine started, where the flag's help says ``> 0``."""
    from fsdp_sync.cli import app as cli

    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv.split())
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), (words, err)
