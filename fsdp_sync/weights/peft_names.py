"""peft's names in the export: a peft (LoRA) model's base weights under their Hugging Face names
(``base_model.model.`` and ``.base_layer`` dropped, as SGLang's loader and verl name them), and
which tensors are the adapter's (``lora_A`` / ``lora_B`` / ``lora_embedding_*`` / ...).

`trainable_base` names the parameters outside the adapter that still train (what an adapter-only
sync would leave stale in the engine).

Not here: the export itself (`export` calls `base_parts` from `hf_name` and `select` on its
items), syncing an adapter (`fsdp_sync.lora_sync`).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

__all__ = ["is_lora", "base_parts", "select", "trainable_base"]


@functools.lru_cache(maxsize=1 << 16)     # a pure function of the name, asked twice a tensor a sync
def is_lora(name: str) -> bool:
    """A peft LoRA tensor: left out of the base weights' stream, the only ones in ``lora=True``
    streams."""
    return any(p.startswith("lora_") for p in name.split("."))


def base_parts(parts: list[str]) -> list[str]:
    """A state-dict name's components without peft's levels (a LoRA tensor keeps ``base_layer``
    if it had one: only base weights are renamed)."""
    if parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    if "base_layer" in parts and not any(p.startswith("lora_") for p in parts):
        parts = [p for p in parts if p != "base_layer"]
    return parts


def select(items: list, lora: bool) -> list:
    """The export items of the base weights (``lora=False``) or of the adapter (``lora=True``);
    the others are dropped (``item.drop()``)."""
    keep = [it for it in items if is_lora(it.name) == lora]
    for it in items:
        if is_lora(it.name) != lora:
            it.drop()
    return keep


def trainable_base(named: Iterable[tuple[str, Any]]) -> list[str]:
    """The names of the parameters in ``named`` (``module.named_parameters()``) that are not the
    adapter's and still train (``requires_grad``). An FSDP1 flat parameter (``use_orig_params=
    False``: one ``requires_grad`` for every tensor it holds) counts by the names it holds."""
    out = []
    for name, p in named:
        if not getattr(p, "requires_grad", False):
            continue
        held = getattr(p, "_fqns", None)        # FSDP1's FlatParameter: the tensors it flattens
        prefix = name.rpartition(".")[0]
        names = [f"{prefix}.{f}" if prefix else f for f in held] if held else [name]
        out += [n for n in names if not is_lora(n)]
    return out
