"""fsdp_sync's block FP8 (`weights.fp8`) against SGLang's own code, on CPU. Run in the SGLang tier
venv with a JSON list of model cases ``[recipe, overrides, tp, ep]``; prints JSON.

1. The quantizer: for each input (odd shapes, zero blocks, huge and tiny values; bfloat16, float16,
   float32), the bytes of our ``(q, scale_inv)`` and of SGLang's
   ``srt/layers/quantization/mxfp8_block_convert.py:bf16_to_block_fp8_128`` (its only block
   quantizer with plain float32 scales in the runtime), and of SGLang's
   ``fp8_utils.block_quant_dequant`` of our pair against our `dequantize_block`. Also reported,
   not required to agree: how many FP8 bytes differ from ``sglang/benchmark/deepseek_utils.py:
   per_block_cast_to_fp8`` (same scales, but it multiplies by ``448 / amax`` where the runtime
   divides by ``amax / 448``).
2. The layers: SGLang's model class built with ``Fp8Config.from_config({quant_method: fp8,
   weight_block_size: [128, 128]})`` (as from a block-FP8 checkpoint's config), one TP rank at a
   time (`sglang_models.build`): which parameters are float8 and which have a
   ``weight_scale_inv`` (and its shape), beside `fp8.quantized_names` / `fp8.scale_shape`.
3. The loader: SGLang's ``model.load_weights`` of the full checkpoint we would write (our
   ``(q, scale_inv)`` per quantized tensor under ``name`` / ``name_scale_inv``, the rest as is):
   digests of each rank's float8 weights and scales beside the pieces `layout.placements` and
   `fp8.scale_placement` cut from the same full tensors, and the scales it left unloaded (still
   float32's min, as SGLang allocates them).
4. A checkpoint's ``ignored_layers`` / ``modules_to_not_convert``: for several lists, the layers
   SGLang's ``quantization.utils.is_layer_skipped`` skips (or refuses) beside `fp8.quantized_names`.
5. The sync's own FP8 stream (`sglang_fp8_stream.py`, run last: it calls SGLang's
   ``update_weights_from_tensor``, which patches torch's reductions for the rest of the process):
   SGLang's ``load_weights`` of our quantized full-tensor buckets, and SGLang's updater with our
   custom loader of our quantized per-rank buckets, beside the per-rank stream's bytes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_models as sm  # noqa: E402  (installs the import stand-ins first)
from sglang_fp8_stream import stream_report  # noqa: E402

import torch  # noqa: E402

QUANT_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                "fmt": "e4m3"}


def _bytes_digest(t: torch.Tensor) -> str:
    return sm.digest(t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)


def inputs():
    gen = torch.Generator().manual_seed(0)
    for shape in [(1, 1), (1, 300), (300, 1), (129, 257), (300, 70), (256, 384), (5, 640)]:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            fi = torch.finfo(dtype)
            w = torch.randn(*shape, generator=gen)
            yield f"randn{shape}/{dtype}", w.to(dtype)
            e = 4 if dtype == torch.float16 else 6
            yield f"decades{shape}/{dtype}", (w * torch.logspace(-e, e, shape[0]).unsqueeze(1)).to(dtype)
            z = w.clone()
            z[:128, :128] = 0.0
            z[-1, -1] = -0.0
            yield f"zeros{shape}/{dtype}", z.to(dtype)
            h = w.clone()
            h[:128, :128] *= fi.max / 8
            h[0, 0] = fi.max
            h[:128, 128:256] *= 1e-30 if dtype != torch.float16 else 1e-6
            h[-1, :] = fi.tiny / 4
            yield f"extremes{shape}/{dtype}", h.to(dtype)


def quantizer_report() -> dict:
    from sglang.benchmark.deepseek_utils import per_block_cast_to_fp8 as bench_quant
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
    from sglang.srt.layers.quantization.mxfp8_block_convert import bf16_to_block_fp8_128

    from fsdp_sync.weights.fp8 import dequantize_block, quantize_block

    out, bench_diff, elems = [], 0, 0
    for label, w in inputs():
        assert torch.isfinite(w).all(), label
        q, s = quantize_block(label, w)
        rq, rs = bf16_to_block_fp8_128(w)
        bq, bs = bench_quant(w)
        deq = {str(dt): [_bytes_digest(dequantize_block(q, s, dt)),
                         _bytes_digest(block_quant_dequant(q, s, [128, 128], dt))]
               for dt in (torch.bfloat16, torch.float32)}
        out.append({"input": label, "q": [_bytes_digest(q), _bytes_digest(rq)],
                    "scale": [_bytes_digest(s), _bytes_digest(rs), _bytes_digest(bs)], "dequant": deq})
        bench_diff += int((q.view(torch.uint8) != bq.view(torch.uint8)).sum())
        elems += q.numel()
    # stacked experts [E, N, K]: block_quant_dequant takes leading dims as they are
    w = torch.randn(3, 256, 320, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, s = quantize_block("experts", w)
    per = [bf16_to_block_fp8_128(w[e]) for e in range(3)]
    out.append({"input": "experts[3,256,320]/bf16",
                "q": [_bytes_digest(q), _bytes_digest(torch.stack([p[0] for p in per]))],
                "scale": [_bytes_digest(s), _bytes_digest(torch.stack([p[1] for p in per]))],
                "dequant": {"torch.bfloat16": [_bytes_digest(dequantize_block(q, s, torch.bfloat16)),
                                               _bytes_digest(block_quant_dequant(q, s, [128, 128],
                                                                                 torch.bfloat16))]}})
    return {"cases": out, "benchmark_fp8_bytes_differing": bench_diff, "elements": elems}


def model_report(cases: list) -> list:
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import fp8
    from fsdp_sync.weights.export import iter_params
    from fsdp_sync.weights.layout import layout_for

    out = []
    for recipe, ov, tp, ep in cases:
        cfg = load_config(recipe, **ov)
        hf = build_model(cfg, seed=7).eval()
        full = {k: v.detach().clone() for k, v in iter_params(hf)}
        layout = layout_for(cfg, tp, ep)
        fp8.check_block_shapes(layout)
        names = fp8.quantized_names(layout)
        quant = {n: fp8.quantize_block(n, full[n]) for n in names}
        ckpt = []          # the full block-FP8 checkpoint, in HF names
        for n, t in full.items():
            if n in quant:
                ckpt += [(n, quant[n][0]), (fp8.scale_name(n), quant[n][1])]
            else:
                ckpt.append((n, t))
        model_dir = tempfile.mkdtemp(prefix="fsdp_sync_sgl_fp8_")
        cfg.architectures = [sm.CLASSES[cfg.model_type][1]]
        cfg.quantization_config = dict(QUANT_CONFIG)
        cfg.save_pretrained(model_dir)
        shapes = layout.engine_shapes()
        for rank in range(tp):
            model = sm.build(lambda c: sm.model_class(c.model_type)(c, quant_config=Fp8Config.from_config(
                QUANT_CONFIG)), cfg, model_dir, tp, rank, ep)
            params = dict(model.named_parameters())
            sglang_fp8 = sorted(k for k, v in params.items() if v.dtype == torch.float8_e4m3fn)
            sglang_scales = {k: list(v.shape) for k, v in params.items() if k.endswith("weight_scale_inv")}
            ours_fp8 = sorted({layout.engine_name(n) for n in names})
            ours_scales = {e + "_scale_inv": list(fp8.scale_shape(shapes[e])) for e in ours_fp8}
            model.load_weights(iter(ckpt))
            expect: dict[str, torch.Tensor] = {}
            for n in names:
                q, s = quant[n]
                for pl in layout.placements(n, rank):
                    spl = fp8.scale_placement(pl)
                    if pl.engine not in expect:
                        expect[pl.engine] = torch.zeros(shapes[pl.engine], dtype=torch.uint8)
                        expect[spl.engine] = torch.full(ours_scales[spl.engine], float("nan"))
                    expect[pl.engine][pl.dst] = q[pl.src].view(torch.uint8)
                    expect[spl.engine][spl.dst] = s[spl.src]
            digests = {k: [_bytes_digest(params[k].data) if k in params else None, _bytes_digest(v)]
                       for k, v in expect.items()}
            # SGLang fills a block scale with float32's min until something loads it
            unloaded = sorted(k for k in sglang_scales if (params[k].data == torch.finfo(torch.float32).min).all())
            others = sorted(k for k, v in params.items()
                            if k not in expect and v.dtype not in (torch.float32,) and not k.endswith("_scale"))
            out.append({"case": [recipe, ov, tp, ep], "rank": rank, "sglang_fp8": sglang_fp8, "ours_fp8": ours_fp8,
                        "sglang_scales": sglang_scales, "ours_scales": ours_scales, "digests": digests,
                        "other_dtypes": others, "unloaded_scales": unloaded,
                        "kv_scales": sorted(k for k in params if k.endswith(("k_scale", "v_scale")))})
    return out


IGNORED = [[], ["model.layers.1"], ["model.layers.0.self_attn.qkv_proj"], ["model.layers.0.self_attn.k_proj"],
           ["q_proj", "k_proj", "v_proj"], ["model.layers.0.mlp.experts"], ["model.layers.0.mlp.experts.2.down_proj"],
           ["down_proj"], ["mlp.gate"], ["model.layers.0.mlp.shared_expert"], ["experts"],
           ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], ["model.layers.0.mlp.gate_proj"],
           ["model.layers.1.block_sparse_moe.experts.0.w1"], ["lm_head", "model.embed_tokens"]]


def ignored_report(cases: list) -> list:
    """For each family and ``ignored`` list: the quantized engine parameters by SGLang's
    ``is_layer_skipped`` on each layer's prefix (``"refused"`` where it raises) and by ours."""
    from sglang.srt.layers.quantization.utils import is_layer_skipped

    from fsdp_sync.models import load_config
    from fsdp_sync.weights import fp8
    from fsdp_sync.weights.layout import layout_for

    out, seen = [], set()
    for recipe, ov, _, _ in cases:
        cfg = load_config(recipe, **ov)
        if cfg.model_type in seen:
            continue
        seen.add(cfg.model_type)
        layout = layout_for(cfg, 1)
        engines = sorted({layout.engine_name(n) for n in fp8.quantized_names(layout)})
        for ign in IGNORED:
            try:
                theirs = [e for e in engines if not is_layer_skipped(e.rsplit(".", 1)[0], ign)]
            except ValueError:
                theirs = "refused"
            try:
                ours = sorted({layout.engine_name(n) for n in fp8.quantized_names(layout, ign)})
            except ValueError:
                ours = "refused"
            out.append({"model_type": cfg.model_type, "ignored": ign, "sglang": theirs, "ours": ours,
                        "all": len(engines)})
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    cases = json.loads(sys.argv[1])
    scratch = sm.scratch_tempdir()
    print(json.dumps({"quantizer": quantizer_report(), "models": model_report(cases),
                      "ignored": ignored_report(cases), "stream": stream_report(cases, QUANT_CONFIG)}))
    sys.stdout.flush()
    scratch.cleanup()
    os._exit(0)   # as sglang_models.py: SGLang may leave non-daemon threads behind
