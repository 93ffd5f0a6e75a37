"""Block FP8 with a layer whose shape does not split into 128 blocks, left unquantized by the model
config's ``quantization_config.ignored_layers`` (H6 audit).

Before, `fp8.check_block_shapes` checked every layer SGLang quantizes by default, ignoring the list:
a model whose only misfit is an ignored layer (here every MLP, intermediate 320: 320 gate/up rows
at TP 1, 160 at TP 2) was refused ("gate_proj/up_proj rows per rank ... = 160 is not a multiple of
block 128") by the sync's quantizer, the plan and the reference engine alike, though SGLang builds
such a layer with its unquantized method and checks no block there. A misfit in a layer that is
quantized is still refused, naming that layer's tensor.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

INTER = 320
BASE = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
ALL_MLPS = {**BASE, "ignored_layers": ["model.layers.0.mlp", "model.layers.1.mlp"]}
ONE_MLP = {**BASE, "ignored_layers": ["model.layers.0.mlp"]}
TP = 2
SYNCS = [{"method": "tensor", "layout": "full"}, {"method": "tensor", "layout": "engine"},
         {"method": "distributed", "layout": "engine"}, {"method": "disk", "layout": "full"}]


def _config(qc):
    from fsdp_sync.models import load_config

    return load_config("tiny-fp8", intermediate_size=INTER, quantization_config=copy.deepcopy(qc))


def _module(cfg):
    from fsdp_sync.models import build_model

    with torch.device("meta"):
        return build_model(cfg, seed=0)


@pytest.mark.parametrize("tp", [1, 2])
def test_an_ignored_layer_that_cuts_a_block_is_no_refusal(tp):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines.reference.quant import engine_layout, resolve
    from fsdp_sync.weights import fp8, fp8_config, quantize
    from fsdp_sync.weights.layout import ModelSpec, layout_for

    cfg = _config(ALL_MLPS)
    quant = quantize.for_sync(_module(cfg), SyncConfig(quantization="fp8"), tp)
    assert sorted(quant.hf) == sorted(f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo")
    held = engine_layout(ModelSpec.from_config(cfg), tp, 1, resolve(cfg, "fp8"))
    assert held.quantized == quant.hf == fp8_config.held_layout(cfg, layout_for(cfg, tp), "fp8").quantized
    # the same model without the list is refused, as before
    with pytest.raises(ValueError, match=r"gate_proj/up_proj rows per rank .* is not a multiple of block 128"):
        fp8.FP8Layout(ModelSpec.from_config(cfg), tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_misfit_in_a_quantized_layer_is_still_refused_naming_it(tp):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines.reference.quant import engine_layout, resolve
    from fsdp_sync.weights import fp8
    from fsdp_sync.weights.layout import ModelSpec, layout_for

    cfg = _config(ONE_MLP)
    rows = INTER // tp
    match = (rf"gate_proj/up_proj rows per rank \(intermediate_size / tp\) = {rows} is not a multiple of block "
             rf"128 \(quantized 'model\.layers\.1\.mlp\.gate_proj\.weight'")
    from fsdp_sync.weights import quantize

    with pytest.raises(ValueError, match=match):
        quantize.for_sync(_module(cfg), SyncConfig(quantization="fp8"), tp)
    with pytest.raises(ValueError, match=match):
        engine_layout(ModelSpec.from_config(cfg), tp, 1, resolve(cfg, "fp8"))
    # the row-parallel input is checked only at TP > 1, and names its own tensor
    layout = layout_for(cfg, tp)
    quantized = set(fp8.quantized_names(layout, ["model.layers.0.mlp", "model.layers.1.mlp.gate_proj",
                                                 "model.layers.1.mlp.up_proj"]))
    if tp == 1:
        fp8.check_block_shapes(layout, fp8.BLOCK, quantized)
    else:
        with pytest.raises(ValueError, match=r"down_proj input per rank \(intermediate_size / tp\) = 160 is not a "
                                             r"multiple of block 128 \(quantized 'model\.layers\.1\.mlp\.down_proj\.weight'"):
            fp8.check_block_shapes(layout, fp8.BLOCK, quantized)


def test_attention_rules_follow_the_attention_layers():
    """q/k/v rows and the o_proj input are checked while an attention layer of theirs is quantized,
    and not once every one is in the list; each misfit names the first quantized tensor it cuts."""
    from fsdp_sync.models import load_config
    from fsdp_sync.weights import fp8
    from fsdp_sync.weights.layout import ModelSpec, TPLayout

    spec = ModelSpec.from_config(load_config("tiny-fp8", head_dim=64))   # 4 heads x 64: 64 rows a rank at TP 4
    layout = TPLayout(spec, 4)
    everything = fp8.quantized_names(layout)
    with pytest.raises(ValueError) as exc:
        fp8.check_block_shapes(layout, fp8.BLOCK, [n for n in everything if ".layers.1.self_attn." in n])
    text = str(exc.value)
    assert "q_proj rows per rank = 64 is not a multiple of block 128 (quantized 'model.layers.1.self_attn.q_proj.weight'" in text, text
    assert "o_proj input per rank (heads / tp * head_dim) = 64 is not a multiple of block 128 (quantized " \
           "'model.layers.1.self_attn.o_proj.weight'" in text, text
    with pytest.raises(ValueError) as exc:
        fp8.check_block_shapes(layout, fp8.BLOCK, [n for n in everything if ".o_proj." in n])
    assert "o_proj input" in str(exc.value) and "q_proj rows" not in str(exc.value), str(exc.value)
    with pytest.raises(ValueError, match="q_proj rows per rank = 64"):
        fp8.check_block_shapes(layout)                          # None: every layer SGLang quantizes
    fp8.check_block_shapes(layout, fp8.BLOCK, [n for n in everything if ".mlp." in n])   # 512 / 4 = 128: fits
    fp8.check_block_shapes(layout, fp8.BLOCK, [])
    with pytest.raises(ValueError, match="q_proj rows per rank = 64"):
        fp8.FP8Layout(spec, 4, ignored=["model.layers.0.self_attn"])
    fp8.FP8Layout(spec, 4, ignored=["self_attn"])


# ------------------------------------------------------------------ a sync, bit for bit
def _job(rank, world, root):
    from fsdp_sync.cli.trainer import synthetic_batch, train_step, wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model
    from fsdp_sync.topology import SyncError, SyncTopology, make_mesh
    from fsdp_sync.weights import fp8
    from fsdp_sync.weights.layout import layout_for

    torch.set_num_threads(1)
    cfg = _config(ALL_MLPS)
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    opt = torch.optim.SGD(module.parameters(), lr=1e-1)
    mesh = make_mesh(world // TP, TP)
    holder = SyncTopology.from_mesh(mesh).is_tp_src
    engine = ReferenceEngine(model_config=cfg, tp_size=TP, quantization="fp8", kv_cache_tokens=64) if holder else None
    names = layout_for(cfg, 1).hf_names()
    out = []
    try:
        for step, kw in enumerate(SYNCS):
            kw = dict(kw)
            if kw["method"] == "disk":
                kw["disk_dir"] = f"{root}/s{step}"
            train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step, rank=rank))
            manager = FSDPShardingManager(module, engine if kw["method"] == "tensor" or rank == 0 else None,
                                          mesh=mesh if kw["method"] == "tensor" else None,
                                          config=SyncConfig(dtype=torch.float32, bucket_bytes=256 << 10,
                                                            quantization="fp8", free_cache_engine=False,
                                                            dist_timeout_s=60, verify="full", **kw))
            rec = {"kw": kw}
            try:
                with manager:
                    pass
            except SyncError as exc:
                rec["error"] = str(exc)
            finally:
                manager.close()
            full = {n: p.full_tensor().detach() for n, p in module.named_parameters()}   # collective
            if engine is not None:
                wrong, fp8s = [], []
                for n in names:
                    got, want = engine.get_weights_by_name(n), full[n]
                    if ".self_attn." in n and n.endswith("proj.weight"):
                        q, s = fp8.quantize_block(n, want)
                        ok = (got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), q.view(torch.uint8))
                              and torch.equal(engine.get_weights_by_name(fp8.scale_name(n)), s))
                    else:
                        ok = got.dtype == torch.float32 and torch.equal(got, want)
                    if not ok:
                        wrong.append(n)
                    if got.dtype == torch.float8_e4m3fn:
                        fp8s.append(n)
                rec["wrong"], rec["fp8"] = wrong, fp8s
            out.append(rec)
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(300)
def test_a_config_whose_only_misfit_is_ignored_syncs_bit_exact_by_every_method(tmp_path):
    results = run_ranks(_job, 2, str(tmp_path), timeout_s=280, env=spawn_env({"SGLANG_FP8_IGNORED_LAYERS": ""}))
    holder = next(r for r in results if any("wrong" in rec for rec in r))
    for i, kw in enumerate(SYNCS):
        errors = [r[i].get("error") for r in results]
        assert errors == [None, None], (kw, errors)
        assert holder[i]["wrong"] == [], (kw, holder[i]["wrong"])
        assert len(holder[i]["fp8"]) == 8 and all(".self_attn." in n for n in holder[i]["fp8"]), (kw, holder[i]["fp8"])


@pytest.mark.timeout(300)
def test_plan_and_bench_take_the_model_and_count_the_bytes_the_engine_holds(tmp_path, capsys):
    """``fsdp-sync plan`` and ``bench`` checked the split with a layout that reads no config (every
    layer SGLang quantizes by default): both refused this model ("gate_proj/up_proj rows per rank
    ... = 320 is not a multiple of block 128"), and the bench's floor priced the MLPs as FP8."""
    import json

    from _util import cli_here

    _config(ALL_MLPS).save_pretrained(tmp_path / "m")
    cfg_json = str(tmp_path / "m" / "config.json")
    plan = cli_here(capsys, "plan", "--config-json", cfg_json, "--ranks", "1", "--tp", "1",
                    "--quantization", "fp8", "--methods", "tensor", "--layout", "engine",
                    "--cluster", "h100-node", "--json", str(tmp_path / "plan.json"))
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert "not a multiple of block" not in plan.stdout + plan.stderr
    bench = cli_here(capsys, "bench", "--models", str(tmp_path / "m"), "--ranks", "1", "--tp", "1",
                     "--quantization", "fp8", "--methods", "tensor", "--layout", "engine",
                     "--repeats", "3", "--json", str(tmp_path / "bench.json"))
    assert bench.returncode == 0, bench.stdout + bench.stderr
    out = json.loads((tmp_path / "bench.json").read_text())
    assert out["rows"] and "incomplete" not in out, out


def test_the_kv_rule_names_a_k_or_v_tensor_and_the_ignored_layers_note_comes_once():
    """The k/v rows rule named the fused layer's first tensor, q_proj (`fsdp-sync plan --models
    tiny --quantization fp8` said "k_proj/v_proj rows per rank = 16 ... (quantized '...q_proj.weight')"),
    and every misfit repeated the ignored_layers sentence."""
    from fsdp_sync.models import load_config
    from fsdp_sync.weights import fp8
    from fsdp_sync.weights.layout import ModelSpec, TPLayout

    layout = TPLayout(ModelSpec.from_config(load_config("tiny")), 2)
    with pytest.raises(ValueError) as exc:
        fp8.check_block_shapes(layout)
    text = str(exc.value)
    assert "k_proj/v_proj rows per rank = 16 is not a multiple of block 128 (quantized " \
           "'model.layers.0.self_attn.k_proj.weight')" in text, text
    assert "q_proj rows per rank = 32 is not a multiple of block 128 (quantized " \
           "'model.layers.0.self_attn.q_proj.weight')" in text, text
    assert text.count("ignored_layers") == 1 and text.endswith("stays unquantized, unchecked"), text
