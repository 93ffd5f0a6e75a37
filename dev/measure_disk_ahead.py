"""Disk method, per-rank files: the same engine told of finished files (hashing ahead) or not, in
one job, syncs alternating ABBA after a warm-up: 2 CPU trainer ranks (FSDP2), qwen2-160m, reference
engine TP 2, 64 MiB buckets, one-host buffers. Prints each sync's seconds and split, then the
medians (docs/benchmarks.md, "Hashing ahead").

Run: PYTHONPATH=.:tests .venv/bin/python dev/measure_disk_ahead.py
     (PAIRS=5: syncs per side; DIR=/dev/shm: where the versions go).
"""
import os, sys, json, tempfile, torch

def job(rank, world, root):
    import torch.distributed as dist
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.cli.trainer import wrap_fsdp
    torch.set_num_threads(1)
    cfg = load_config("qwen2-160m")
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    engine = ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) if rank == 0 else None

    class NotAhead:
        def __init__(self, e): self._e = e
        def __getattr__(self, n):
            if n == "hash_files_ahead": raise AttributeError(n)
            return getattr(self._e, n)
    out = []
    d = os.path.join(root, "v")
    conf = SyncConfig(method="disk", disk_dir=d, dtype=torch.float32, bucket_bytes=64 << 20,
                      memory_probe="off", layout="auto", share_host_memory=True)
    ms = {True: FSDPShardingManager(module, engine, config=conf),
          False: FSDPShardingManager(module, NotAhead(engine) if engine else None, config=conf)}
    keys = ("export_s", "file_write_s", "write_wait_s", "fsync_s", "load_s", "read_hash_s", "copy_s", "files_told_ahead", "files_hashed_ahead")
    try:
        step = 0
        for i in range(int(os.environ.get("PAIRS", 5)) * 2 + 2):
            ahead = (i % 2 == 0) if (i // 2) % 2 == 0 else (i % 2 == 1)   # ABBA
            m = ms[ahead]
            m.step = step; step += 1
            dist.barrier()
            with m:
                pass
            if i >= 2:
                out.append({"ahead": ahead, "s": m.stats.seconds, **{k: m.stats.extra.get(k) for k in keys}})
    finally:
        for m in ms.values(): m.close()
        if engine: engine.shutdown()
    return out

if __name__ == "__main__":
    from fsdp_sync.cli.launch import run_ranks, spawn_env
    root = tempfile.mkdtemp(dir=os.environ.get("DIR", "/dev/shm"))
    try:
        res = run_ranks(job, 2, root, timeout_s=900, env=spawn_env())
    finally:
        import shutil; shutil.rmtree(root, ignore_errors=True)
    import statistics
    rows = res[0]
    for r in rows:
        print(r["ahead"], {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items() if k != "ahead"})
    for a in (True, False):
        ss = [r["s"] for r in rows if r["ahead"] is a]
        print("ahead" if a else "not  ", "median %.3f" % statistics.median(ss), [round(x, 3) for x in ss])
