"""What fsdp_sync's verl adapter refuses, and how it checks SGLang (`make test-verl`).

- LoRA: refused when the adapter is built (verl's model config says adapters, not merged), and at
  a sync where verl passes a ``peft_config``; merged LoRA (full weights) is taken.
- An infer-TP group where one rank runs another adapter (verl's own, when the plug-in failed to
  load there): fsdp_sync's rank refuses at its first sync, naming the other rank, instead of
  hanging with it.
- ``verify`` against SGLang: after each sync the adapter compares ``/weights_checker``'s per-TP-rank
  hashes with the same hashes of what it sent (`verify.SentToSGLang`), in full and sampled; a
  parameter the server holds wrong fails the sync on every rank, naming it and the TP rank.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
RECIPE = ROOT / "recipes" / "verl" / "grpo_qwen2_5_0_5b_gsm8k_fsdp_sync.yaml"


def rollout_config(overrides=()) -> dict:
    """The GSM8K recipe's rollout section (``rollout.name=sglang``, fsdp_sync enabled), TP 2."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(RECIPE.parent), version_base=None):
        cfg = compose(config_name=RECIPE.stem, overrides=[
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.dtype=float32", *overrides])
    return OmegaConf.to_container(cfg.actor_rollout_ref.rollout, resolve=True)


def test_lora_adapters_are_refused_when_the_adapter_is_built_merged_lora_is_not(tmp_path):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.base import get_rollout_class

    from fsdp_sync.models import load_config

    hf = load_config("tiny")
    hf.architectures = ["Qwen2ForCausalLM"]        # what a checkpoint's config.json names
    hf.save_pretrained(tmp_path)
    config = omega_conf_to_dataclass(rollout_config())
    cls = get_rollout_class("sglang", "async")
    adapters = HFModelConfig(path=str(tmp_path), load_tokenizer=False, lora_rank=8)
    with pytest.raises(NotImplementedError, match=(
            r"does not sync LoRA adapters \(actor_rollout_ref\.model\.lora_rank=8, lora\.merge=false\): "
            r"set actor_rollout_ref\.model\.lora\.merge=true")):
        cls(config=config, model_config=adapters, device_mesh=None)
    megatron = HFModelConfig(path=str(tmp_path), load_tokenizer=False, lora={"rank": 16})
    with pytest.raises(NotImplementedError, match=r"lora_rank=16, lora\.merge=false"):
        cls(config=config, model_config=megatron, device_mesh=None)
    merged = HFModelConfig(path=str(tmp_path), load_tokenizer=False, lora_rank=8,
                           lora={"merge": True})
    adapter = cls(config=config, model_config=merged, device_mesh=None)
    assert type(adapter).__name__ == "SGLangAdapter"
    # what the config did not show: verl's first LoRA base sync passes base_sync_done=False
    # with the adapter's peft_config (and '.base_layer.' names): refused before anything moves
    with pytest.raises(NotImplementedError, match="verl passed a LoRA peft_config"):
        asyncio.run(adapter.update_weights(iter([("x.base_layer.weight", torch.zeros(2))]),
                                           peft_config={"r": 8}, base_sync_done=False))


def test_a_rank_running_another_adapter_is_named_not_waited_for_forever():
    """Issue 37, item 3. Global rank 1 runs fsdp_sync's adapter, rank 0 (the infer-TP group's
    first rank) verl's own: fsdp_sync's rank refuses at its first sync within
    ``dist_timeout_s``, naming rank 0 and the setting that makes a plug-in failure loud; nothing
    reaches the engine."""
    from fsdp_sync.cli.launch import run_ranks
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer

    import verl_ranks

    with ReferenceEngine("tiny", tp_size=2, seed=5) as engine, EngineServer(engine) as server:
        cfg = rollout_config([f"+actor_rollout_ref.rollout.custom.fsdp_sync.base_url={server.url}",
                              "+actor_rollout_ref.rollout.custom.fsdp_sync.dist_timeout_s=2"])
        before = engine.weights_checksum()
        (theirs, _), (ours, seconds) = run_ranks(verl_ranks.mixed_group, 2, cfg, 1, pg_timeout_s=6,
                                                 timeout_s=200)
        assert engine.weights_checksum() == before          # nothing reached the engine
    assert ours is not None and ours.startswith("RuntimeError: fsdp_sync's verl adapter on infer-TP "
                                                "rank 1 (global rank 1): infer-TP rank 0 (global "
                                                "rank 0) did not start fsdp_sync's adapter within 2 s"), ours
    assert "VERL_USE_EXTERNAL_MODULES=fsdp_sync.integrations.verl" in ours, ours
    # not forever: the refusal comes dist_timeout_s after the first sync begins; the rest is the
    # rank's export and imports, which took 36 s once on a 2-core machine under heavy load
    assert seconds < 120, seconds
    assert theirs is not None          # verl's rank waited in its collectives: its own timeout


def test_verify_against_sglang_compares_weights_checker_with_what_was_sent(monkeypatch):
    """Issue 37, item 7: ``custom.fsdp_sync.verify`` against an SGLang server. Sync 0 full, sync 1
    sampled (every 8th engine parameter), sync 2 full with the server holding one parameter
    wrong: refused on both ranks, naming it and the TP rank."""
    import fake_sglang

    from fsdp_sync.cli.launch import run_ranks
    from fsdp_sync.models import load_config
    from fsdp_sync.weights.layout import layout_for

    import verl_ranks

    layout = layout_for(load_config("tiny"), 2)
    with fake_sglang.FakeSGLangServer(tp_size=2, layout=layout) as server:
        engine = server.engine
        load = engine.update_weights_from_tensor

        def load_then_spoil(*a, **kw):      # the third session's norm weight lands wrong
            out = load(*a, **kw)
            if engine.names().count("begin_weight_update") == 3 and "model.norm.weight" in engine.weights:
                engine.weights["model.norm.weight"][0] += 1.0
            return out

        monkeypatch.setattr(engine, "update_weights_from_tensor", load_then_spoil)
        cfg = rollout_config([f"+actor_rollout_ref.rollout.custom.fsdp_sync.base_url={server.url}",
                              "+actor_rollout_ref.rollout.custom.fsdp_sync.bucket_mb=0.1"])
        results = run_ranks(verl_ranks.verify_on_sglang, 2, cfg, ["full", "sample", "full"],
                            timeout_s=240)
        checked = server.hits.get("/weights_checker", 0)
    params = list(layout.engine_shapes())
    full, sample, spoiled = results[0]
    assert isinstance(full, dict) and full["verify"] == "full", full
    assert full["verify_tensors"] == len(params) and full["buckets"] > 2
    assert isinstance(sample, dict) and sample["verify"] == "sample", sample
    # a new adapter per sync here: its first sync checks engine parameters 0, 8, 16, ...
    assert sample["verify_tensors"] == len(params[0::8]), (sample["verify_tensors"], len(params))
    assert checked == 3                               # one /weights_checker call per sync
    assert isinstance(results[1][0], dict) and isinstance(results[1][1], dict), results[1]
    for r in (0, 1):
        err = results[r][2]
        assert isinstance(err, str) and "SyncError" in err, err
        assert "(SGLang, /weights_checker) serves weights different" in err, err
        assert "'model.norm.weight' on TP rank 0: SGLang hashes" in err, err
