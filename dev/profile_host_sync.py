"""Where a one-rank tensor sync's host time goes, phase by phase: the sync's own figure
(`stats.seconds`), the export (`export.resolve`), the per-rank write (`reshard._write_local`), the
payload (`handles.make_payloads`), the coverage check, the engine's round trips (`_round`, which
also holds the memory stages' resume and release), per sync, medians and minima of ``--syncs``
after three warm-up syncs. Each phase is timed by wrapping its function (one clock read on each
side, nothing per tensor). With ``--model dev/qwen2-1500m-tensors.yaml`` (qwen2-1500m's 338
tensors, 4 MiB) a sync is all host work: the part a GPU sync waits on (docs/gpu.md).

With ``--bucket-kb`` the sync is cut into buckets as a GPU sync of the real model is (400: six
per-rank buckets, as qwen2-1500m's 512 MiB ones on the H200) and the first bucket's making, which
also holds the export's resolve, is shown beside the others' (median).

Usage: PYTHONPATH=. .venv/bin/python dev/profile_host_sync.py [--model dev/qwen2-1500m-tensors.yaml]
           [--layout engine|full] [--dtype bfloat16] [--syncs 40] [--bucket-kb 400] [--unpipelined]
"""

from __future__ import annotations

import argparse
import collections
import functools
import time

import _timing      # dev/_timing.py (run as dev/NAME.py: dev/ is on the path)


def _rank(rank, world, a):
    import torch

    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync import manager as manager_mod
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.reference import engine as engine_mod
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.weights import export, handles, reshard

    took: dict[str, float] = collections.defaultdict(float)
    timed = functools.partial(_timing.timed, took)

    for name in ("_check_coverage", "_resume", "_release"):
        timed(manager_mod.FSDPShardingManager, name)
    timed(export, "resolve")
    timed(reshard, "_write_local")
    timed(handles, "make_payloads")
    timed(engine_mod.ReferenceEngine, "_round")
    torch.set_num_threads(1)
    cfg = load_config(a.model)
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    dtype = getattr(torch, a.dtype)
    per: dict[str, list[float]] = collections.defaultdict(list)
    with ReferenceEngine(model_config=cfg, tp_size=1, dtype=dtype) as engine:
        manager = FSDPShardingManager(module, engine, mesh=make_mesh(1, 1),
                                      config=SyncConfig(layout=a.layout, strategy="flattened", dtype=dtype,
                                                        pipelined=not a.unpipelined,
                                                        **({"bucket_bytes": a.bucket_kb * 1024}
                                                           if a.bucket_kb else {})))
        for _ in range(3):
            with manager:
                pass
        for _ in range(a.syncs):
            took.clear()
            t0 = time.perf_counter()
            with manager:
                pass
            per["the with block"].append(time.perf_counter() - t0)
            per["sync_weights (stats.seconds)"].append(manager.stats.seconds)
            calls = manager.stats.extra["calls"]
            if len(calls) > 1:
                per["first bucket's making"].append(calls[0]["make_s"])
                per["other buckets' making (median)"].append(
                    sorted(c["make_s"] for c in calls[1:])[(len(calls) - 1) // 2])
                per[f"buckets ({len(calls)}): engine_s"].append(sum(c["engine_s"] for c in calls))
            for k, v in took.items():
                per[k].append(v)
        manager.close()
    return {k: (sorted(v)[len(v) // 2], min(v)) for k, v in per.items()}


def main() -> None:
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="dev/qwen2-1500m-tensors.yaml")
    ap.add_argument("--layout", default="engine", choices=("engine", "full"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--syncs", type=int, default=40)
    ap.add_argument("--bucket-kb", type=int, default=0, help="bucket size (0: SyncConfig's default)")
    ap.add_argument("--unpipelined", action="store_true")
    a = ap.parse_args()
    (out,) = run_ranks(_rank, 1, a, timeout_s=900, env=spawn_env())
    print(f"{a.model}, layout {a.layout}, {a.dtype}, {a.syncs} syncs, "
          f"{'un' if a.unpipelined else ''}pipelined (ms: median, min)")
    for k, (med, low) in sorted(out.items(), key=lambda kv: -kv[1][0]):
        print(f"  {k:30s} {med * 1e3:7.2f} {low * 1e3:7.2f}")


if __name__ == "__main__":
    main()
