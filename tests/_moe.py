"""transformers 4's MoE layout for the tests: per-expert modules under the Hub's names.

transformers 5 (installed here) holds a layer's routed experts fused (``experts.gate_up_proj``
``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``); transformers 4 held one module per expert
(``experts.{e}.gate_proj`` ...: the Hub names). `per_expert(model)` swaps every fused experts module
for a `PerExpert` holding the same weights as separate ``nn.Linear``s, with the same forward, so a
test trains and exports the layout a transformers-4 trainer has. Kept free of pytest: spawned
ranks import it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Expert(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_proj = nn.Linear(gate.shape[1], gate.shape[0], bias=False)
        self.up_proj = nn.Linear(up.shape[1], up.shape[0], bias=False)
        self.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate)
            self.up_proj.weight.copy_(up)
            self.down_proj.weight.copy_(down)


class PerExpert(nn.ModuleList):
    """transformers 4's experts: ``experts.{e}.gate_proj/up_proj/down_proj``, the fused module's
    forward (``(hidden, top_k_index, top_k_weights) -> hidden``)."""

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        out = torch.zeros_like(hidden)
        for e, ex in enumerate(self):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel():
                x = hidden[tok]
                y = ex.down_proj(F.silu(ex.gate_proj(x)) * ex.up_proj(x)) * top_k_weights[tok, pos, None]
                out.index_add_(0, tok, y.to(out.dtype))
        return out


def per_expert(model: nn.Module) -> nn.Module:
    """``model`` with every fused experts module replaced by a `PerExpert` of the same weights."""
    for layer in model.model.layers:
        fused = getattr(getattr(layer, "mlp", None), "experts", None)
        if fused is None or not hasattr(fused, "gate_up_proj"):
            continue
        inter = fused.gate_up_proj.shape[1] // 2
        layer.mlp.experts = PerExpert(
            _Expert(fused.gate_up_proj[e, :inter], fused.gate_up_proj[e, inter:], fused.down_proj[e])
            for e in range(fused.gate_up_proj.shape[0]))
    return model
