"""Disk method figures: DiskTransport.sync on 2 CPU ranks (FSDP2), parallel writers vs rank 0
alone, beside `disk_floor` (plain write + fsync + read of the same bytes), and the reference
engine's load of the published version.

Run: PYTHONPATH=. .venv/bin/python dev/measure_disk.py [recipe] [bucket_mb] [dir]
     (default: qwen2-160m, 64 MiB buckets, a temp dir under /tmp). Prints one JSON object.
"""
import json
import os
import shutil
import sys
import tempfile
import time

import torch


def job(rank, world, recipe, bucket_mb, root):
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.transport import SyncContext, SyncStats
    from fsdp_sync.transport.disk import DiskTransport, disk_floor
    import torch.distributed as dist

    torch.set_num_threads(1)
    cfg = load_config(recipe)
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    out = {}
    for mode in ("parallel", "rank0") * 3:
        d = os.path.join(root, mode)
        sc = SyncConfig(dtype=torch.bfloat16, bucket_bytes=bucket_mb << 20, disk_dir=d, disk_keep=1)
        t = DiskTransport(sc, parallel_write=mode == "parallel")
        runs = out.setdefault(mode, [])
        for _ in range(2):
            step = len(runs)
            st = SyncStats()
            dist.barrier()
            t0 = time.perf_counter()
            t.sync(SyncContext(module, sc, None, None, [], step, st))
            runs.append({"s": round(time.perf_counter() - t0, 3), "write_s": round(st.extra["write_s"], 3),
                         "publish_s": round(st.extra["publish_s"], 3), "bytes": st.bytes,
                         "files": st.buckets})
        dist.barrier()
    if rank == 0:
        nbytes, files = out["parallel"][0]["bytes"], out["parallel"][0]["files"]
        out["floor_s"] = [round(disk_floor(nbytes, root, files=files), 3) for _ in range(3)]
        path = os.path.join(root, "parallel", sorted(os.listdir(os.path.join(root, "parallel")))[-1])
        with ReferenceEngine(model_config=cfg, tp_size=1, dtype=torch.bfloat16,
                             kv_cache_tokens=64) as e:
            loads = []
            for _ in range(3):
                t0 = time.perf_counter()
                e.update_weights_from_disk(path)
                loads.append(round(time.perf_counter() - t0, 3))
        out["engine_load_s"] = loads
    dist.barrier()
    return out


if __name__ == "__main__":
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    recipe = sys.argv[1] if len(sys.argv) > 1 else "qwen2-160m"
    bucket_mb = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    root = sys.argv[3] if len(sys.argv) > 3 else tempfile.mkdtemp(prefix="fsdp_sync-disk-")
    try:
        res = run_ranks(job, 2, recipe, bucket_mb, root, timeout_s=900, env=spawn_env())[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    mb = res["parallel"][0]["bytes"] / 1e6
    import statistics

    best = {m: statistics.median(r["s"] for r in res[m]) for m in ("parallel", "rank0")}
    res["summary"] = {"MB": round(mb, 1), "files": res["parallel"][0]["files"],
                      "sync_MBps": {m: round(mb / s, 1) for m, s in best.items()},
                      "floor_MBps": round(mb / statistics.median(res["floor_s"]), 1),
                      "sync_over_floor": {m: round(s / statistics.median(res["floor_s"]), 2)
                                          for m, s in best.items()},
                      "engine_load_MBps": round(mb / statistics.median(res["engine_load_s"]), 1),
                      "note": "medians over the runs"}
    print(json.dumps(res, indent=1))
