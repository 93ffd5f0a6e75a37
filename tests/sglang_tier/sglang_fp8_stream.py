"""fsdp_sync's FP8 sync STREAM against SGLang 0.5.23's own loaders, on CPU (issue 25 item 5). Part
of `sglang_fp8.py`'s subprocess (its import stand-ins), run last: SGLang's
``update_weights_from_tensor`` patches torch's reductions process-wide, so every payload of every
case is made before the first update.

Per case ``[recipe, overrides, tp, ep]``, with the trainer's rollout dtype bfloat16 and SGLang's
model built in bfloat16 (as its loader sets the default dtype to the model's) with the block
``Fp8Config`` of a block-FP8 checkpoint:

1. the HF stream, by the sync's own code: ``export.iter_buckets`` (small buckets, so several occur)
   -> ``StreamQuantizer.bucket`` -> unflatten: ``(HF name, tensor)`` pairs, fp8 weights followed by
   their ``weight_scale_inv``. SGLang's ``model.load_weights`` of these pairs on each TP/EP rank
   (model A: SGLang cuts the full quantized checkpoint);
2. the per-rank stream: ``reshard.iter_rank_buckets`` of the plain module at the engine's layout ->
   ``StreamQuantizer.rank_bucket`` -> each rank's buffer unflattened (engine names, each rank's
   slice quantized on its own);
3. the same per-rank buckets through SGLang's real ``WeightUpdater.update_weights_from_tensor``
   with ``load_format = engines.sglang.loader.LOADER`` (one ``LocalSerializedTensor`` of per-rank
   payloads per bucket; model B).

Reported per rank and SGLang parameter: digests of A's, B's and our rank stream's bytes (A's vocab
padding rows left out: SGLang does not write them when it loads full tensors), whether A still holds
the fill it was given (a parameter SGLang's loader never wrote), and for each FP8 weight the digests
of SGLang's ``fp8_utils.block_quant_dequant`` of A's and B's ``(weight, weight_scale_inv)`` and of our
`fp8.dequantize_block` of the rank stream's pair, in bfloat16 and float32.
"""

from __future__ import annotations

import json
import tempfile

import sglang_models as sm

import torch

DTYPE = torch.bfloat16
BUCKET_BYTES = 96 << 10     # a norm-sized tensor shares a bucket; each large weight gets its own
FILL = 0x7F                 # every byte of a fresh SGLang parameter: NaN in fp8, 3.4e38 in bf16/fp32


def _digest(t: torch.Tensor) -> str:
    return sm.digest(t.contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _plain(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def _hf_stream(hf, sc, tp: int, ep: int) -> dict:
    """The full-tensor stream of ``hf`` as the sync makes it: ``(HF name, tensor)`` pairs."""
    from fsdp_sync.weights import export, quantize
    from fsdp_sync.weights.bucket import unflatten

    hq = quantize.for_sync(hf, sc, tp, ep)
    pairs, buckets, mixed = [], 0, 0
    for bkt, flat in export.iter_buckets(hf, BUCKET_BYTES, dtype=DTYPE, alloc=_plain):
        out, buf = hq.bucket(bkt, flat, _plain)
        pairs += unflatten(buf, out.entries)
        buckets += 1
        mixed += len({e.dtype for e in out.entries}) == 3      # fp8, its scale and a bf16 tensor
    return {"pairs": pairs, "buckets": buckets, "mixed": mixed, "dtypes": sorted({_dt(t.dtype) for _, t in pairs})}


def prepare(case: list, quant_config: dict, cache: dict) -> dict:
    """Everything made before SGLang's first update: the model, both streams and the payloads.
    ``cache``: the trainer model and its full-tensor stream by ``(recipe, overrides)`` (they do
    not depend on the engine's TP/EP: which HF tensors are quantized does not)."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines.sglang.loader import bucket_name
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import handles, quantize, reshard
    from fsdp_sync.weights.bucket import unflatten
    from fsdp_sync.weights.layout import layout_for

    recipe, ov, tp, ep = case
    cfg = load_config(recipe, **ov)
    sc = SyncConfig(quantization="fp8", dtype=DTYPE)
    key = json.dumps([recipe, ov], sort_keys=True)
    if key not in cache:
        hf = build_model(cfg, seed=7).eval()
        cache[key] = (hf, _hf_stream(hf, sc, tp, ep))
    hf, stream = cache[key]
    layout = layout_for(cfg, tp, ep)

    rq = quantize.for_sync(hf, sc, tp, ep)
    rank_buckets = [rq.rank_bucket(rb, handles.empty_shared)
                    for rb in reshard.iter_rank_buckets(hf, layout, BUCKET_BYTES, dtype=DTYPE, alloc=_plain)]
    ours = [{n: t for rb in rank_buckets for n, t in unflatten(rb.buffers[r], rb.bucket.entries)}
            for r in range(tp)]
    sets = [[handles.make_payloads(rb.buffers[i], tp, ranks=[i], tagged=False) for i in range(tp)]
            for rb in rank_buckets]
    named = [(bucket_name(rb.bucket), LocalSerializedTensor(values=[s.payloads[0] for s in row]))
             for rb, row in zip(rank_buckets, sets)]

    model_dir = tempfile.mkdtemp(prefix="fsdp_sync_sgl_fp8s_")
    cfg.architectures = [sm.CLASSES[cfg.model_type][1]]
    cfg.quantization_config = dict(quant_config)
    cfg.save_pretrained(model_dir)
    return {"case": case, "cfg": cfg, "layout": layout, "model_dir": model_dir, "stream": stream,
            "ours": ours, "named": named, "sets": sets, "rank_buckets": len(rank_buckets),
            "engine_fp8": sorted(rq.engine)}


def _build(p: dict, rank: int, quant_config: dict):
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    cls = sm.model_class(p["cfg"].model_type)
    tp, ep = p["case"][2], p["case"][3]
    prev = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        model = sm.build(lambda c: cls(c, quant_config=Fp8Config.from_config(quant_config)), p["cfg"],
                         p["model_dir"], tp, rank, ep)
    finally:
        torch.set_default_dtype(prev)
    _fill(model)
    return model


def _fill(model) -> None:
    with torch.no_grad():
        for v in model.parameters():
            v.data.view(-1).view(torch.uint8).fill_(FILL)


def check(p: dict, quant_config: dict) -> list:
    """Load ``p``'s streams into SGLang's models, rank by rank, and report what they hold."""
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    from fsdp_sync.engines.sglang.loader import LOADER
    from fsdp_sync.weights.fp8 import BLOCK, dequantize_block

    tp = p["case"][2]
    layout = p["layout"]
    rows = []
    for rank in range(tp):
        # one model per rank: A is what load_weights left (copied out), then B the same model
        # filled afresh and loaded by our loader through SGLang's updater
        b = _build(p, rank, quant_config)
        b.load_weights(iter(p["stream"]["pairs"]))
        pa = {k: v.detach().clone() for k, v in b.named_parameters()}
        _fill(b)
        updater = WeightUpdater(tp_rank=rank, device="cpu", gpu_id=0, model_config=None,
                                custom_weight_loaders=[LOADER], get_model=lambda b=b: b,
                                update_model_fields=lambda *x, **k: None, recapture_cuda_graph=lambda: None,
                                get_model_runner=lambda: None)
        calls = [list(updater.update_weights_from_tensor([item], load_format=LOADER)) for item in p["named"]]
        ours = p["ours"][rank]
        pb = {k: v.detach() for k, v in b.named_parameters()}
        params = {}
        for k, va in pa.items():
            vb, o = pb[k], ours.get(k)
            pad = layout.padding(k, rank)
            keep = slice(0, pad[0].start) if pad is not None else ...
            params[k] = {"dtype": _dt(va.dtype), "ours_dtype": _dt(o.dtype) if o is not None else None,
                         "a": _digest(va[keep]), "b": _digest(vb),
                         "ours_a": _digest(o[keep]) if o is not None else None,
                         "ours": _digest(o) if o is not None else None,
                         "a_unwritten": bool((va.view(-1).view(torch.uint8) == FILL).all())}
        dequant = {}
        for k in p["engine_fp8"]:
            s = k + "_scale_inv"
            # B's block_quant_dequant only where B holds other bytes than A (else it is A's)
            b_same = params[k]["a"] == params[k]["b"] and params[s]["a"] == params[s]["b"]
            dequant[k] = {_dt(dt): {
                "a": _digest(block_quant_dequant(pa[k], pa[s], list(BLOCK), dt)),
                "b": None if b_same else _digest(block_quant_dequant(pb[k], pb[s], list(BLOCK), dt)),
                "ours": _digest(dequantize_block(ours[k], ours[s], dt))} for dt in (torch.bfloat16, torch.float32)}
        st = p["stream"]
        rows.append({"case": p["case"], "rank": rank, "params": params, "dequant": dequant, "calls": calls,
                     "only_ours": sorted(set(ours) - set(pa)), "engine_fp8": p["engine_fp8"],
                     "hf_buckets": st["buckets"], "hf_mixed_buckets": st["mixed"],
                     "hf_dtypes": st["dtypes"], "rank_buckets": p["rank_buckets"]})
    return rows


def stream_report(cases: list, quant_config: dict) -> list:
    cache: dict = {}
    prepared = [prepare(c, quant_config, cache) for c in cases]   # all payloads before the first update
    out = []
    for p in prepared:
        out += check(p, quant_config)
        for row in p["sets"]:
            for s in row:
                s.release(require_ack=False)
    return out
