"""What fsdp_sync's verl adapter refuses, and how it checks SGLang (`make test-verl`).

- LoRA: served as adapters (the base once, then lora_A/lora_B only, verified), merged LoRA as full
  weights; what cannot be exact (a regex target_modules, an fsdp_sync_ref run whose base verl
  would never sync, a LoRA sync without its adapter) refused naming verl's key.
- An infer-TP group where one rank runs another adapter (verl's own, when the plug-in failed to
  load there): fsdp_sync's rank refuses at its first sync, naming the other rank, instead of
  hanging with it.
- ``verify`` against SGLang: after each sync the adapter compares ``/weights_checker``'s per-TP-rank
  hashes with the same hashes of what it sent (`verify.SentToSGLang`), in full and sampled; a
  parameter the server holds wrong fails the sync on every rank, naming it and the TP rank.
- What SGLang would load or check wrongly is refused at the first sync, before any byte moves, as
  the manager refuses it (`config_check.check_engine`): block FP8 of a Llama model (SGLang's
  loader drops its scales), verify with ``rollout.data_parallel_size`` > 1 (attention DP). A model
  whose fused pairs SGLang must load in one call (DeepSeek-V4) is refused when the adapter is built.
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


def test_lora_runs_build_the_adapter_what_cannot_be_exact_is_refused(tmp_path):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.base import get_rollout_class

    from fsdp_sync.models import load_config

    hf = load_config("tiny")
    hf.architectures = ["Qwen2ForCausalLM"]        # what a checkpoint's config.json names
    hf.save_pretrained(tmp_path)
    config = omega_conf_to_dataclass(rollout_config())
    cls = get_rollout_class("sglang", "async")
    # adapters (verl's HFModelConfig, fsdp's flat key and megatron's block): served as verl's own
    # SGLang rollout serves them, the base kept between syncs (sleep_level 1)
    for kw in ({"lora_rank": 8}, {"lora": {"rank": 16}}):
        adapter = cls(config=config, model_config=HFModelConfig(path=str(tmp_path),
                                                                load_tokenizer=False, **kw),
                      device_mesh=None)
        assert type(adapter).__name__ == "SGLangAdapter" and adapter.lora and adapter.sleep_level == 1
    merged = cls(config=config, model_config=HFModelConfig(path=str(tmp_path), load_tokenizer=False,
                                                           lora_rank=8, lora={"merge": True}),
                 device_mesh=None)
    assert not merged.lora and merged.sleep_level == 2            # full weights, synced as any
    regex = HFModelConfig(path=str(tmp_path), load_tokenizer=False, lora_rank=8,
                          target_modules=".*proj")
    with pytest.raises(NotImplementedError, match=r"actor_rollout_ref\.model\.target_modules='\.\*proj'"):
        cls(config=config, model_config=regex, device_mesh=None)
    ref = omega_conf_to_dataclass(rollout_config(["actor_rollout_ref.rollout.name=fsdp_sync_ref",
                                                  "actor_rollout_ref.rollout.load_format=auto"]))
    with pytest.raises(NotImplementedError, match=r"rollout\.load_format='auto' with LoRA adapters"):
        get_rollout_class("fsdp_sync_ref", "async")(
            config=ref, model_config=HFModelConfig(path=str(tmp_path), load_tokenizer=False,
                                                   lora_rank=8), device_mesh=None)


def test_lora_base_once_then_adapter_only_every_sync_verified():
    """verl's LoRA-as-adapter calls through fsdp_sync's adapter into ``fsdp-sync serve`` (TP 2):
    the base (``base_sync_done=False``, '.base_layer.' names) lands under the engine's names, each
    adapter sync (``base_sync_done=True``) loads verl's adapter name with only lora_A / lora_B,
    read back bit for bit; a sync of a LoRA run without a peft_config (verl's checkpoint-engine
    modes: base only, the adapter never) is refused on both ranks."""
    from fsdp_sync.cli.launch import run_ranks
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer
    from fsdp_sync.integrations.verl_lora import LORA_NAME
    from fsdp_sync.models import build_model, load_config

    import verl_ranks

    base = build_model(load_config("tiny"), seed=0).state_dict()
    with ReferenceEngine("tiny", tp_size=2, seed=9) as engine, EngineServer(engine) as server:
        cfg = rollout_config([f"+actor_rollout_ref.rollout.custom.fsdp_sync.base_url={server.url}",
                              "+actor_rollout_ref.rollout.custom.fsdp_sync.verify=full"])
        results = run_ranks(verl_ranks.lora_syncs, 2, cfg, timeout_s=240)
        served = {n: engine.get_weights_by_name(n) for n in base}
        loaded = engine.lora_adapters
        held = engine.lora_tensors(LORA_NAME)
    for out in results:
        assert out["sleep_level"] == 1
        syncs = out["syncs"]
        assert all(isinstance(s, dict) for s in syncs[:4]), syncs
        assert isinstance(syncs[4], str) and syncs[4].startswith("NotImplementedError") \
            and "without its adapter" in syncs[4], syncs[4]
    first, adapters = results[0]["syncs"][0], results[0]["syncs"][1:4]
    assert first["kind"] == "base" and first["verify_tensors"] == first["tensors"] == len(base)
    assert all(served[n].equal(t) for n, t in base.items())          # base_layer names stripped
    assert list(loaded) == [LORA_NAME] and loaded[LORA_NAME]["r"] == 4
    n_lora = 2 * 7 * load_config("tiny").num_hidden_layers
    for s in adapters:
        assert s["kind"] == "adapter" and s["tensors"] == n_lora and s["verify_tensors"] == n_lora, s
        assert s["verify"] == "full" and s["bytes"] < first["bytes"] / 5, (s["bytes"], first["bytes"])
    assert [s["engine_calls"] for s in adapters] == [2, 3, 3]        # then unload + load
    want = {n.removeprefix("base_model.model."): t for n, t in results[0]["adapter"].items()}
    assert sorted(held) == sorted(want) and all(held[n].equal(want[n]) for n in want)


@pytest.mark.parametrize("overrides, refused", [({}, None),
                                                ({"rms_norm_eps": 1e-5}, "rms_norm_eps: trainer 1e-05, engine 1e-06")])
def test_an_adapter_only_first_sync_checks_the_served_model(overrides, refused):
    """verl's first call for a new adapter may be adapter-only (``base_sync_done=True``: a
    rollout replica made again, a run resumed): no base sync checked the served model against the
    actor's. Before, the adapter was loaded onto whatever the server served; now the served
    config is checked first, as a base sync checks it: a model whose math differs (its
    ``rms_norm_eps``) is refused on both ranks before anything reaches the engine; a matching one
    loads, and the next call does not check again."""
    from fsdp_sync.cli.launch import run_ranks
    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.engines.reference.serve import EngineServer

    import verl_ranks

    with ReferenceEngine("tiny", tp_size=2, seed=9, max_lora_rank=8) as engine, EngineServer(engine) as server:
        cfg = rollout_config([f"+actor_rollout_ref.rollout.custom.fsdp_sync.base_url={server.url}",
                              "+actor_rollout_ref.rollout.custom.fsdp_sync.verify=full"])
        results = run_ranks(verl_ranks.adapter_only_first, 2, cfg, overrides, timeout_s=240)
        loaded = dict(engine.lora_adapters)
    for syncs in results:
        if refused is None:
            assert all(isinstance(s, dict) and s["kind"] == "adapter" for s in syncs), syncs
        else:
            assert all(isinstance(s, str) and s.startswith("SyncError") and refused in s for s in syncs), syncs
    assert bool(loaded) == (refused is None), loaded


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


def test_what_sglang_would_load_or_check_wrongly_is_refused_before_any_byte_moves():
    """verl2 audit, items 1 and 6. ``rollout.quantization=fp8`` with a Llama model: the manager's
    check (`config_check.check_engine` -> SGLang's ``load_refusal``) refuses it, the adapter
    synced it (SGLang's Llama loader renames every ``weight_scale_inv``: all 14 scales dropped).
    ``verify=full`` with ``data_parallel_size=2``: the adapter hashed each rank's shard for TP 1
    while SGLang runs TP 2 (tp x dp, attention DP), and failed after the whole sync. Both are
    refused on both ranks at the first sync, before any update reaches the server; so is a LoRA
    run's base sync whose adapter SGLang would serve otherwise (trained biases: lora2 audit)."""
    import fake_sglang

    from fsdp_sync.cli.launch import run_ranks

    import verl_ranks

    with fake_sglang.FakeSGLangServer(tp_size=2) as server:
        url = f"+actor_rollout_ref.rollout.custom.fsdp_sync.base_url={server.url}"
        fp8 = rollout_config([url, "actor_rollout_ref.rollout.quantization=fp8"])
        dp2 = rollout_config([url, "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
                              "actor_rollout_ref.rollout.data_parallel_size=2",
                              "+actor_rollout_ref.rollout.custom.fsdp_sync.verify=full"])
        # a LoRA run's base sync whose adapter SGLang would serve otherwise (trained biases)
        biased = {"peft_config": {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "all",
                                  "target_modules": ["q_proj", "v_proj"]}, "base_sync_done": False}
        results = run_ranks(verl_ranks.refused_before_sending, 2,
                            [(fp8, "llama", "tiny-fp8"), (dp2, "qwen2", "tiny"),
                             (rollout_config([url]), "qwen2", "tiny", biased)], timeout_s=240)
        loads = server.hits.get("/update_weights_from_tensor", 0)
    for r, (quantized, verified, lora) in enumerate(results):
        assert isinstance(lora, str) and lora.startswith("ValueError") and "bias='all'" in lora, (r, lora)
        assert isinstance(quantized, str) and "SyncError" in quantized, (r, quantized)
        assert "quantization='fp8' for a 'llama' model" in quantized, quantized
        assert "set actor_rollout_ref.rollout.quantization=null" in quantized, quantized
        assert isinstance(verified, str) and "SyncError" in verified, (r, verified)
        assert "rollout.data_parallel_size=2" in verified and "tp_size=2" in verified, verified
        assert "set rollout.custom.fsdp_sync.verify=off" in verified, verified
    assert loads == 0


def test_a_model_whose_fused_pairs_sglang_loads_in_one_call_is_refused_when_built():
    """verl2 audit, item 3: DeepSeek-V4's fused pairs (wq_a/wkv ...) must reach SGLang in one
    ``load_weights`` call (verl keeps them in one bucket, ``DEEPSEEK_V4_FUSION_GROUPS``); the
    adapter's buckets, cut by bytes, split them, and fsdp_sync's layout map does not know the
    model: refused by name when the adapter is built, before any sync. Other models build."""
    from types import SimpleNamespace

    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.base import get_rollout_class

    config = omega_conf_to_dataclass(rollout_config())
    cls = get_rollout_class("sglang", "async")
    with pytest.raises(NotImplementedError, match=r"model_type 'deepseek_v4': SGLang loads its "
                                                  r"fused pairs .* drop rollout\.custom\.fsdp_sync\.enable"):
        cls(config=config, model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v4")),
            device_mesh=None)
    built = cls(config=config, model_config=SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen2")),
                device_mesh=None)
    assert type(built).__name__ == "SGLangAdapter"
