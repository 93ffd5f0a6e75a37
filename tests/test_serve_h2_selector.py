"""SGLang's ``selector`` on the update bodies is honoured or refused, never ignored (audit H2, item 2).

SGLang 0.5.21+ carries ``selector`` (``"target"``, ``"draft"`` or ``"all"``, default ``"all"``) on
``update_weights_from_tensor``, ``update_weights_from_distributed`` and ``begin_weight_update``:
the model runners the call loads (``SchedulerWeightUpdaterManager._select_runners``). Serve has
the target runner only, so ``"target"`` and ``"all"`` load it, as SGLang's do without a draft
model. Before, serve ignored the field: ``"draft"`` (which SGLang without a draft model answers
with success and nothing loaded) and values SGLang refuses loaded the target's weights.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.engines.sglang import flattened_bucket_payloads

from _util import post_json

pytestmark = pytest.mark.timeout(120)
NAME = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def server():
    with ReferenceEngine("tiny", tp_size=1, seed=4) as eng, EngineServer(eng) as srv:
        yield srv


def post(srv, path: str, body: dict) -> tuple[int, dict]:
    return post_json(srv, path, body, timeout=60)


def served(srv) -> torch.Tensor:
    return srv.engine.get_weights_by_name(NAME, truncate_size=1 << 30).clone()


def tensor_body(srv, value: float, selector) -> tuple[dict, object]:
    shape = served(srv).shape
    bucket = flattened_bucket_payloads([(NAME, torch.full(shape, value))], 1, output_str=True)
    body = {"serialized_named_tensors": list(bucket), "load_format": "flattened_bucket",
            "flush_cache": True}
    if selector is not ...:
        body["selector"] = selector
    return body, bucket


@pytest.mark.parametrize("selector", ["draft", "bogus", None, 1])
def test_a_selector_serve_cannot_honour_is_refused_and_nothing_loads(server, selector):
    before = served(server)
    status, out = post(server, "/begin_weight_update", {"selector": selector})
    assert status == 400 and "'selector'" in out["message"], (status, out)
    assert post(server, "/begin_weight_update", {})[0] == 200
    try:
        body, bucket = tensor_body(server, 0.25, selector)
        status = None
        try:
            status, out = post(server, "/update_weights_from_tensor", body)
        finally:
            bucket.release(unopened=status == 400)      # refused before any payload was opened
        assert status == 400 and "'selector'" in out["message"], (status, out)
        status, out = post(server, "/update_weights_from_distributed",
                           {"names": [NAME], "dtypes": ["float32"], "shapes": [list(before.shape)],
                            "selector": selector})
        assert status == 400 and "'selector'" in out["message"], (status, out)
    finally:
        assert post(server, "/end_weight_update", {})[0] == 200
    assert torch.equal(served(server), before)           # before: 0.25 everywhere


@pytest.mark.parametrize("selector", ["target", "all", ...], ids=["target", "all", "missing"])
def test_target_and_all_load_the_served_model(server, selector):
    value = {"target": 0.5, "all": 0.75}.get(selector, 1.25)
    begin = {} if selector is ... else {"selector": selector}
    assert post(server, "/begin_weight_update", begin)[0] == 200
    body, bucket = tensor_body(server, value, selector)
    try:
        status, out = post(server, "/update_weights_from_tensor", body)
    finally:
        bucket.release()
    assert (status, out["success"]) == (200, True), out
    assert post(server, "/end_weight_update", {})[0] == 200
    got = served(server)
    assert torch.equal(got, torch.full_like(got, value))
