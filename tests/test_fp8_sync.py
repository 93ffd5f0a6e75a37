"""FP8 syncs end to end (`SyncConfig.quantization="fp8"`), one 2-rank job: FSDP2 and FSDP1 trainers
into a block-FP8 reference engine by every method (tensor: flattened full and per-rank, bucketed,
per_tensor; distributed: full and per-rank; disk: a block-FP8 Hugging Face checkpoint and per-rank
files), dense and MoE (TP 2, EP 1 and 2). After every sync ``verify="full"`` passes (the engine holds
the trainer's FP8 bytes and scales bit for bit, per TP rank), the bytes moved are exactly the FP8
stream's, and the engine's greedy tokens equal transformers' greedy run of the trainer's weights
quantized and dequantized (what the engine computes with). A scale left stale in the engine is caught
by verify, naming it; a NaN in one trainer rank's shard (hence in one engine rank's slice) fails the
sync on every rank at once, naming the tensor, for the per-rank and full paths of every method, and
the engine keeps its weights; an engine and a config of different formats are refused before
anything moves.
The disk version is a checkpoint transformers' own block-FP8 dequantizing loader reads back to the
weights the engine serves.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env

sys.path.insert(0, str(Path(__file__).parent))

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7]]
STALE = "model.layers.1.mlp.down_proj.weight_scale_inv"
NAN = "model.layers.1.mlp.down_proj.weight"      # [256, 512]: element [200, 300] is on trainer rank 1
                                                 # (FSDP2 rows 128-255) and engine rank 1 (columns 256-511)
CASES = [  # (fsdp, recipe, tp, ep, syncs)
    (2, "tiny-fp8", 2, 1,
     [{"method": "tensor", "layout": "full"}, {"method": "tensor", "layout": "engine"},
      {"method": "tensor", "strategy": "bucketed"}, {"method": "tensor", "strategy": "per_tensor"},
      {"method": "distributed", "layout": "full"}, {"method": "distributed", "layout": "engine"},
      {"method": "disk", "layout": "full", "keep": True}, {"method": "disk", "layout": "engine"},
      {"method": "tensor", "layout": "engine", "stale": True},
      {"method": "disk", "layout": "full", "stale": True},
      {"method": "tensor", "layout": "engine", "nan": True}, {"method": "distributed", "layout": "engine", "nan": True},
      {"method": "distributed", "layout": "full", "nan": True}, {"method": "disk", "layout": "full", "nan": True},
      {"method": "disk", "layout": "engine", "nan": True},   # quantized per engine rank: one writer fails
      {"method": "tensor", "quantization": None}]),
    (1, "tiny-fp8-moe", 2, 2,
     [{"method": "tensor", "layout": "engine", "fsdp1_state_dict": "local"},
      {"method": "distributed", "layout": "full", "fsdp1_state_dict": "local"},
      {"method": "disk", "layout": "engine", "fsdp1_state_dict": "local"}]),
]


def _job(rank, world, root):
    from fsdp_sync.cli.demo import _rollout_copy
    from fsdp_sync.cli.trainer import greedy_generate, synthetic_batch, train_step, wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncError, SyncTopology, make_mesh
    from fsdp_sync.weights import quantize

    torch.set_num_threads(1)
    out = []
    for c, (fsdp, recipe, tp, ep, syncs) in enumerate(CASES):
        cfg = load_config(recipe)
        module = wrap_fsdp(build_model(cfg, seed=c), fsdp)
        opt = torch.optim.SGD(module.parameters(), lr=1e-1)
        mesh = make_mesh(world // tp, tp)
        holder = SyncTopology.from_mesh(mesh).is_tp_src
        engine = ReferenceEngine(model_config=cfg, tp_size=tp, ep_size=ep, quantization="fp8",
                                 kv_cache_tokens=128) if holder else None
        ref = build_model(cfg, seed=c).eval() if holder else None
        try:
            for step, kw in enumerate(syncs):
                kw = dict(kw)
                stale, keep, nan = kw.pop("stale", False), kw.pop("keep", False), kw.pop("nan", False)
                kw.setdefault("quantization", "fp8")
                if kw["method"] == "disk":
                    kw["disk_dir"] = os.path.join(root, f"case{c}-{step}")
                train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step, rank=rank))
                manager = FSDPShardingManager(module, engine if kw["method"] == "tensor" or rank == 0 else None,
                                              mesh=mesh if kw["method"] == "tensor" else None,
                                              config=SyncConfig(dtype=torch.float32, bucket_bytes=256 << 10,
                                                                free_cache_engine=False, dist_timeout_s=60,
                                                                verify="full", **kw))
                if stale:        # the engine ends up with one wrong block scale (a stale derived scale)
                    real = manager.transport.sync

                    def sync(ctx, real=real):
                        old = engine.get_weights_by_name(STALE) if engine is not None else None
                        real(ctx)
                        if engine is not None:
                            engine.update_weights_from_tensor([(STALE, old * 2)])

                    manager.transport.sync = sync
                rec = {"case": c, "step": step, "kw": kw, "stale": stale, "nan": nan}
                if nan:       # one trainer rank's shard holds a NaN: every rank must fail, at once
                    local = module.model.layers[1].mlp.down_proj.weight.to_local()
                    old = local[200 - 128, 300].item() if rank == 1 else None
                    if rank == 1:
                        with torch.no_grad():
                            local[200 - 128, 300] = float("nan")
                    before = engine.weights_checksum() if engine is not None else None
                try:
                    with manager:
                        rec["bytes"] = manager.stats.bytes
                        rec["want_bytes"] = sum(m.nbytes for m in quantize.sync_metas(module, manager.config))
                        rec["fp8_shard"] = quantize.for_sync(module, manager.config, tp, ep).layout.engine_bytes(4)
                        rec["extra"] = {k: v for k, v in manager.stats.extra.items()
                                        if isinstance(v, (int, float, str, bool, type(None)))}
                        _rollout_copy(module, ref, torch.float32, "fp8")          # collective
                        if engine is not None:
                            rec["tokens"] = engine.generate(PROMPTS, max_new_tokens=4, ignore_eos=True)
                            rec["want"] = greedy_generate(ref, PROMPTS, 4)
                            rec["dtypes"] = {n: str(engine.get_weights_by_name(n).dtype) for n in
                                             ("model.layers.0.self_attn.q_proj.weight", STALE.replace(
                                                 "mlp.down_proj", "self_attn.o_proj"), "model.norm.weight")}
                        if keep and rank == 0:
                            rec["checkpoint"] = manager.stats.extra["path"]
                except SyncError as exc:
                    rec["error"] = str(exc)
                finally:
                    manager.close()
                if nan:
                    if rank == 1:
                        with torch.no_grad():
                            local[200 - 128, 300] = old
                    rec["kept"] = engine.weights_checksum() == before if engine is not None else True
                if keep and rank == 0 and "checkpoint" in rec:
                    rec["hf"] = _read_with_transformers(rec["checkpoint"], engine)
                out.append(rec)
        finally:
            if engine is not None:
                engine.shutdown()
    return out


def _read_with_transformers(path: str, engine) -> dict:
    """transformers reads the block-FP8 checkpoint (dequantizing on CPU) into the weights the engine
    serves dequantized; the safetensors hold float8_e4m3fn weights and float32 scales."""
    import transformers
    from safetensors import safe_open

    from fsdp_sync.weights import fp8

    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f).get("quantization_config")
    dtypes = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                for k in f.keys():
                    dtypes[k] = str(f.get_slice(k).get_dtype())
    res = {"quantization_config": qc, "dtypes": dtypes}
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
            dtype=torch.float32, device_map="cpu")
    except Exception as exc:  # noqa: BLE001 - reported and asserted on by the test
        res["load_error"] = f"{type(exc).__name__}: {exc}"
        return res
    sd = dict(model.named_parameters())
    name = "model.layers.0.self_attn.q_proj.weight"
    want = fp8.dequantize_block(engine.get_weights_by_name(name),
                                engine.get_weights_by_name(name + "_scale_inv"), torch.float32)
    res["q_proj_equal"] = bool(torch.equal(sd[name].detach().float(), want))
    return res


@pytest.mark.timeout(420)
def test_every_method_and_layout_syncs_fp8_bit_exact(tmp_path):
    results = run_ranks(_job, 2, str(tmp_path), timeout_s=400, env=spawn_env())
    n = sum(len(case[-1]) for case in CASES)
    for rank, recs in enumerate(results):
        assert len(recs) == n, rank
        for rec in recs:
            kw = rec["kw"]
            if rec["nan"]:        # refused on every rank, naming the tensor; the engine kept its weights
                assert NAN in rec.get("error", "") and "NaN" in rec["error"], (rank, rec)
                assert rec["kept"], rec
                continue
            if rec["stale"]:      # caught on every rank, naming the stale scale
                assert "error" in rec and STALE in rec["error"], (rank, rec)
                continue
            if kw["quantization"] is None:     # a bf16 config into an FP8 engine: refused by name
                assert "quantization='fp8'" in rec.get("error", "") and "None" in rec["error"], rec
                continue
            assert "error" not in rec, rec["error"]
            assert rec["bytes"] == rec["want_bytes"], rec          # exactly the FP8 stream's bytes
            assert rec["extra"]["quantization"] == "fp8", rec
            if kw["method"] != "distributed" or rank == 0:    # distributed: rank 0 quantizes what it sends
                assert rec["extra"]["quantized_tensors"] > 0 and rec["extra"]["quantize_s"] > 0, rec
            if "layout" in kw:
                assert rec["extra"]["layout"] == kw["layout"], rec
            if kw.get("layout") == "engine" and rank == 0:   # each engine rank gets its FP8 shard only
                x = rec["extra"]
                assert x["engine_rank_bytes_in"] <= 1.05 * x["engine_rank_shard_bytes"] == 1.05 * rec["fp8_shard"], rec
            if "tokens" in rec:
                assert rec["tokens"] == rec["want"], rec
                assert rec["dtypes"] == {"model.layers.0.self_attn.q_proj.weight": "torch.float8_e4m3fn",
                                         "model.layers.1.self_attn.o_proj.weight_scale_inv": "torch.float32",
                                         "model.norm.weight": "torch.float32"}, rec
            if "hf" in rec:
                hf = rec["hf"]
                assert hf["quantization_config"]["quant_method"] == "fp8", hf
                assert hf["quantization_config"]["weight_block_size"] == [128, 128], hf
                assert hf["dtypes"]["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3", hf
                assert hf["dtypes"]["model.layers.0.self_attn.q_proj.weight_scale_inv"] == "F32", hf
                assert hf["dtypes"]["model.norm.weight"] == "F32", hf
                assert hf.get("q_proj_equal"), hf
