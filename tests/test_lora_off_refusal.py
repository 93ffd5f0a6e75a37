"""A module holding peft's LoRA tensors under ``SyncConfig.lora="off"`` is refused (a full sync
would leave the adapter out), and the refusal says which merge passes: peft's ``merge_adapter()``
(verl's merge / unmerge pattern) keeps the ``lora_A`` / ``lora_B`` tensors and is refused again;
``merge_and_unload()`` drops them (H87: the text said only "merge the adapter into the weights")."""

from __future__ import annotations

import pytest
import torch

from fsdp_sync import SyncConfig
from fsdp_sync.lora_sync import check_mode


class _Lora(torch.nn.Module):       # peft's names: base_layer, lora_A.<adapter>, lora_B.<adapter>
    def __init__(self):
        super().__init__()
        self.base_layer = torch.nn.Linear(4, 4)
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(4, 2, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(2, 4, bias=False)})


def test_lora_tensors_under_lora_off_are_refused_naming_the_merge_that_drops_them():
    module = torch.nn.Sequential(_Lora())
    with pytest.raises(ValueError) as info:
        check_mode(module, SyncConfig(lora="off"))
    msg = str(info.value)
    assert "SyncConfig(lora='adapter')" in msg and "merge_and_unload()" in msg, msg
    check_mode(module, SyncConfig(lora="adapter"))                      # taken
    check_mode(torch.nn.Sequential(torch.nn.Linear(4, 4)), SyncConfig(lora="off"))   # no LoRA: taken
