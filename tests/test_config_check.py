"""Trainer and engine configs that differ in values that change the engine's math are refused at
the first sync, naming each key and both values (issue 21 item 7: ``rope_theta: 1e6`` and
``rms_norm_eps: 1e-5`` on the engine synced and passed ``verify="full"`` while its logits differed)."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env
from fsdp_sync.config_check import check_configs, config_mismatches, model_config
from fsdp_sync.models import build_model, load_config


def test_mismatches_name_each_key_and_both_values():
    base = load_config("tiny")
    other = load_config("tiny", rope_theta=1e6, rms_norm_eps=1e-5)
    assert config_mismatches(base, base) == []
    assert config_mismatches(base, other) == [("rms_norm_eps", base.rms_norm_eps, 1e-5),
                                              ("rope_theta", 10000.0, 1e6)]
    deeper = load_config("tiny", num_hidden_layers=base.num_hidden_layers + 1)
    with pytest.raises(ValueError, match=rf"num_hidden_layers: trainer {base.num_hidden_layers}, "
                                         rf"engine {base.num_hidden_layers + 1}"):
        check_configs(base, deeper)
    act = load_config("tiny", hidden_act="gelu")
    assert [k for k, _, _ in config_mismatches(base, act)] == ["hidden_act"]
    # values that do not change the math are not compared
    assert config_mismatches(base, load_config("tiny", max_position_embeddings=4096)) == []


def test_training_only_keys_and_an_idle_window_are_not_compared():
    """A loss weight (``router_aux_loss_coef``) and the sizes of a sliding window that is off
    (``max_window_layers``, ``sliding_window`` with ``use_sliding_window`` false) do not change the
    engine's outputs: a trainer's 0.02 against the recipe's 0.001 refused a valid sync. A window
    that is on is compared, and a Mixtral-style config (no switch) has it on when it has a size."""
    moe = load_config("tiny-qwen3-moe")
    assert config_mismatches(moe, load_config("tiny-qwen3-moe", router_aux_loss_coef=moe.router_aux_loss_coef * 20)) == []
    base = load_config("tiny")
    assert base.use_sliding_window is False
    assert config_mismatches(base, load_config("tiny", max_window_layers=base.max_window_layers + 3,
                                               sliding_window=17)) == []
    on = load_config("tiny", use_sliding_window=True, sliding_window=64)
    assert config_mismatches(on, load_config("tiny", use_sliding_window=True, sliding_window=64,
                                             max_window_layers=on.max_window_layers + 3)) == [
        ("max_window_layers", on.max_window_layers, on.max_window_layers + 3)]
    assert [k for k, _, _ in config_mismatches(base, on)] == ["use_sliding_window", "sliding_window",
                                                             "max_window_layers"]
    mixtral = load_config("tiny-mixtral")
    assert getattr(mixtral, "use_sliding_window", None) is None and mixtral.sliding_window is None
    windowed = load_config("tiny-mixtral", sliding_window=4096)
    assert config_mismatches(mixtral, windowed) == [("use_sliding_window", False, True),
                                                    ("sliding_window", None, 4096)]
    # a module's config, through wrappers
    model = build_model(base, seed=0)

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    assert model_config(Wrapper(model)) is model.config
    assert model_config(torch.nn.Linear(2, 2)) is None


def _job(rank, world, http=False):
    from contextlib import ExitStack

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.topology import SyncError, make_mesh

    torch.set_num_threads(1)
    module = build_model(load_config("tiny"), seed=1)
    cfg = SyncConfig(dtype=torch.float32, free_cache_engine=False, verify="full")
    out = {}

    def driven(stack, eng):
        """The engine the manager drives: itself, or over HTTP through fsdp-sync serve"""
        if not http:
            return eng
        from fsdp_sync.engines.reference.serve import EngineServer
        from fsdp_sync.engines.sglang import SGLangEngine

        server = stack.enter_context(EngineServer(eng))
        return SGLangEngine(base_url=server.url, tp_size=1)

    with ExitStack() as stack:
        eng = stack.enter_context(ReferenceEngine(load_config("tiny", rope_theta=1e6, rms_norm_eps=1e-5),
                                                  tp_size=1))
        before = eng.weights_checksum()
        try:
            with FSDPShardingManager(module, driven(stack, eng), mesh=make_mesh(1, 1), config=cfg):
                pass
            out["error"] = None
        except SyncError as exc:
            out["error"] = str(exc)
        out["unchanged"] = eng.weights_checksum() == before
    with ExitStack() as stack:   # equal configs: syncs, verified
        eng = stack.enter_context(ReferenceEngine(load_config("tiny"), tp_size=1))
        with FSDPShardingManager(module, driven(stack, eng), mesh=make_mesh(1, 1), config=cfg):
            pass
        out["equal_synced"] = torch.equal(eng.get_weights_by_name("model.norm.weight"),
                                          module.model.norm.weight)
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("http", [False, True], ids=["in_process", "over_http"])
def test_the_manager_refuses_an_engine_with_other_math_on_every_rank(http):
    """In process, and over HTTP through fsdp-sync serve (which reports its config in
    /get_model_info): the manager refuses before any byte moves."""
    (r,) = run_ranks(_job, 1, http, timeout_s=140, env=spawn_env())
    assert r["error"] is not None, r
    assert "rms_norm_eps: trainer 1e-06, engine 1e-05" in r["error"], r["error"]
    assert "rope_theta: trainer 10000.0, engine 1000000.0" in r["error"], r["error"]
    assert r["unchanged"] and r["equal_synced"]


def test_a_served_config_is_read_from_serve_or_from_sglangs_model_path(tmp_path):
    """SGLang's /get_model_info names only model_path: where that is a local directory its
    config.json is the engine's config; fsdp-sync serve reports the whole config (hf_config)."""
    import json

    from fsdp_sync.engines.sglang.served_config import served_config

    base = load_config("tiny")
    (tmp_path / "config.json").write_text(json.dumps(load_config("tiny", rope_theta=1e6).to_dict()))
    from_path = served_config({"model_path": str(tmp_path), "weight_version": "default"})
    assert config_mismatches(base, from_path) == [("rope_theta", 10000.0, 1e6)]
    assert config_mismatches(base, served_config({"hf_config": base.to_dict()})) == []
    # a model type transformers does not know: its values still compare
    odd = served_config({"hf_config": {"model_type": "not-a-model", "rms_norm_eps": 1e-5}})
    assert ("rms_norm_eps", base.rms_norm_eps, 1e-5) in config_mismatches(base, odd)
    # nothing to read: not checked
    assert served_config({"model_path": "Qwen/Qwen3-8B"}) is None and served_config(None) is None


def _tp_job(rank, world):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.topology import SyncError, make_mesh

    torch.set_num_threads(1)
    module = build_model(load_config("tiny"), seed=1)
    cfg = SyncConfig(dtype=torch.float32, free_cache_engine=False)
    engine = ReferenceEngine(load_config("tiny"), tp_size=1) if rank == 0 else None
    out = {}
    try:
        before = engine.weights_checksum() if engine is not None else None
        try:
            with FSDPShardingManager(module, engine, mesh=make_mesh(1, world), config=cfg):
                pass
            out["error"] = None
        except SyncError as exc:
            out["error"] = str(exc)
        out["unchanged"] = engine is None or engine.weights_checksum() == before
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(120)
def test_an_engine_tp_other_than_the_meshs_infer_tp_is_refused_on_every_rank_naming_both():
    """The tensor method: infer-TP rank r makes engine TP rank r's payload, so an engine of TP 1
    under a mesh of infer_tp 2 cannot take what the ranks send. Refused at the first sync, on
    every rank, with both sizes and what to change, before any payload is made (the engine kept
    its weights); before, the engine refused the first bucket for its count of payloads."""
    results = run_ranks(_tp_job, 2, timeout_s=110, env=spawn_env())
    for rank, r in enumerate(results):
        assert r["error"] is not None, (rank, r)
        assert "the engine runs TP 1 but the mesh's infer_tp has 2 rank(s)" in r["error"], (rank, r["error"])
        assert "make the mesh with infer_tp=1" in r["error"] and "tp_size=2" in r["error"], r["error"]
        assert r["unchanged"], rank


def test_check_engine_names_tp_quantization_and_math_and_passes_a_matching_engine():
    """`check_engine`, what the manager asks of each engine before its first sync, on stand-ins:
    the tensor method's TP against the mesh's infer_tp (other methods send no per-rank payloads),
    the engine's quantization against the sync's, then the model config's math."""
    import types

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.config_check import check_engine

    cfg = load_config("tiny")
    module = build_model(cfg, seed=0)
    topo = types.SimpleNamespace(tp_size=2)

    def engine(tp=2, quantization=None, config=cfg):
        return types.SimpleNamespace(tp_size=tp, quantization=quantization, config=config)

    plain = SyncConfig(dtype=torch.float32)
    check_engine(module, engine(), plain, topo, where="here")                  # all equal: passes
    with pytest.raises(ValueError, match=r"engine runs TP 4 but the mesh's infer_tp has 2 .*"
                                         r"infer_tp=4 .*tp_size=2 \(here\)"):
        check_engine(module, engine(tp=4), plain, topo, where="here")
    check_engine(module, engine(tp=4), SyncConfig(method="distributed"), None, where="here")
    check_engine(module, types.SimpleNamespace(), plain, topo, where="here")    # tells nothing: passes
    with pytest.raises(ValueError, match=r"serves quantization='fp8' but SyncConfig.quantization=None"):
        check_engine(module, engine(quantization="fp8"), plain, topo, where="here")
    with pytest.raises(ValueError, match=r"serves quantization=None but SyncConfig.quantization='fp8'"):
        check_engine(module, engine(), SyncConfig(quantization="fp8"), topo, where="here")
    with pytest.raises(ValueError, match=r"rope_theta: trainer 10000.0, engine 1000000.0.* \(here\)"):
        check_engine(module, engine(config=load_config("tiny", rope_theta=1e6)), plain, topo, where="here")
