"""``fsdp_sync_ref``'s ``abort_all_requests`` against a request still on the wire (`make test-verl`).

verl's disaggregated modes call ``abort_all_requests`` on every replica, then release the KV cache
and sync the weights. The replica's gate (`ServeServer`) holds requests that come after it, and
``/abort_request`` aborts what serve is running; a request that passed the gate just before it
closed but whose ``/generate`` reached serve after the abort (separate connections) was neither
held nor aborted: abort_all_requests returned at once and that request ran through the sync,
answered as "completed" with tokens from partly new weights. Now abort_all_requests returns only
once every request past the gate has been answered, aborting again while any is out.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(60)]


def _server(tmp_path):
    import types

    from fsdp_sync.integrations.verl.replica import ServeServer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    cfg = types.SimpleNamespace(tensor_model_parallel_size=1, data_parallel_size=1,
                                pipeline_model_parallel_size=1, dtype="float32",
                                response_length=16, prompt_length=64, max_model_len=None,
                                free_cache_engine=True, custom=None)
    model = types.SimpleNamespace(local_path=str(tmp_path), path=str(tmp_path))
    return ServeServer(cfg, model, replica_rank=0, node_rank=0)


def test_a_request_on_the_wire_when_the_abort_lands_is_aborted_before_abort_returns(tmp_path):
    server = _server(tmp_path)
    running: dict = {}        # serve's side: rid -> the event its abort sets
    events: list = []

    async def post(path, body):
        if path == "/abort_request":
            events.append(("abort", sorted(running)))
            for ev in running.values():
                ev.set()
            return {"success": True}
        assert path == "/generate"
        await asyncio.sleep(0.2)              # on the wire: reaches serve after the first abort
        rid = body["rid"]
        running[rid] = ev = asyncio.Event()
        try:
            await asyncio.wait_for(ev.wait(), 2.0)    # generating, until aborted
            aborted = True
        except asyncio.TimeoutError:
            aborted = False
        finally:
            del running[rid]
        events.append(("answered", rid, aborted))
        return {"output_ids": [5], "meta_info": {
            "finish_reason": {"type": "abort" if aborted else "length"}}}

    server._post = post

    async def scenario():
        req = asyncio.ensure_future(server.generate([1, 2], {}, "r1"))
        await asyncio.sleep(0.05)             # past the gate, its /generate in flight
        await server.abort_all_requests()
        returned = req.done()                 # the sync starts now
        out = await asyncio.wait_for(req, 5)
        return returned, out

    returned, out = asyncio.run(scenario())
    assert returned, f"abort_all_requests returned while request r1 was still out: {events}"
    assert out.stop_reason == "aborted", (out, events)
    assert events[0] == ("abort", []) and ("answered", "r1", True) in events, events


def test_nothing_out_means_one_abort_and_held_requests_still_wait(tmp_path):
    server = _server(tmp_path)
    posted: list = []

    async def post(path, body):
        posted.append(path)
        return {"output_ids": [5], "meta_info": {"finish_reason": {"type": "length"}}} \
            if path == "/generate" else {"success": True}

    server._post = post

    async def scenario():
        await server.abort_all_requests()
        held = asyncio.ensure_future(server.generate([1], {}, "h"))
        await asyncio.sleep(0.2)
        assert not held.done() and posted == ["/abort_request"]
        await server.resume_generation()
        return await asyncio.wait_for(held, 5)

    assert asyncio.run(scenario()).stop_reason == "completed"
    assert posted == ["/abort_request", "/generate"]
