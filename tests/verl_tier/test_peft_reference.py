"""The reference engine's LoRA against peft itself (issue 38 item 2): the verl venv has peft (verl's
LoRA path uses it), the default tier has not, so `tests/test_lora_engine.py` checks against the
merge peft computes and this file against a real ``peft.get_peft_model`` model.

A tiny Qwen2 model gets a LoRA adapter from peft (r 8, alpha 16, every linear layer of each
block, B made nonzero: peft initialises B to zeros), then peft writes it with
``save_pretrained``. The engine loads that directory as it stands (the files peft writes, not
ours) and the same tensors through ``load_lora_adapter_from_tensors``; at TP 1 and 2 its
last-position logits are within 1e-5 of the peft model's (float32) and its greedy tokens equal
``peft_model.generate``'s, while the base rows still give the model without the adapter.
"""

from __future__ import annotations

import json

import pytest
import torch

from fsdp_sync.engines import ReferenceEngine
from fsdp_sync.models import build_model, load_config

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7], [300, 301, 302, 5, 6, 7, 8]]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 12


@torch.no_grad()
def _last_logits(model, prompts) -> torch.Tensor:
    return torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1].float() for p in prompts])


@torch.no_grad()
def _greedy(model, prompts) -> list[list[int]]:
    return [model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


@pytest.fixture(scope="module")
def peft_run(tmp_path_factory):
    import peft

    cfg = load_config("tiny")
    base = build_model(cfg, seed=0).eval()
    base_state = {k: v.detach().clone() for k, v in base.state_dict().items()}
    base_logits = _last_logits(base, PROMPTS)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                                   lora_dropout=0.0, bias="none"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pm.eval()
    out = tmp_path_factory.mktemp("peft_adapter")
    pm.save_pretrained(str(out))
    tensors = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(pm).items()}
    return {"cfg": cfg, "base_state": base_state, "base_logits": base_logits, "dir": out,
            "tensors": tensors, "config": json.loads((out / "adapter_config.json").read_text()),
            "logits": _last_logits(pm, PROMPTS), "tokens": _greedy(pm, PROMPTS)}


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_lora_equals_peft(peft_run, tp):
    r = peft_run
    # the adapter moves the logits: the comparison below could not pass with the base alone
    assert (r["logits"] - r["base_logits"]).abs().max() > 1e-2
    with ReferenceEngine(model_config=r["cfg"], tp_size=tp, dtype=torch.float32, max_lora_rank=8) as eng:
        eng.update_weights_from_tensor(list(r["base_state"].items()))
        eng.load_lora_adapter("from_dir", str(r["dir"]))               # peft's own files
        eng.load_lora_adapter_from_tensors("from_tensors", r["tensors"], r["config"])
        for name in ("from_dir", "from_tensors"):
            diff = (eng.forward_logits(PROMPTS, lora_path=name).float() - r["logits"]).abs().max()
            assert diff <= 1e-5, (name, tp, float(diff))
            got = eng.generate(input_ids=PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.0,
                               ignore_eos=True, lora_path=name)
            assert got == r["tokens"], (name, tp)
        base_diff = (eng.forward_logits(PROMPTS).float() - r["base_logits"]).abs().max()
        assert base_diff <= 1e-5, float(base_diff)


def _peft_model(adapter_name, seed, r=4, alpha=8):
    """A tiny model with a peft adapter ``adapter_name`` of rank ``r``, B made nonzero."""
    import peft

    pm = peft.get_peft_model(build_model(load_config("tiny"), seed=0), _lora(r, alpha), adapter_name=adapter_name)
    _randomize(pm, adapter_name, seed)
    return pm


def _lora(r, alpha):
    import peft

    return peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0, bias="none")


def _randomize(pm, adapter_name, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if f".lora_B.{adapter_name}." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_manager_syncs_the_active_peft_adapter(tmp_path):
    """`SyncConfig(lora="adapter")` of a real peft model holding two adapters (``add_adapter``,
    "default" active, then "second" by ``set_adapter``) and of one named "actor": the engine's
    logits with the adapter equal peft's merged model's (``merge_and_unload`` of the active one),
    and the sync sends that adapter alone (28 tensors of its rank). Before: the 56 tensors of both
    collided under peft's names, the engine served "second"'s under "default"'s config (0.66 away,
    verify passing), or refused for want of a config ("actor", after sending the base). Both
    active at once (``base_model.set_adapter([...])``) is refused before anything is sent."""
    import copy

    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.topology import SyncError

    torch.set_num_threads(1)
    two = _peft_model("default", 1)
    two.add_adapter("second", _lora(8, 16))
    _randomize(two, "second", 2)
    dirs = iter(range(10))
    with ReferenceEngine("tiny", tp_size=1, max_lora_rank=8, dtype=torch.float32) as eng:
        for pm, active, r in ((two, "default", 4), (two, "second", 8), (_peft_model("actor", 3), "actor", 4)):
            pm.set_adapter(active)
            pm.eval()
            merged = _last_logits(copy.deepcopy(pm).merge_and_unload(), PROMPTS)
            with pm.disable_adapter():      # the adapter moves the logits: the check below has teeth
                assert (merged - _last_logits(pm, PROMPTS)).abs().max() > 1e-2
            if "L" in eng.lora_adapters:
                eng.unload_lora_adapter("L")
            manager = FSDPShardingManager(pm, eng, config=SyncConfig(
                method="disk", disk_dir=str(tmp_path / str(next(dirs))), lora="adapter",
                lora_name="L", verify="full", dtype=torch.float32))
            try:
                with manager:
                    diff = (eng.forward_logits(PROMPTS, lora_path="L").float() - merged).abs().max()
                    assert diff <= 1e-5, (active, float(diff))
                    assert manager.stats.tensors == 28 and manager.stats.extra["r"] == r, manager.stats
            finally:
                manager.close()
        two.base_model.set_adapter(["default", "second"])      # both active: peft sums them
        manager = FSDPShardingManager(two, eng, config=SyncConfig(
            method="disk", disk_dir=str(tmp_path / "both"), lora="adapter", lora_name="L2"))
        try:
            with pytest.raises(SyncError, match=r"active adapters are \['default', 'second'\]"):
                with manager:
                    pass
        finally:
            manager.close()
        assert not list((tmp_path / "both").glob("step_*")) and "L2" not in eng.lora_adapters   # nothing sent
