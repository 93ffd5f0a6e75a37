"""verl's adapter on a one-rank infer-TP group, in process (audit H74, items a and b).

- The sync's figures in ``custom.fsdp_sync.metrics_file``: one whole line per sync, naming its
  replica (several replicas' leaders may share the path); a path that cannot be written is a
  warning naming the key, and the sync, whose weights are in, goes through (before: the leader's
  step failed with the OSError alone, after the weights were committed).
- No server actor for the replica, where the group has no other rank: raised at once, naming the
  Ray actor and the key to set.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys

import pytest

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _cfg(**fsdp_sync):
    from test_verl_adapter_checks import rollout_config

    cfg = rollout_config()
    cfg["tensor_model_parallel_size"] = 1
    cfg["custom"] = {"fsdp_sync": dict(cfg["custom"]["fsdp_sync"], **fsdp_sync)}
    return cfg


def _weights(step):
    from fsdp_sync.models import build_model, load_config

    model = build_model(load_config("tiny"), seed=0)
    return [(n, (t * (1.0 + 0.125 * step)).contiguous()) for n, t in model.state_dict().items()]


def test_metrics_file_lines_name_their_replica_and_an_unwritable_one_fails_no_sync(one_rank, tmp_path,
                                                                                    caplog):
    import verl_ranks
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer

    good, bad = tmp_path / "m.jsonl", tmp_path / "no" / "such" / "dir" / "m.jsonl"
    with ReferenceEngine("tiny", tp_size=1, seed=5) as engine, EngineServer(engine) as server:
        for step, path in ((1, good), (2, good), (3, bad)):
            adapter, _ = verl_ranks._adapter(0, 1, _cfg(base_url=server.url, metrics_file=str(path)))
            with caplog.at_level(logging.WARNING, logger="fsdp_sync.verl"):
                asyncio.run(adapter.update_weights(iter(_weights(step)), global_steps=step))
            assert engine.weight_version == str(step)
    lines = [json.loads(x) for x in good.read_text().splitlines()]
    assert [(x["global_steps"], x["replica_rank"], x["strategy"]) for x in lines] == \
        [(1, 0, "flattened"), (2, 0, "flattened")]
    assert not bad.parent.exists()
    assert f"rollout.custom.fsdp_sync.metrics_file={str(bad)!r}: could not append" in caplog.text


def test_no_server_actor_on_a_one_rank_group_is_raised_at_once_naming_the_key(one_rank, monkeypatch):
    import verl_ranks
    from fsdp_sync.integrations.verl.unreached import EngineUnreached
    from test_h74_rank0_unreached import _fail_actor_lookup

    _fail_actor_lookup(monkeypatch)
    adapter, _ = verl_ranks._adapter(0, 1, _cfg())
    with pytest.raises(EngineUnreached, match=r"Ray actor sglang_server_0_0\) cannot be reached: "
                                              r"ValueError: Failed to look up actor .*"
                                              r"\+actor_rollout_ref\.rollout\.custom\.fsdp_sync\.base_url"):
        asyncio.run(adapter.resume(tags=["weights"]))


def test_the_sink_keeps_the_newest_records_when_no_trainer_drains_it():
    """verl's ``trainer.use_v1=false`` and its fully async trainer never call
    ``_consume_sync_metrics``: the sink grew by one record per replica and sync for the whole run."""
    from fsdp_sync.integrations.verl import metrics

    sink = metrics.Sink()
    for i in range(metrics.KEPT + 10):
        sink.put({"global_steps": i})
    held = sink.drain()
    assert len(held) == metrics.KEPT and held[-1] == {"global_steps": metrics.KEPT + 9}
    assert held[0] == {"global_steps": 10} and sink.drain() == []
