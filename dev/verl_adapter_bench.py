"""Sync time and engine calls of fsdp_sync's verl adapter, strategy by strategy, in one run.

Runs in the verl tier's venv (`bash scripts/verl_env.sh` first):

    .venv-verl/bin/python dev/verl_adapter_bench.py --model small --repeats 3 --json out.json

Two CPU trainer ranks hold an FSDP2 model; verl's rollout class (``get_rollout_class("sglang",
"async")``, i.e. fsdp_sync's plug-in, opted in) is built as verl's worker builds it and syncs
verl's own per-tensor generator (``full_tensor()`` per parameter, as ``FSDPEngine.
get_per_tensor_param``) into a reference engine served over HTTP (`fsdp_sync.engines.reference.serve`, TP 2), in
verl's order (resume weights, update_weights, barrier, resume kv_cache), each sync followed by
the release verl's colocated loop makes after generation (``sleep_replicas``: weights and KV
cache; ``--keep-weights`` skips it, so the engine holds valid weights at each sync and stages it
all or nothing, one more copy of the model). One rollout per strategy, kept across its syncs (as
verl's worker keeps its own). Strategies alternate, after one warm-up sync each:

- ``flattened``: fsdp_sync's: one handle per bucket per TP rank, one call per bucket.
- ``bucketed``: verl 0.9.1's own algorithm (SGLang's ``weight_sync.utils.update_weights``): one
  handle per tensor, one call per bucket of verl's size. verl's own ``ServerAdapter`` cannot run
  on a CPU machine (it imports sglang, whose import needs triton and a CUDA torch stack), so its
  algorithm is run by the adapter.
- ``per_tensor``: the older verl sharding manager's loop: one handle and one call per tensor.

``--stream module``: the generator comes as verl's engine hands it once fsdp_sync's plug-in is on
(`fsdp_sync.integrations.module_stream.ModuleStream`: the generator plus the FSDP module), so the
adapter exports from the module with fsdp_sync's bucketed export where that is exact (the
``flattened`` strategy only; the others walk the generator). ``--stream verl`` (default): the bare
generator, verl's per-tensor export.

Not a test: figures only (JSON), no asserts beyond the bit-exact check of the last sync.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _generator(module):
    from torch.distributed.tensor import DTensor

    params = module.state_dict()
    return ((n, p.full_tensor() if isinstance(p, DTensor) else p) for n, p in params.items())


def _ranks(rank: int, world: int, rollout_cfg: dict, plan: list[str], model_name: str,
           stream: str = "verl", release: bool = True):
    import verl  # noqa: F401  (loads the plug-in)
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.base import get_rollout_class

    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.cli.trainer import wrap_fsdp

    model = wrap_fsdp(build_model(load_config(model_name), seed=0), 2)
    mesh = init_device_mesh("cpu", (world // 2, 2, 1), mesh_dim_names=["dp", "infer_tp", "infer_pp"])
    cls = get_rollout_class("sglang", "async")
    rows = []
    rollouts = {}       # one per strategy, kept across its syncs, as verl's worker keeps its own
    for i, strategy in enumerate(plan):
        if strategy not in rollouts:
            cfg = dict(rollout_cfg)
            cfg["custom"] = {"fsdp_sync": dict(rollout_cfg["custom"]["fsdp_sync"], strategy=strategy)}
            rollouts[strategy] = cls(config=omega_conf_to_dataclass(OmegaConf.create(cfg)),
                                     model_config=None, device_mesh=mesh)
        rollout = rollouts[strategy]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.001)

        async def one():
            await rollout.resume(tags=["weights"])
            weights = _generator(model)
            if stream == "module":
                from fsdp_sync.integrations.module_stream import ModuleStream

                weights = ModuleStream(weights, model)
            await rollout.update_weights(weights, global_steps=i)
            await asyncio.to_thread(dist.barrier)
            await rollout.resume(tags=["kv_cache"])

        dist.barrier()
        t0 = time.perf_counter()
        asyncio.run(one())
        wall = time.perf_counter() - t0
        rows.append(dict(rollout.last_stats, wall_s=wall, i=i))
        if release and i + 1 < len(plan):   # verl's sleep_replicas after generation: weights
            # and KV cache released (not after the last sync: its weights are checked)
            asyncio.run(rollout.release())
    checksum = checksum_named_tensors(_generator(model))
    return {"rows": rows, "checksum": checksum if rank == 0 else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="small", help="fsdp_sync model recipe (tiny, small, qwen2-160m)")
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategies", default="flattened,bucketed,per_tensor")
    ap.add_argument("--json", default=None)
    ap.add_argument("--stream", choices=("verl", "module"), default="verl",
                    help="verl: the bare generator; module: with the FSDP module (see above)")
    ap.add_argument("--keep-weights", action="store_true",
                    help="skip the release after each sync (verl's sleep_replicas): the engine then "
                         "holds valid weights at the next sync and stages it all or nothing")
    args = ap.parse_args(argv)

    from omegaconf import OmegaConf

    from fsdp_sync.engines.reference import ReferenceEngine
    from fsdp_sync.cli.launch import run_ranks
    from fsdp_sync.engines.reference.serve import EngineServer

    strategies = args.strategies.split(",")
    plan = strategies + [s for _ in range(args.repeats) for s in strategies]   # warm-up first
    from hydra import compose, initialize_config_dir

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "verl"
    with initialize_config_dir(config_dir=str(recipe), version_base=None):
        cfg = compose(config_name="grpo_qwen2_5_0_5b_gsm8k_fsdp_sync", overrides=[
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
            "actor_rollout_ref.rollout.dtype=float32",
            f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes="
            f"{max(1, int(args.bucket_mb))}"])
    verl_rollout = cfg.actor_rollout_ref.rollout
    t0 = time.perf_counter()
    with ReferenceEngine(args.model, tp_size=2, seed=1) as engine, EngineServer(engine) as server:
        rollout = OmegaConf.to_container(verl_rollout, resolve=True)
        rollout["custom"] = {"fsdp_sync": {"enable": True, "base_url": server.url,
                                           "bucket_mb": args.bucket_mb, "memory_probe": "off"}}
        results = run_ranks(_ranks, 2, rollout, plan, args.model, args.stream,
                            not args.keep_weights, timeout_s=1800)
        exact = engine.weights_checksum() == results[0]["checksum"]
        calls = dict(server.hits)
    rows = results[0]["rows"]
    summary = {}
    for s in strategies:
        timed = [r for r in rows[len(strategies):] if r["strategy"] == s]
        summary[s] = {"sync_s_median": statistics.median(r["sync_s"] for r in timed),
                      "sync_s_all": [round(r["sync_s"], 4) for r in timed],
                      "export_s_median": statistics.median(r["export_s"] for r in timed),
                      "export": timed[0].get("export"),
                      # the module export's exactness comparison: made (first sync) or kept
                      "export_decision": [r.get("export_decision") for r in rows
                                          if r["strategy"] == s],
                      "engine_calls": timed[0]["engine_calls"], "tensors": timed[0]["tensors"],
                      "bytes": timed[0]["bytes"]}
    out = {"model": args.model, "stream": args.stream, "bucket_mb": args.bucket_mb,
           "released_between_syncs": not args.keep_weights,
           "repeats": args.repeats,
           "trainer_ranks": 2, "engine_tp": 2, "transport": "HTTP (fsdp-sync serve) + CPU shm",
           "last_sync_bit_exact": exact, "http_requests": calls, "strategies": summary,
           "wall_s": time.perf_counter() - t0, "torch": torch.__version__,
           "verl": __import__("verl").__version__}
    print(f"{'strategy':>10} {'export':>9} {'sync s (median)':>16} {'of it export':>13} "
          f"{'engine calls':>13} {'tensors':>8} {'MiB':>8}")
    for s, v in summary.items():
        print(f"{s:>10} {v['export'] or '-':>9} {v['sync_s_median']:16.3f} "
              f"{v['export_s_median']:13.3f} {v['engine_calls']:13d} {v['tensors']:8d} "
              f"{v['bytes'] / 2**20:8.1f}")
    print(f"last sync bit-exact: {exact}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
