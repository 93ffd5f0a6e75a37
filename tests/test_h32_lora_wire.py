"""The adapter's config as it goes to an engine that takes it over HTTP (`SGLangEngine`'s
``/load_lora_adapter_from_tensors``: a JSON body, ``json.dumps`` in `engines.sglang.client`): peft's
``LoraConfig.to_dict()`` holds ``target_modules`` and ``exclude_modules`` as sets (verl passes
``exclude_modules`` to peft). `lora_sync.adapter_config` made lists of ``target_modules`` only, so
an adapter with ``exclude_modules`` could not be loaded at all: the JSON body failed (TypeError)
after SGLang's old adapter was unloaded, and putting it back failed the same way (the replica then
served no adapter). Here an SGLang-like engine (the reference engine seen without its staged swap:
``/v1/models`` says what it holds, unload, then load) serializes the config as the HTTP client
does; two syncs under one name: the second replaces the first (unloaded first, one adapter live),
bit for bit, the config carried as given (r, lora_alpha, sorted target_modules).
"""

from __future__ import annotations

import json

import pytest
import torch

from test_lora_sync import PROMPTS, _peft_adapters

pytestmark = pytest.mark.timeout(120)


class JSONWire:
    """``engine`` as SGLang over HTTP: no staged replace, its load's config a JSON body."""

    def __init__(self, engine):
        self._engine, self.sent, self.unloads = engine, [], 0

    def __getattr__(self, name):
        if name in ("lora_adapters", "lora_load_formats"):
            raise AttributeError(name)
        return getattr(self._engine, name)

    def available_models(self):
        return {"object": "list", "data": [{"id": n} for n in self._engine.lora_adapters]}

    def unload_lora_adapter(self, name):
        self.unloads += 1
        return self._engine.unload_lora_adapter(name)

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, **kw):
        self.sent.append(json.loads(json.dumps({"lora_name": lora_name, "config_dict": config_dict})))
        return self._engine.load_lora_adapter_from_tensors(lora_name, tensors, config_dict, **kw)


def test_a_peft_config_with_sets_goes_as_json_and_a_reload_replaces_the_adapter(tmp_path):
    from fsdp_sync.cli.lora_model import ALL_LINEAR
    from fsdp_sync.cli.trainer import last_logits
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager

    torch.set_num_threads(1)
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": set(ALL_LINEAR),
           "exclude_modules": {"lm_head", "embed_tokens"}}
    pm = _peft_adapters({"default": (4, 8)}, ["default"], configs={"default": cfg})
    with ReferenceEngine("tiny", tp_size=1, max_lora_rank=8, dtype=torch.float32) as eng:
        wire = JSONWire(eng)
        manager = FSDPShardingManager(pm, wire, config=SyncConfig(
            method="disk", disk_dir=str(tmp_path), lora="adapter", lora_name="L", verify="full",
            dtype=torch.float32))
        try:
            for step in range(2):
                if step:
                    with torch.no_grad():
                        for n, p in pm.named_parameters():
                            if ".lora_B." in n:
                                p.add_(0.01 * (step + 1))
                with manager, torch.no_grad():
                    diff = float((eng.forward_logits(PROMPTS, lora_path="L").float()
                                  - last_logits(pm, PROMPTS)).abs().max())
                assert diff < 1e-5, (step, diff)
                assert list(eng.lora_adapters) == ["L"] and wire.unloads == step
        finally:
            manager.close()
    got = wire.sent[-1]["config_dict"]
    assert got["exclude_modules"] == ["embed_tokens", "lm_head"]
    assert got["target_modules"] == sorted(ALL_LINEAR)
    assert (got["r"], got["lora_alpha"], got["peft_type"]) == (4, 8, "LORA")


class SGLangKeys(JSONWire):
    """JSONWire reading the config as SGLang 0.5.23's ``LoRAConfig`` does (``hf_config[...]``)."""

    def load_lora_adapter_from_tensors(self, lora_name, tensors, config_dict, **kw):
        for key in ("target_modules", "r", "lora_alpha"):
            config_dict[key]      # KeyError, as SGLang raises it
        return super().load_lora_adapter_from_tensors(lora_name, tensors, config_dict, **kw)


def test_a_config_without_lora_alpha_gets_pefts_default_and_one_without_targets_is_refused(tmp_path):
    """peft's default lora_alpha (8, what the reference engine applies) goes with the config, so
    SGLang (which reads the key: KeyError after the unload, before) serves the trainer's scaling;
    a config without target_modules is refused by name before anything is sent."""
    from fsdp_sync.cli.trainer import last_logits
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.topology import SyncError

    torch.set_num_threads(1)
    with ReferenceEngine("tiny", tp_size=1, max_lora_rank=8, dtype=torch.float32) as eng:
        for n, given in enumerate(({"r": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"]},
                                   {"r": 4, "lora_alpha": 8})):
            pm = _peft_adapters({"default": (4, 8)}, ["default"], configs={"default": given}, seed=n)
            wire = SGLangKeys(eng)
            manager = FSDPShardingManager(pm, wire, config=SyncConfig(
                method="disk", disk_dir=str(tmp_path / str(n)), lora="adapter", lora_name="L",
                verify="full", dtype=torch.float32))
            try:
                if n == 0:
                    with manager, torch.no_grad():
                        diff = float((eng.forward_logits(PROMPTS, lora_path="L").float()
                                      - last_logits(pm, PROMPTS)).abs().max())
                    assert diff < 1e-5 and wire.sent[-1]["config_dict"]["lora_alpha"] == 8
                    base = eng.forward_logits(PROMPTS)
                else:
                    with pytest.raises(SyncError, match=r"has no target_modules"):
                        with manager:
                            pass
                    assert wire.sent == [] and torch.equal(eng.forward_logits(PROMPTS), base)
            finally:
                manager.close()
