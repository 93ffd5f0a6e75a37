"""Refusals of `fsdp-sync serve`'s routes that name the field and change nothing (helper H12's
mutation pass over serve, serve_updates, serve_control, serve_cache, generate_request,
http_fields). Each test kills the mutant its docstring names; all but two (the /health_generate
and EngineStateError ones, which tests/test_serve_errors.py and tests/test_serve.py kill too)
survived the existing serve tests, or were not run against them. A stub engine records the calls
that reach it, so no worker starts: each test costs milliseconds.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path

import pytest

from fsdp_sync.engines.reference.generate_request import GenerateRefused, parse_generate
from fsdp_sync.engines.reference.http_fields import Refused, check_disk_path
from fsdp_sync.engines.reference.serve import EngineServer

pytestmark = pytest.mark.timeout(60)


class Stub:
    """An engine that records what reaches it; ``generate_requests`` runs until aborted."""

    tp_size = 1

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.running = threading.Event()

    def end_weight_update(self, *, abort: bool = False, weight_version: str | None = None) -> bool:
        self.calls.append(("end_weight_update", abort, weight_version))
        return True

    refuse: str | None = None       # what update_weights_from_distributed answers: (False, it)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        flush_cache=True, load_format=None):
        self.calls.append(("update_weights_from_distributed", names))
        return None if self.refuse is None else (False, self.refuse)

    def begin_weight_update(self) -> None:
        from fsdp_sync.engines.base import EngineStateError

        raise EngineStateError("begin_weight_update called twice without end_weight_update")

    def generate(self, prompts, max_new_tokens=1):
        raise RuntimeError("no KV cache")

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="gloo"):
        self.calls.append(("init_weights_update_group", rank_offset, world_size))

    def pause_generation(self, mode: str = "abort") -> None:
        self.calls.append(("pause_generation", mode))

    def flush_cache(self, timeout_s: float = 0.0) -> None:
        self.calls.append(("flush_cache", timeout_s))

    def generate_requests(self, prompts, sampling, *, return_logprob=False, logprob_start_len=None,
                          on_step=None, should_abort=None, **kw):
        self.calls.append(("generate", len(prompts)))
        rows = [i for i, s in enumerate(sampling) for _ in range(int(s.get("n", 1)))]
        self.running.set()
        deadline = time.monotonic() + 20
        while not all(should_abort(k) for k in range(len(rows))) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [{"prompt_index": i, "output_ids": [1], "finish_reason": {"type": "abort"}} for i in rows]


@pytest.fixture
def served():
    stub = Stub()
    with EngineServer(stub) as srv:
        yield srv, stub


def call(srv, path, body):
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
        return resp.status, (json.loads(raw) if resp.getheader("Content-Type") == "application/json" else raw)
    finally:
        conn.close()


def test_an_abort_with_a_weight_version_is_refused_and_nothing_ends(served):
    """serve_updates._end_weight_update, mutant: the refusal of ``{"abort": true,
    "weight_version": ...}`` dropped: the session was dropped and the answer said success, the
    version the client meant to commit silently lost."""
    srv, stub = served
    status, out = call(srv, "/end_weight_update", {"abort": True, "weight_version": "v2"})
    assert status == 400 and "weight_version" in out["message"] and "abort" in out["message"], out
    assert stub.calls == []
    assert call(srv, "/end_weight_update", {"abort": True})[0] == 200
    assert stub.calls == [("end_weight_update", True, None)]


def test_a_bool_is_not_an_int_field(served):
    """http_fields.body_field, mutant: a bool taken for an int (``True`` is an int in Python):
    ``rank_offset: true`` joined the group as rank 1."""
    srv, stub = served
    body = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": True, "world_size": 2,
            "backend": "gloo"}
    status, out = call(srv, "/init_weights_update_group", body)
    assert status == 400 and out["message"] == "field 'rank_offset' must be int, got bool", out
    assert stub.calls == []


def test_distributed_names_dtypes_and_shapes_of_other_lengths_are_refused(served):
    """serve_updates._update_from_distributed, mutant: the length check dropped: the engine was
    asked to receive two tensors described by one dtype."""
    srv, stub = served
    status, out = call(srv, "/update_weights_from_distributed",
                       {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[2], [2]]})
    assert status == 400 and "names, dtypes and shapes differ in length: 2, 1, 2" in out["message"], out
    assert stub.calls == []


def test_a_pause_mode_not_sglangs_is_refused_naming_it(served):
    """serve_control._pause_generation, mutant: the mode check dropped: an unknown mode reached
    the engine."""
    srv, stub = served
    status, out = call(srv, "/pause_generation", {"mode": "later"})
    assert status == 400 and "field 'mode'" in out["message"] and "'later'" in out["message"], out
    assert stub.calls == []
    assert call(srv, "/pause_generation", {"mode": "retract"}) == (
        200, {"message": "Generation paused successfully.", "status": "ok"})


def test_a_flush_with_timeout_zero_is_sglangs_default(served):
    """serve_cache.timeout_param, mutant: ``0 < t`` for ``0 <= t``: ``?timeout=0`` (SGLang's
    default, sent explicitly) was refused."""
    srv, stub = served
    assert call(srv, "/flush_cache?timeout=0", {})[0] == 200
    assert call(srv, "/flush_cache?timeout=-1", {})[0] == 400
    assert stub.calls == [("flush_cache", 0.0)]


def test_a_running_rid_is_refused_to_a_second_request(served):
    """serve._generate, mutant: the check of ids already running dropped: a second request with
    a running rid replaced the first's abort flag, so ``/abort_request`` could no longer end the
    first (SGLang refuses a duplicate id: ``TokenizerManager._init_req_state``)."""
    srv, stub = served
    box = []
    t = threading.Thread(target=lambda: box.append(call(srv, "/generate", {"input_ids": [1, 2], "rid": "r"})))
    t.start()
    try:
        assert stub.running.wait(10)
        status, out = call(srv, "/generate", {"input_ids": [3, 4], "rid": "r"})
        assert status == 400 and "field 'rid'" in out["message"] and "'r'" in out["message"], out
    finally:
        assert call(srv, "/abort_request", {"rid": "r"})[0] == 200
        t.join(20)
    assert box and box[0][0] == 200 and box[0][1]["meta_info"]["finish_reason"]["type"] == "abort", box
    assert [c for c in stub.calls if c[0] == "generate"] == [("generate", 1)]


def test_a_batch_with_one_id_twice_or_samples_that_differ_in_n_is_refused():
    """generate_request.parse_generate, mutants: the distinct-ids check of a ``rid`` list dropped
    (two prompts under one id: an abort of it ends either), and the one-``n`` check dropped
    (SGLang: "The parallel_sample_num should be the same for all samples in sample params.")."""
    with pytest.raises(GenerateRefused, match=r"field 'rid' must be .* distinct strings"):
        parse_generate({"input_ids": [[1], [2]], "rid": ["a", "a"]})
    with pytest.raises(GenerateRefused, match=r"sampling_params\.n must be the same for every prompt, got \[1, 2\]"):
        parse_generate({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]})


def test_a_disk_path_beside_an_allowed_directory_is_not_inside_it(tmp_path):
    """http_fields.check_disk_path, mutant: "inside" tested as a string prefix: ``/x/allowed2``
    passed for ``/x/allowed``."""
    allowed, beside = tmp_path / "allowed", tmp_path / "allowed2"
    (allowed / "ckpt").mkdir(parents=True)
    (beside / "ckpt").mkdir(parents=True)
    assert check_disk_path(str(allowed / "ckpt"), [str(allowed)]) == (allowed / "ckpt").resolve()
    with pytest.raises(Refused, match="is outside the allowed directories") as err:
        check_disk_path(str(beside / "ckpt"), [str(allowed)])
    assert err.value.status == 403
    assert Path(beside).exists()


def test_tp_payloads_naming_other_tensors_are_refused_and_nothing_loads():
    """serve_updates._update_from_tensor, mutant: the check that every TP rank's payload names
    payload 0's tensors dropped: with ``load_format="direct"`` each tensor is matched by position,
    so rank 1's payload in another order loaded its ``b`` as ``a`` (same shape: no refusal) on
    rank 1: a model of mixed-up shards, answered success."""
    import torch

    from fsdp_sync.weights import handles

    class TwoRanks(Stub):
        tp_size = 2

        def update_weights_from_tensor(self, named, load_format=None, flush_cache=True):
            self.calls.append(("update_weights_from_tensor", [n for n, _ in named]))

    a, b = torch.ones(2), torch.zeros(2)
    sets = [handles.make_payloads(pairs, 1, output_str=True, tagged=False)
            for pairs in ([("a", a), ("b", b)], [("b", b), ("a", a)])]
    stub = TwoRanks()
    try:
        with EngineServer(stub) as srv:
            status, out = call(srv, "/update_weights_from_tensor", {
                "serialized_named_tensors": [s.payloads[0] for s in sets], "load_format": "direct"})
    finally:
        for s in sets:
            s.release(require_ack=False)
    assert status == 400 and out["message"] == "payload 1 names other tensors than payload 0", out
    assert stub.calls == []


def test_a_refused_update_does_not_take_its_weight_version(served):
    """serve_control.versioned, mutant: the body's ``weight_version`` taken after an update the
    engine refused (an engine that keeps no version, answering SGLang's ``(False, message)``):
    the old weights were served under the new version's name."""
    srv, stub = served
    stub.refuse = "no such group"
    status, out = call(srv, "/update_weights_from_distributed", {
        "names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "weight_version": "v2"})
    assert (status, out) == (400, {"success": False, "message": "no such group"}), out
    assert call(srv, "/get_weight_version", {}) == (200, {"weight_version": "default"})
    stub.refuse = None
    assert call(srv, "/update_weights_from_distributed", {
        "names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "weight_version": "v2"})[0] == 200
    assert call(srv, "/get_weight_version", {}) == (200, {"weight_version": "v2"})


def test_an_updates_abort_all_requests_ends_the_running_generate_first(served):
    """serve_control.versioned, mutant: an update's ``abort_all_requests`` ignored: the request in
    flight was not ended (SGLang's field ends them before the update)."""
    srv, stub = served
    box = []
    t = threading.Thread(target=lambda: box.append(call(srv, "/generate", {"input_ids": [1, 2]})))
    t.start()
    try:
        assert stub.running.wait(10)
        assert call(srv, "/update_weights_from_distributed", {
            "names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "abort_all_requests": True})[0] == 200
        t.join(5)
        assert box and box[0][1]["meta_info"]["finish_reason"]["type"] == "abort", box
    finally:
        call(srv, "/abort_request", {"abort_all": True})
        t.join(20)


def test_health_generate_is_503_when_nothing_generates(served):
    """serve_control._health_generate, mutant: 200 when the probe's generate raised: a router kept
    sending traffic to a server that generates nothing."""
    srv, _ = served
    status, out = call(srv, "/health_generate", {})
    assert status == 503 and out["retryable"] and "cannot generate: RuntimeError: no KV cache" in out["message"], out


def test_a_call_that_does_not_fit_now_is_a_400_not_a_500(served):
    """http_fields.error_status, mutant: `EngineStateError` (begin twice, an update outside
    begin/end) answered 500: a router retried a client's mistake elsewhere as a server fault."""
    srv, _ = served
    status, out = call(srv, "/begin_weight_update", {})
    assert status == 400 and not out["retryable"] and "called twice" in out["message"], out


def test_update_weight_version_ends_running_requests_by_default(served):
    """serve_control._update_weight_version, mutant: ``abort_all_requests`` defaulting to false:
    SGLang 0.5.23's ``UpdateWeightVersionReqInput.abort_all_requests`` is true, so a request in
    flight ends (and is not labelled with a version whose weights it did not use)."""
    srv, stub = served
    box = []
    t = threading.Thread(target=lambda: box.append(call(srv, "/generate", {"input_ids": [1, 2]})))
    t.start()
    try:
        assert stub.running.wait(10)
        assert call(srv, "/update_weight_version", {"new_version": "v3"}) == (
            200, {"success": True, "message": "Weight version updated to v3", "new_version": "v3"})
        t.join(5)
        assert box and box[0][1]["meta_info"]["finish_reason"]["type"] == "abort", box
    finally:
        call(srv, "/abort_request", {"abort_all": True})
        t.join(20)
    assert call(srv, "/get_weight_version", {}) == (200, {"weight_version": "v3"})


def test_out_of_service_generate_never_reaches_the_engine(served):
    """serve._generate, mutant: the out-of-service check before the engine dropped. Equivalent
    with a `ReferenceEngine` (its ``generate_requests`` refuses too, and the route answers the
    same 503), but an engine that does not check served a request the fleet had taken out of
    service: the route itself must not hand it over."""
    srv, stub = served
    stub.serving_state = "quarantined by the fleet"
    status, out = call(srv, "/generate", {"input_ids": [1, 2]})
    assert (status, out) == (503, {"success": False, "message": "quarantined by the fleet",
                                   "serving": False, "retryable": True}), out
    assert stub.calls == []
