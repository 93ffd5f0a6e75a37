"""peft's names in the export: a peft (LoRA) model's base weights under their Hugging Face names
(``base_model.model.`` and ``.base_layer`` dropped, as SGLang's loader and verl name them), and
which tensors are the adapter's (``lora_A`` / ``lora_B`` / ``lora_embedding_*`` / ...).

`adapter_of` reads the adapter's name segment of a LoRA tensor's name (peft keys each layer's
``lora_A`` / ``lora_B`` by adapter: ``...q_proj.lora_A.default.weight`` is adapter ``default``'s), so
that a sync takes the tensors of one adapter only, the one the peft model runs.

`trainable_base` names the parameters outside the adapter that still train (what an adapter-only
sync would leave stale in the engine). `unserved_option` names a peft ``LoraConfig`` option that
changes what the trained model computes and that SGLang's LoRA (and the reference engine) does not
apply (rsLoRA's scaling, DoRA, LoRA biases, ``modules_to_save``, KaSA, ...): such an adapter would
be served as another model than the trainer's. `unserved_target` does the same for ``bias`` and
``target_modules`` (trained biases, a regular expression, embeddings or lm_head), and
`unserved_tensor` for the tensors themselves: anything but ``lora_A`` / ``lora_B`` of a linear
module (a variant's own parameter a config key this list does not know may add included).
`pattern_refusal` (``rank_pattern`` / ``alpha_pattern``) and `config_refusal` (every config
check) say it of a whole config; `sglang_refusal` of target modules SGLang's LoRA cannot stack.
`sglang_targets` normalizes target module names as SGLang does before it compares an adapter's
with a server's ``--lora-target-modules`` (`engines.sglang.lora`'s up-front refusal).

Not here: the export itself (`export` calls `base_parts` from `hf_name` and `select` on its
items), syncing an adapter (`fsdp_sync.lora_sync`).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Mapping

__all__ = ["is_lora", "adapter_of", "base_parts", "select", "trainable_base", "merged", "unserved_option",
           "unserved_tensor", "unserved_target", "pattern_refusal", "config_refusal", "sglang_refusal",
           "sglang_targets", "UNSERVED", "UNSERVED_MODULES", "SERVED_KINDS"]


@functools.lru_cache(maxsize=1 << 16)     # a pure function of the name, asked twice a tensor a sync
def is_lora(name: str) -> bool:
    """A peft LoRA tensor: left out of the base weights' stream, the only ones in ``lora=True``
    streams."""
    return any(p.startswith("lora_") for p in name.split("."))


def adapter_of(name: str) -> str | None:
    """The adapter a LoRA tensor belongs to: the name component after its first ``lora_*`` one
    (``...q_proj.lora_A.default.weight``, ``...embed_tokens.lora_embedding_A.default`` and a
    variant's ParameterDict entry such as KaSA's ``...q_proj.lora_diag.default`` -> ``"default"``);
    None for a name with none (not a LoRA tensor, or no adapter level: ``...lora_A.weight``)."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p.startswith("lora_"):     # a ModuleDict's ``<adapter>.weight``, a ParameterDict's ``<adapter>``
            if i + 1 == len(parts):
                return None
            last = i + 1 == len(parts) - 1
            return None if last and parts[i + 1] in _PARAM_NAMES else parts[i + 1]
    return None


_PARAM_NAMES = frozenset({"weight", "bias"})
"""A module's own parameter names: ``lora_A.weight`` has no adapter level (an adapter is never
named so: peft keys its ModuleDicts and ParameterDicts by adapter name)."""

SERVED_KINDS = ("lora_A", "lora_B")
"""The LoRA tensors an engine serves: ``scale * lora_B @ lora_A`` on a decoder layer's linear
modules (SGLang's LoRA and the reference engine alike)."""


UNSERVED_MODULES = frozenset({"embed_tokens", "lm_head"})
"""Modules a peft ``target_modules`` may name that neither engine serves LoRA on."""


def unserved_tensor(names: Iterable[str], adapter: str | None) -> str | None:
    """Why the LoRA tensors ``names`` (the module's parameter names, of ``adapter``; None: every
    one) cannot be served exactly (None: they can): one that is not ``lora_A`` / ``lora_B``
    (peft's ``lora_embedding_A`` / ``_B`` on embeddings, or a variant's own parameter: KaSA's
    ``lora_diag``, MonteCLoRA's sampler, DoRA's magnitude, ...; the engine would serve
    ``B @ A`` without it), or LoRA on ``embed_tokens`` / ``lm_head`` (neither engine serves it).
    Said of the first such tensor, with what to do."""
    for name in names:
        parts = name.split(".")
        i = next((k for k, p in enumerate(parts) if p.startswith("lora_")), None)
        if i is None or (adapter is not None and adapter_of(name) != adapter):
            continue
        kind, module = parts[i], (parts[i - 1] if i else "")
        if kind.startswith("lora_embedding_") or module in UNSERVED_MODULES:
            return (f"the adapter's tensor {name!r} is LoRA on {module or 'an embedding'!r}: LoRA on "
                    f"embeddings and lm_head is not served (SGLang's LoRA and the reference engine "
                    f"apply it to the decoder layers' linear modules only), so the engine would serve "
                    f"another model than the trainer's; leave {module!r} out of target_modules, or "
                    f"merge the adapter into the weights and sync them with SyncConfig(lora='off')")
        if kind not in SERVED_KINDS:
            return (f"the adapter's tensor {name!r} ({kind}) is neither lora_A nor lora_B: a peft "
                    f"LoRA variant's own parameter (KaSA's lora_diag, MonteCLoRA's sampler, DoRA's "
                    f"magnitude, ...), which the engine does not apply (it serves lora_alpha / r * "
                    f"lora_B @ lora_A), so it would serve another model than the trainer's; train "
                    f"plain LoRA, or merge the adapter into the weights and sync them with "
                    f"SyncConfig(lora='off')")
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


def merged(named: Iterable[tuple[str, Any]], adapter: str | None) -> list[str]:
    """The modules in ``named`` (``module.named_modules()``) into whose base weight peft merged
    ``adapter`` (None: any adapter): a LoRA layer's ``merged_adapters`` (peft's
    ``merge_adapter``). Its base weight then holds ``W + scaling * B @ A`` and its forward skips the
    adapter, so the base sent plus the adapter served would apply it twice."""
    out = []
    for name, m in named:
        held = getattr(m, "merged_adapters", None)
        if isinstance(held, (list, tuple, set)) and held and (adapter is None or adapter in held):
            out.append(name)
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
    "kasa_config": ("KaSA's learned diagonal between lora_A and lora_B (lora_diag) and its truncation "
                    "of the base weight's smallest singular values are not applied"),
    "monteclora_config": "MonteCLoRA's sampled mixture over lora_A is not applied",
    "use_bdlora": ("BD-LoRA's block-diagonal lora_A / lora_B (held as their blocks) are not laid out "
                   "as such: the engine takes dense ones"),
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


def unserved_target(cfg: Any) -> str | None:
    """Why an adapter config's ``bias`` or ``target_modules`` cannot be served exactly (None: they
    can): trained biases (``bias="all"`` / ``"lora_only"``: the base's biases train, and an
    adapter-only sync sends the adapter alone; neither engine serves a LoRA bias), a regular
    expression (SGLang and the reference engine take module names or ``"all-linear"``), or
    ``embed_tokens`` / ``lm_head`` among the targets (`UNSERVED_MODULES`)."""
    if not isinstance(cfg, Mapping):
        return None
    bias = cfg.get("bias")
    bias = getattr(bias, "value", bias)
    if bias not in (None, "none"):
        return (f"the adapter config's bias={bias!r} cannot be served exactly: it trains the base "
                f"layers' biases, which an adapter-only sync does not send, and neither SGLang's "
                f"LoRA nor the reference engine serves trained LoRA biases; train with bias='none' "
                f"(peft's default), or merge the adapter into the weights and sync them with "
                f"SyncConfig(lora='off')")
    tm = cfg.get("target_modules")
    if isinstance(tm, str) and tm not in ("all-linear", "all"):
        return (f"the adapter config's target_modules={tm!r} is a regular expression: SGLang's LoRA "
                f"(and the reference engine) take a list of module names or 'all-linear'; give "
                f"peft the module names (['q_proj', 'v_proj', ...])")
    if isinstance(tm, (list, tuple, set, frozenset)):
        bad = sorted({str(m) for m in tm if str(m).split(".")[-1] in UNSERVED_MODULES})
        if bad:
            return (f"the adapter config's target_modules include {bad}: LoRA on embeddings and "
                    f"lm_head is not served (SGLang's LoRA and the reference engine apply it to the "
                    f"decoder layers' linear modules only), so the engine would serve another model "
                    f"than the trainer's; leave them out of target_modules, or merge the adapter "
                    f"into the weights and sync them with SyncConfig(lora='off')")
    return None


def pattern_refusal(cfg: Any) -> str | None:
    """Why an adapter config cannot be served as the trainer computes it (None: it can): an option
    the engines do not apply (`unserved_option`: rsLoRA, DoRA, LoRA biases, ...), or a
    peft ``rank_pattern`` / ``alpha_pattern`` entry other than the adapter's own ``r`` /
    ``lora_alpha``. peft gives each module it matches its own rank or ``lora_alpha`` (scaling
    ``alpha / r`` of that module); SGLang's LoRA reads neither key (0.5.23's ``LoRAAdapter``: one
    ``scaling = lora_alpha / r`` and one rank for the whole adapter), nor does the reference
    engine, so those modules would be served with another scaling (or rank) than trained."""
    if not isinstance(cfg, Mapping):
        return None
    why = unserved_option(cfg)
    if why is not None:
        return why
    for key, main, default in (("rank_pattern", "r", 8), ("alpha_pattern", "lora_alpha", 8)):
        pattern, whole = cfg.get(key), cfg.get(main, default)
        if pattern is None or pattern == {}:
            continue
        differ = {k: v for k, v in pattern.items() if v != whole} if isinstance(pattern, Mapping) else pattern
        if differ:
            return (f"the adapter config's {key}={differ!r} ({main}={whole!r} elsewhere) cannot be "
                    f"served exactly: SGLang's LoRA (and the reference engine) reads no {key} and "
                    f"applies one {main} and one scaling lora_alpha / r to every module, so those "
                    f"modules would be served with another {main} than the trainer's; train with "
                    f"one r and lora_alpha for every module (no {key}), or merge the adapter into "
                    f"the weights and sync them with SyncConfig(lora='off')")
    return None


def config_refusal(cfg: Any) -> str | None:
    """Why an adapter config cannot be served as the trainer computes it, by any engine (None: it
    can): `pattern_refusal`, then trained biases, a regular expression for ``target_modules`` or
    embeddings / lm_head among them (`unserved_target`)."""
    return pattern_refusal(cfg) or unserved_target(cfg)


def sglang_refusal(targets: Any) -> str | None:
    """Why SGLang cannot serve an adapter on ``targets`` (None: it can, "all-linear" included).
    Its ``LoRAAdapter`` stacks q/k/v into ``qkv_proj`` only from a ``q_proj`` tensor and needs
    ``v_proj`` beside it (a missing ``k_proj`` becomes zeros), and gate/up into ``gate_up_proj``
    only from ``gate_proj`` (a missing ``up_proj`` becomes zeros); anything else it leaves
    unstacked or raises on, and its memory pool cannot place an unstacked ``k_proj`` / ``v_proj``
    / ``up_proj``: it raises when a request first uses the adapter (checked against SGLang's own
    code in tests/sglang_tier/test_sglang_lora.py)."""
    if not isinstance(targets, (list, tuple, set, frozenset)):
        return None
    names = {str(m).split(".")[-1] for m in targets}
    add = sorted({"q_proj", "v_proj"} - names) if names & {"q_proj", "k_proj", "v_proj"} else []
    if "up_proj" in names and "gate_proj" not in names:
        add.append("gate_proj")
    if not add:
        return None
    return (f"SGLang cannot serve target_modules {sorted(names)}: it stacks q/k/v from q_proj with "
            f"v_proj (k_proj may be left out) and gate/up from gate_proj (up_proj may be left out); "
            f"add {add} to the adapter's target_modules")


# SGLang's ``get_normalized_target_modules`` (sglang/srt/lora/utils.py, 0.5.12 and 0.5.23): a
# target module's last dotted part, renamed to the LoRA weight SGLang stacks it into; any other
# name stays itself. 0.5.23 also renames the DSA indexer's three (`_INDEXER_TARGETS`), which
# 0.5.12 leaves as they are: either way the same names land inside or outside a server's set
# (both sides are normalized alike), so only the names a refusal shows differ.
_SGLANG_TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                   "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "out_proj": "out_proj",
                   "embed_tokens": "embed_tokens", "vocab_emb": "embed_tokens",
                   "embeddings": "embed_tokens", "word_embeddings": "embed_tokens",
                   "lm_head": "lm_head", "output": "lm_head", "unembed_tokens": "lm_head",
                   "q_a_proj": "fused_qkv_a_proj_with_mqa",
                   "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa"}
_INDEXER_TARGETS = {"wq_b": "indexer.wq_b", "wk": "indexer.wk",
                    "weights_proj": "indexer.weights_proj"}
_INDEXER_SINCE = (0, 5, 23)      # the first release read that renames them (0.5.12 does not)


def sglang_targets(modules: Any, version: tuple[int, ...] | None = None) -> set[str] | None:
    """``modules`` (a peft ``target_modules`` list, or a server's ``--lora-target-modules``) as
    SGLang's ``get_normalized_target_modules`` of release ``version`` (None: the newest read)
    normalizes them: ``{"all"}`` for peft's ``"all"`` / ``"all-linear"``; None for any other
    string (SGLang raises "Only 'all' or 'all-linear' can be used as the string for target
    module") or for what is not a collection of names."""
    if isinstance(modules, str):
        return {"all"} if modules in ("all", "all-linear") else None
    if not isinstance(modules, (list, tuple, set, frozenset)):
        return None
    table = _SGLANG_TARGETS if version is not None and version < _INDEXER_SINCE \
        else {**_SGLANG_TARGETS, **_INDEXER_TARGETS}
    out = set()
    for name in modules:
        base = str(name).split(".")[-1]
        out.add(table.get(base, base))
    return out
