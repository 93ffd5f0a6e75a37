"""Disk method, layout="full" (Hugging Face files every engine worker reads its slices of) against
layout="engine" (one file per engine TP rank, each worker reads only its own): DiskTransport.sync on
2 CPU ranks (FSDP2) into a reference engine held by trainer rank 0, rounds alternating the two
layouts so load from other jobs hits both alike.

Run: PYTHONPATH=. .venv/bin/python dev/measure_disk_layout.py [recipe] [bucket_mb] [tp] [rounds] [dir]
     (default: qwen2-160m, 64 MiB buckets, engine TP 2, 3 rounds of 2 syncs per layout, a temp dir
     under /tmp). Prints one JSON object: per layout the syncs' seconds (total, write, publish,
     engine load) and bytes (each engine rank's read, its shard), and the medians.
"""
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch


def job(rank, world, recipe, bucket_mb, tp, rounds, root):
    import torch.distributed as dist

    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.engines.base import checksum_named_tensors
    from fsdp_sync.weights.export import iter_params
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport

    torch.set_num_threads(1)
    cfg = load_config(recipe)
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    engine = ReferenceEngine(model_config=cfg, tp_size=tp, dtype=torch.float32, kv_cache_tokens=64) \
        if rank == 0 else None
    out = {"full": [], "engine": []}
    steps = {"full": 0, "engine": 0}
    try:
        for r in range(rounds + 1):                      # round 0: warm-up, not reported
            for layout in ("full", "engine"):
                sc = SyncConfig(method="disk", layout=layout, dtype=torch.float32,
                                bucket_bytes=bucket_mb << 20, disk_dir=os.path.join(root, layout),
                                disk_keep=1)
                t = DiskTransport(sc)
                for _ in range(2):
                    st = SyncStats()
                    dist.barrier()
                    t0 = time.perf_counter()
                    t.sync(SyncContext(module, sc, None, None, [engine] if engine else [],
                                       steps[layout], st))
                    secs = time.perf_counter() - t0
                    steps[layout] += 1
                    assert st.extra["layout"] == layout, st.extra
                    if r:
                        e = st.extra
                        out[layout].append({
                            "s": round(secs, 3), "write_s": round(e["write_s"], 3),
                            "publish_s": round(e["publish_s"], 3), "load_s": round(e["load_s"], 3),
                            "files": e["files"], "engine_rank_bytes_in": e.get("engine_rank_bytes_in"),
                            "engine_rank_shard_bytes": e.get("engine_rank_shard_bytes"),
                            "trainer_rank_bytes_in": e.get("trainer_rank_bytes_in"),
                            "reshard_path": e.get("reshard_path")})
        want = checksum_named_tensors(iter_params(module, dtype=torch.float32))
        if engine is not None:
            out["bit_exact_after_last_sync"] = engine.weights_checksum() == want
        out["bytes"] = st.bytes
    finally:
        if engine is not None:
            engine.shutdown()
    dist.barrier()
    return out


if __name__ == "__main__":
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    a = sys.argv[1:]
    recipe = a[0] if len(a) > 0 else "qwen2-160m"
    bucket_mb = int(a[1]) if len(a) > 1 else 64
    tp = int(a[2]) if len(a) > 2 else 2
    rounds = int(a[3]) if len(a) > 3 else 3
    root = a[4] if len(a) > 4 else tempfile.mkdtemp(prefix="fsdp_sync-disk-layout-")
    try:
        res = run_ranks(job, 2, recipe, bucket_mb, tp, rounds, root, timeout_s=1800, env=spawn_env())[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    res["summary"] = {
        lay: {k: statistics.median(x[k] for x in res[lay])
              for k in ("s", "write_s", "publish_s", "load_s")} | {
            "engine_rank_bytes_in": res[lay][-1]["engine_rank_bytes_in"],
            "engine_rank_shard_bytes": res[lay][-1]["engine_rank_shard_bytes"]}
        for lay in ("full", "engine")}
    res["config"] = {"recipe": recipe, "bucket_mb": bucket_mb, "tp": tp, "rounds": rounds,
                     "trainer_ranks": 2, "fsdp": 2, "dtype": "float32", "dir": root}
    print(json.dumps(res, indent=1))
