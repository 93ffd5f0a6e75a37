"""Hub names for MoE experts: transformers 5's fused expert tensors -> the checkpoint's per-expert ones.

transformers 5 holds a layer's routed experts as two 3-D parameters, ``mlp.experts.gate_up_proj``
``[E, 2 * I, H]`` (each expert's gate rows, then its up rows) and ``mlp.experts.down_proj``
``[E, H, I]``, and renames Mixtral's ``block_sparse_moe`` to ``mlp``. The Hub checkpoint, SGLang's
loader (``FusedMoE.make_expert_params_mapping``) and the layout map all name experts one by one:
``mlp.experts.{e}.gate_proj.weight`` ... for Qwen2/Qwen3-MoE, ``block_sparse_moe.experts.{e}.w1.weight``
(gate), ``w3`` (up), ``w2`` (down) and ``block_sparse_moe.gate.weight`` for Mixtral (transformers'
own ``conversion_mapping`` does the reverse when it loads such a checkpoint).

`hub_parts(name, shape, model_type)` says how one exported tensor maps to Hub tensors: ``None``
when it keeps its name, else ``[(hub_name, shape, flat_offset), ...]``: contiguous ranges of the
fused tensor's flattened form, one per expert and projection, so an exporter can cut a sharded
fused tensor expert by expert (each range is a contiguous piece of each rank's shard) without ever
gathering the fused tensor. transformers 4's per-expert modules already carry Hub names and pass
through unchanged.

Only the families whose fused layout is known are split (`SPLIT_FAMILIES`): another family's
fused tensor (some interleave gate and up rows) keeps its own name, and an engine that does not
know that name refuses it, rather than loading a wrong split.

Not here: the gathering (`export`, `gather`) or the engine-side layout (`layout`).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SPLIT_FAMILIES", "hub_parts", "model_type_of", "hub_views", "fused_hint"]

SPLIT_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
"""Model types whose transformers-5 fused experts are ``cat([gate, up], dim=1)`` per expert."""


def fused_hint(name: str, model_type: str | None) -> str:
    """What to add to an engine's "unknown parameter" error for ``name``: transformers 5's own
    fused-experts name (or Mixtral's renamed router) says so, and what to send instead; anything
    else, nothing."""
    if model_type not in SPLIT_FAMILIES:
        return ""
    fused = name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))
    if not fused and not (model_type == "mixtral" and name.endswith(".mlp.gate.weight")):
        return ""
    return ("; it is the installed transformers' own name (a state_dict() of transformers 5, which "
            "holds a layer's experts fused and names Mixtral's block_sparse_moe 'mlp'): send the "
            "checkpoint's per-expert names, as fsdp_sync.weights.export.iter_params(model) gives "
            "them (the manager does this itself)")


def model_type_of(module: Any) -> str | None:
    """The ``config.model_type`` of the first submodule carrying a Hugging Face config (the model
    itself, or the module inside an FSDP1 wrapper), or None."""
    for m in module.modules():
        mt = getattr(getattr(m, "config", None), "model_type", None)
        if isinstance(mt, str):
            return mt
    return None


def hub_parts(name: str, shape: tuple[int, ...], model_type: str | None
              ) -> list[tuple[str, tuple[int, ...], int]] | None:
    """How exported tensor ``name`` of ``shape`` maps to Hub names (see the module docstring)."""
    if model_type not in SPLIT_FAMILIES:
        return None
    mixtral = model_type == "mixtral"
    if mixtral and name.endswith(".mlp.gate.weight"):
        return [(name.removesuffix("mlp.gate.weight") + "block_sparse_moe.gate.weight", tuple(shape), 0)]
    for fused in ("gate_up_proj", "down_proj"):
        if name.endswith(f".experts.{fused}") and len(shape) == 3:
            break
    else:
        return None
    base = name.removesuffix(fused)            # "model.layers.3.mlp.experts."
    if mixtral:
        base = base.replace(".mlp.experts.", ".block_sparse_moe.experts.")
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    E, A, B = shape
    per = A * B
    if fused == "down_proj":
        return [(f"{base}{e}.{down}.weight", (A, B), e * per) for e in range(E)]
    if A % 2:
        raise ValueError(f"{name!r}: a fused gate_up_proj of shape {tuple(shape)} has an odd row "
                         f"count; expected [experts, 2 * intermediate, hidden]")
    half = (A // 2, B)
    n = math.prod(half)
    out = []
    for e in range(E):
        out.append((f"{base}{e}.{gate}.weight", half, e * per))
        out.append((f"{base}{e}.{up}.weight", half, e * per + n))
    return out


def hub_views(module: Any) -> dict[str, Any]:
    """``{hub_name: tensor}`` of a plain (unsharded) module's parameters under the names the
    export streams them by: a fused expert parameter appears as one view per expert
    and projection into its own storage, so copying a Hub-named tensor into the view loads it
    (the reverse of `hub_parts`, without a copy of the fused tensor)."""
    mt = model_type_of(module)
    out: dict[str, Any] = {}
    for name, t in module.named_parameters():
        parts = hub_parts(name, tuple(t.shape), mt)
        if parts is None:
            out[name] = t
            continue
        flat = t.data.view(-1)
        for hub, shape, off in parts:
            out[hub] = flat[off:off + math.prod(shape)].view(shape)
    return out
