"""Block FP8 (`weights.fp8`): the quantizer against a straightforward block-by-block reference (bit for
bit: FP8 bytes and scale bytes), NaN/Inf refused by name, the round trip within FP8's precision, and
which HF tensors of each family are quantized. SGLang's own quantizer and dequantizer are compared
in the sglang tier (``tests/sglang_tier/test_sglang_fp8.py``)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fsdp_sync.weights import fp8
from fsdp_sync.weights.fp8 import dequantize_block, quantize_block
from fsdp_sync.weights.layout import ModelSpec, TPLayout

pytestmark = pytest.mark.timeout(120)

F8 = torch.float8_e4m3fn


def reference_quantize(w: torch.Tensor, block=(128, 128)):
    """SGLang's convention written the plain way: one block at a time, its amax in float32 clamped
    to 1e-4, scale_inv = amax / 448, q = block / scale_inv cast to float8_e4m3fn (no padding: a
    partial edge block is just smaller)."""
    bn, bk = block
    n, k = w.shape
    x = w.to(torch.float32)
    q = torch.empty(n, k, dtype=F8)
    s = torch.empty(math.ceil(n / bn), math.ceil(k / bk), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = x[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            amax = torch.clamp(blk.abs().max(), min=1e-4)
            sc = amax / 448.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / sc).to(F8)
            s[i, j] = sc
    return q, s


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_same(w: torch.Tensor, block=(128, 128)):
    q, s = quantize_block("w", w, block)
    rq, rs = reference_quantize(w.cpu(), block)
    assert q.dtype == F8 and q.shape == w.shape and s.dtype == torch.float32
    assert q.is_contiguous() and s.is_contiguous()     # partial edge blocks too: handles take whole tensors
    assert tuple(s.shape) == fp8.scale_shape(tuple(w.shape), block) == tuple(rs.shape)
    assert _bytes(s.cpu()) == _bytes(rs), "scale_inv bytes differ from the reference"
    assert _bytes(q.cpu()) == _bytes(rq), "fp8 bytes differ from the reference"
    return q, s


SHAPES = [(1, 1), (1, 300), (300, 1), (129, 257), (300, 70), (128, 128), (256, 384), (127, 129), (5, 640)]


def _cases(shape, dtype, gen):
    n, k = shape
    yield torch.randn(n, k, generator=gen).to(dtype)
    # per-row scales spread over 12 decades (8 in float16's range), so blocks differ wildly
    e = 4 if dtype == torch.float16 else 6
    yield (torch.randn(n, k, generator=gen) * torch.logspace(-e, e, n).unsqueeze(1)).to(dtype)
    z = torch.randn(n, k, generator=gen)
    z[: min(n, 128), : min(k, 128)] = 0.0        # a whole zero block (the first)
    z[-1, -1] = -0.0
    yield z.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference_bit_for_bit(shape, dtype):
    gen = torch.Generator().manual_seed(hash(shape) % 1000)
    for w in _cases(shape, dtype, gen):
        _assert_same(w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_huge_and_tiny_values(dtype):
    fi = torch.finfo(dtype)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(129, 257, generator=gen)
    w[:128, :128] *= fi.max / 8                         # a huge block ...
    w[0, 0], w[1, 1] = fi.max, -fi.max                  # ... reaching the dtype's max
    w[:128, 128:256] *= 1e-30                           # tiny (below the 1e-4 amax floor)
    w[:128, 256] = fi.tiny / 4                          # subnormal of the dtype
    w[128, :128] = torch.linspace(-fi.tiny, fi.tiny, 128)   # a partial block of tiny normals
    w = w.to(dtype)
    assert torch.isfinite(w).all()
    q, s = _assert_same(w)
    assert torch.isfinite(s).all() and torch.isfinite(q.float()).all()
    back = dequantize_block(q, s)
    assert torch.isfinite(back).all()
    # the huge block keeps its extremes: amax maps to 448 exactly, then back to about fi.max
    assert q[0, 0].float() == 448.0 and q[1, 1].float() == -448.0
    assert back[0, 0] == pytest.approx(float(fi.max), rel=1e-6)
    # blocks below the 1e-4 floor are scaled as if their amax were 1e-4: tiny values round to zero
    floor = torch.tensor(1e-4, dtype=torch.float32) / 448.0
    assert s[0, 1] == floor and s[0, 2] == floor
    assert (q[:128, 128:].float() == 0).all()


def test_zero_blocks_and_signed_zero():
    w = torch.zeros(200, 300)
    w[150, 10] = 2.0
    w[5, 5] = -0.0
    q, s = _assert_same(w)
    floor = torch.tensor(1e-4, dtype=torch.float32) / 448.0
    assert (s[0] == floor).all() and s[1, 0] == torch.tensor(2.0) / 448.0
    assert (s[1, 1:] == floor).all()
    assert _bytes(q[5, 5]) == b"\x80" and _bytes(q[5, 6]) == b"\x00"    # -0.0 keeps its sign
    assert q[150, 10].float() == 448.0


def test_cast_rounds_to_nearest_even_and_never_saturates_to_nan():
    # amax 448 -> scale exactly 1, so q is the value itself, rounded by the e4m3 grid
    # (between 16 and 32 the step is 2: 17 ties to 16 (even mantissa), 19 ties to 20, 17.5 -> 18;
    # subnormals are multiples of 2**-9: 2**-10 ties to 0, 1.5 * 2**-9 ties to 2 * 2**-9)
    vals = torch.tensor([448.0, 17.0, 19.0, 17.5, -17.0, 0.0009765625, 0.0029296875, 300.0])
    w = torch.zeros(1, 128)
    w[0, : vals.numel()] = vals
    q, s = quantize_block("w", w)
    assert s.item() == 1.0
    assert q[0, : vals.numel()].float().tolist() == [448.0, 16.0, 20.0, 18.0, -16.0, 0.0,
                                                     0.00390625, 288.0]
    # amax that is not a power of two: x / scale_inv can land a float32 ulp above 448; the cast
    # rounds it back to 448 (float8_e4m3fn has no Inf, torch's cast gives NaN only past 464)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        w = torch.rand(128, 128, generator=gen) * float(torch.rand(1, generator=gen) * 1e3 + 1e-3)
        q, _ = quantize_block("w", w)
        assert not q.float().isnan().any() and q.float().abs().max() == 448.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nan_and_inf_refused_naming_the_tensor(bad, dtype):
    w = torch.randn(130, 260).to(dtype)
    w[129, 7] = bad
    name = "model.layers.3.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=r"'model\.layers\.3\.mlp\.down_proj\.weight'.*1 of 33800 values "
                                         r"are NaN or Inf \(first at \(129, 7\)"):
        quantize_block(name, w)


def test_refuses_other_shapes_and_dtypes():
    with pytest.raises(ValueError, match=r"expected a 2-D weight .* for 'b', got shape \(5,\)"):
        quantize_block("b", torch.ones(5))
    with pytest.raises(ValueError, match=r"expected dtype bfloat16, float16 or float32 for 'w', got float64"):
        quantize_block("w", torch.ones(2, 2, dtype=torch.float64))
    q, s = quantize_block("w", torch.ones(3, 5))
    with pytest.raises(ValueError, match=r"expected scale_inv of shape \(1, 1\)"):
        dequantize_block(q, torch.ones(2, 1))


def test_experts_3d_are_blocked_per_matrix():
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(3, 200, 130, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    w[1] *= 1000
    q, s = quantize_block("experts", w)
    assert s.shape == (3, 2, 2)
    for e in range(3):
        rq, rs = reference_quantize(w[e])
        assert _bytes(q[e]) == _bytes(rq) and _bytes(s[e]) == _bytes(rs)
    back = dequantize_block(q, s, torch.bfloat16)
    assert back.shape == w.shape and back.dtype == torch.bfloat16
    for e in range(3):
        assert torch.equal(back[e], dequantize_block(q[e], s[e], torch.bfloat16))


def test_block_size_is_a_parameter():
    w = torch.randn(70, 50, generator=torch.Generator().manual_seed(2))
    q, s = _assert_same(w, (32, 16))
    assert s.shape == (3, 4)


@pytest.mark.parametrize("shape", [(1, 300), (129, 257), (300, 70), (256, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_trip_within_fp8_precision(shape, dtype):
    gen = torch.Generator().manual_seed(11)
    w = (torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[0]).unsqueeze(1)).to(dtype)
    q, s = quantize_block("w", w)
    back = dequantize_block(q, s, torch.float32)
    x = w.float()
    # e4m3: 3 mantissa bits -> half an ulp is 2**-4 of the value; below the normal range (2**-6 of
    # the block's scale) the step is 2**-9 of the scale, so half of it is the absolute floor
    per_elem_scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    bound = x.abs() * 2.0 ** -4 + per_elem_scale * 2.0 ** -10
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    # and cast to the rollout dtype, as an engine would hold it
    assert dequantize_block(q, s, dtype).dtype == dtype


def test_scale_name():
    assert fp8.scale_name("model.layers.0.mlp.experts.3.up_proj.weight") == \
        "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"
    # SGLang's FusedMoE parameters (Fp8MoEMethod's w13_weight_scale_inv / w2_weight_scale_inv)
    assert fp8.scale_name("model.layers.0.mlp.experts.w13_weight") == "model.layers.0.mlp.experts.w13_weight_scale_inv"
    assert fp8.scale_name("model.layers.0.mlp.experts.w2_weight") == "model.layers.0.mlp.experts.w2_weight_scale_inv"
    with pytest.raises(ValueError, match="ends with '.weight'"):
        fp8.scale_name("model.layers.0.self_attn.q_proj.bias")
    with pytest.raises(ValueError, match="ends with '.weight'"):
        fp8.scale_name("model.layers.0.mlp.gate_weight")


@pytest.mark.parametrize("family,tp,ep", [("qwen3_moe", 2, 2), ("mixtral", 1, 1)])
def test_fp8_layout_of_an_moe_model(family, tp, ep):
    """`FP8Layout` of an MoE model: the fused experts' engine scales are ``experts.w13_weight_scale_inv``
    / ``experts.w2_weight_scale_inv`` of `scale_shape` of each rank's ``[E_local, rows, cols]``."""
    layout = fp8.FP8Layout(SPECS[family], tp, ep)
    shapes = layout.engine_shapes()
    for w in ("w13_weight", "w2_weight"):
        name = f"model.layers.0.{SPECS[family].moe_prefix}.experts.{w}"
        assert layout.dtype_of(name, torch.bfloat16) == F8
        assert shapes[name + "_scale_inv"] == fp8.scale_shape(shapes[name])
        assert layout.dtype_of(name + "_scale_inv", torch.bfloat16) == torch.float32


# --------------------------------------------------------------------------- which tensors

def _spec(model_type, **kw):
    base = dict(model_type=model_type, vocab_size=1000, hidden_size=256, intermediate_size=512,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                rope_theta=1e4, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                mlp_bias=False, max_position_embeddings=128)
    base.update(kw)
    return ModelSpec(**base)


MOE = dict(num_experts=4, top_k=2, moe_intermediate_size=256, moe_layers=(0, 1))
SPECS = {
    "qwen2": _spec("qwen2", qkv_bias=True, head_dim=128, num_kv_heads=1),
    "llama": _spec("llama", qkv_bias=True, o_bias=True, mlp_bias=True, head_dim=128),
    "qwen3": _spec("qwen3", qk_norm=True, tie_word_embeddings=True, head_dim=128),
    "qwen3_moe": _spec("qwen3_moe", qk_norm=True, head_dim=128, **MOE),
    "qwen2_moe": _spec("qwen2_moe", qkv_bias=True, head_dim=128, shared_expert_intermediate_size=256, **MOE),
    "mixtral": _spec("mixtral", head_dim=128, **MOE),
}

QUANTIZED_LEAVES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                    "w1", "w2", "w3"}


@pytest.mark.parametrize("family", list(SPECS))
def test_quantized_names_per_family(family):
    layout = TPLayout(SPECS[family], 1)
    names = fp8.quantized_names(layout)
    for n in layout.hf_names():
        parts = n.split(".")
        want = parts[-1] == "weight" and parts[-2] in QUANTIZED_LEAVES
        assert fp8.is_quantized(n, layout) == want, n
        assert (n in names) == want
    assert not fp8.is_quantized("lm_head.weight", layout)
    assert not fp8.is_quantized("model.layers.9.mlp.nonsense.weight", layout)
    spec = SPECS[family]
    never = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"]
    if spec.qk_norm:
        never += ["model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"]
    if spec.num_experts:
        m = f"model.layers.0.{spec.moe_prefix}."
        never.append(m + "gate.weight")
        g, u, d = spec.expert_names
        assert {f"{m}experts.3.{p}.weight" for p in (g, u, d)} <= set(names)
        if spec.shared_expert_intermediate_size:
            never.append(m + "shared_expert_gate.weight")
            assert {m + "shared_expert.gate_proj.weight", m + "shared_expert.down_proj.weight"} <= set(names)
    if spec.qkv_bias:
        never.append("model.layers.0.self_attn.q_proj.bias")
    if spec.mlp_bias:
        never += ["model.layers.0.mlp.gate_proj.bias", "model.layers.0.mlp.down_proj.bias"]
    for n in never:
        assert layout.accepts(n) and not fp8.is_quantized(n, layout), n
    expect = 7 * spec.num_layers if not spec.num_experts else \
        (4 + 3 * spec.num_experts + (3 if spec.shared_expert_intermediate_size else 0)) * spec.num_layers
    assert len(names) == expect


def test_ignored_modules_as_sglang_matches_them():
    layout = TPLayout(SPECS["qwen2_moe"], 1)
    # a whole layer, q/k/v by their checkpoint names, the experts of one layer
    ign = ["model.layers.1", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
           "model.layers.0.self_attn.v_proj", "model.layers.0.mlp.experts"]
    names = set(fp8.quantized_names(layout, ign))
    assert not any(n.startswith("model.layers.1.") for n in names)
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    assert "model.layers.0.self_attn.o_proj.weight" in names
    # SGLang matches a fused linear by its shards' names: "qkv_proj" skips nothing
    assert "model.layers.0.self_attn.q_proj.weight" in fp8.quantized_names(layout, ["model.layers.0.self_attn.qkv_proj"])
    assert not any(".experts." in n for n in names)
    assert "model.layers.0.mlp.shared_expert.up_proj.weight" in names
    # dotted boundaries: "mlp.gate" (a router name in some configs) does not skip gate_up / gate_proj
    names = set(fp8.quantized_names(layout, ["mlp.gate"]))
    assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in names
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names
    # some but not all shards of a fused parameter: refused, as SGLang refuses it
    with pytest.raises(ValueError, match=r"skip some but not all tensors of 'model\.layers\.0\.self_attn\.qkv_proj"):
        fp8.quantized_names(layout, ["model.layers.0.self_attn.k_proj"])
    # one expert named: SGLang leaves that layer's whole FusedMoE unquantized
    names = set(fp8.quantized_names(layout, ["model.layers.0.mlp.experts.2.down_proj"]))
    assert not any(n.startswith("model.layers.0.mlp.experts.") for n in names)
    assert "model.layers.1.mlp.experts.2.down_proj.weight" in names


@pytest.mark.parametrize("family", list(SPECS))
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2)])
def test_block_shapes_accepted(family, tp, ep):
    spec = SPECS[family]
    if ep > 1 and not spec.num_experts:
        return
    fp8.check_block_shapes(TPLayout(spec, tp, ep))


def test_block_shapes_refused_as_sglang_refuses_them():
    # 64-wide heads: at tp 1 each of q (4 x 64) and k/v (2 x 64) is a whole number of blocks only
    # for q; k/v are 128 rows (fine); at tp 2 q is 128 per rank, k/v 64: refused
    fp8.check_block_shapes(TPLayout(_spec("qwen3"), 1))
    with pytest.raises(ValueError, match=r"tp 2.*k_proj/v_proj rows per rank = 64 is not a multiple of block 128"):
        fp8.check_block_shapes(TPLayout(_spec("qwen3"), 2))
    # the dense MLP at tp 4: 512 / 4 = 128 is fine; intermediate 384 at tp 2 is 192 rows, refused
    with pytest.raises(ValueError, match=r"gate_proj/up_proj rows per rank .* = 192 .*down_proj input per rank "
                                         r"\(intermediate_size / tp\) = 192 is not a multiple of block 128"):
        fp8.check_block_shapes(TPLayout(_spec("qwen3", intermediate_size=384, head_dim=128), 2))
    # experts: 256 / 4 = 64 rows per rank at tp 4 (refused), whole experts per rank at ep 4 (fine)
    spec = SPECS["qwen3_moe"]
    with pytest.raises(ValueError, match=r"expert rows per rank .* = 64 is not"):
        fp8.check_block_shapes(TPLayout(spec, 4, 1))
    fp8.check_block_shapes(TPLayout(spec, 4, 4))
    # the row-parallel input is only checked when it is split (tp > 1), as SGLang does
    fp8.check_block_shapes(TPLayout(_spec("llama", num_heads=3, num_kv_heads=1, head_dim=128, hidden_size=384), 1))
    # ... and only there: o_proj's 3 x 64 = 192 input, qkv left unquantized (ignored_layers, so
    # its own 192 q rows constrain nothing), is whole at tp 1, cut into 64 a rank at tp 3
    spec = _spec("llama", num_heads=3, num_kv_heads=3, head_dim=64, hidden_size=384, intermediate_size=384)
    for tp in (1, 3):
        layout = TPLayout(spec, tp)
        names = fp8.quantized_names(layout, ["q_proj", "k_proj", "v_proj"])
        assert any(".o_proj." in n for n in names) and not any(".q_proj." in n for n in names)
        if tp == 1:
            fp8.check_block_shapes(layout, quantized=names)
        else:
            with pytest.raises(ValueError, match=r"o_proj input per rank \(heads / tp \* head_dim\) = 64 is not"):
                fp8.check_block_shapes(layout, quantized=names)


@pytest.mark.parametrize("family,tp,ep", [("qwen2", 2, 1), ("llama", 2, 1), ("qwen3", 2, 1), ("qwen3_moe", 2, 2),
                                          ("qwen2_moe", 2, 1), ("mixtral", 2, 1)])
def test_rank_pieces_are_whole_blocks(family, tp, ep):
    """Under a split `check_block_shapes` accepts, each rank's piece of a quantized tensor quantizes
    to exactly its slice of the full tensor's (q, scale_inv), and `scale_placement` names that
    slice: quantizing before or after the TP split gives the same bytes, and the pieces' scales
    fill each rank's ``weight_scale_inv`` (`scale_shape` of the engine parameter) exactly once."""
    spec = dataclasses.replace(SPECS[family], hidden_size=320)       # a partial edge block of columns
    layout = TPLayout(spec, tp, ep)
    fp8.check_block_shapes(layout)
    gen = torch.Generator().manual_seed(4)
    shapes = layout.engine_shapes()
    for r in range(tp):
        filled = {}
        for name in fp8.quantized_names(layout):
            full = torch.randn(layout.full_shape(name), generator=gen).to(torch.bfloat16)
            q, s = quantize_block(name, full)
            for pl in layout.placements(name, r):
                spl = fp8.scale_placement(pl)
                pq, ps = quantize_block(name, full[pl.src])
                assert _bytes(pq) == _bytes(q[pl.src]) and _bytes(ps) == _bytes(s[spl.src]), (name, r)
                eng = filled.setdefault(spl.engine, torch.zeros(fp8.scale_shape(shapes[pl.engine]), dtype=torch.int32))
                eng[spl.dst] += 1
                assert eng[spl.dst].shape == s[spl.src].shape
        assert filled and all((c == 1).all() for c in filled.values()), r


@pytest.mark.parametrize("shape", [(256, 384), (129, 257), (3, 256, 128), (3, 200, 130)],
                         ids=["whole-blocks", "edge-blocks", "experts", "experts-edge"])
def test_out_is_written_in_place_bit_for_bit(shape):
    """``out=`` (a bucket's slot): q lands in it, the same bytes as without, padded or not."""
    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(7)) * 5).to(torch.bfloat16)
    q0, s0 = quantize_block("w", w)
    slot = torch.full((w.numel() + 16,), 0x7F, dtype=torch.uint8)       # a bucket, bytes around it
    out = slot[8:8 + w.numel()].view(F8).view(shape)
    q1, s1 = quantize_block("w", w, out=out)
    assert q1.data_ptr() == out.data_ptr() and _bytes(q1) == _bytes(q0) and _bytes(s1) == _bytes(s0)
    assert (slot[:8] == 0x7F).all() and (slot[-8:] == 0x7F).all()          # nothing written around it
    # scale_out= (its slot in the same bucket): the scale lands there, q unchanged
    ns = s0.numel()
    sslot = torch.full((4 * ns + 8,), 0x7F, dtype=torch.uint8)
    sout = sslot[4:4 + 4 * ns].view(torch.float32).view(s0.shape)
    q2, s2 = quantize_block("w", w, out=out, scale_out=sout)
    assert s2.data_ptr() == sout.data_ptr() and _bytes(s2) == _bytes(s0) and _bytes(q2) == _bytes(q0)
    assert (sslot[:4] == 0x7F).all() and (sslot[-4:] == 0x7F).all()


def test_out_of_another_shape_or_dtype_is_refused_naming_the_tensor():
    w = torch.randn(128, 256)
    for bad in (torch.empty(128, 255, dtype=F8), torch.empty(128, 256, dtype=torch.uint8),
                torch.empty(256, 128, dtype=F8).t()):
        with pytest.raises(ValueError, match=r"out for 'layers\.0\.w' must be a contiguous float8_e4m3fn "
                                             r"tensor of shape \(128, 256\)"):
            quantize_block("layers.0.w", w, out=bad)
    for bad in (torch.empty(2, 1), torch.empty(2), torch.empty(1, 2, dtype=torch.float64),
                torch.empty(1, 4)[:, ::2]):
        with pytest.raises(ValueError, match=r"scale_out for 'layers\.0\.w' must be a contiguous float32 "
                                             r"tensor of shape \(1, 2\)"):
            quantize_block("layers.0.w", w, scale_out=bad)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_buckets_non_finite_weight_is_refused_by_name_after_one_check(bad):
    """The bucket quantizer checks NaN/Inf once per bucket, on the scales (one wait for the device
    instead of one per tensor), and still names the tensor, the count and the first place."""
    from fsdp_sync.weights import bucket as bk
    from fsdp_sync.weights.quantize import StreamQuantizer

    metas = [bk.TensorMeta("model.layers.0.mlp.up_proj.weight", torch.bfloat16, (256, 128)),
             bk.TensorMeta("model.layers.0.input_layernorm.weight", torch.bfloat16, (128,)),
             bk.TensorMeta("model.layers.0.mlp.down_proj.weight", torch.bfloat16, (128, 256))]
    (plan,) = bk.plan_buckets(metas, 1 << 20)
    flat = torch.zeros(plan.nbytes, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(0)
    tensors = {e.name: torch.randn(*e.shape, generator=gen).to(torch.bfloat16) for e in plan.entries}
    tensors["model.layers.0.mlp.down_proj.weight"][100, 200] = bad
    for e in plan.entries:
        flat[e.start:e.end].view(e.dtype).view(e.shape).copy_(tensors[e.name])
    layout = type("L", (), {"quantized": frozenset({m.name for m in metas if "proj" in m.name}),
                            "engine_quantized": frozenset(), "block": fp8.BLOCK})()
    quant = StreamQuantizer(layout)
    with pytest.raises(ValueError, match=r"cannot quantize 'model\.layers\.0\.mlp\.down_proj\.weight' to fp8: "
                                         r"1 of 32768 values are NaN or Inf \(first at \(100, 200\)"):
        quant.bucket(plan, flat, lambda n: torch.empty(n, dtype=torch.uint8))
    tensors["model.layers.0.mlp.down_proj.weight"][100, 200] = 1.0     # the same bucket, finite
    for e in plan.entries:
        flat[e.start:e.end].view(e.dtype).view(e.shape).copy_(tensors[e.name])
    out, buf = quant.bucket(plan, flat, lambda n: torch.empty(n, dtype=torch.uint8))
    for name in layout.quantized:
        q, s = quantize_block(name, tensors[name])
        e, es = {x.name: x for x in out.entries}[name], {x.name: x for x in out.entries}[fp8.scale_name(name)]
        assert _bytes(buf[e.start:e.end]) == _bytes(q) and _bytes(buf[es.start:es.end]) == _bytes(s)


def test_a_device_that_cannot_cast_on_store_gets_the_same_bits_in_two_steps(monkeypatch):
    """The division is cast to FP8 as it is stored where the device does that with torch's own
    rounding (`fp8.cast_on_store`, asked once per device type); elsewhere the quotient is made in
    float32 and cast: the same bytes either way."""
    w = (torch.randn(256, 384, generator=torch.Generator().manual_seed(11)) * 7).to(torch.bfloat16)
    assert fp8.cast_on_store(w.device)            # torch's CPU kernel does
    chunked = quantize_block("w", w)              # but holds temporaries: chunks of float32 on a CPU
    with monkeypatch.context() as m:              # the path a CUDA device takes: one division
        m.setattr(fp8, "CASTS_IN_TEMPORARIES", frozenset())
        direct = quantize_block("w", w)
        m.setitem(fp8._CAST_ON_STORE, "cpu", False)
        slot = torch.empty(256, 384, dtype=F8)
        two = quantize_block("w", w, out=slot)
    assert two[0].data_ptr() == slot.data_ptr()
    for q, s in (chunked, two):
        assert _bytes(q) == _bytes(direct[0]) and _bytes(s) == _bytes(direct[1])
    _assert_same(w)                               # and all are the reference's


@pytest.mark.parametrize("shape", [(4096, 8192), (4, 1024, 4096)], ids=["matrix", "experts"])
def test_a_cpu_quantizes_within_its_scratch_bound(shape):
    """On a CPU the quantizer divides in float32 chunks (`fp8.SCRATCH_ELEMENTS`): what it holds
    beside its outputs stays within `fp8.quantize_scratch_bytes`, the bound the plan and the bench
    budget. Before: one division of the whole weight, whose CPU kernel casts in temporaries of the
    weight's size: 257 MiB beside a 64 MiB bf16 weight, where the bound is 17 MiB. Measured as the
    rise of a fresh process's RSS (sampled; the allocator may keep a freed chunk: 16 MiB slack)."""
    import subprocess
    import sys

    bound = fp8.quantize_scratch_bytes(shape, 2)
    assert bound < 20 * 2**20
    code = f"""
import threading, time, psutil, torch
from fsdp_sync.weights.fp8 import quantize_block
w = torch.randn{shape}.to(torch.bfloat16)
out = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
sc = torch.empty(*w.shape[:-2], -(-w.shape[-2] // 128), -(-w.shape[-1] // 128))
out.view(torch.uint8).fill_(1), sc.fill_(1)                      # the outputs' pages, touched
quantize_block("w", w[..., :128, :128].contiguous(), check=False)
p, peak, done = psutil.Process(), [0], []
base = p.memory_info().rss
def sample():
    while not done:
        peak[0] = max(peak[0], p.memory_info().rss)
        time.sleep(0.0005)
t = threading.Thread(target=sample)
t.start()
for _ in range(3):
    quantize_block("w", w, out=out, scale_out=sc, check=False)
done.append(1)
t.join()
print(peak[0] - base)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    rise = int(r.stdout.split()[-1])
    assert rise <= bound + 16 * 2**20, (rise / 2**20, bound / 2**20)


def test_cast_on_store_is_refused_where_the_kernel_rounds_otherwise(monkeypatch):
    """A device whose division stores other bits than the two steps is not trusted (emulated: the
    direct store made to round one value differently)."""
    real = torch.div

    def off_by_one(*args, out=None, **kw):
        r = real(*args, out=out, **kw)
        if out is not None:
            out.view(torch.uint8)[100] ^= 1
        return r

    monkeypatch.setattr(fp8, "_CAST_ON_STORE", {})
    monkeypatch.setattr(torch, "div", off_by_one)
    assert fp8.cast_on_store(torch.device("cpu")) is False
