"""Where an adapter-only LoRA sync's time goes, on 2 CPU trainer ranks (FSDP2) and a TP-2 reference
engine (the `fsdp-sync bench --lora-r` job): per adapter sync, on each trainer rank, the seconds in
each of `lora_sync`'s steps and, on infer-TP rank 0, in the engine's LoRA load (packing, the
workers' stage round, the commit round), plus the CPU seconds and minor page faults of the engine
workers (from ``/proc``). Prints the median over ``--syncs`` adapter syncs after one full sync and
one warm-up adapter sync (``--each``: every adapter sync's figures, the warm-up's first).

``--alternate``: a full sync before each adapter sync (as `fsdp-sync bench --lora-r` times them).

Usage: PYTHONPATH=. .venv/bin/python dev/profile_lora_sync.py [--model qwen2-160m] [--r 16]
           [--syncs 8] [--alternate] [--verify off|full]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import time

import _timing      # dev/_timing.py (run as dev/NAME.py: dev/ is on the path)


def _proc(pid: int) -> tuple[int, float]:
    """Minor faults and CPU seconds (user + system) of a process."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[7]), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _rank(rank, world, a):
    import torch

    from fsdp_sync import lora_sync, topology
    from fsdp_sync.cli.lora_model import add_lora
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.reference import engine as engine_mod, lora_calls
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology, make_mesh

    torch.set_num_threads(1)
    acc: dict[str, float] = collections.defaultdict(float)

    timed = functools.partial(_timing.timed, acc)

    from fsdp_sync.weights import adapter_export
    for name in ("adapter_config", "check_engine", "load_adapter"):
        timed(lora_sync, name, name)
    timed(adapter_export.AdapterExport, "tensors", "export.tensors")
    timed(adapter_export.AdapterExport, "_resolve", "export.resolve (misses)")
    timed(adapter_export, "fill_shared", "export.fill_shared")
    timed(adapter_export, "fill_bucket", "export.fill_bucket")
    from fsdp_sync import manager as manager_mod
    timed(manager_mod, "agree", "agree")
    timed(lora_calls, "check_adapter", "engine.check_adapter")
    timed(lora_calls, "pack_plain", "engine.pack")
    rounds = engine_mod.ReferenceEngine._round

    def round_timed(self, cmd, *args, **kw):
        t0 = time.perf_counter()
        try:
            out = rounds(self, cmd, *args, **kw)
            for r, rep in (out or {}).items():
                if isinstance(rep, tuple) and len(rep) > 1 and isinstance(rep[1], dict):
                    for k, v in (rep[1].get("t") or {}).items():
                        acc[f"worker{r}.{k}"] = v
            return out
        finally:
            acc[f"engine.round.{cmd}"] += time.perf_counter() - t0
    engine_mod.ReferenceEngine._round = round_timed

    cfg = load_config(a.model)
    model = wrap_fsdp(add_lora(build_model(cfg, seed=0), a.r, 2 * a.r), 2)
    mesh = make_mesh(world // 2, 2)
    holds = SyncTopology.from_mesh(mesh).is_tp_src
    engine = ReferenceEngine(model_config=cfg, tp_size=2, max_lora_rank=a.r) if holds else None
    manager = FSDPShardingManager(model, engine, mesh=mesh, config=SyncConfig(
        dtype=torch.float32, lora="adapter", verify=a.verify, bucket_bytes=int(a.bucket_mb * 2**20)))
    pids = list(engine.worker_pids) if engine is not None else []
    load = lora_sync.load_adapter

    def load_counted(*args, **kw):       # the workers' page faults and CPU during the load alone
        before = [_proc(p) for p in pids]
        try:
            return load(*args, **kw)
        finally:
            for w, (b, e) in enumerate(zip(before, [_proc(p) for p in pids])):
                acc[f"worker{w}.load_faults"] += e[0] - b[0]
                acc[f"worker{w}.load_cpu"] += e[1] - b[1]
    lora_sync.load_adapter = load_counted
    rows = []
    try:
        for i in range(a.syncs + 2):
            if a.alternate and i > 0:        # a full sync before each adapter sync, as the bench does
                manager.base_sync_done = False
                with manager:
                    pass
            manager.base_sync_done = i > 0
            acc.clear()
            before = [_proc(p) for p in pids]
            with manager:
                pass
            after = [_proc(p) for p in pids]
            stage = next(s.seconds for s in manager.timeline.stages if s.name == "sync_weights")
            row = {"stage": stage, **acc, "export.misses": float(manager.lora_export.misses)}
            for w, (b, e) in enumerate(zip(before, after)):
                row[f"worker{w}.faults"] = e[0] - b[0]
                row[f"worker{w}.cpu"] = e[1] - b[1]
            if i >= 2 or (a.each and i >= 1):
                rows.append(row)
    finally:
        manager.close()
        if engine is not None:
            engine.shutdown()
    keys = sorted({k for r in rows for k in r})
    if a.each:
        return {k: [round(r.get(k, 0.0), 4) for r in rows] for k in keys}
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}


def main() -> None:
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2-160m")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--syncs", type=int, default=8)
    p.add_argument("--verify", default="off")
    p.add_argument("--alternate", action="store_true", help="a full sync before each adapter sync")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--each", action="store_true", help="every sync's figures, not the medians")
    a = p.parse_args()
    per_rank = run_ranks(_rank, 2, a, timeout_s=900, env=spawn_env())
    for rank, res in enumerate(per_rank):
        print(f"rank {rank} (median over {a.syncs} adapter syncs, seconds):")
        for k, v in res.items():
            print(f"  {k:28s} {v:10.4f}" if isinstance(v, float) else f"  {k:28s} {v}")
    print(json.dumps(per_rank))


if __name__ == "__main__":
    main()
