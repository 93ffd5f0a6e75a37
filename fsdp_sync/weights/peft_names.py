"""peft's names in the export: a peft (LoRA) model's base weights under their Hugging Face names
(``base_model.model.`` and ``.base_layer`` dropped, as SGLang's loader and verl name them), and
which tensors are the adapter's (``lora_A`` / ``lora_B`` / ``lora_embedding_*`` / ...).

`adapter_of` reads the adapter's name segment of a LoRA tensor's name (peft keys each layer's
``lora_A`` / ``lora_B`` by adapter: ``...q_proj.lora_A.default.weight`` is adapter ``default``'s), so
that a sync takes the tensors of one adapter only, the one the peft model runs.

`trainable_base` names the parameters outside the adapter that still train (what an adapter-only
sync would leave stale in the engine). `unserved_option` names a peft ``LoraConfig`` option that
changes what the trained model computes and that SGLang's LoRA (and the reference engine) does not
apply (rsLoRA's scaling, DoRA, LoRA biases, ``modules_to_save``, ...): such an adapter would be
served as another model than the trainer's.

Not here: the export itself (`export` calls `base_parts` from `hf_name` and `select` on its
items), syncing an adapter (`fsdp_sync.lora_sync`).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping

__all__ = ["is_lora", "adapter_of", "base_parts", "select", "trainable_base", "unserved_option", "UNSERVED"]


@functools.lru_cache(maxsize=1 << 16)     # a pure function of the name, asked twice a tensor a sync
def is_lora(name: str) -> bool:
    """A peft LoRA tensor: left out of the base weights' stream, the only ones in ``lora=True``
    streams."""
    return any(p.startswith("lora_") for p in name.split("."))


def adapter_of(name: str) -> str | None:
    """The adapter a LoRA tensor belongs to: the name component after its first ``lora_*`` one
    (``...q_proj.lora_A.default.weight`` and ``...embed_tokens.lora_embedding_A.default`` ->
    ``"default"``); None for a name with none (not a LoRA tensor, or no adapter level)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.startswith("lora_"):     # a ModuleDict's ``<adapter>.weight``, a ParameterDict's ``<adapter>``
            last = i + 1 == len(parts) - 1
            return parts[i + 1] if i + 1 < len(parts) and (not last or p.startswith("lora_embedding_")) else None
    return None


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


UNSERVED: dict[str, str] = {
    "use_rslora": "rsLoRA scales by lora_alpha / sqrt(r); SGLang's LoRA always scales by lora_alpha / r",
    "use_dora": "DoRA's magnitude vectors are not applied (SGLang refuses DoRA adapters when loading them)",
    "lora_bias": "the bias of lora_B is not applied",
    "modules_to_save": "the trained copies of those whole modules are not served (the base's are)",
    "trainable_token_indices": "the trained token embeddings are not served (the base's are)",
    "target_parameters": "LoRA on bare parameters (MoE experts) is not applied; only target_modules are",
    "layer_replication": "the replicated layers are not built (the base's layer stack is served)",
    "use_qalora": "QALoRA's pooled input is not applied",
    "alora_invocation_tokens": "activated LoRA (applied only after its invocation tokens) is applied to every token",
    "arrow_config": "Arrow's per-token routing among adapters is not applied",
}
"""peft ``LoraConfig`` options that change what the trained model computes, with what the engine
does instead: SGLang 0.5.23's LoRA reads only ``r``, ``lora_alpha``, ``target_modules`` and
``use_dora`` (which it refuses), as does the reference engine. Options that only shape training
(``lora_dropout``, ``init_lora_weights``, LoftQ/EVA/CorDA initialization) or choose which layers
hold tensors (``layers_to_transform``, ``exclude_modules``: a layer without tensors is served
without LoRA, as SGLang's memory pool zero-fills it) are served exactly and not listed."""


def unserved_option(cfg: Any) -> str | None:
    """Why an adapter config cannot be served as the trainer computes it (None: it can): its first
    `UNSERVED` option that is set (true, or a non-empty list / dict / string), named with its value,
    what the engine would do instead, and what to do."""
    if not isinstance(cfg, Mapping):
        return None
    for key, instead in UNSERVED.items():
        value = cfg.get(key)
        if value is None or value is False or (hasattr(value, "__len__") and len(value) == 0):
            continue
        return (f"the adapter config's {key}={value!r} cannot be served exactly: {instead}, so the "
                f"engine would serve another model than the trainer's; train without {key} (SGLang "
                f"serves plain LoRA: r, lora_alpha, target_modules), or merge the adapter into the "
                f"weights and sync them with SyncConfig(lora='off')")
    return None
