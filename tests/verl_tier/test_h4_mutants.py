"""Cases no verl-tier test pinned, found by mutating the verl integration (`make test-verl`).

Each test kills a mutant that survived the tier's tests:
- a group kept after replicas were removed: the same group name and ranks, but the world it was
  made for is larger (its broadcasts would wait for members that are gone);
- a bucket of another step than the one the receiver was asked for, and a bucket header whose
  entries end past its bytes: refused by name, not loaded;
- the reference replica serving LoRA as an adapter releases and resumes its KV cache only (the
  base weights, synced once, must stay: a release of the weights would leave it generating from
  released memory until a base sync that never comes).
"""

from __future__ import annotations

import asyncio
import json
import types

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.timeout(60)]

BUCKET = 1 << 20


def _meta(n_rollout: int) -> list:
    return [{"master": {"address": "a", "port": 1, "group_name": "g", "device_type": "cpu",
                        "bucket_size": BUCKET}}] + [{"master": None}] * n_rollout


def test_a_group_made_for_more_replicas_is_not_kept_when_some_are_gone():
    from fsdp_sync.integrations.verl.checkpoint_engine import FsdpSyncCheckpointEngine

    # the last sync ran with 3 rollout workers (world 4); now 2 remain at ranks 1 and 2
    engines = [FsdpSyncCheckpointEngine(bucket_size=BUCKET, device="cpu") for _ in range(3)]
    for i, e in enumerate(engines):
        e.pg, e.held = object(), {"group_name": "g", "rank": i, "world_size": 4}
    answers = [dict(e.prepare(), master=m["master"]) for e, m in zip(engines, _meta(2))]
    actor, rollout = FsdpSyncCheckpointEngine.build_topology(1, 2, answers)
    assert actor["world_size"] == [3] and rollout["rank"] == [1, 2]
    assert actor["master"][0]["keep"] is False and rollout["master"][0]["keep"] is False
    # the same members holding a group of the right world: kept
    for e in engines:
        e.held = dict(e.held, world_size=3)
    answers = [dict(e.prepare(), master=m["master"]) for e, m in zip(engines, _meta(2))]
    actor, _ = FsdpSyncCheckpointEngine.build_topology(1, 2, answers)
    assert actor["master"][0]["keep"] is True


def _received(global_steps):
    from fsdp_sync.integrations.verl.checkpoint_engine import (FsdpSyncCheckpointEngine,
                                                               ReceivedWeights)

    engine = FsdpSyncCheckpointEngine(bucket_size=BUCKET, device="cpu")
    engine.rank, engine.world_size = 1, 2
    return ReceivedWeights(engine, global_steps)


def test_a_bucket_of_another_step_is_refused_naming_both():
    w = torch.arange(4, dtype=torch.float32)
    flat = w.view(torch.uint8).clone()
    entry = [["w", "float32", [4], 0, 16]]
    from fsdp_sync.integrations.verl.checkpoint_engine import _read_entries

    entries = _read_entries({"entries": entry, "nbytes": 16})
    got = _received(7)._bucket(({"step": 7, "entries": entries}, flat))
    assert [n for n, _ in got] == ["w"] and got[0][1].equal(w)
    with pytest.raises(RuntimeError, match=r"rank 1 expected the weights of step 8, the sender "
                                           r"sent step 7"):
        _received(8)._bucket(({"step": 7, "entries": entries}, flat))


def test_a_header_whose_entries_end_past_its_bytes_is_refused():
    from fsdp_sync.integrations.verl.checkpoint_engine import _read_entries

    with pytest.raises(RuntimeError, match=r"entries end past its 8 bytes"):
        _read_entries({"entries": [["w", "float32", [4], 0, 16]], "nbytes": 8})


def test_the_reference_replica_serving_a_lora_adapter_keeps_its_base_weights(tmp_path):
    from fsdp_sync.integrations.verl.replica import ServeServer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    cfg = types.SimpleNamespace(tensor_model_parallel_size=1, data_parallel_size=1,
                                pipeline_model_parallel_size=1, dtype="float32",
                                response_length=16, prompt_length=64, max_model_len=None,
                                free_cache_engine=True, custom=None)

    def server(lora_rank):
        model = types.SimpleNamespace(local_path=str(tmp_path), path=str(tmp_path),
                                      lora_rank=lora_rank, lora={"merge": False})
        s = ServeServer(cfg, model, replica_rank=0, node_rank=0)
        posted = []

        async def post(path, body):
            posted.append((path, body.get("tags")))
            return {"success": True}

        s._post = post
        return s, posted

    for lora_rank, tags in ((8, ["kv_cache"]), (0, ["kv_cache", "weights"])):
        s, posted = server(lora_rank)
        asyncio.run(s.sleep())
        asyncio.run(s.wake_up())
        assert posted == [("/release_memory_occupation", tags),
                          ("/resume_memory_occupation", tags)], (lora_rank, posted)


def test_the_adapter_resumes_memory_only_where_verl_frees_it():
    """``rollout.free_cache_engine=False``: verl never releases the server's memory, and its own
    adapter never resumes it; neither does fsdp_sync's (a resume of memory that was not released
    is refused by SGLang's memory saver). With it on, verl's tags go to the server as given."""
    import verl  # noqa: F401
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import RolloutConfig
    from verl.workers.rollout.base import get_rollout_class

    calls = []

    class Engine:
        def resume_memory_occupation(self, tags):
            calls.append(("resume", tags))

        def release_memory_occupation(self, tags):
            calls.append(("release", tags))

    async def client():
        return Engine()

    for free in (False, True):
        cfg = {"name": "sglang", "dtype": "bfloat16", "free_cache_engine": free,
               "tensor_model_parallel_size": 1,
               "custom": {"fsdp_sync": {"enable": True, "base_url": "http://127.0.0.1:9"}}}
        rollout = get_rollout_class("sglang", "async")(
            config=omega_conf_to_dataclass(OmegaConf.create(cfg), RolloutConfig),
            model_config=types.SimpleNamespace(hf_config=None), device_mesh=None)
        rollout._client = client
        calls.clear()
        asyncio.run(rollout.resume(tags=["weights"]))
        asyncio.run(rollout.resume(tags=["kv_cache"]))
        assert calls == ([("resume", ["weights"]), ("resume", ["kv_cache"])] if free else []), \
            (free, calls)


def test_a_consumer_that_fails_mid_stream_still_walks_an_async_stream_to_its_end():
    """`stream.pulled_in_a_thread`: the sync (in a thread) refuses after one tensor of verl's
    checkpoint-engine stream; the rest is walked before the error is raised, so the sender's
    broadcast (which waits for every receiver) ends now, not at its timeout."""
    from fsdp_sync.integrations.verl.stream import pulled_in_a_thread

    walked, closed = [], []

    async def stream():
        try:
            for i in range(5):
                walked.append(i)
                yield f"w{i}", torch.full((2,), float(i))
        finally:
            closed.append(len(walked))

    def run(it):
        next(it)
        raise ValueError("refused by the engine")

    with pytest.raises(ValueError, match="refused by the engine"):
        asyncio.run(pulled_in_a_thread(stream(), run))
    assert walked == [0, 1, 2, 3, 4] and closed == [5]

    def whole(it):
        return [n for n, _ in it]

    walked.clear()
    assert asyncio.run(pulled_in_a_thread(stream(), whole)) == [f"w{i}" for i in range(5)]


def test_finalize_destroys_the_group_a_failed_sync_ran_on_and_keeps_a_good_one(monkeypatch):
    """The group of a failed sync goes at finalize, not at the next sync's init: a receiver thread
    still blocked in a broadcast on it ends then (`_Receiver.stop`), and its connections close."""
    from fsdp_sync.integrations.verl import checkpoint_engine as ce

    destroyed = []
    monkeypatch.setattr(ce, "destroy_update_group", destroyed.append)
    for failed in (False, True):
        e = ce.FsdpSyncCheckpointEngine(bucket_size=BUCKET, device="cpu")
        pg = object()
        e.pg, e.held, e.failed = pg, {"group_name": "g", "rank": 1, "world_size": 2}, failed
        e.finalize()
        assert (e.pg is None, destroyed[-1:] == [pg]) == ((True, True) if failed else (False, False))
