"""Which layers a verl FP8 rollout leaves unquantized, read as verl and the engine it starts read them.

Under ``rollout.name=sglang`` with ``rollout.quantization=fp8`` verl starts SGLang with a block-FP8
``quantization_config`` whose ``ignored_layers`` is verl's ``get_sglang_fp8_ignored_layers`` of the
model's ``hf_config.quantization_config`` (``verl/utils/sglang/sglang_fp8_utils.py``): its
``ignored_layers``, its ``modules_to_not_convert`` and the ``SGLANG_FP8_IGNORED_LAYERS``
environment variable (comma-separated). SGLang builds those layers unquantized
(``Fp8Config.get_quant_method`` -> ``is_layer_skipped``) and verl's own quantizer
(``SGLangFP8QuantizerHelper``) sends them in the rollout dtype. fsdp_sync's adapter must send them
so too: an FP8 weight and its ``weight_scale_inv`` into a bf16 layer is a wrong load.

- `ignored_layers`: that list for the adapter's quantizer (`weights.quantize.for_sync`'s
  ``ignored``, which then does not read the model config's list itself: verl's list includes it),
  each entry with and without a leading ``model.``, as SGLang's ``Fp8Config.from_config`` reads it
  (`weights.fp8_config.sglang_entries`). A ``re:`` entry is refused: verl's quantizer matches it as a
  regular expression, SGLang as a plain module path (it matches nothing there), so verl itself
  would send bf16 into an FP8 layer; the error says to list the modules by path.
- `check_as_verl`: the tensors fsdp_sync's quantizer leaves unquantized (SGLang's rule,
  `weights.fp8.is_quantized`) against those verl's quantizer leaves unquantized, for every tensor
  both quantize by default. A difference (an entry in another case, one naming ``...weight``, a
  single expert: SGLang skips the layer's every expert, verl that one) is refused naming the
  tensor: SGLang and verl's own quantizer disagree, so no sync could load it exactly.
- ``rollout.name=fsdp_sync_ref``: ``fsdp-sync serve`` reads ``config.json``'s list only
  (`engines.reference.quant.resolve`), so that is the list; ``SGLANG_FP8_IGNORED_LAYERS`` is
  refused there (serve does not read it).

Not here: the quantizer (`weights.quantize`, `weights.fp8`), the sync (`adapter`).
"""

from __future__ import annotations

import os
from typing import Any

from ...weights import fp8, quantize
from ...weights.fp8_config import ENV, sglang_entries
from .replica import ROLLOUT_NAME

__all__ = ["ENV", "ignored_layers", "check_as_verl", "quantizer"]

_BY_PATH = ("list the layers by their module paths, as SGLang's Fp8Config matches them (whole "
            "dotted parts, case-sensitive): e.g. 'model.layers.0.mlp' (the layer's MLP), "
            "'model.layers.0.self_attn' or all of its q_proj/k_proj/v_proj, "
            "'model.layers.1.mlp.experts' (all of a layer's experts)")


def _sources() -> str:
    return (f"{ENV}={os.environ.get(ENV, '')!r} and the model's "
            f"quantization_config.ignored_layers / modules_to_not_convert")


def ignored_layers(rollout_name: Any, hf_config: Any) -> tuple[str, ...]:
    """The ignored layers of an FP8 rollout of ``hf_config`` under verl's ``rollout.name``, in the
    form `fp8.FP8Layout` matches (see the module docstring); raises ValueError for a list that
    cannot be matched exactly, saying what to do."""
    if rollout_name == ROLLOUT_NAME:
        if os.environ.get(ENV, "").strip():
            raise ValueError(f"rollout.name={ROLLOUT_NAME} with rollout.quantization=fp8: {ENV}="
                             f"{os.environ[ENV]!r} is SGLang's, and fsdp-sync serve does not read it "
                             f"(it would quantize those layers while you asked for them unquantized); "
                             f"unset it and list the layers in the model's config.json "
                             f"quantization_config.ignored_layers")
        from ...engines.reference.quant import resolve

        quant = resolve(hf_config, "fp8")
        return tuple(quant.get("ignored", ())) if quant else ()
    from verl.utils.sglang.sglang_fp8_utils import build_sglang_fp8_quant_config

    raw = build_sglang_fp8_quant_config(hf_config).get("ignored_layers", [])   # what SGLang gets
    regex = [e for e in raw if e.startswith("re:")]
    if regex:
        raise ValueError(f"rollout.quantization=fp8 with ignored layers {regex} (from "
                         f"{_sources()}): verl's quantizer matches a 're:' entry as a regular "
                         f"expression, but the SGLang server verl starts matches it as a plain module "
                         f"path (it skips nothing there), so SGLang would build those layers FP8 while "
                         f"verl's quantizer sends them unquantized; {_BY_PATH}")
    return tuple(sglang_entries(raw))       # SGLang's Fp8Config.from_config: with and without "model."


def check_as_verl(hf_config: Any, quantized: frozenset[str], default: list[str]) -> None:
    """Refuse where verl's quantizer and SGLang's rule (``quantized``: what fsdp_sync's quantizer
    sends as FP8) disagree on a tensor both quantize when nothing is ignored (``default``: SGLang's
    Fp8 layers, `fp8.quantized_names` without a list); a tensor SGLang never quantizes is not
    compared (verl's pattern list quantizes some of those, e.g. Qwen2-MoE's shared_expert_gate:
    not a matter of the ignored list)."""
    from verl.utils.fp8_utils import FP8QuantizerHelper
    from verl.utils.sglang.sglang_fp8_utils import SGLangFP8QuantizerHelper, build_sglang_fp8_quant_config

    qc = build_sglang_fp8_quant_config(hf_config)       # what verl starts SGLang with
    if not qc.get("ignored_layers"):
        return
    verl, plain = SGLangFP8QuantizerHelper(qc), FP8QuantizerHelper(qc)
    differ = [n for n in default if plain.should_quantize_param(n)
              and verl.should_quantize_param(n) != (n in quantized)]
    if differ:
        n = differ[0]
        ours = "quantized" if n in quantized else "unquantized"
        theirs = "quantized" if verl.should_quantize_param(n) else "unquantized"
        raise ValueError(f"rollout.quantization=fp8 with ignored layers {qc['ignored_layers']} (from "
                         f"{_sources()}): SGLang builds {n!r} {ours} but verl's quantizer "
                         f"(SGLangFP8QuantizerHelper) matches the list otherwise and would send it "
                         f"{theirs} ({len(differ)} tensors differ: {differ[:4]}); {_BY_PATH}")


def quantizer(rollout_name: Any, hf_config: Any, sync: Any, tp: int,
              ignored: tuple[str, ...]) -> "quantize.StreamQuantizer":
    """The block-FP8 quantizer of a verl sync at TP ``tp``, leaving ``ignored`` (`ignored_layers`)
    unquantized, checked against verl's quantizer under SGLang (`check_as_verl`)."""
    quant = quantize.for_sync(_Module(hf_config), sync, tp, ignored=ignored)
    if ignored and rollout_name != ROLLOUT_NAME:
        check_as_verl(hf_config, quant.hf, fp8.quantized_names(quant.layout))
    return quant


class _Module:
    """What `quantize.for_sync` reads of a module: its Hugging Face ``config``."""

    def __init__(self, config: Any) -> None:
        self.config = config
