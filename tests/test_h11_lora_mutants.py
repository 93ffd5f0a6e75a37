"""Checks of `lora_sync` that no test held (H11's mutation pass: each test below fails with the
check taken out), in process and cheap:

- `adapter_config` refuses a config whose ``r`` is not the rank of the module's LoRA tensors (the
  engine would scale by ``lora_alpha / r`` of the config: another model than the trainer's);
- `check_engine` refuses an adapter of another rank than the one the engine serves under that
  name (its LoRA memory is sized for that rank), naming both;
- `verify_adapter` fails where the engine holds an adapter tensor the trainer does not (a module
  the engine applies LoRA to that the trainer's adapter has none on).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fsdp_sync import lora_sync

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def model():
    """peft's layout of a rank-4 adapter "default" on q_proj and v_proj (no transformers needed)."""
    def lora(r=4, d=16):
        m = torch.nn.Linear(d, d, bias=False)
        m.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(d, r, bias=False)})
        m.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(r, d, bias=False)})
        return m
    attn = torch.nn.Module()
    attn.q_proj, attn.v_proj = lora(), lora()
    layer = torch.nn.Module()
    layer.self_attn = attn
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([layer])
    return root


def test_a_config_whose_rank_is_not_the_tensors_is_refused(model):
    targets = sorted({n.split(".lora_")[0].split(".")[-1] for n, _ in model.named_parameters() if ".lora_" in n})
    good = {"r": 4, "lora_alpha": 8, "target_modules": targets}
    assert lora_sync.adapter_config(model, good)["r"] == 4
    with pytest.raises(ValueError, match=r"the adapter config says r=8 but the module's LoRA tensors "
                                         r"have rank \[4\]"):
        lora_sync.adapter_config(model, dict(good, r=8, lora_alpha=16))


def test_an_adapter_of_another_rank_than_the_one_served_is_refused():
    load = lambda *a, **k: None   # noqa: E731
    held = SimpleNamespace(load_lora_adapter_from_tensors=load, weight_version="3",
                           lora_adapters={"a": {"r": 4, "target_modules": ["q_proj", "v_proj"]}})
    cfg = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    assert lora_sync.check_engine(held, cfg, "a", "3") == (
        "adapter 'a': r=8 but the engine serves it with r=4 (its LoRA memory is sized for that "
        "rank); the engine keeps its adapter; to serve this one under 'a', unload the engine's "
        "first (engine.unload_lora_adapter('a')), or sync it under another SyncConfig.lora_name")
    assert lora_sync.check_engine(held, dict(cfg, r=4), "a", "3") is None


def test_verify_fails_on_a_tensor_the_engine_holds_and_the_trainer_does_not():
    a = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    sent = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": a}
    held = {"model.layers.0.self_attn.q_proj.lora_A.weight": a.clone()}
    engine = SimpleNamespace(lora_tensors=lambda name: dict(held))
    assert lora_sync.verify_adapter(engine, "L", sent) is None
    held["model.layers.0.self_attn.o_proj.lora_A.weight"] = a.clone()
    assert lora_sync.verify_adapter(engine, "L", sent) == (
        "verify: the engine's adapter 'L' holds ['model.layers.0.self_attn.o_proj.lora_A.weight'] "
        "that the trainer does not")


def test_the_kept_copy_follows_the_last_adapter_loaded_tensors_and_config():
    """`AdapterCopy` is what a failed sync puts back: the last adapter loaded, its tensors (copied
    in place while names and shapes stay) and its config (a changed lora_alpha is another scaling)."""
    from fsdp_sync.weights.adapter_export import AdapterCopy

    t = {"x.lora_A.weight": torch.ones(2, 4)}
    copy = AdapterCopy()
    copy.keep(t, {"r": 2, "lora_alpha": 4})
    kept = copy.tensors["x.lora_A.weight"]
    t["x.lora_A.weight"].mul_(3)                 # the export's buffer is rewritten by the next sync
    assert torch.equal(kept, torch.ones(2, 4))
    copy.keep(t, {"r": 2, "lora_alpha": 8})
    assert copy.tensors["x.lora_A.weight"] is kept and torch.equal(kept, torch.full((2, 4), 3.0))
    assert copy.cfg == {"r": 2, "lora_alpha": 8}


def test_an_fsdp1_flat_parameter_counts_by_the_names_it_holds():
    """FSDP1 without use_orig_params: one FlatParameter (one requires_grad) per wrapped module; one
    holding only LoRA tensors is no trainable base parameter (read as its own name, an adapter-only
    sync was refused for "base parameters that still train"), one holding base tensors is."""
    from fsdp_sync.weights.peft_names import trainable_base

    flat = SimpleNamespace(requires_grad=True, _fqns=["self_attn.q_proj.lora_A.default.weight",
                                                      "self_attn.q_proj.lora_B.default.weight"])
    assert trainable_base([("model.layers.0._flat_param", flat)]) == []
    flat._fqns.append("self_attn.q_proj.base_layer.weight")
    assert trainable_base([("model.layers.0._flat_param", flat)]) == \
        ["model.layers.0.self_attn.q_proj.base_layer.weight"]


def test_embeddings_named_by_their_path_among_the_targets_are_refused():
    """peft matches target_modules by suffix, so 'model.embed_tokens' targets the embeddings as
    'embed_tokens' does (served by neither engine): refused by name either way."""
    from fsdp_sync.weights.peft_names import config_refusal

    for tm in (["q_proj", "embed_tokens"], ["q_proj", "model.embed_tokens"], ["lm_head", "v_proj"]):
        why = config_refusal({"r": 4, "lora_alpha": 8, "target_modules": tm})
        bad = sorted(m for m in tm if m.split(".")[-1] in ("embed_tokens", "lm_head"))
        assert why is not None and f"target_modules include {bad}" in why, (tm, why)
    assert config_refusal({"r": 4, "lora_alpha": 8, "target_modules": ["model.layers.0.self_attn.q_proj"]}) is None


def test_the_reference_engines_rank_bound_is_exact():
    """``max_lora_rank`` (SGLang's --max-lora-rank) admits r up to it and refuses r one over,
    naming both (an off-by-one let r = max + 1 through)."""
    from fsdp_sync.engines.reference.lora_calls import LoRACalls

    eng = LoRACalls()
    eng.max_lora_rank = 8
    cfg = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "peft_type": "LORA"}
    assert eng.lora_refusal(cfg) is None
    assert eng.lora_refusal(dict(cfg, r=9)) == "its rank r=9 exceeds the engine's max_lora_rank 8"
