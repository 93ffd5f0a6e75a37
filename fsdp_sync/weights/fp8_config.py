"""What a model config's ``quantization_config`` tells a block-FP8 sync: whether it makes the engine
FP8, and which layers it leaves unquantized (``ignored_layers`` / ``modules_to_not_convert``), read
as the engines that start from that config read it.

Both engines build an FP8 model from a config that carries a ``quantization_config``, whatever their
``--quantization`` says (SGLang takes its ``quant_method``; the reference engine's
`engines.reference.quant.resolve` turns block FP8 on), and both build the listed layers unquantized.
The sync must then send those layers in the rollout dtype with no ``weight_scale_inv``: an FP8
weight sent into one is a wrong load (SGLang 0.5.23 copies the raw FP8 values into the unquantized
parameter and drops the scale with a warning) or a refusal partway through the sync.

The two engines read the list slightly differently, and a sync can only send one set of tensors:

- SGLang 0.5.23 (``Fp8Config.from_config``) takes the first key *present* of ``ignored_layers``,
  ``modules_to_not_convert`` and adds each entry both with and without a leading ``model.``;
  ``Fp8Config.__init__`` adds the entries of the ``SGLANG_FP8_IGNORED_LAYERS`` environment variable
  of the process it runs in;
- the reference engine takes ``ignored_layers``, or ``modules_to_not_convert`` when that is empty,
  each entry as written, and no environment variable.

Both then match an entry against a layer as SGLang's ``is_layer_skipped`` does (`fp8.is_quantized`).
`ignored_layers` gives the list when both readings skip the same tensors of the model, and refuses
it otherwise, naming the entry (or the variable) and what to write instead, before anything is sent.
A list that skips some but not all shards of a fused layer is refused by `fp8.quantized_names`, as
both engines refuse it.

`config_refusal` says why a sync (or a plan) of a given ``quantization`` cannot serve a model of this
config at all: an FP8 config synced unquantized, or a ``quantization_config`` the block-FP8
quantizer does not write (another method, per-tensor FP8, another block size, static activations).

Not here: the matching rule and the quantizer (`fp8`), the stream (`quantize`), the engines.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from . import fp8
from .layout import TPLayout

__all__ = ["ENV", "KEYS", "quantization_config", "config_refusal", "sglang_entries", "ignored_layers",
           "held_layout"]

ENV = "SGLANG_FP8_IGNORED_LAYERS"
"""SGLang's environment variable of more ignored layers (comma-separated), read by ``Fp8Config``."""
KEYS = ("ignored_layers", "modules_to_not_convert")
"""The ``quantization_config`` keys of the layers left unquantized, in SGLang's order."""


def quantization_config(cfg: Any) -> dict | None:
    """``cfg.quantization_config`` as a dict (a dict, or an object with ``to_dict``), None when the
    config has none (or an empty one)."""
    qc = getattr(cfg, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    return qc or None


def _describe(qc: dict) -> str:
    keep = ("quant_method", "weight_block_size", "activation_scheme", *KEYS)
    return "{" + ", ".join(f"{k}: {qc[k]!r}" for k in keep if k in qc) + "}"


def config_refusal(cfg: Any, quantization: str | None) -> str | None:
    """Why a sync of ``quantization`` (``SyncConfig.quantization``, ``fsdp-sync plan --quantization``)
    cannot serve an engine started from ``cfg``, whose ``quantization_config`` decides the engine's
    format; None when it can (no ``quantization_config``, or block FP8 [128, 128] synced as
    ``"fp8"``)."""
    qc = quantization_config(cfg)
    if qc is None:
        return None
    method, block = qc.get("quant_method"), qc.get("weight_block_size")
    where = f"the model config's quantization_config {_describe(qc)}"
    if quantization is None:
        if method == "fp8":
            return (f"{where} makes the engine serve block FP8 whatever its --quantization (SGLang "
                    f"and fsdp-sync serve both read it), but the sync sends unquantized weights "
                    f"(quantization=None); quantize the sync (SyncConfig(quantization='fp8'), "
                    f"fsdp-sync plan --quantization fp8) or start the engine from a config without "
                    f"quantization_config")
        return (f"{where} makes the engine serve {method!r} weights, which fsdp_sync does not write; "
                f"start the engine from a config without quantization_config (or with block FP8)")
    if method != "fp8" or block is None:
        what = f"quant_method {method!r}" if method != "fp8" else "per-tensor FP8 (no weight_block_size)"
        return (f"{where} is {what}, but quantization={quantization!r} sends block FP8 (quant_method "
                f"'fp8', weight_block_size {list(fp8.BLOCK)}); start the engine from a block-FP8 config")
    if list(block) != list(fp8.BLOCK):
        return (f"{where} has weight_block_size {list(block)}, but the sync quantizes in blocks of "
                f"{list(fp8.BLOCK)} (SGLang's); start the engine from a config with weight_block_size "
                f"{list(fp8.BLOCK)}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        return (f"{where} has activation_scheme {qc['activation_scheme']!r}; block FP8 quantizes "
                f"activations dynamically (SGLang refuses any other scheme with a block size)")
    return None


def sglang_entries(entries: Iterable[str]) -> list[str]:
    """``entries`` as SGLang 0.5.23's ``Fp8Config.from_config`` keeps them: each both without and with
    a leading ``model.``, in order, once."""
    out: list[str] = []
    for entry in entries:
        base = entry.removeprefix("model.")
        for e in (base, f"model.{base}"):
            if e not in out:
                out.append(e)
    return out


def _entries(qc: dict, key: str) -> list[str]:
    v = qc.get(key)
    if v is None:
        return []
    if isinstance(v, str) or not isinstance(v, (list, tuple)) or not all(isinstance(i, str) for i in v):
        raise ValueError(f"the model config's quantization_config.{key} is {v!r}; expected a list of "
                         f"module names (e.g. ['model.layers.0.mlp'])")
    return list(v)


def _module_of(name: str, layout: TPLayout) -> str:
    engine = layout.engine_name(name)
    if engine.endswith(("experts.w13_weight", "experts.w2_weight")):
        return engine.rsplit(".", 1)[0]            # one FusedMoE per layer: its experts go together
    return name.removesuffix(".weight")


def _quantized(layout: TPLayout, ignored: list[str], reader: str) -> set[str]:
    try:
        return set(fp8.quantized_names(layout, ignored))
    except ValueError as exc:
        raise ValueError(f"{reader}: {exc}") from None


def ignored_layers(cfg: Any, layout: TPLayout) -> tuple[str, ...]:
    """The layers of ``cfg``'s model (``layout``: its layout map, any TP) that a block-FP8 sync leaves
    in the rollout dtype: the ``quantization_config``'s list as both engines read it (see the module
    docstring); () without one. Raises ValueError, naming the entry and what to write instead,
    where the readings skip different tensors, for a ``quantization_config`` the quantizer does not
    write (`config_refusal`), or for a list that splits a fused layer."""
    qc = quantization_config(cfg) or {}
    if qc:
        why = config_refusal(cfg, "fp8")
        if why:
            raise ValueError(why)
    mine = _entries(qc, KEYS[0]) or _entries(qc, KEYS[1])              # the reference engine's
    key = next((k for k in KEYS if k in qc), None)                    # SGLang: the first present
    theirs = _entries(qc, key) if key else []
    if mine and not theirs:
        raise ValueError(f"the model config's quantization_config has {KEYS[0]} {qc.get(KEYS[0])!r} and "
                         f"{KEYS[1]} {qc.get(KEYS[1])!r}: SGLang reads {KEYS[0]} alone (it skips "
                         f"nothing), the reference engine reads {KEYS[1]} when {KEYS[0]} is empty; "
                         f"remove the empty {KEYS[0]} or list the layers in it")
    env = [e.strip() for e in os.environ.get(ENV, "").split(",") if e.strip()]
    listed = f"the model config's quantization_config.{key}"
    reference = _quantized(layout, mine, listed)
    sglang = _quantized(layout, sglang_entries(theirs), f"{listed} as SGLang reads it (each entry with "
                                                        f"and without 'model.')")
    if sglang != reference:
        for entry in mine:
            extra = [e for e in sglang_entries([entry]) if e not in mine]
            differ = sorted(reference - set(fp8.quantized_names(layout, [*mine, *extra])))
            if differ:
                base = entry.removeprefix("model.")
                raise ValueError(
                    f"the model config's quantization_config.{key} entry {entry!r}: SGLang "
                    f"(Fp8Config.from_config) also reads it as {extra[0]!r} and leaves {differ[0]!r} "
                    f"unquantized ({len(differ)} tensors), the reference engine reads it as written and "
                    f"quantizes them; no sync can load both. Write it so that both read it alike: "
                    f"{base!r} (every module whose path holds those dotted parts, as SGLang reads "
                    f"it) or the full path of the module to skip (e.g. {_module_of(differ[0], layout)!r})")
        raise ValueError(f"the model config's quantization_config lists {theirs}: SGLang leaves "  # pragma: no cover
                         f"{sorted(reference - sglang)[:3]} unquantized, the reference engine does not; "
                         f"list the layers by their full module paths")
    if env:
        both = _quantized(layout, [*sglang_entries(theirs), *env], f"{ENV}={os.environ[ENV]!r} with the config's list")
        if both != sglang:
            n = sorted(sglang - both)[0]
            raise ValueError(f"{ENV}={os.environ[ENV]!r} is set: an SGLang engine started in this "
                             f"environment leaves {n!r} unquantized ({len(sglang - both)} tensors), but "
                             f"the reference engine does not read the variable and the model config "
                             f"does not list it, so the sync cannot tell which to send; list the layers "
                             f"in the model config's quantization_config.ignored_layers (e.g. "
                             f"{_module_of(n, layout)!r}: both engines read it) and unset {ENV}")
    return tuple(mine)


def held_layout(cfg: Any, layout: TPLayout, quantization: str | None) -> TPLayout:
    """``layout`` as an engine started from ``cfg`` holds it under ``quantization``: itself (None), or
    its `fp8.FP8Layout` leaving `ignored_layers` unquantized (``"fp8"``)."""
    if quantization not in fp8.QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(fp8.QUANTIZATIONS)}, got {quantization!r}")
    if quantization is None:
        return layout
    return fp8.FP8Layout(layout.spec, layout.tp, layout.ep, ignored=ignored_layers(cfg, layout))
