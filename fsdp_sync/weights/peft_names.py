"""peft's names in the export: a peft (LoRA) model's base weights under their Hugging Face names
(``base_model.model.`` and ``.base_layer`` dropped, as SGLang's loader and verl name them), and
which tensors are the adapter's (``lora_A`` / ``lora_B`` / ``lora_embedding_*`` / ...).

Not here: the export itself (`export` calls `base_parts` from `hf_name` and `select` on its
items), syncing an adapter (`fsdp_sync.lora_sync`).
"""

from __future__ import annotations

import functools

__all__ = ["is_lora", "base_parts", "select"]


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
