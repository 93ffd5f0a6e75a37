"""A peft-shaped LoRA model without peft: the demo's and bench's ``--lora`` trainer (peft is not a
dependency of fsdp_sync).

`add_lora(model, r, alpha, targets)` replaces each targeted ``nn.Linear`` of a decoder with a
`LoRALinear` holding it as ``base_layer`` plus ``lora_A`` / ``lora_B`` ``ModuleDict``s keyed by
the adapter name (``"default"``), and wraps the model as ``base_model.model`` with a
``peft_config`` dict, so every state-dict name is the one a ``peft.get_peft_model`` model has
(``base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight``,
``...q_proj.lora_A.default.weight``) and the forward is peft's: ``base_layer(x) + lora_B(lora_A(x))
* lora_alpha / r`` (no dropout); only the adapter trains (the base's ``requires_grad`` off, as
peft sets it). lora_B starts random (peft starts it at zero, which would make
the first adapter a no-op and a sync check blind).

Not here: syncing it (`fsdp_sync.lora_sync`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..plan_lora import ALL_LINEAR, lora_linears

__all__ = ["LoRALinear", "PeftLike", "add_lora", "ALL_LINEAR"]



class LoRALinear(nn.Module):
    """peft's ``lora.Linear`` in its names and math (one adapter, no dropout)."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base_layer = base
        a = nn.Linear(base.in_features, r, bias=False)
        b = nn.Linear(r, base.out_features, bias=False)
        with torch.no_grad():
            a.weight.copy_(torch.randn(a.weight.shape, generator=generator) * 0.05)
            b.weight.copy_(torch.randn(b.weight.shape, generator=generator) * 0.05)
        self.lora_A = nn.ModuleDict({"default": a.to(base.weight.dtype)})
        self.lora_B = nn.ModuleDict({"default": b.to(base.weight.dtype)})
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x)) * self.scaling


class _Inner(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model


class PeftLike(nn.Module):
    """``base_model.model`` around a transformers model, with peft's ``peft_config``."""

    def __init__(self, model: nn.Module, peft_config: dict):
        super().__init__()
        self.base_model = _Inner(model)
        self.peft_config = {"default": peft_config}

    @property
    def config(self) -> Any:
        return self.base_model.model.config

    @property
    def model(self) -> nn.Module:      # the decoder stack, as wrap_fsdp looks for model.layers
        return self.base_model.model.model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.base_model.model(*args, **kwargs)


def add_lora(model: nn.Module, r: int, alpha: float, targets: Sequence[str] = ALL_LINEAR,
             seed: int = 0) -> PeftLike:
    """``model`` with a LoRA adapter on ``targets`` of every decoder layer (see the module docstring)."""
    if r < 1:
        raise ValueError(f"--lora-r must be >= 1, got {r}")
    g = torch.Generator().manual_seed(seed)
    model.requires_grad_(False)       # the base frozen, as peft's get_peft_model leaves it
    for _, parent, name, child in lora_linears(model, targets):    # the modules `plan --lora-r` counts
        setattr(parent, name, LoRALinear(child, r, alpha, g))
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
           "bias": "none", "lora_dropout": 0.0, "use_dora": False, "use_rslora": False}
    return PeftLike(model, cfg)
