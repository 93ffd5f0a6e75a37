"""`fsdp-sync serve` says when it refused a tensor or LoRA update before opening any payload, and
`SGLangEngine` then gives the payloads' shared-memory references back at once.

A payload pickled for another process holds a reference its consumer takes when it opens it. An
update refused before that (a busy server's 503, a field it refuses) left those references with the
sender, and their /dev/shm segments (a bucket's bytes each) outlived the sender's tensors until its
process exited: the client could not tell such a refusal from one after the server opened them.
Serve now adds `base.UNOPENED_MARK` to exactly those refusals, and the client reads ``opened``
False from it, as it does from SGLang's answers that come before any handler."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from fsdp_sync.engines import sglang as sg
from fsdp_sync.engines.base import UNOPENED_MARK
from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer

from _util import post_json as _post

pytestmark = pytest.mark.timeout(120)
NAME = "model.layers.0.mlp.down_proj.weight"
LORA = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"


@pytest.fixture(scope="module")
def server():
    with ReferenceEngine("tiny", tp_size=2, seed=4, max_lora_rank=8) as eng, \
            EngineServer(eng, update_wait_s=0.3) as srv:
        yield srv


def _segments() -> set[str]:
    mine = f"torch_{os.getpid()}_"
    return {x for x in os.listdir("/dev/shm") if x.startswith(mine)}


def _served(srv) -> torch.Tensor:
    return srv.engine.get_weights_by_name(NAME, truncate_size=1 << 30).clone()


def test_a_busy_servers_refusals_give_every_segment_back(server):
    """Another update holds the server: the bucket and the named tensors are refused 503 before
    any payload is opened: ``opened`` is False and no segment is left. A LoRA adapter's route
    opens its payloads before it waits for the server (and acknowledges them on any refusal): its
    503 is no such refusal, ``opened`` stays unknown, and nothing is left either."""
    client = sg.SGLangEngine(base_url=f"http://{server.host}:{server.port}", timeout_s=30)
    before_w = _served(server)
    client.begin_weight_update()
    shape = before_w.shape
    before = _segments()
    errors = []
    server._update_lock.acquire()          # another update is running
    try:
        for send in (lambda: client.update_weights_from_bucket([(NAME, torch.full(shape, 0.5))]),
                     lambda: client.update_weights_from_tensor([(NAME, torch.full(shape, 0.5))])):
            with pytest.raises(sg.SGLangUpdateError, match="HTTP 503") as ei:
                send()
            errors.append(ei.value)
    finally:
        server._update_lock.release()
    client.end_weight_update()
    adapter = {LORA.format("A"): torch.randn(4, 64), LORA.format("B"): torch.randn(64, 4)}
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "LORA"}
    server._update_lock.acquire()
    try:
        with pytest.raises(sg.SGLangUpdateError, match="HTTP 503") as ei:
            client.load_lora_adapter_from_tensors("L", adapter, config)
        errors.append(ei.value)
    finally:
        server._update_lock.release()
    gc.collect()
    left = _segments() - before
    assert [e.opened for e in errors] == [False, False, None], errors
    assert [UNOPENED_MARK in str(e) for e in errors] == [True, True, False], errors
    assert not left, left                                   # before: one segment per refused call
    assert torch.equal(_served(server), before_w)           # nothing loaded
    client.load_lora_adapter_from_tensors("L", adapter, config)   # the server itself is fine
    assert "L" in server.engine.lora_adapters
    client.shutdown()


@pytest.mark.parametrize("field, value, says", [("flush_cache", "yes", "field 'flush_cache'"),
                                                ("load_format", "npz", "unknown load_format 'npz'"),
                                                ("selector", "draft", "field 'selector'")])
def test_a_field_refused_before_opening_says_so_and_one_after_does_not(server, field, value, says):
    """Refused for a field: the answer carries the mark, and the sender's references are what it
    gives back (here by hand, as the client does). A payload that opens but is not a list of
    pairs is refused after opening: no mark, the server took the references itself."""
    from fsdp_sync.weights import handles

    shape = _served(server).shape
    assert _post(server, "/begin_weight_update", {})[0] == 200
    try:
        before = _segments()
        bucket = sg.flattened_bucket_payloads([(NAME, torch.full(shape, 0.25))], 2, output_str=True)
        status, out = _post(server, "/update_weights_from_tensor",
                            {"serialized_named_tensors": list(bucket), "load_format": "flattened_bucket",
                             field: value})
        assert status == 400 and says in out["message"] and UNOPENED_MARK in out["message"], out
        bucket.release(unopened=True)
        del bucket
        # opened, then refused: no mark (the server acknowledged every payload it opened)
        lease = handles.make_payloads({"not": torch.ones(1000)}, 2, output_str=True, tagged=False)
        status, out = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": lease.payloads})
        assert status == 400 and "is not a list of (name, tensor) pairs" in out["message"], out
        assert UNOPENED_MARK not in out["message"], out
        lease.release(require_ack=False)
        # a LoRA adapter refused for a field, before its payloads are opened
        lease = handles.make_payloads({LORA.format("A"): torch.randn(4, 64)}, 2, output_str=True, tagged=False)
        status, out = _post(server, "/load_lora_adapter_from_tensors",
                            {"lora_name": "M", "config_dict": {"r": 4}, "pinned": "yes",
                             "serialized_named_tensors": lease.payloads})
        assert status == 400 and "field 'pinned'" in out["message"] and UNOPENED_MARK in out["message"], out
        lease.release(require_ack=False, unopened=[0, 1])
        del lease
        gc.collect()
        assert not _segments() - before
    finally:
        assert _post(server, "/end_weight_update", {})[0] == 200
