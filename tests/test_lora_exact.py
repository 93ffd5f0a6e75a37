"""`SyncConfig(lora="adapter")` serves the trainer's model or refuses, never a near miss:

- a peft ``alpha_pattern`` / ``rank_pattern`` (which SGLang's LoRA ignores: one ``lora_alpha / r``
  per adapter) is refused by name, by the reference engine's config, by the manager before the
  base is sent, and on verl's path; a pattern that only repeats ``r`` / ``lora_alpha`` is served;
- a sync that sends the adapter alone refuses base parameters that still train, and is served
  again once the base is sent with it (``base_sync_done=False``) or frozen;
- ``verify`` at such a sync checks the base too: a base weight changed since it was sent fails it
  by name (before, it passed with the engine's logits 0.03-0.05 away from the trainer's).

One process, no process group (the manager's errors are its own), the disk method for the base,
one TP-2 reference engine for the module.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import FSDPShardingManager, SyncConfig
from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.engines.reference.lora import LoRAConfig
from fsdp_sync.models import build_model, load_config
from fsdp_sync.topology import SyncError

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
CFG = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
       "bias": "none", "use_dora": False, "use_rslora": False}


@pytest.fixture(scope="module")
def eng():
    with ReferenceEngine("tiny", tp_size=2, max_lora_rank=8) as e:
        yield e


def _model(alpha_q=None):
    """add_lora's peft-shaped model; ``alpha_q``: q_proj scaled by alpha_q / r and the config's
    alpha_pattern saying so, as peft builds a ``LoraConfig(alpha_pattern={"q_proj": alpha_q})``."""
    from fsdp_sync.cli.lora_model import LoRALinear, add_lora

    model = add_lora(build_model(load_config("tiny"), seed=0), r=8, alpha=16, seed=1)
    for n, p in model.named_parameters():          # frozen whatever add_lora does (the old one did not)
        p.requires_grad_(".lora_" in n)
    if alpha_q is not None:
        for n, mod in model.named_modules():
            if isinstance(mod, LoRALinear) and n.endswith("q_proj"):
                mod.scaling = alpha_q / 8
        model.peft_config["default"]["alpha_pattern"] = {"q_proj": alpha_q}
    return model


def _manager(model, eng, tmp_path, verify="full"):
    return FSDPShardingManager(model, eng, config=SyncConfig(
        method="disk", disk_dir=str(tmp_path), lora="adapter", lora_name="L", verify=verify))


@torch.no_grad()
def _diff(model, eng):
    want = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1].float() for p in PROMPTS])
    return float((eng.forward_logits(PROMPTS, lora_path="L").float() - want).abs().max())


def _drop(eng):
    if "L" in eng.lora_adapters:
        eng.unload_lora_adapter("L")


@pytest.mark.parametrize("key, pattern", [("alpha_pattern", {"q_proj": 64}),
                                          ("rank_pattern", {r"model\.layers\.0\..*q_proj": 16})])
def test_the_engine_refuses_patterns_it_would_ignore(key, pattern):
    with pytest.raises(ValueError, match=rf"{key}=.*is not served.*same r and lora_alpha"):
        LoRAConfig.from_dict(dict(CFG, **{key: pattern}))
    with pytest.raises(ValueError, match=f"{key} must be a dict"):
        LoRAConfig.from_dict(dict(CFG, **{key: ["q_proj"]}))
    # empty (peft's default) or only repeating the adapter's own value: the same adapter
    same = {"q_proj": CFG["r"] if key == "rank_pattern" else CFG["lora_alpha"]}
    for ok in ({}, None, same):
        assert LoRAConfig.from_dict(dict(CFG, **{key: ok})).scale == 2.0


def test_verl_path_refuses_patterns_sglang_would_ignore():
    from fsdp_sync.integrations import verl_lora

    with pytest.raises(ValueError, match=r"alpha_pattern=\{'q_proj': 64\}.*lora_alpha=16 elsewhere"):
        verl_lora.normalize_peft_config(dict(CFG, alpha_pattern={"q_proj": 64}))
    with pytest.raises(ValueError, match=r"rank_pattern=\{'v_proj': 4\}"):
        verl_lora.normalize_peft_config(dict(CFG, rank_pattern={"v_proj": 4}, alpha_pattern={}))
    assert verl_lora.normalize_peft_config(dict(CFG, alpha_pattern={}, rank_pattern={}))["r"] == 8


def test_verl_path_sends_pefts_sets_as_json():
    """peft's LoraConfig.to_dict() holds target_modules and exclude_modules as sets (verl passes
    exclude_modules to peft). Before: only target_modules was made a list, and the JSON body of
    SGLang's load_lora_adapter raised TypeError after the old adapter's unload."""
    import json

    from fsdp_sync.integrations import verl_lora

    out = verl_lora.normalize_peft_config(dict(CFG, target_modules={"v_proj", "q_proj"},
                                               exclude_modules={"lm_head", "embed_tokens"}))
    assert json.loads(json.dumps(out)) == dict(CFG, target_modules=["q_proj", "v_proj"],
                                               exclude_modules=["embed_tokens", "lm_head"])


def test_alpha_pattern_is_refused_before_the_base_is_sent(eng, tmp_path):
    _drop(eng)
    version = eng.weight_version
    manager = _manager(_model(alpha_q=64), eng, tmp_path)
    try:
        with pytest.raises(SyncError, match=r"alpha_pattern=\{'q_proj': 64\}.*cannot be served exactly"):
            with manager:
                pass
        assert eng.weight_version == version and "L" not in eng.lora_adapters   # nothing sent
    finally:
        manager.close()
    # the control: the same adapter without the pattern serves the trainer's logits
    model = _model()
    manager = _manager(model, eng, tmp_path)
    try:
        with manager:
            assert _diff(model, eng) < 1e-5
    finally:
        manager.close()


def test_a_base_that_still_trains_is_refused_at_adapter_only_syncs(eng, tmp_path):
    _drop(eng)
    model = _model()
    norm = model.base_model.model.model.norm.weight
    norm.requires_grad_(True)                           # trained beside the adapter
    manager = _manager(model, eng, tmp_path, verify="off")
    try:
        with manager:                                   # the base goes with this one: served
            assert manager.stats.extra["base_bytes"] > 0 and _diff(model, eng) < 1e-5
        with torch.no_grad():
            norm.add_(0.05)
        before = eng.lora_tensors("L")
        with pytest.raises(SyncError, match=r"1 base parameter\(s\) still train \(requires_grad=True: "
                                            r"\['base_model\.model\.model\.norm\.weight'\]\).*base_sync_done=False"):
            with manager:
                pass
        after = eng.lora_tensors("L")
        assert sorted(after) == sorted(before) and all(torch.equal(after[k], before[k]) for k in before)
        manager.base_sync_done = False                  # sent with the base: served
        with manager:
            assert manager.stats.extra["base_bytes"] > 0 and _diff(model, eng) < 1e-5
        norm.requires_grad_(False)                      # frozen: the adapter alone again
        with manager:
            assert "base_bytes" not in manager.stats.extra and _diff(model, eng) < 1e-5
    finally:
        manager.close()


def test_verify_checks_the_base_at_adapter_only_syncs(eng, tmp_path):
    _drop(eng)
    model = _model()
    manager = _manager(model, eng, tmp_path)
    figures = []
    try:
        with manager:
            figures.append(dict(manager.stats.extra))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".lora_" in n:
                    p.add_(0.01)
        with manager:                                   # the adapter alone, the base still the same
            figures.append(dict(manager.stats.extra))
            assert _diff(model, eng) < 1e-5
        with torch.no_grad():                           # the base changed behind the manager's back
            model.base_model.model.model.layers[1].post_attention_layernorm.weight.add_(0.05)
        with pytest.raises(SyncError, match=r"verify='full' of the base weights.*"
                                            r"'model\.layers\.1\.post_attention_layernorm\.weight' "
                                            r"different from the trainer's.*base_sync_done=False"):
            with manager:
                pass
        manager.base_sync_done = False
        with manager:
            assert _diff(model, eng) < 1e-5
    finally:
        manager.close()
    # what was checked, said: the base (by the base sync's verify, then by the adapter sync's own)
    # and the adapter's 28 tensors
    first, adapter_only = figures
    assert first.get("base_verify_tensors", 0) > 0 and "base_bytes" not in adapter_only
    assert adapter_only.get("base_verify_tensors") == first["base_verify_tensors"]
    assert first.get("verify_tensors") == adapter_only.get("verify_tensors") == 2 * 7 * 2


def test_add_lora_freezes_the_base_as_peft_does():
    from fsdp_sync.cli.lora_model import add_lora
    from fsdp_sync.weights.peft_names import trainable_base

    model = add_lora(build_model(load_config("tiny"), seed=0), r=4, alpha=8)
    assert trainable_base(model.named_parameters()) == []
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)


# peft options that change what the trained model computes, which SGLang's LoRA does not apply
# (rsLoRA: alpha / sqrt(r) against SGLang's alpha / r; DoRA; LoRA biases; trained copies of whole
# modules; ...): refused by name by the engine's config, on verl's path, and by the manager before
# the base is sent (before, the reference engine refused the adapter only after the base had gone,
# and an SGLang engine served rsLoRA's adapter at another scaling without a word)
UNSERVED_CASES = [("use_rslora", True), ("use_dora", True), ("lora_bias", True),
                  ("modules_to_save", ["lm_head"]), ("trainable_token_indices", [5, 6]),
                  ("target_parameters", ["mlp.experts.gate_up_proj"]),
                  ("layer_replication", [[0, 2], [1, 2]]), ("use_qalora", True),
                  ("alora_invocation_tokens", [7, 8]), ("kasa_config", {"beta": 1e-4, "gamma": 1e-3}),
                  ("monteclora_config", {"num_samples": 8}), ("use_bdlora", {"nblocks": 2})]


@pytest.mark.parametrize("key, value", UNSERVED_CASES)
def test_options_the_engines_do_not_apply_are_refused(key, value):
    from fsdp_sync.integrations import verl_lora

    pattern = rf"{key}={value!r}".replace("[", r"\[").replace("]", r"\]") + ".*cannot be served exactly"
    with pytest.raises(ValueError, match=pattern):
        LoRAConfig.from_dict(dict(CFG, **{key: value}))
    with pytest.raises(ValueError, match=pattern):
        verl_lora.normalize_peft_config(dict(CFG, **{key: value}))
    # peft's defaults for them (False, None, empty) are plain LoRA
    for off in (False, None, [], {}):
        assert LoRAConfig.from_dict(dict(CFG, **{key: off})).scale == 2.0
        assert verl_lora.normalize_peft_config(dict(CFG, **{key: off}))["r"] == 8


def _config(key, value):
    def edit(model, eng, monkeypatch):
        model.peft_config["default"][key] = value
    return edit


def _lora_param(module_path, kind, shape):
    """A LoRA parameter peft keeps in a ParameterDict (``<module>.<kind>.default``) that the engines
    do not apply: KaSA's ``lora_diag`` on q_proj (its config key left out, as a variant this list
    does not know would be), ``lora_embedding_A`` on embed_tokens."""
    def edit(model, eng, monkeypatch):
        mod = model.get_submodule(module_path)
        setattr(mod, kind, torch.nn.ParameterDict({"default": torch.nn.Parameter(torch.ones(shape))}))
    return edit


def _max_rank(model, eng, monkeypatch):
    monkeypatch.setattr(eng, "max_lora_rank", 4)        # the adapter's r is 8


# Each is refused before anything is sent (before, all but rsLoRA were refused by the reference
# engine only after the base had gone, and lora_diag was dropped: served as plain LoRA, "verified")
BEFORE_THE_BASE = {
    "rslora": (_config("use_rslora", True), r"use_rslora=True cannot be served exactly: rsLoRA scales "
                                            r"by lora_alpha / sqrt\(r\)"),
    "bias_all": (_config("bias", "all"), r"bias='all' cannot be served exactly"),
    "bias_lora_only": (_config("bias", "lora_only"), r"bias='lora_only' cannot be served exactly"),
    "lm_head": (_config("target_modules", ["q_proj", "v_proj", "lm_head"]),
                r"target_modules include \['lm_head'\]: LoRA on embeddings and lm_head is not served"),
    "regex": (_config("target_modules", r".*\.(q_proj|v_proj)"), r"is a regular expression"),
    "kasa_config": (_config("kasa_config", {"beta": 1e-4}), r"kasa_config=.*cannot be served exactly"),
    "lora_diag": (_lora_param("base_model.model.model.layers.0.self_attn.q_proj", "lora_diag", 8),
                  r"model.layers.0.self_attn.q_proj.lora_diag.default' \(lora_diag\) is neither "
                  r"lora_A nor lora_B"),
    "embedding": (_lora_param("base_model.model.model.embed_tokens", "lora_embedding_A", (8, 16)),
                  r"model.embed_tokens.lora_embedding_A.default' is LoRA on 'embed_tokens'"),
    "max_lora_rank": (_max_rank, r"replica 0: adapter 'L': the engine would refuse it: its rank r=8 "
                                 r"exceeds the engine's max_lora_rank 4; nothing was sent"),
}


@pytest.mark.parametrize("case", list(BEFORE_THE_BASE))
def test_unservable_adapters_are_refused_before_the_base_is_sent(eng, tmp_path, monkeypatch, case):
    _drop(eng)
    version = eng.weight_version
    model = _model()
    edit, message = BEFORE_THE_BASE[case]
    edit(model, eng, monkeypatch)
    manager = _manager(model, eng, tmp_path)
    try:
        with pytest.raises(SyncError, match=message):
            with manager:
                pass
        assert eng.weight_version == version and "L" not in eng.lora_adapters   # nothing sent
        assert not manager.base_sync_done
    finally:
        manager.close()


def test_parameter_dict_names_keep_their_adapter():
    """A LoRA tensor peft keeps in a ParameterDict ends in its adapter's name: `adapter_of` reads it
    (before: None, so the export dropped it without a word) and `peft_name` drops it as peft's
    saved names do (before: ``...lora_embedding_A.default`` was sent so)."""
    from fsdp_sync.lora_sync import peft_name
    from fsdp_sync.weights.peft_names import adapter_of

    assert adapter_of("model.layers.0.self_attn.q_proj.lora_diag.default") == "default"
    assert adapter_of("model.embed_tokens.lora_embedding_A.actor") == "actor"
    assert adapter_of("model.layers.0.self_attn.q_proj.lora_A.weight") is None       # no adapter level
    assert adapter_of("model.layers.0.self_attn.q_proj.lora_A.actor.weight") == "actor"
    assert peft_name("model.embed_tokens.lora_embedding_A.default") == \
        "base_model.model.model.embed_tokens.lora_embedding_A"
    assert peft_name("model.layers.0.self_attn.q_proj.lora_A.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_an_adapter_on_some_layers_only_is_served_exactly(eng, tmp_path):
    """peft's ``layers_to_transform`` / ``exclude_modules`` leave some layers without tensors: the
    engine serves those layers without LoRA (SGLang's memory pool zero-fills them), as trained."""
    from fsdp_sync.cli.lora_model import LoRALinear

    _drop(eng)
    model = _model()
    for layer in model.base_model.model.model.layers[1:]:
        for parent in (layer.self_attn, layer.mlp):
            for n, child in list(parent.named_children()):
                if isinstance(child, LoRALinear):
                    setattr(parent, n, child.base_layer)
    with torch.no_grad():                               # B nonzero: the adapter moves the logits
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.5)
    model.peft_config["default"].update(layers_to_transform=[0], layers_pattern="layers")
    manager = _manager(model, eng, tmp_path)
    try:
        with manager:
            assert _diff(model, eng) < 1e-5
            assert sorted({k.split(".")[2] for k in eng.lora_tensors("L")}) == ["0"]
    finally:
        manager.close()
