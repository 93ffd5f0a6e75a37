"""The verl adapter's LoRA logic without verl (`fsdp_sync.integrations.verl_lora`): which runs are
served as adapters and which are refused (naming verl's key), the base names without peft's
``.base_layer.``, the peft config as SGLang takes it, and one adapter sync's engine side (verl's
unload-then-load under its adapter name, the read-back verify) against `fsdp-sync serve` over HTTP,
the way the adapter drives it from verl. verl's own loop with LoRA: tests/verl_tier.
"""

from __future__ import annotations

import enum
import re
from types import SimpleNamespace

import pytest
import torch

from fsdp_sync.engines.reference import ReferenceEngine
from fsdp_sync.engines.reference.serve import EngineServer
from fsdp_sync.engines.sglang import SGLangEngine
from fsdp_sync.integrations import verl_lora
from fsdp_sync.models import build_model, load_config
from fsdp_sync.verify import tensor_digest
from test_lora_engine import PROMPTS, make_adapter

pytestmark = pytest.mark.timeout(240)


def model(**kw):
    return SimpleNamespace(**{"lora_rank": 0, "lora": {}, "target_modules": "all-linear", **kw})


def rollout(**kw):
    return SimpleNamespace(**{"name": "fsdp_sync_ref", "load_format": "dummy", "quantization": None, **kw})


def test_which_runs_are_adapters():
    assert not verl_lora.served_as_adapter(model())
    assert verl_lora.served_as_adapter(model(lora_rank=8))
    assert verl_lora.served_as_adapter(model(lora={"rank": 16}))          # megatron's block
    assert not verl_lora.served_as_adapter(model(lora_rank=8, lora={"merge": True}))
    assert not verl_lora.served_as_adapter(model(lora_rank=8, lora={"merge": "true"}))
    assert verl_lora.served_as_adapter({"lora_rank": 4, "lora": {"merge": False}})   # a dict config
    assert verl_lora.lora_rank(model(lora_rank=4, lora={"rank": 8})) == 8


def test_refusals_name_verls_key():
    assert verl_lora.refusal(rollout(), model(lora_rank=8), "fsdp_sync_ref") is None
    assert verl_lora.refusal(rollout(load_format="auto"), model(), "fsdp_sync_ref") is None   # no LoRA
    assert verl_lora.refusal(rollout(load_format="auto"), model(lora_rank=8, lora={"merge": True}),
                             "fsdp_sync_ref") is None                                           # merged
    msg = verl_lora.refusal(rollout(load_format="auto"), model(lora_rank=8), "fsdp_sync_ref")
    assert msg.startswith("actor_rollout_ref.rollout.load_format='auto' with LoRA adapters (lora_rank=8)")
    assert "load_format=dummy" in msg
    # a real SGLang server loads the base from the model path itself: auto is fine there
    assert verl_lora.refusal(rollout(name="sglang", load_format="auto"), model(lora_rank=8),
                             "fsdp_sync_ref") is None
    msg = verl_lora.refusal(rollout(quantization="fp8"), model(lora_rank=8), "fsdp_sync_ref")
    assert msg.startswith("actor_rollout_ref.rollout.quantization='fp8' with LoRA adapters"), msg
    msg = verl_lora.refusal(rollout(), model(lora_rank=8, target_modules=".*proj"), "fsdp_sync_ref")
    assert msg.startswith("actor_rollout_ref.model.target_modules='.*proj'"), msg
    assert verl_lora.refusal(rollout(), model(lora_rank=8, target_modules=["q_proj", "v_proj"]),
                             "fsdp_sync_ref") is None
    # a real SGLang server stacks q/k/v from q_proj with v_proj and gate/up from gate_proj: other
    # target sets fail there at load or at the first request using the adapter, so they are
    # refused when built (as a list, or as OmegaConf's ListConfig verl's config holds)
    from omegaconf import OmegaConf

    for tm in (["q_proj", "k_proj"], OmegaConf.create({"t": ["q_proj", "k_proj"]}).t):
        msg = verl_lora.refusal(rollout(name="sglang"), model(lora_rank=8, target_modules=tm), "fsdp_sync_ref")
        assert msg.startswith("actor_rollout_ref.model.target_modules=['q_proj', 'k_proj']: SGLang cannot serve"), msg
        assert "add ['v_proj']" in msg, msg
    msg = verl_lora.refusal(rollout(name="sglang"), model(lora_rank=8, target_modules=["up_proj", "down_proj"]),
                            "fsdp_sync_ref")
    assert "add ['gate_proj']" in msg, msg
    for ok in (["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "gate_proj"], "all-linear"):
        assert verl_lora.refusal(rollout(name="sglang"), model(lora_rank=8, target_modules=ok),
                                 "fsdp_sync_ref") is None, ok
    # the reference engine serves any subset
    assert verl_lora.refusal(rollout(), model(lora_rank=8, target_modules=["k_proj"]), "fsdp_sync_ref") is None
    msg = verl_lora.no_adapter_refusal(model(lora_rank=8))
    assert "without its adapter" in msg and "checkpoint_engine.backend=naive" in msg


def test_base_names_drop_peft_base_layer_only():
    assert verl_lora.base_name("model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert verl_lora.base_name("model.layers.0.mlp.down_proj.base_layer.bias") == \
        "model.layers.0.mlp.down_proj.bias"
    assert verl_lora.base_name("model.norm.weight") == "model.norm.weight"
    assert verl_lora.base_name("model.base_layer_x.weight") == "model.base_layer_x.weight"


def test_peft_config_normalized_as_verl_does_for_sglang():
    class PeftType(str, enum.Enum):     # peft's enums: str-valued
        LORA = "LORA"

    class TaskType(str, enum.Enum):
        CAUSAL_LM = "CAUSAL_LM"

    cfg = {"peft_type": PeftType.LORA, "task_type": TaskType.CAUSAL_LM, "r": 8, "lora_alpha": 16,
           "target_modules": {"v_proj", "q_proj", "down_proj"}, "bias": "none"}
    out = verl_lora.normalize_peft_config(cfg)
    assert out["peft_type"] == "LORA" and type(out["peft_type"]) is str
    assert out["task_type"] == "CAUSAL_LM" and type(out["task_type"]) is str
    assert out["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert cfg["target_modules"] == {"v_proj", "q_proj", "down_proj"}       # the caller's untouched
    assert verl_lora.normalize_peft_config(dict(cfg, target_modules="all-linear"))["target_modules"] == "all-linear"
    assert verl_lora.normalize_peft_config(SimpleNamespace(to_dict=lambda: {"peft_type": "LORA", "r": 2}))["r"] == 2
    with pytest.raises(ValueError, match="no 'peft_type'"):
        verl_lora.normalize_peft_config({"r": 8})
    with pytest.raises(TypeError, match="peft_config must be a LoraConfig dict"):
        verl_lora.normalize_peft_config([("r", 8)])
    # what SGLang would load and serve otherwise than the trainer computes is refused at the sync,
    # as the manager refuses it (lora2 audit: verl's path checked the rank/alpha patterns only)
    for bad, why in ((dict(cfg, bias="all"), "bias='all'"),
                     (dict(cfg, bias="lora_only"), "bias='lora_only'"),
                     (dict(cfg, target_modules=".*proj"), "regular expression"),
                     (dict(cfg, target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
                     (dict(cfg, target_modules=["q_proj", "lm_head"]), "lm_head"),
                     (dict(cfg, use_rslora=True), "use_rslora"),
                     (dict(cfg, rank_pattern={"q_proj": 4}), "rank_pattern")):
        with pytest.raises(ValueError, match=re.escape(why)):
            verl_lora.normalize_peft_config(bad)


@pytest.fixture(scope="module")
def tiny():
    return build_model(load_config("tiny"), seed=0).eval()


@pytest.fixture(scope="module")
def client(tiny):
    with ReferenceEngine(model_config=load_config("tiny"), tp_size=2) as eng:
        eng.update_weights_from_tensor(list(tiny.state_dict().items()))
        with EngineServer(eng) as srv:
            yield eng, SGLangEngine(base_url=f"http://{srv.host}:{srv.port}")


def test_adapter_swapped_in_as_verl_does_and_verified(client, tiny):
    eng, sg = client
    t1, cfg = make_adapter(tiny, r=4, alpha=8, seed=1)
    # what a peft model's config holds once "all-linear" is resolved (verl sends it): module paths,
    # read by their last part, as SGLang reads them
    paths = {n.removeprefix("base_model.model.").removesuffix(".lora_A.weight") for n in t1 if ".lora_A." in n}
    config = verl_lora.normalize_peft_config(dict(cfg, target_modules=paths))
    assert config["target_modules"] == sorted(paths) and "model.layers.0.self_attn.q_proj" in paths
    assert verl_lora.load_adapter(sg, list(t1.items()), config) == 2        # not listed: load only
    assert eng.lora_adapters[verl_lora.LORA_NAME]["target_modules"] == list(cfg["target_modules"])
    err, figures = verl_lora.check_adapter(sg, t1.items())
    assert err is None and figures["verify_tensors"] == len(t1)
    assert figures["digests"] == {n.removeprefix("base_model.model."): tensor_digest(
        n.removeprefix("base_model.model."), t) for n, t in t1.items()}
    first = eng.generate(PROMPTS, max_new_tokens=5, lora_path=verl_lora.LORA_NAME)
    t2, _ = make_adapter(tiny, r=4, alpha=8, seed=2)
    assert verl_lora.load_adapter(sg, list(t2.items()), config) == 3        # listed: unload, load
    assert verl_lora.check_adapter(sg, t2.items())[0] is None
    assert eng.generate(PROMPTS, max_new_tokens=5, lora_path=verl_lora.LORA_NAME) != first
    # what the engine holds is not what was sent: named, bit for bit
    spoiled = dict(t2)
    name = next(n for n in spoiled if ".lora_B." in n)
    spoiled[name] = spoiled[name].clone()
    spoiled[name].view(torch.int32)[0, 0] += 1      # one ulp
    err, _ = verl_lora.check_adapter(sg, spoiled.items())
    assert err.startswith(f"verify: adapter 'verl_actor_lora_name' tensor "
                          f"{name.removeprefix('base_model.model.')!r} in the engine differs"), err
    fewer = dict(t2)
    dropped = fewer.pop(name)
    err, _ = verl_lora.check_adapter(sg, fewer.items())
    assert "holds ['" in err and "that was not sent" in err, err
    err, _ = verl_lora.check_adapter(sg, [*t2.items(), (name.replace("layers.0", "layers.9"), dropped)])
    assert "has no 'model.layers.9" in err, err
    sg.unload_lora_adapter(verl_lora.LORA_NAME)
