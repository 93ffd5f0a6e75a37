"""Two rules of a sync that nothing else pinned down:

- The tensor method flushes the engine's cache once, with its last engine call, on every strategy
  (``flattened``, ``bucketed``, ``per_tensor``) with ``layout="full"``: a flush before the last
  call lets requests cache KV of half-new weights, none at all leaves the old weights' KV in the
  radix cache (`test_pause_modes` covers ``pause_mode="in_place"``, where no call flushes).
- A peft ``rank_pattern`` / ``alpha_pattern`` that only repeats the adapter's own ``r`` /
  ``lora_alpha`` is the same adapter and is served; only the entries that differ are refused, and
  named (`weights.peft_names.pattern_refusal`, what the sync and the verl path ask).
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.weights.peft_names import config_refusal, pattern_refusal
from test_lora_exact import CFG
from test_pause_modes import _BusyFlush

STRATEGIES = ("flattened", "bucketed", "per_tensor")


class _TensorFlushes(_BusyFlush):
    """`_BusyFlush` (a flush of its own is refused) recording each tensor update's flush_cache."""

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True, **kw):
        self.flushes.append(flush_cache)
        return self._e.update_weights_from_tensor(named_tensors, load_format=load_format,
                                                  flush_cache=flush_cache, **kw)


def _flushes(rank, world, _):
    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    torch.set_num_threads(1)
    cfg = load_config("tiny")
    out = {}
    with ReferenceEngine(model_config=cfg, tp_size=1, kv_cache_tokens=64) as ref:
        for strategy in STRATEGIES:
            eng = _TensorFlushes(ref)
            manager = FSDPShardingManager(build_model(cfg, seed=0), eng, mesh=make_mesh(1, 1), config=SyncConfig(
                method="tensor", layout="full", strategy=strategy, bucket_bytes=16 << 10, free_cache_engine=False))
            try:
                with manager:
                    pass
                out[strategy] = {"flushes": eng.flushes, "flush_calls": eng.flush_calls,
                                 "layout": manager.stats.extra.get("layout")}
            finally:
                manager.close()
    return out


@pytest.mark.timeout(150)
def test_every_tensor_strategy_flushes_the_cache_with_its_last_call_only():
    (out,) = run_ranks(_flushes, 1, None, timeout_s=140, env=spawn_env())
    for strategy in STRATEGIES:
        got = out[strategy]
        assert got["layout"] == "full" and got["flush_calls"] == 0, (strategy, got)
        flushes = got["flushes"]
        assert len(flushes) > 1 and flushes == [False] * (len(flushes) - 1) + [True], (strategy, flushes)


def test_a_rank_or_alpha_pattern_that_repeats_the_adapters_own_values_is_served():
    from fsdp_sync.integrations import verl_lora

    same = dict(CFG, rank_pattern={"q_proj": CFG["r"]}, alpha_pattern={"v_proj": CFG["lora_alpha"]})
    assert pattern_refusal(same) is None and config_refusal(same) is None
    assert verl_lora.normalize_peft_config(same)["rank_pattern"] == {"q_proj": 8}
    # one entry that differs among repeats: refused, naming that entry alone
    why = pattern_refusal(dict(CFG, rank_pattern={"q_proj": CFG["r"], "v_proj": 4}))
    assert why and "rank_pattern={'v_proj': 4} (r=8 elsewhere)" in why, why
    why = pattern_refusal(dict(CFG, alpha_pattern={"q_proj": 64, "v_proj": CFG["lora_alpha"]}))
    assert why and "alpha_pattern={'q_proj': 64} (lora_alpha=16 elsewhere)" in why, why
