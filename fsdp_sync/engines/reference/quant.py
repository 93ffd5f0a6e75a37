"""Block FP8 in the reference engine: which quantization an engine runs, its layout, and the
refusals of a tensor sent in the wrong precision.

`resolve` reconciles the engine's ``quantization`` argument (SGLang's ``--quantization``) with the
model config's ``quantization_config`` as SGLang does: a block-FP8 checkpoint config
(``{quant_method: fp8, weight_block_size: [128, 128]}``) makes the engine FP8 even without the
argument; anything SGLang's block ``Fp8Config`` refuses (another method, per-tensor FP8, a static
activation scheme) is refused here, naming the value. The answer is plain data (it travels to the
workers); `engine_layout` turns it into the engine's `TPLayout` (`fp8.FP8Layout` when quantized),
which holds every weight's dtype (`TPLayout.dtype_of`).

`dtype_refusal` / `scale_refusal` word the errors every load path raises for a tensor in the wrong
precision (a bfloat16 weight into an FP8 engine, an FP8 weight or a scale into an unquantized one),
with what to change.

Not here: the quantizer and the layout map (`fsdp_sync.weights.fp8`), checking the tensors
(`staging`, `update_items`), the dequantizing forward (`tp_model`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...weights import fp8
from ...weights.bucket import dtype_name
from ...weights.layout import ModelSpec, TPLayout
from .tp_model import check_runnable

__all__ = ["resolve", "engine_layout", "dtype_refusal", "scale_refusal"]

_FP8_DTYPES = tuple(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
                                getattr(torch, "float8_e4m3fnuz", None), getattr(torch, "float8_e5m2fnuz", None))
                    if d is not None)


def resolve(config: Any, quantization: Any) -> dict | None:
    """``{"method": "fp8", "block": (rows, cols), "ignored": (layer names...)}`` for an engine
    started with ``quantization`` on ``config`` (a ``transformers`` config), or None for an
    unquantized one. Raises ValueError naming the parameter or config field and its value."""
    if quantization not in fp8.QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(fp8.QUANTIZATIONS)} (SGLang's --quantization; "
                         f"'fp8' is block-wise FP8, weight_block_size {list(fp8.BLOCK)}), got {quantization!r}")
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    if not qc:
        if quantization is None:
            return None
        return {"method": "fp8", "block": tuple(fp8.BLOCK), "ignored": ()}   # quantized online
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"the model config's quantization_config has quant_method {method!r}; the reference "
                         f"engine runs block FP8 only (quant_method 'fp8', weight_block_size {list(fp8.BLOCK)})")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError("the model config's quantization_config is per-tensor FP8 (quant_method 'fp8' without "
                         "weight_block_size); the reference engine runs block FP8 only (weight_block_size "
                         f"{list(fp8.BLOCK)})")
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"the model config's quantization_config has weight_block_size {block!r}; expected "
                         f"two positive ints such as {list(fp8.BLOCK)}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"the model config's quantization_config has activation_scheme {scheme!r}; block FP8 "
                         f"quantizes activations dynamically (SGLang refuses any other scheme with a block size)")
    ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()
    # a list of names, as `weights.fp8_config` reads it for the sync (a dict's keys, a number: refused)
    if not isinstance(ignored, (list, tuple)) or not all(isinstance(i, str) for i in ignored):
        raise ValueError(f"the model config's quantization_config has ignored_layers / modules_to_not_convert "
                         f"{ignored!r}; expected a list of module names")
    return {"method": "fp8", "block": (int(block[0]), int(block[1])), "ignored": tuple(ignored)}


def engine_layout(spec: ModelSpec, tp: int, ep: int, quant: dict | None) -> TPLayout:
    """The layout an engine of ``quant`` (`resolve`'s answer) holds: `TPLayout`, or `fp8.FP8Layout`,
    which refuses a TP/EP split that cuts a block (`fp8.check_block_shapes`). First refuses a model
    the engine's forward does not compute (`tp_model.check_runnable`: rope scaling, say), so the
    engine, `serve` and `demo` say so before any worker starts."""
    check_runnable(spec)
    if quant is None:
        return TPLayout(spec, tp, ep)
    return fp8.FP8Layout(spec, tp, ep, ignored=quant.get("ignored", ()), block=tuple(quant["block"]))


def _on(rank: int | None) -> str:
    return "" if rank is None else f" on TP rank {rank}"


def dtype_refusal(name: str, got: Any, want: torch.dtype, rank: int | None, quantization: str | None) -> str:
    """``expected dtype W for 'name' on TP rank r, got G`` and what to change: quantize on the
    trainer side (an FP8 engine), start the engine quantized (an FP8 tensor into an unquantized
    one), or cast (a plain dtype mismatch)."""
    g = dtype_name(got) if isinstance(got, torch.dtype) else str(got)
    msg = f"expected dtype {dtype_name(want)} for {name!r}{_on(rank)}, got {g}"
    if want in _FP8_DTYPES:
        return (msg + "; this engine runs block FP8 (quantization='fp8'): each quantized weight arrives as "
                "float8_e4m3fn with its float32 weight_scale_inv; quantize on the trainer side "
                "(SyncConfig(quantization='fp8')) or start the engine with quantization=None")
    if got in _FP8_DTYPES and quantization is None:
        return (msg + "; this engine holds unquantized weights (quantization=None): start it with "
                "quantization='fp8' (fsdp-sync serve --quantization fp8) to take block-FP8 weights, or "
                "send unquantized ones (SyncConfig(quantization=None))")
    if quantization is not None and name.endswith("_scale_inv"):
        return msg + "; a block-FP8 weight_scale_inv is float32, whatever the rollout dtype"
    return (msg + f"; the engine runs in {dtype_name(want)}: send {dtype_name(want)} tensors "
            f"(FSDPShardingManager casts them with SyncConfig(dtype=torch.{dtype_name(want)}))")


def scale_refusal(name: str, quantization: str | None) -> str:
    """What to add to an "unknown parameter" error for ``name``: a ``..._scale_inv`` sent to an
    unquantized engine says so (and what to change); anything else, nothing."""
    if quantization is None and name.endswith("_scale_inv"):
        return ("; it is a block-FP8 scale (float32), and this engine holds unquantized weights "
                "(quantization=None): start it with quantization='fp8' (fsdp-sync serve --quantization "
                "fp8), or send unquantized weights (SyncConfig(quantization=None))")
    return ""
