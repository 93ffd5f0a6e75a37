"""A failed sync's update is dropped, never committed half: ``end_weight_update(abort=True)``
through `SGLangEngine` and ``fsdp-sync serve``, and a commit of an update an earlier failure
aborted is refused.

Before: ``/end_weight_update`` ignored ``{"abort": true}`` and committed the buckets sent before
the failure (half the model new, half old, answered success), `SGLangEngine.end_weight_update` had
no ``abort`` (so `fleet.end_all(commit=False)`, what the transports run after a failed sync, sent a
plain end, and the distributed transport's take-over of an open session raised TypeError), and a
commit after a failed update answered success, after which the client relabelled the old weights
with the new version. Against SGLang itself (here its HTTP stand-in, which ignores the field as
SGLang's request models do) an abort cannot undo what SGLang applied: the session is closed and a
warning says so.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fsdp_sync import fleet
from fsdp_sync.engines.base import EngineStateError, WeightUpdateError
from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.engines.sglang import SGLangEngine
from fsdp_sync.transport.distributed import _begin

from _util import post_json
import fake_sglang as fake

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine():
    with ReferenceEngine("tiny", tp_size=2, seed=3) as eng:
        # loaded weights, as after a first sync: an update now stages its writes aside (an engine
        # still on its random initial weights has nothing to protect and writes in place)
        eng.update_weights_from_tensor(new_weights(eng, seed=20))
        yield eng


@pytest.fixture(scope="module")
def server(engine):
    with EngineServer(engine, update_wait_s=5.0) as srv:
        yield srv


def post(srv, path: str, body: dict) -> tuple[int, dict]:
    return post_json(srv, path, body, timeout=30)


def new_weights(engine, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(engine.layout.full_shape(n), generator=g)) for n in engine.hf_names()]


def weights(engine) -> dict[str, torch.Tensor]:
    return {n: engine.get_weights_by_name(n).clone() for n in engine.hf_names()}


def unchanged(engine, before: dict[str, torch.Tensor]) -> list[str]:
    """The names whose weights differ, bit for bit, from ``before``."""
    return [n for n, t in before.items() if not engine.get_weights_by_name(n).view(torch.int32)
            .equal(t.view(torch.int32))]


@pytest.mark.parametrize("how", ["client", "fleet", "take-over"])
def test_an_abort_over_http_drops_what_was_sent(engine, server, how, caplog):
    client = SGLangEngine(base_url=server.url, max_retries=0)
    before, version = weights(engine), engine.weight_version
    new = new_weights(engine, seed=21)
    client.begin_weight_update()
    client.update_weights_from_bucket(new[: len(new) // 2])         # the first buckets arrived
    with caplog.at_level(logging.WARNING):
        if how == "client":
            client.end_weight_update(abort=True)
        elif how == "fleet":     # what the transports run after a failed sync
            fleet.end_all([client], commit=False)
        else:                    # a fresh trainer finds the dead one's update open: aborts it, opens its own
            _begin(client)
            client.end_weight_update()
    assert unchanged(engine, before) == [] and engine.weight_version == version
    assert not engine._in_txn
    assert "cannot drop" not in caplog.text
    prompts = [[1, 2, 3]]
    assert client.generate(prompts, max_new_tokens=4) == engine.generate(prompts, max_new_tokens=4)


def test_an_abort_answers_aborted_and_checks_its_body(engine, server):
    assert post(server, "/begin_weight_update", {})[0] == 200
    status, out = post(server, "/end_weight_update", {"abort": "yes"})
    assert status == 400 and "'abort'" in out["message"], out
    status, out = post(server, "/end_weight_update", {"abort": True, "weight_version": "v7"})
    assert status == 400 and "commits none" in out["message"], out
    assert engine._in_txn                                   # neither refusal closed the session
    status, out = post(server, "/end_weight_update", {"abort": True})
    assert status == 200 and out["success"] and out["aborted"] is True, out
    assert not engine._in_txn


def test_a_commit_after_a_failed_update_is_refused(engine, server):
    client = SGLangEngine(base_url=server.url, max_retries=0)
    before, version = weights(engine), engine.weight_version
    new = new_weights(engine, seed=22)
    client.begin_weight_update()
    client.update_weights_from_bucket(new[:3])
    bad = [(n, t[..., :1].contiguous()) for n, t in new[3:5]]           # wrong shapes: refused
    with pytest.raises(Exception, match="shape"):
        client.update_weights_from_bucket(bad)
    with pytest.raises(EngineStateError, match="nothing was committed"):
        client.end_weight_update(weight_version="v9")
    assert engine.weight_version == version and server.weight_version == version
    assert unchanged(engine, before) == [] and not engine._in_txn
    client.begin_weight_update()                            # the session was closed: a new one opens
    client.update_weights_from_bucket(new)
    client.end_weight_update(weight_version="v10")
    assert engine.weight_version == "v10" and len(unchanged(engine, before)) == len(before)


def test_in_process_a_commit_after_a_failed_update_raises_and_an_abort_does_not(engine):
    before, version = weights(engine), engine.weight_version
    new = new_weights(engine, seed=23)
    for abort in (False, True):
        engine.begin_weight_update()
        engine.update_weights_from_tensor(new[:3])
        with pytest.raises(WeightUpdateError):
            engine.update_weights_from_tensor([(new[3][0], new[3][1][..., :1].contiguous())])
        if abort:
            engine.end_weight_update(abort=True)
        else:
            with pytest.raises(WeightUpdateError, match="nothing was committed"):
                engine.end_weight_update(weight_version="v11")
        assert not engine._in_txn and engine.weight_version == version
        assert unchanged(engine, before) == []


def test_against_sglang_an_abort_closes_the_session_and_says_what_it_could_not_undo(caplog):
    with fake.FakeSGLangServer(tp_size=1) as srv:
        client = SGLangEngine(base_url=srv.url, tp_size=1, max_retries=0)
        client.begin_weight_update()
        with caplog.at_level(logging.WARNING):
            fleet.end_all([client], commit=False)
        assert srv.engine.session_open is False
        body = [b for _, p, b in srv.requests if p == "/end_weight_update"][-1]
    assert body == {"abort": True}
    assert "cannot drop a failed update" in caplog.text and "sync again" in caplog.text
    with pytest.raises(ValueError, match="not both"):
        client.end_weight_update(weight_version="v1", abort=True)


def test_an_abort_over_start_up_weights_answers_not_aborted_and_the_client_says_so(caplog):
    """An engine still on its start-up weights writes an update in place (nothing to protect),
    so an abort cannot give them back: `ReferenceEngine.end_weight_update(abort=True)` returns
    False. Before: ``/end_weight_update`` answered ``"aborted": true`` whatever it returned, so a
    client (and the fleet's note on a failed sync) took the replica for unchanged. Now the answer
    says ``"aborted": false`` and why, and the client counts the replica as holding partly new
    weights."""
    with ReferenceEngine("tiny", tp_size=2, seed=3) as fresh, EngineServer(fresh, update_wait_s=5.0) as srv:
        client = SGLangEngine(base_url=srv.url, max_retries=0)
        new = new_weights(fresh, seed=23)
        client.begin_weight_update()
        client.update_weights_from_bucket(new[:3])
        with caplog.at_level(logging.WARNING):
            partial = fleet.end_all([client], commit=False)
        assert len(partial) == 1, partial                 # named as holding partly new weights
        assert "written over" in caplog.text and "cannot drop" not in caplog.text, caplog.text
        # the server's own answer to a raw abort, on the weights now half pushed: nothing to give back
        assert post(srv, "/begin_weight_update", {})[0] == 200
        status, out = post(srv, "/end_weight_update", {"abort": True})
        assert status == 200 and out["aborted"] is True, out
