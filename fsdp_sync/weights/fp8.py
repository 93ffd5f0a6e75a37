"""Block-wise FP8 as SGLang loads a block-FP8 checkpoint (``quantization_config: {quant_method: fp8,
weight_block_size: [128, 128]}``): which Hugging Face tensors are quantized, and the quantizer.

A quantized linear weight ``[N, K]`` travels as ``weight`` (``float8_e4m3fn``, same shape) plus
``weight_scale_inv`` (``float32`` ``[ceil(N/128), ceil(K/128)]``, one per block, the edge blocks
partial), and ``weight ~= q * scale_inv`` block by block.

The convention is SGLang 0.5.23's own block quantizer,
``sglang/srt/layers/quantization/mxfp8_block_convert.py:bf16_to_block_fp8_128`` ("the DeepSeek-V3
block-fp8 contract"), followed bit for bit:

- the weight is converted to float32 and zero-padded up to whole blocks (padding never raises a
  block's amax, so the edge blocks are scaled by their real values only);
- ``amax`` per block in float32, clamped to at least ``1e-4`` (DeepGEMM's floor: an all-zero block
  gets ``scale_inv = float32(1e-4) / 448``, a block of tiny values is scaled as if its amax were
  1e-4, so values far below that round to zero);
- ``scale_inv = amax / 448`` (float32; no power-of-two rounding: the UE8M0 variant,
  ``fp8_utils.per_block_cast_to_fp8``, is DeepGEMM's requantization, not the checkpoint format).
  torch divides by a Python scalar on CUDA as a multiplication by its float32 reciprocal, on the
  CPU as a division, so SGLang's function, and this one, give a block's scale one float32 step
  apart on the two devices now and then (seen on an H200): the bits are SGLang's of the device
  the trainer quantizes on;
- ``q = (x / scale_inv).to(float8_e4m3fn)``: a float32 division, then torch's cast, which rounds to
  nearest, ties to even (``|x / scale_inv| <= 448`` up to one float32 rounding, which the cast
  rounds back to 448, so nothing saturates);
- NaN and Inf are refused, naming the tensor (a block's amax would be NaN/Inf and the whole block
  lost).

`quantize_block` computes the same bits with less traffic: a bfloat16 or float16 value is exact in
float32, so its amax (and the zero padding) can be taken in its own dtype and only the scale made
in float32; the division promotes to float32 as above and is cast to FP8 on its way into the
output (a 16-bit weight is read twice, FP8 written once). A bucket's quantizer checks NaN/Inf on
the scales, once per bucket (a non-finite value makes its block's scale non-finite).

Dequantization is ``fp8_utils.block_quant_dequant``: the scale repeated over its block, cut to the
weight's shape, multiplied in float32.

Which tensors: SGLang builds the layers these families use with ``Fp8LinearMethod`` when they are a
``LinearBase`` made with the model's quant config, and ``Fp8MoEMethod`` for ``FusedMoE``
(``Fp8Config.get_quant_method``): ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` (the
dense MLP and Qwen2-MoE's shared expert) and the routed experts (``w13_weight``/``w2_weight``).
Embeddings and the lm_head (``VocabParallelEmbedding``, no Fp8 method), norms, biases, the router
``gate`` (its ``ReplicatedLinear`` gets ``quant_config=None`` in ``qwen2_moe``/``mixtral``, and
``qwen3_moe`` passes it only for ModelSlim) and ``shared_expert_gate`` (``quant_config=None``) stay
in the rollout dtype. A checkpoint's ``ignored_layers`` / ``modules_to_not_convert`` are honoured
as SGLang's ``is_layer_skipped`` matches them (on dotted module-path boundaries); `fp8_config` reads
the list from a model config as the engines read it.

Not here: moving the tensors (export, buckets, transports) or loading them (engines).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from fsdp_sync.weights.layout import ModelSpec, Placement, TPLayout, split_refusal

__all__ = ["BLOCK", "FP8_MAX", "AMAX_FLOOR", "QUANTIZATIONS", "scale_shape", "scale_name", "quantize_block",
           "check_finite", "scales_finite", "CASTS_IN_TEMPORARIES", "SCRATCH_ELEMENTS",
           "quantize_scratch_bytes", "dequantize_block", "is_quantized", "quantized_names", "check_block_shapes",
           "scale_placement", "FP8Layout", "quantized_layout"]

QUANTIZATIONS = (None, "fp8")
"""What ``SyncConfig.quantization`` and the engines' ``quantization`` take (SGLang's names)."""

BLOCK = (128, 128)
"""SGLang's ``weight_block_size`` for block FP8 (rows, cols)."""
FP8_MAX = 448.0
"""The largest finite ``float8_e4m3fn`` value."""
AMAX_FLOOR = 1e-4
"""A block's amax is clamped to at least this (SGLang's and DeepGEMM's ``clamp(min=1e-4)``)."""

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)

# SGLang's parameters that an Fp8 quant method owns: its fused linears and FusedMoE's two weights
_QUANTIZED_ENGINE = ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "gate_up_proj.weight",
                     "down_proj.weight", "experts.w13_weight", "experts.w2_weight")


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` (leading dims kept: ``[E, N, K]``
    experts get ``[E, ceil(N/bn), ceil(K/bk)]``)."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / block[0]), math.ceil(k / block[1]))


def scale_name(name: str) -> str:
    """``...proj.weight`` -> ``...proj.weight_scale_inv`` (the name SGLang's loader looks for); an
    engine's fused experts ``experts.w13_weight`` -> ``experts.w13_weight_scale_inv`` (``Fp8MoEMethod``'s)."""
    if not name.endswith((".weight", "experts.w13_weight", "experts.w2_weight")):
        raise ValueError(f"a quantized tensor's name ends with '.weight' (or is an engine's "
                         f"'experts.w13_weight' / 'experts.w2_weight'), got {name!r}")
    return name + "_scale_inv"


def _check(name: str, w: torch.Tensor, block: tuple[int, int]) -> None:
    if w.dim() not in (2, 3):
        raise ValueError(f"expected a 2-D weight (or 3-D [experts, rows, cols]) for {name!r}, "
                         f"got shape {tuple(w.shape)}")
    if w.dtype not in _FLOATS:
        raise ValueError(f"expected dtype bfloat16, float16 or float32 for {name!r}, got "
                         f"{str(w.dtype).removeprefix('torch.')}")
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"expected a block of two positive sizes, got {block!r}")


def check_finite(name: str, w: torch.Tensor) -> None:
    """Raise naming ``name``, the count and the first place of a NaN or Inf in ``w`` (reads it
    all and waits for the device: `quantize_block` callers that quantize many tensors check their
    scales once instead, see `scales_finite`)."""
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"cannot quantize {name!r} to fp8: {int(bad.sum())} of {w.numel()} values "
                         f"are NaN or Inf (first at {where}: {w[where].item()})")


def scales_finite(scales: list[torch.Tensor]) -> bool:
    """Whether every scale of `quantize_block` outputs is finite: a block holding a NaN or an Inf
    has a NaN or Inf amax (``amax``/``amin`` and ``maximum`` propagate NaN), so this is the
    weights' own check at a scale's size, with one wait for the device for all of them."""
    if not scales:
        return True
    return bool(torch.isfinite(torch.cat([s.reshape(-1) for s in scales])).all())


_CAST_ON_STORE: dict[str, bool] = {}


def cast_on_store(device: torch.device) -> bool:
    """Whether ``torch.div(x, s, out=<float8_e4m3fn>)`` on ``device`` stores the float32 quotient
    with the same bits as the division followed by torch's cast (`quantize_block` then skips the
    float32 quotient in memory). Asked once per device type, on bf16 values over the FP8 range and
    at its rounding ties; a device whose kernel refuses the out dtype, or rounds otherwise, gets
    the two steps."""
    key = torch.device(device).type
    if key not in _CAST_ON_STORE:
        gen = torch.Generator().manual_seed(0)
        x = (torch.randn(4096, generator=gen) * torch.logspace(-6, 3, 4096)).to(torch.bfloat16)
        x[:8] = torch.tensor([448.0, 17.0, 19.0, 17.5, -17.0, 0.0009765625, 0.0029296875, -0.0])
        s = torch.tensor([1.0, 0.37, 1e-4 / FP8_MAX, 3.9], dtype=torch.float32).repeat_interleave(1024)
        x, s = x.to(device), s.to(device)
        try:
            out = torch.empty(4096, dtype=torch.float8_e4m3fn, device=device)
            torch.div(x, s, out=out)
            two = torch.div(x, s).to(torch.float8_e4m3fn)
            _CAST_ON_STORE[key] = torch.equal(out.view(torch.uint8), two.view(torch.uint8))
        except (RuntimeError, TypeError):
            _CAST_ON_STORE[key] = False
    return _CAST_ON_STORE[key]


def quantize_block(name: str, w: torch.Tensor, block: tuple[int, int] = BLOCK, *,
                   out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
                   check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale_inv)`` of weight ``w`` (``name`` is for errors): ``q`` float8_e4m3fn of ``w``'s
    shape, ``scale_inv`` float32 `scale_shape`, on ``w``'s device, bit for bit SGLang's
    ``bf16_to_block_fp8_128`` (see the module docstring). ``w``: 2-D, or 3-D for stacked experts
    (each ``[N, K]`` matrix blocked on its own). ``out``: a contiguous float8_e4m3fn tensor of
    ``w``'s shape that ``q`` is written into (and returned as ``q``); ``scale_out``: likewise a
    contiguous float32 tensor of `scale_shape` for ``scale_inv``. ``check=False`` leaves the
    NaN/Inf check to the caller (`scales_finite` of the scales, then `check_finite` by name).

    Computed in ``w``'s own dtype where that is exact: the block amax as the larger of ``amax``
    and ``-amin`` (a 16-bit value is exact in float32, so its amax is the float32 one), then the
    float32 scale; the division promotes to float32 as SGLang's does and is cast to FP8 on its
    way out. A 16-bit weight is read three times (its rows' ``amax``, ``amin``, the division) and
    FP8 written once (no float32 copy of the weight, no wait for the device)."""
    _check(name, w, block)
    if check:
        check_finite(name, w)
    bn, bk = block
    *lead, n, k = w.shape
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    padded = (nb * bn, kb * bk) != (n, k)
    if out is not None and (out.dtype != torch.float8_e4m3fn or tuple(out.shape) != tuple(w.shape)
                            or not out.is_contiguous() or out.device != w.device):
        raise ValueError(f"out for {name!r} must be a contiguous float8_e4m3fn tensor of shape "
                         f"{tuple(w.shape)} on {w.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
    if scale_out is not None and (scale_out.dtype != torch.float32 or not scale_out.is_contiguous()
                                  or tuple(scale_out.shape) != (*lead, nb, kb) or scale_out.device != w.device):
        raise ValueError(f"scale_out for {name!r} must be a contiguous float32 tensor of shape "
                         f"{(*lead, nb, kb)} on {w.device}, got {scale_out.dtype} "
                         f"{tuple(scale_out.shape)} on {scale_out.device}")
    x = w.reshape(-1, n, k)
    if padded:                                 # zero-pad the edge blocks, as SGLang does
        x = torch.nn.functional.pad(x, (0, kb * bk - k, 0, nb * bn - n))
    xv = x.view(-1, nb, bn, kb, bk)
    # few kernels and allocations a tensor: a sync quantizes hundreds, each costs its launches.
    # The block's amax in two steps, each over one dim: first over each row's 128 contiguous
    # elements of a block (the pass that reads the weight: an inner reduction with an output per
    # 128 elements, the layout reductions parallelize best), then over the block's 128 rows of
    # those (1/128 of the bytes); max of maxes is the same value bit for bit. The H200 ran the
    # one-step reduction over both of a block's dims at about 0.3 TB/s (docs/gpu.md); this one's
    # GPU rate is not measured yet (`dev/fp8_reductions_ab.py`); on a CPU both take the same time.
    rows = x.view(-1, nb * bn, kb, bk)
    amax = rows.amax(dim=-1).view(-1, nb, bn, kb).amax(dim=2)
    torch.maximum(amax, rows.amin(dim=-1).view(-1, nb, bn, kb).amin(dim=2).neg_(), out=amax)
    sf = amax.view(-1, nb, 1, kb, 1).to(torch.float32).clamp_(min=AMAX_FLOOR)
    if scale_out is not None:
        sf = torch.div(sf, FP8_MAX, out=scale_out.view(sf.shape))
    else:
        sf = sf.div_(FP8_MAX)
    scale = sf.view(*lead, nb, kb)
    fp8 = torch.float8_e4m3fn
    if not padded and w.device.type not in CASTS_IN_TEMPORARIES and cast_on_store(w.device):
        q = out if out is not None else torch.empty(w.shape, dtype=fp8, device=w.device)
        torch.div(xv, sf, out=q.view(-1, nb, bn, kb, bk))
        return q, scale
    # The float32 quotient through one buffer of whole block rows (`SCRATCH_ELEMENTS`): a CPU's
    # ``torch.div`` of a 16-bit weight by float32 scales casts in temporaries of the weight's size
    # (a float32 copy of it and the quotient: 8 bytes an element, also with an FP8 ``out``), and
    # the FP8 cast after it another (224 MiB measured beside a 32 MiB bf16 weight). The same division of the same float32 values, bit for bit;
    # no block spans two chunks. A weight with partial edge blocks goes through its zero-padded
    # copy and an FP8 one (`quantize_scratch_bytes`).
    qp = out if out is not None and not padded else torch.empty(x.shape if padded else w.shape, dtype=fp8,
                                                                device=w.device)
    xr, sr, qr = xv.reshape(-1, bn, kb, bk), sf.reshape(-1, 1, kb, 1), qp.view(-1, bn, kb, bk)
    step = min(xr.shape[0], max(1, SCRATCH_ELEMENTS // (bn * kb * bk)))
    buf = torch.empty((step, bn, kb, bk), dtype=torch.float32, device=w.device)
    for r in range(0, xr.shape[0], step):
        t = buf[:min(step, xr.shape[0] - r)]
        t.copy_(xr[r:r + step])
        t.div_(sr[r:r + step])
        qr[r:r + step].copy_(t)
    if not padded:
        return qp, scale
    q = qp.view(-1, nb * bn, kb * bk)[:, :n, :k]
    if out is not None:
        out.view(-1, n, k).copy_(q)
        return out, scale
    # the padded copy's slice is not contiguous: a handle (per_tensor, bucketed) takes only whole
    # tensors, and this copy is the output itself
    return q.reshape(*lead, n, k).contiguous(), scale


CASTS_IN_TEMPORARIES = frozenset({"cpu"})
"""Device types whose division of a 16-bit weight by float32 scales casts in temporaries of the
weight's size whatever the ``out`` dtype (torch's CPU kernels): `quantize_block` divides there in
chunks. A CUDA kernel casts each element in registers."""

SCRATCH_ELEMENTS = 1 << 22
"""Elements `quantize_block` divides at once where the device does not store the float32
quotient straight into FP8 (`cast_on_store`; a CPU): a float32 buffer of about 16 MiB (at least
one row of blocks), where dividing the whole weight at once held 14 bytes a bf16 element."""


def quantize_scratch_bytes(shape: tuple[int, ...], itemsize: int, block: tuple[int, int] = BLOCK) -> int:
    """The most `quantize_block` allocates beside its outputs for a weight of ``shape`` and
    ``itemsize`` (on any device; what the plan budgets): the float32 chunk buffer (`SCRATCH_ELEMENTS`
    of the weight, at least a row of blocks), a weight with partial edge blocks its zero-padded
    copy and FP8 quotient, and the block reductions' partial maxima (one per 128 elements, twice)."""
    bn, bk = block
    *lead, n, k = shape
    row = bn * math.ceil(k / bk) * bk
    elements = math.prod(lead) * math.ceil(n / bn) * row
    chunk = min(elements, row * max(1, SCRATCH_ELEMENTS // row))
    padded = (n % bn or k % bk) and elements * (itemsize + 1)
    return 4 * chunk + int(padded) + 2 * itemsize * (elements // bk)


def dequantize_block(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                     block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """``q * scale_inv`` block by block, in float32, then cast to ``dtype``: SGLang's
    ``fp8_utils.block_quant_dequant`` (leading dims of both tensors kept)."""
    *_, n, k = q.shape
    if tuple(scale_inv.shape) != scale_shape(tuple(q.shape), block):
        raise ValueError(f"expected scale_inv of shape {scale_shape(tuple(q.shape), block)} for a weight "
                         f"of shape {tuple(q.shape)} in blocks {tuple(block)}, got {tuple(scale_inv.shape)}")
    s = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)[..., :n, :k]
    return (q.to(torch.float32) * s).to(dtype)


def _module_match(ignored: str, module: str) -> bool:
    """SGLang's ``_module_path_match``: equal, a parent module, or a run of whole dotted parts."""
    ignored, module = ignored.rstrip("."), module.rstrip(".")
    return ignored == module or module.startswith(ignored + ".") or f".{ignored}." in f".{module}."


def is_quantized(name: str, layout: TPLayout, ignored: Iterable[str] = ()) -> bool:
    """Whether HF tensor ``name`` travels as FP8 (``weight`` + ``weight_scale_inv``): a weight
    whose engine parameter belongs to a layer SGLang builds with an Fp8 method (see the module
    docstring), unless ``ignored`` (the checkpoint's ``ignored_layers`` / ``modules_to_not_convert``)
    skips its layer as SGLang's ``is_layer_skipped`` does: a linear by its checkpoint module names
    (``q_proj``: an entry ``qkv_proj`` skips nothing), a layer's experts by their FusedMoE prefix
    (``mlp.experts``) or by any entry naming experts that contains it."""
    if not layout.accepts(name) or not name.endswith(".weight"):
        return False
    engine = layout.engine_name(name)
    if not engine.endswith(_QUANTIZED_ENGINE):
        return False
    if engine.endswith(("experts.w13_weight", "experts.w2_weight")):
        # one FusedMoE per layer, matched by its own prefix, or skipped whole when an entry that
        # names experts contains that prefix (one expert's name in the list skips them all)
        moe = engine.rsplit(".", 1)[0]
        return not any(_module_match(i, moe) or ("experts" in i and moe in i) for i in ignored)
    # a linear (fused or not) is matched by its checkpoint names: q_proj, not qkv_proj
    return not any(_module_match(i, name.removesuffix(".weight")) for i in ignored)


def quantized_names(layout: TPLayout, ignored: Iterable[str] = ()) -> list[str]:
    """The HF tensors of ``layout`` that travel as FP8, in `TPLayout.hf_names` order. Refuses an
    ``ignored`` list that skips some but not all tensors of one fused parameter (q/k/v, gate/up,
    one layer's experts), as SGLang's ``is_layer_skipped`` does."""
    ignored = tuple(ignored)
    names = [n for n in layout.hf_names() if is_quantized(n, layout, ignored)]
    if ignored:
        fused: dict[str, list[str]] = {}
        for n in layout.hf_names():
            fused.setdefault(layout.engine_name(n), []).append(n)
        kept = set(names)
        for engine, parts in fused.items():
            part = [n for n in parts if n in kept]
            whole = [n.removesuffix(".weight") for n in parts if n.endswith(".weight")]
            if part and len(part) < len(whole):
                raise ValueError(f"ignored layers {list(ignored)} skip some but not all tensors of {engine!r} "
                                 f"(quantized: {part[:3]}); all shards of a fused layer have one precision "
                                 f"(SGLang refuses it too): list all of {whole} or their module "
                                 f"{whole[0].rsplit('.', 1)[0]!r}, or none of them")
    return names


def check_block_shapes(layout: TPLayout, block: tuple[int, int] = BLOCK,
                       quantized: Iterable[str] | None = None) -> None:
    """Refuse a layout SGLang's block FP8 refuses (``Fp8LinearMethod.validate_block_quant_shapes``,
    ``Fp8MoEMethod.create_weights``), so that no TP or EP split cuts a block and each rank's
    ``weight_scale_inv`` is whole blocks of the full one:

    - every output partition of a fused column-parallel linear (this rank's q, k, v rows; gate and
      up rows; the shared expert's too) is a multiple of ``block[0]``, at any TP size;
    - at TP > 1 the row-parallel ``o_proj`` / ``down_proj`` input slice is a multiple of ``block[1]``;
    - each expert's intermediate slice is a multiple of ``block[0]``, and of ``block[1]`` when the
      experts are split over more than one rank (``tp / ep > 1``).

    ``quantized``: the HF tensors that travel as FP8 (`quantized_names` with the model's ignored
    layers); None: every layer SGLang quantizes. A rule is checked only where a layer it constrains
    is quantized: SGLang builds a layer its ``ignored_layers`` skips with the unquantized method,
    which checks no block (a misfit there is no cut block: that layer has no scale). The refusal
    names the first quantized tensor of each misfit."""
    s, t = layout.spec, layout.tp
    if quantized is None:
        names = quantized_names(layout)
    else:
        keep = set(quantized)
        names = [n for n in layout.hf_names() if n in keep]
    first: dict[str, str] = {}           # engine parameter kind -> its first quantized HF tensor
    for n in names:
        engine = layout.engine_name(n)
        kind = next((k for k in _QUANTIZED_ENGINE if engine.endswith(k)), None)
        if kind in ("gate_up_proj.weight", "down_proj.weight") and ".shared_expert." in engine:
            kind = "shared_expert." + kind
        if kind is not None:
            first.setdefault(kind, n)
            if kind == "self_attn.qkv_proj.weight" and (".k_proj." in n or ".v_proj." in n):
                first.setdefault("k/v", n)   # the fused layer's k or v part: the k/v rule names it
    bad = _misfits(s, t, layout.ep, first, block)
    if bad:
        raise ValueError(f"block FP8 {list(block)} at tp {t}, ep {layout.ep} ({s.model_type}): "
                         + "; ".join(bad) + _fitting_splits(s, t, layout.ep, first, block)
                         + "; a layer the model config's quantization_config.ignored_layers lists stays "
                         "unquantized, unchecked")


def _misfits(s: ModelSpec, t: int, ep: int, first: dict[str, str], block: tuple[int, int]) -> list[str]:
    """`check_block_shapes`' rules at ``t`` ranks and ``ep`` expert groups (a split the layout map
    takes: `layout.split_refusal` is None), for the quantized kinds ``first`` names."""
    (bn, bk), d = block, s.head_dim
    q, kv = s.num_heads // t * d, max(1, s.num_kv_heads // t) * d
    moe_tp = t // ep
    # (what, size, the kind it constrains, split: the ranks the input dim is cut over; 0 for rows)
    rules = [("q_proj rows per rank", q, "self_attn.qkv_proj.weight", 0),
             ("k_proj/v_proj rows per rank", kv, "self_attn.qkv_proj.weight", 0),
             ("o_proj input per rank (heads / tp * head_dim)", q, "self_attn.o_proj.weight", t)]
    if len(s.moe_layers) < s.num_layers:
        rules += [("gate_proj/up_proj rows per rank (intermediate_size / tp)", s.intermediate_size // t,
                   "gate_up_proj.weight", 0),
                  ("down_proj input per rank (intermediate_size / tp)", s.intermediate_size // t,
                   "down_proj.weight", t)]
    if s.shared_expert_intermediate_size:
        shared = s.shared_expert_intermediate_size // t
        rules += [("shared expert rows per rank", shared, "shared_expert.gate_up_proj.weight", 0),
                  ("shared expert down_proj input per rank", shared, "shared_expert.down_proj.weight", t)]
    if s.num_experts:
        inter = s.moe_intermediate_size // moe_tp
        rules += [("expert rows per rank (moe_intermediate_size / (tp / ep))", inter, "experts.w13_weight", 0),
                  ("expert down_proj input per rank", inter, "experts.w2_weight", moe_tp)]
    bad = []
    for what, v, kind, split in rules:
        b = bk if split else bn
        if kind in first and split != 1 and v % b:
            named = first.get("k/v", first[kind]) if what.startswith("k_proj/v_proj") else first[kind]
            bad.append(f"{what} = {v} is not a multiple of block {b} (quantized {named!r})")
    return bad


def _fitting_splits(s: ModelSpec, t: int, ep: int, first: dict[str, str], block: tuple[int, int]) -> str:
    """What to do about a refused block split: the EP sizes at tp ``t``, and the TP sizes (up to
    64) at ``ep``, whose every quantized slice is whole blocks (SGLang takes those)."""
    def fits(tp: int, e: int) -> bool:
        return split_refusal(s, tp, e) is None and not _misfits(s, tp, e, first, block)

    eps = [e for e in range(1, t + 1) if s.num_experts and e != ep and fits(t, e)]
    tps = [x for x in range(1, 65) if fits(x, ep)]
    at = f" with ep_size {ep}" if ep > 1 else ""
    if not eps and not tps:
        return (f"; SGLang refuses it too, and every tp_size up to 64{at}: leave those layers "
                f"unquantized (below) or sync unquantized (quantization=None)")
    out = f"; SGLang refuses it too: at tp_size {t} use ep_size {', '.join(map(str, eps[:8]))}, or" if eps \
        else "; SGLang refuses it too: start the engine (and make the trainer's infer_tp) at"
    return f"{out} a tp_size whose slices are whole blocks{at}: {', '.join(map(str, tps[:8])) or 'none up to 64'}"


def _in_blocks(sl: slice, b: int) -> slice:
    start, stop = sl.start or 0, sl.stop
    if start % b:
        raise ValueError(f"a block-FP8 piece starts at {start}, not a multiple of block {b} "
                         f"(check_block_shapes refuses such a split)")
    return slice(start // b, None if stop is None else -(-stop // b))


def scale_placement(pl: Placement, block: tuple[int, int] = BLOCK) -> Placement:
    """The ``weight_scale_inv`` piece that goes with weight placement ``pl`` (`TPLayout.placements`):
    the same rows and columns counted in blocks, into ``<engine>_scale_inv``. Exact because no split
    cuts a block (`check_block_shapes`); a piece ending at a partial edge block keeps that block."""
    src = tuple(_in_blocks(s, block[i]) for i, s in enumerate(pl.src))
    if pl.dst and isinstance(pl.dst[0], int):        # (expert, rows[, cols]) of a fused 3-D parameter
        dst = (pl.dst[0], *(_in_blocks(s, block[i]) for i, s in enumerate(pl.dst[1:])))
    else:
        dst = tuple(_in_blocks(s, block[i]) for i, s in enumerate(pl.dst))
    return Placement(pl.engine + "_scale_inv", dst, src, pl.owner)


class FP8Layout(TPLayout):
    """`TPLayout` of a block-FP8 rollout: every quantized weight (`quantized_names`) is held as
    ``float8_e4m3fn`` and followed by its ``weight_scale_inv`` (float32, `scale_shape`), both in
    the HF names (``...q_proj.weight_scale_inv``) and in the engine's (``...qkv_proj.weight_scale_inv``,
    ``experts.w13_weight_scale_inv`` ``[E_local, 2*I_local/128, H/128]``: SGLang's ``Fp8LinearMethod`` /
    ``Fp8MoEMethod`` parameters); a scale's placements are its weight's counted in blocks
    (`scale_placement`). Refuses, naming the tensor and the split, a TP/EP split that cuts a block
    (`check_block_shapes`). ``dtype_of`` tells each tensor's dtype; everything else (norms,
    embeddings, the lm_head, router gates, biases) stays in the rollout dtype."""

    quantization = "fp8"

    def __init__(self, spec: ModelSpec, tp_size: int, ep_size: int = 1, ignored: Iterable[str] = (),
                 block: tuple[int, int] = BLOCK):
        super().__init__(spec, tp_size, ep_size)
        self.block = tuple(block)
        self.quantized: frozenset[str] = frozenset(quantized_names(self, ignored))
        check_block_shapes(self, self.block, self.quantized)
        self.engine_quantized: frozenset[str] = frozenset(self.engine_name(n) for n in self.quantized)
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in self.hf_shapes.items():
            shapes[name] = shape
            if name in self.quantized:
                sn = scale_name(name)
                shapes[sn] = scale_shape(shape, self.block)
                self._kinds[sn] = ("scale", scale_name(self.engine_name(name)), name)
        self.hf_shapes = shapes
        # every scale's name, HF and engine: `dtype_of` runs once per tensor of every load
        self.scales: frozenset[str] = frozenset(scale_name(n) for n in self.quantized) | frozenset(
            scale_name(n) for n in self.engine_quantized)

    def engine_shapes(self) -> dict[str, tuple[int, ...]]:
        cache = self.__dict__.get("_fp8_engine_shapes")
        if cache is None:
            cache = {}
            for name, shape in super().engine_shapes().items():
                cache[name] = shape
                if name in self.engine_quantized:
                    cache[scale_name(name)] = scale_shape(shape, self.block)
            self.__dict__["_fp8_engine_shapes"] = cache
        return dict(cache)

    def placements(self, name: str, rank: int) -> list[Placement]:
        kind = self._kinds.get(name)
        if kind is not None and kind[0] == "scale":
            return [scale_placement(pl, self.block) for pl in super().placements(kind[2], rank)]
        return super().placements(name, rank)

    def weight_of(self, name: str) -> str | None:
        """The weight a ``..._scale_inv`` tensor (HF or engine name) scales, else None."""
        if not name.endswith("_scale_inv"):
            return None
        kind = self._kinds.get(name)
        return kind[2] if kind is not None else name.removesuffix("_scale_inv")

    def dtype_of(self, name: str, dtype, itemsize: int | None = None):
        if name in self.scales:
            d = torch.float32
        elif name in self.quantized or name in self.engine_quantized:
            d = torch.float8_e4m3fn
        else:
            return itemsize if itemsize is not None else dtype
        return d.itemsize if itemsize is not None else d


def quantized_layout(layout: TPLayout, quantization: str | None) -> TPLayout:
    """``layout`` as it is held under ``quantization`` (None: itself; ``"fp8"``: its `FP8Layout`),
    every layer SGLang quantizes quantized: a layout has no model config, so the config's
    ``ignored_layers`` are not read here (a model whose only block misfit is an ignored layer is
    refused); where the config is at hand, `fp8_config.held_layout` gives what the engine holds."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    if quantization is None or isinstance(layout, FP8Layout):
        return layout
    return FP8Layout(layout.spec, layout.tp, layout.ep)
