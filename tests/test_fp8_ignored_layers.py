"""A block-FP8 sync of a model whose config's ``quantization_config`` leaves layers unquantized
(``ignored_layers`` / ``modules_to_not_convert``) sends those layers in the rollout dtype, by every
method, and ``fsdp-sync plan`` counts what the sync sends (plan3 audit).

Before, the manager's quantizer never read the list: it quantized every layer SGLang quantizes by
default. SGLang 0.5.23 copied the raw FP8 values into its unquantized parameter and dropped the
scale (max |served - trainer| 447.9 on ``model.layers.0.mlp.down_proj.weight``); the reference
engine refused partway ('unknown parameter ...down_proj.weight_scale_inv'), leaving its replica
partly new; the plan counted 14 quantized tensors where the engines hold 9. Now the quantizer
reads the list as both engines read it (`weights.fp8_config`) and refuses, before anything is
sent, a list they read differently, naming the entry and what to write instead.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

QC = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
      "ignored_layers": ["model.layers.0.mlp.down_proj", "model.layers.1.self_attn"]}
SKIPPED = ["model.layers.0.mlp.down_proj.weight"] + [f"model.layers.1.self_attn.{p}_proj.weight"
                                                     for p in "qkvo"]
SYNCS = [{"method": "tensor", "layout": "full"}, {"method": "tensor", "layout": "engine"},
         {"method": "distributed", "layout": "full"}, {"method": "distributed", "layout": "engine"},
         {"method": "disk", "layout": "full"}, {"method": "disk", "layout": "engine"}]
BUCKET = 256 << 10
TP = 2


def _config(qc=QC, **kw):
    from fsdp_sync.models import load_config

    return load_config("tiny-fp8", quantization_config=copy.deepcopy(qc), **kw)


def _module(cfg):
    from fsdp_sync.models import build_model

    with torch.device("meta"):
        return build_model(cfg, seed=0)


# ------------------------------------------------------------------ the list, read as the engines read it
def test_the_quantizer_leaves_the_configs_ignored_layers_unquantized():
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.weights import quantize

    module = _module(_config())
    sync = SyncConfig(quantization="fp8")
    quant = quantize.for_sync(module, sync, 2)
    everything = quantize.for_sync(module, sync, 2, ignored=())       # an explicit list still wins
    assert sorted(everything.hf - quant.hf) == sorted(SKIPPED), sorted(everything.hf - quant.hf)
    assert len(quant.hf) == 9 and quantize.quantized_hf_names(module) == quant.hf
    sent = {m.name: m.dtype for m in quantize.sync_metas(module, sync)}
    for n in SKIPPED:
        assert sent[n] == torch.float32 and n + "_scale_inv" not in sent, n
    assert sent["model.layers.0.mlp.up_proj.weight"] == torch.float8_e4m3fn
    # the same list, by modules_to_not_convert, or written without "model." (SGLang adds it)
    qc = {k: v for k, v in QC.items() if k != "ignored_layers"}
    for other in ({**qc, "modules_to_not_convert": QC["ignored_layers"]},
                  {**qc, "ignored_layers": ["layers.0.mlp.down_proj", "layers.1.self_attn"]}):
        assert quantize.quantized_hf_names(_module(_config(other))) == quant.hf, other


def test_the_reference_engine_and_sglang_read_the_list_the_sync_reads():
    """What the sync sends is what the reference engine's layout holds (`quant.resolve` of the same
    config) and what SGLang 0.5.23's Fp8Config.from_config + is_layer_skipped skip (its rule:
    `fp8.is_quantized`; the sglang tier checks it on SGLang's own code)."""
    from fsdp_sync.engines.reference.quant import engine_layout, resolve
    from fsdp_sync.weights import fp8, fp8_config
    from fsdp_sync.weights.layout import ModelSpec, layout_for

    cfg = _config()
    held = engine_layout(ModelSpec.from_config(cfg), 2, 1, resolve(cfg, "fp8"))
    layout = layout_for(cfg, 2)
    sglang = set(fp8.quantized_names(layout, fp8_config.sglang_entries(QC["ignored_layers"])))
    assert held.quantized == fp8_config.held_layout(cfg, layout, "fp8").quantized == sglang


@pytest.mark.parametrize("qc, env, match", [
    # SGLang also reads 'model.mlp' as 'mlp' (every layer's MLP); the reference engine as written (none)
    ({"ignored_layers": ["model.mlp"]}, "",
     r"entry 'model\.mlp': SGLang \(Fp8Config\.from_config\) also reads it as 'mlp' and leaves "
     r"'model\.layers\.0\.mlp\.down_proj\.weight' unquantized \(6 tensors\).*Write it so that both read "
     r"it alike: 'mlp' .* or the full path of the module to skip \(e\.g\. 'model\.layers\.0\.mlp\.down_proj'\)"),
    # SGLang takes the first key present (an empty ignored_layers: nothing), the reference the non-empty one
    ({"ignored_layers": [], "modules_to_not_convert": ["model.layers.0.mlp"]}, "",
     r"SGLang reads ignored_layers alone.*remove the empty ignored_layers"),
    # SGLang's variable: read by an SGLang engine started in this environment, not by the reference engine
    ({}, "model.layers.0.mlp",
     r"SGLANG_FP8_IGNORED_LAYERS='model\.layers\.0\.mlp' is set.*'model\.layers\.0\.mlp\.down_proj\.weight'"
     r".*list the layers in the model config's quantization_config\.ignored_layers"),
    # one shard of a fused layer: both engines refuse such a checkpoint
    ({"ignored_layers": ["model.layers.0.self_attn.q_proj"]}, "",
     r"quantization_config\.ignored_layers: ignored layers .* skip some but not all tensors of "
     r"'model\.layers\.0\.self_attn\.qkv_proj\.weight'.*list all of "
     r"\['model\.layers\.0\.self_attn\.q_proj', .*or their module 'model\.layers\.0\.self_attn'"),
    ({"ignored_layers": "model.layers.0.mlp"}, "", r"ignored_layers is 'model\.layers\.0\.mlp'; expected a list"),
    ({"quant_method": "awq"}, "", r"quant_method 'awq', but quantization='fp8' sends block FP8"),
    ({"weight_block_size": [64, 64]}, "", r"weight_block_size \[64, 64\], but the sync quantizes in blocks of \[128, 128\]"),
])
def test_a_list_the_engines_cannot_both_load_exactly_is_refused_saying_what_to_write(qc, env, match, monkeypatch):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.plan import PlanJob, plan_row
    from fsdp_sync.weights import quantize

    monkeypatch.setenv("SGLANG_FP8_IGNORED_LAYERS", env)
    base = {k: v for k, v in QC.items() if k != "ignored_layers"}
    cfg = _config({**base, **qc})
    with pytest.raises(ValueError, match=match):
        quantize.for_sync(_module(cfg), SyncConfig(quantization="fp8"), 2)
    with pytest.raises(ValueError, match=match):       # the plan refuses what the sync refuses
        plan_row(PlanJob(cfg, "tensor", "engine", BUCKET, "float32", "fp8", 2, 2, TP, engine="reference"), "h100-node")


# ------------------------------------------------------------------ syncs, bit for bit
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
    cfg = _config()
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    opt = torch.optim.SGD(module.parameters(), lr=1e-1)
    mesh = make_mesh(world // TP, TP)
    holder = SyncTopology.from_mesh(mesh).is_tp_src
    engine = ReferenceEngine(model_config=cfg, tp_size=TP, quantization="fp8", kv_cache_tokens=64) if holder else None
    names = layout_for(cfg, 1).hf_names()
    quantized = set(fp8.quantized_names(layout_for(cfg, 1))) - set(SKIPPED)     # SGLang's Fp8 layers, less the list
    out = []
    try:
        for step, kw in enumerate([*SYNCS, {"method": "tensor", "layout": "engine", "bad": True}]):
            kw = dict(kw)
            bad = kw.pop("bad", False)
            if kw["method"] == "disk":
                kw["disk_dir"] = f"{root}/s{step}"
            train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step, rank=rank))
            if bad:        # the trainer's config: a list SGLang and the reference engine read apart
                module.config = _config({**QC, "ignored_layers": ["model.mlp"]})
            manager = FSDPShardingManager(module, engine if kw["method"] == "tensor" or rank == 0 else None,
                                          mesh=mesh if kw["method"] == "tensor" else None,
                                          config=SyncConfig(dtype=torch.float32, bucket_bytes=BUCKET, quantization="fp8",
                                                            free_cache_engine=False, dist_timeout_s=60,
                                                            verify="full" if step == 0 else "off", **kw))
            rec = {"kw": kw, "bad": bad}
            before = engine.weights_checksum() if engine is not None else None
            try:
                with manager:
                    pass
                rec["stats"] = {"bytes": manager.stats.bytes, "buckets": manager.stats.buckets,
                                **{k: manager.stats.extra.get(k) for k in ("quantized_tensors", "layout")}}
            except SyncError as exc:
                rec["error"] = str(exc)
            finally:
                manager.close()
                if bad:
                    module.config = cfg
            full = {n: p.full_tensor().detach() for n, p in module.named_parameters()}   # collective
            if engine is not None and not bad:
                wrong = []
                for n in names:
                    got, want = engine.get_weights_by_name(n), full[n]
                    if n not in quantized:
                        ok = got.dtype == torch.float32 and torch.equal(got, want)
                    else:
                        q, s = fp8.quantize_block(n, want)
                        g_s = engine.get_weights_by_name(fp8.scale_name(n))
                        ok = (got.dtype == torch.float8_e4m3fn and torch.equal(got.view(torch.uint8), q.view(torch.uint8))
                              and torch.equal(g_s, s))
                    if not ok:
                        wrong.append(n)
                rec["wrong"] = wrong
                rec["fp8"] = sorted(n for n in names if engine.get_weights_by_name(n).dtype == torch.float8_e4m3fn)
            if bad and engine is not None:
                rec["kept"] = engine.weights_checksum() == before
            out.append(rec)
    finally:
        if engine is not None:
            engine.shutdown()
    return out


@pytest.mark.timeout(300)
def test_every_method_syncs_the_ignored_layers_unquantized_bit_exact_and_the_plan_counts_it(tmp_path):
    from fsdp_sync.plan import Cluster, PlanJob, plan_row

    cpu = Cluster("cpu-test", "cpu", 64, 10**12, 5.0, 1.0, 1.0, 1.0, 1.0, 1e-4, 1e-4)
    results = run_ranks(_job, 2, str(tmp_path), timeout_s=280, env=spawn_env({"SGLANG_FP8_IGNORED_LAYERS": ""}))
    holder = next(r for r in results if any("wrong" in rec for rec in r))
    cfg = _config()
    for i, kw in enumerate(SYNCS):
        recs = [r[i] for r in results]
        assert all("error" not in rec for rec in recs), (kw, [rec.get("error") for rec in recs])
        rec = holder[i]
        assert rec["wrong"] == [], (kw, rec["wrong"])                   # every tensor the trainer's, bit for bit
        assert not set(SKIPPED) & set(rec["fp8"]) and len(rec["fp8"]) == 9, (kw, rec["fp8"])
        # the plan of the same job counts what the sync sent
        plan = plan_row(PlanJob(cfg, kw["method"], kw["layout"], BUCKET, "float32", "fp8", 2, 2, TP,
                                engine="reference"), cpu)
        sent = {"bytes": recs[0]["stats"]["bytes"],
                "quantized_tensors": max(r["stats"]["quantized_tensors"] or 0 for r in recs)}
        assert sent == {k: plan[k] for k in sent}, (kw, sent, {k: plan[k] for k in sent})
    bad = [r[-1] for r in results]
    for rec in bad:      # refused on every rank before anything was sent: the engine kept its weights
        # (the engine, built with the trainer's first list, is refused first as another config)
        assert "quantization_config.ignored: trainer ['mlp'], engine" in rec.get("error", ""), rec
        assert rec.get("kept", True), rec


def test_the_checkpoints_config_json_keeps_the_ignored_layers():
    """Before: the disk method's config.json replaced the model's ``quantization_config`` with one
    without ``ignored_layers``: an engine started from the checkpoint would build those layers FP8
    and read their bf16 bytes as FP8 (plan3 fix follow-up)."""
    from fsdp_sync.models import hf_config_json

    for qc in (QC, {k: v for k, v in QC.items() if k != "ignored_layers"}
               | {"modules_to_not_convert": QC["ignored_layers"]}):
        d = hf_config_json(_module(_config(qc)), torch.bfloat16, quantization="fp8")
        key = "ignored_layers" if "ignored_layers" in qc else "modules_to_not_convert"
        assert d["quantization_config"][key] == qc[key], d["quantization_config"]
        assert d["quantization_config"]["weight_block_size"] == [128, 128]
    plain = hf_config_json(_module(_config(None)), torch.bfloat16, quantization="fp8")
    assert set(plain["quantization_config"]) == {"quant_method", "fmt", "activation_scheme",
                                                 "weight_block_size"}


def test_an_engine_built_with_another_list_is_a_config_mismatch():
    """The manager refuses, before any byte moves, an engine whose config lists other unquantized
    layers than the trainer's (`config_check`, as for rope_theta): before, the reference engine
    refused partway through the sync ('unknown parameter ...weight_scale_inv'), holding part of the
    new weights. The same list written with or without 'model.', or by the other key, is no
    mismatch; no list on either side compares nothing."""
    from fsdp_sync.config_check import config_mismatches

    plain = {k: v for k, v in QC.items() if k != "ignored_layers"}
    mine = _config()
    diff = config_mismatches(mine, _config(plain))
    assert [(k, b) for k, _, b in diff] == [("quantization_config.ignored", None)], diff
    assert diff[0][1] == ["layers.0.mlp.down_proj", "layers.1.self_attn"]
    assert [k for k, _, _ in config_mismatches(mine, _config({**QC, "ignored_layers": ["model.layers.0.mlp.down_proj"]}))] \
        == ["quantization_config.ignored"]
    for same in ({**plain, "modules_to_not_convert": QC["ignored_layers"]},
                 {**QC, "ignored_layers": [e.removeprefix("model.") for e in QC["ignored_layers"]]}):
        assert config_mismatches(mine, _config(same)) == [], same
    assert config_mismatches(_config(plain), _config(None)) == []
