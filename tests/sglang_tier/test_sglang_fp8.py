"""fsdp_sync's block FP8 against SGLang 0.5.23's own code, on CPU (`sglang_fp8.py` runs it in one
subprocess, behind the tier's import stand-ins):

- our quantizer's ``(q, scale_inv)`` equal, byte for byte, SGLang's runtime block quantizer
  ``mxfp8_block_convert.bf16_to_block_fp8_128`` on odd shapes, zero blocks, huge and tiny values,
  bfloat16 / float16 / float32 inputs, and stacked experts; SGLang's ``block_quant_dequant`` of
  our pair equals our `dequantize_block` (bfloat16 and float32 outputs); the scales also equal
  those of ``sglang/benchmark/deepseek_utils.per_block_cast_to_fp8``, whose FP8 bytes differ in a
  few elements in ten thousand (it multiplies by ``448 / amax``; the runtime divides);
- SGLang's model classes (Qwen2, Llama, Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral) built with a
  block-FP8 ``Fp8Config`` make float8 exactly the parameters `fp8.quantized_names` maps to, each
  with a ``weight_scale_inv`` of `fp8.scale_shape` (router gates, shared-expert gate, norms,
  embeddings, lm_head stay in the model dtype);
- SGLang's loader (``model.load_weights``) of the full checkpoint (our pairs under ``name`` and
  ``name_scale_inv``) puts on every TP/EP rank exactly the pieces `layout.placements` and
  `fp8.scale_placement` cut (qkv with replicated KV heads, gate_up, o/down row splits, w13/w2 under
  TP and EP, a hidden size of 320: a partial edge block). One difference, kept and asserted:
  SGLang's Llama loader renames ``weight_scale_inv`` to ``weight_scale`` and so loads no block
  scale at all (its FP8 weights load as ours);
- a checkpoint's ``ignored_layers`` / ``modules_to_not_convert`` skip (or refuse) the same layers by
  `fp8.quantized_names` as by SGLang's ``is_layer_skipped``;
- the sync's own stream (`sglang_fp8_stream.py`; bfloat16 rollout, SGLang's model built in
  bfloat16, buckets of 96 KiB so every case makes many): our quantized full-tensor buckets
  (``export.iter_buckets`` -> ``StreamQuantizer.bucket``) loaded by SGLang's ``load_weights`` on each
  TP/EP rank hold, bit for bit, what our quantized per-rank buckets (``reshard.iter_rank_buckets`` ->
  ``StreamQuantizer.rank_bucket``) give that rank: fp8 weights, scales and every unquantized
  parameter (quantizing each rank's slice == SGLang cutting the full quantized checkpoint), every
  tensor we send named as SGLang's parameter; SGLang's ``block_quant_dequant`` of the pairs it
  holds equals our `dequantize_block` of the rank stream's (bfloat16, float32); and the per-rank
  buckets through SGLang's real ``WeightUpdater.update_weights_from_tensor`` with our custom loader
  (``engines.sglang.loader``: fp8, float32 and bfloat16 entries in one bucket) fill every parameter
  with the rank stream's bytes. Two differences, asserted: Llama's renamed scales (above: SGLang's
  ``load_weights`` leaves every block scale unloaded, so its dequantized weights differ from ours;
  our loader loads them); and the KV-cache scales ``attn.k_scale`` / ``attn.v_scale`` (0-dim float32)
  that ``Fp8Config`` gives the attention of Qwen2, Llama, Qwen2-MoE and Mixtral (not Qwen3's nor
  Qwen3-MoE's): no
  block-FP8 checkpoint of ours and no stream carries them, so neither loader writes them and SGLang
  keeps what it allocated (its ``BaseKVCacheMethod`` reads a scale <= 0 as 1.0).

Not checked here (needs a GPU): SGLang's ``process_weights_after_loading`` for block FP8 (DeepGEMM's
UE8M0 requantization, aiter / CUTLASS layouts), the FP8 GEMMs and a generation with the weights,
the cast on CUDA (the same torch code as on CPU, so expected equal), ``update_weights_from_tensor``
of FP8 tensors through CUDA IPC.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

HERE = Path(__file__).resolve().parent
DENSE = {"hidden_size": 320, "intermediate_size": 512, "num_attention_heads": 2, "num_key_value_heads": 1,
         "head_dim": 128}
MOE = {**DENSE, "moe_intermediate_size": 256}
CASES = [["tiny", DENSE, 1, 1], ["tiny", DENSE, 2, 1],
         ["tiny", {**DENSE, "model_type": "llama", "attention_bias": True}, 2, 1],
         ["tiny-qwen3", DENSE, 2, 1],
         ["tiny-qwen3-moe", {**MOE, "mlp_only_layers": []}, 2, 1],
         ["tiny-qwen3-moe", {**MOE, "mlp_only_layers": []}, 2, 2],
         # SGLang's Qwen2-MoE and Mixtral take head_dim = hidden_size / heads (a config's head_dim
         # is ignored), so their hidden size is 2 x 128 here
         ["tiny-qwen2-moe", {**MOE, "hidden_size": 256, "shared_expert_intermediate_size": 256}, 2, 1],
         ["tiny-mixtral", {**DENSE, "hidden_size": 256, "intermediate_size": 256}, 2, 2],
         # TP 4: four heads (one KV head, replicated); experts split over 2 ranks each at EP 2
         ["tiny", {**DENSE, "num_attention_heads": 4}, 4, 1],
         ["tiny-qwen3-moe", {**MOE, "num_attention_heads": 4, "mlp_only_layers": []}, 4, 2]]
KV_SCALES = ("self_attn.attn.k_scale", "self_attn.attn.v_scale")


@pytest.fixture(scope="module")
def report():
    # one torch thread: on a busy 2-core runner two threads' spin-waits made it ten times slower
    env = {**os.environ, "PYTHONPATH": str(HERE.parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-W", "ignore", str(HERE / "sglang_fp8.py"), json.dumps(CASES)],
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_quantizer_matches_sglang_bit_for_bit(report):
    cases = report["quantizer"]["cases"]
    assert len(cases) == 7 * 3 * 4 + 1
    for c in cases:
        assert c["q"][0] == c["q"][1], f"fp8 bytes differ from bf16_to_block_fp8_128 for {c['input']}"
        assert c["scale"][0] == c["scale"][1], f"scales differ from bf16_to_block_fp8_128 for {c['input']}"
        if len(c["scale"]) > 2:
            assert c["scale"][0] == c["scale"][2], f"scales differ from the benchmark's for {c['input']}"
        for dt, (ours, theirs) in c["dequant"].items():
            assert ours == theirs, f"block_quant_dequant ({dt}) differs for {c['input']}"


def test_benchmark_quantizer_differs_only_in_rare_roundings(report):
    q = report["quantizer"]
    assert 0 < q["benchmark_fp8_bytes_differing"] < q["elements"] * 1e-3


def test_sglang_quantizes_the_layers_we_quantize(report):
    models = report["models"]
    assert len(models) == sum(c[2] for c in CASES)
    for m in models:
        where = (m["case"][0], m["case"][2], m["case"][3], m["rank"])
        assert m["sglang_fp8"] == m["ours_fp8"], where
        assert m["sglang_scales"] == m["ours_scales"], where
        assert m["other_dtypes"] == [], where
        assert any("experts.w13_weight" in n for n in m["ours_fp8"]) == ("moe" in m["case"][0] or
                                                                        "mixtral" in m["case"][0])


def test_sglang_loader_cuts_the_pieces_we_cut(report):
    llama = 0
    for m in report["models"]:
        where = (m["case"][0], m["case"][2], m["case"][3], m["rank"])
        assert set(m["digests"]) == set(m["ours_fp8"]) | set(m["ours_scales"]), where
        if m["case"][1].get("model_type") == "llama":
            # SGLang 0.5.23's LlamaForCausalLM.load_weights renames ".weight_scale_inv" to
            # ".weight_scale" (per-tensor FP8's name), a parameter block FP8 does not have: every
            # block scale is skipped ("not found in params_dict") and stays as allocated. The FP8
            # weights load as ours; loading by engine name (our custom loader) does not rename.
            llama += 1
            assert m["unloaded_scales"] == sorted(m["ours_scales"]), where
            assert all(m["digests"][n][0] == m["digests"][n][1] for n in m["ours_fp8"]), where
            continue
        assert m["unloaded_scales"] == [], where
        for name, (theirs, ours) in m["digests"].items():
            assert theirs == ours, (where, name)
    assert llama == 2


def test_fsdp_sync_refuses_the_families_whose_scales_sglang_drops(report):
    """`SGLangEngine.load_refusal` refuses block FP8 through SGLang's own loader for exactly the
    model types whose scales this SGLang left unloaded (`refusals.FP8_SCALES_DROPPED`): a release
    that stops renaming them, or another family that starts, fails here."""
    from fsdp_sync.engines.sglang.refusals import FP8_SCALES_DROPPED

    dropped = {m["case"][1].get("model_type", "not llama") for m in report["models"] if m["unloaded_scales"]}
    assert dropped == set(FP8_SCALES_DROPPED)


def test_ignored_layers_skipped_as_sglang_skips_them(report):
    rows = report["ignored"]
    assert {r["model_type"] for r in rows} == {"qwen2", "llama", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"}
    for r in rows:
        assert r["ours"] == r["sglang"], (r["model_type"], r["ignored"])
    # the lists do something: some skip a part, one is refused, one skips nothing
    assert any(r["ours"] == "refused" for r in rows)
    assert any(isinstance(r["ours"], list) and 0 < len(r["ours"]) < r["all"] for r in rows)


def _where(row):
    return (row["case"][0], row["case"][1].get("model_type"), row["case"][2], row["case"][3], row["rank"])


def test_stream_loaded_by_sglang_equals_our_rank_stream(report):
    rows = report["stream"]
    assert len(rows) == sum(c[2] for c in CASES)
    assert any(r["hf_mixed_buckets"] for r in rows)     # fp8, scale and bf16 tensors in one bucket
    llama = 0
    for r in rows:
        where, params = _where(r), r["params"]
        # the stream is what it says: several buckets of fp8 weights, float32 scales, bf16 others
        assert r["hf_buckets"] > 1 and r["rank_buckets"] > 1, where
        assert r["hf_dtypes"] == ["bfloat16", "float32", "float8_e4m3fn"], where
        assert r["only_ours"] == [], where                  # every tensor we send is SGLang's by name
        assert sorted(k for k, v in params.items() if v["dtype"] == "float8_e4m3fn") == r["engine_fp8"], where
        assert all(params[k + "_scale_inv"]["dtype"] == "float32" for k in r["engine_fp8"]), where
        assert all(v["dtype"] == v["ours_dtype"] for v in params.values() if v["ours"] is not None), where
        # what no stream of ours carries: only the attention's KV-cache scales, written by no loader
        unsent = sorted(k for k, v in params.items() if v["ours"] is None)
        kv = not r["case"][0].startswith("tiny-qwen3")      # SGLang's Qwen3 attention has none
        assert unsent == (sorted(k for k in params if k.endswith(KV_SCALES)) if kv else []), where
        assert bool(unsent) == kv, where
        assert all(params[k]["a_unwritten"] and params[k]["a"] == params[k]["b"] for k in unsent), where
        # our per-rank buckets through SGLang's updater and our loader: every sent parameter, all bytes
        assert r["calls"] == [[True, "Success"]] * r["rank_buckets"], where
        assert all(v["b"] == v["ours"] for v in params.values() if v["ours"] is not None), where
        # SGLang's load_weights of our full-tensor stream: the same bytes (Llama: no block scale)
        sent = {k: v for k, v in params.items() if v["ours"] is not None}
        if r["case"][1].get("model_type") == "llama":
            llama += 1
            scales = {k for k in sent if k.endswith("_scale_inv")}
            assert scales and all(sent[k]["a_unwritten"] for k in scales), where
            assert all(v["a"] == v["ours_a"] for k, v in sent.items() if k not in scales), where
            continue
        for k, v in sent.items():
            assert v["a"] == v["ours_a"] and not v["a_unwritten"], (where, k)
    assert llama == 2


def test_sglang_dequant_of_loaded_pairs_equals_ours(report):
    for r in report["stream"]:
        where = _where(r)
        assert sorted(r["dequant"]) == r["engine_fp8"] and r["engine_fp8"], where
        llama = r["case"][1].get("model_type") == "llama"
        for k, per in r["dequant"].items():
            assert sorted(per) == ["bfloat16", "float32"], (where, k)
            for dt, d in per.items():
                if llama:
                    # load_weights left the scale unloaded: SGLang's weight is not ours; the pair
                    # our loader put in SGLang's model dequantizes as ours does
                    assert d["a"] != d["ours"] and d["b"] == d["ours"], (where, k, dt)
                else:
                    # b None: our loader left the very bytes load_weights did (asserted above)
                    assert d["a"] == d["ours"] and d["b"] is None, (where, k, dt)
