"""Where a per-rank disk sync's time goes (``method="disk"``, ``layout="engine"``), on 2 CPU trainer
ranks (FSDP2) and a TP-2 reference engine, the bench's setup for issue 39: per sync, on each trainer
rank, the wall and CPU seconds of the cut into the per-rank buffers (`reshard._write_local`), of the
one-host barriers, of the writer thread (`disk_writer.write_shard`), the minor page faults and CPU
seconds of the trainer ranks and of the engine workers (from ``/proc``), the sync's `stats.extra`
split, and (``--cprofile``) the top functions of one sync on each trainer rank's main thread.

Usage: PYTHONPATH=. .venv/bin/python dev/profile_disk_sync.py [--model qwen2-160m]
           [--bucket-mb 64] [--dir /dev/shm] [--syncs 3] [--cprofile]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import tempfile
import time


def _proc(pid: int) -> tuple[int, float]:
    """Minor faults and CPU seconds (user + system) of a process."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[7]), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _rank(rank, world, a, root):
    import torch
    import torch.distributed as dist

    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.transport import disk_ranked, disk_writer
    from fsdp_sync.weights import hostbuf, reshard

    torch.set_num_threads(1)
    acc: dict[str, float] = collections.defaultdict(float)

    def timed(owner, name, key, where=None):
        fn = getattr(owner, name)

        def run(*args, **kw):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                acc[key + " wall"] += time.perf_counter() - t0
                acc[key + " cpu"] += time.thread_time() - c0
        setattr(owner, name, run)
        for w in where or ():
            setattr(w, name, run)

    timed(reshard, "_write_local", "cut (_write_local)")
    timed(reshard, "_zero_gaps", "zero gaps")
    timed(hostbuf.HostShared, "fill", "host fill (cut + barriers)")
    timed(disk_writer, "write_shard", "writer thread (write_shard)", where=[disk_ranked])
    timed(disk_ranked.HashAhead, "tell", "tell engines (hash ahead)")
    from fsdp_sync.transport import disk as disk_transport
    timed(disk_transport.DiskTransport, "_prune", "prune old versions")
    timed(disk_transport.DiskTransport, "_load", "engine load (_load)")
    cfg = load_config(a.model)
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    engine = ReferenceEngine(model_config=cfg, tp_size=2, dtype=torch.float32) if rank == 0 else None
    workers = list(engine.worker_pids) if engine is not None else []
    conf = SyncConfig(method="disk", disk_dir=os.path.join(root, "v"), dtype=torch.float32,
                      bucket_bytes=a.bucket_mb << 20, memory_probe="off", layout="auto",
                      share_host_memory=True)
    manager = FSDPShardingManager(module, engine, config=conf)
    rows = []
    try:
        with manager:
            pass
        for i in range(a.syncs):
            manager.step = i + 1
            acc.clear()
            dist.barrier()
            start = [_proc(p) for p in [os.getpid()] + workers]
            prof = cProfile.Profile() if a.cprofile and i == a.syncs - 1 else None
            if prof:
                prof.enable()
            with manager:
                pass
            if prof:
                prof.disable()
            end = [_proc(p) for p in [os.getpid()] + workers]
            names = [f"trainer{rank}"] + [f"worker{j}" for j in range(len(workers))]
            row = {"rank": rank, "sync": i, "seconds": round(manager.stats.seconds, 4),
                   "split": {k: round(v, 4) for k, v in manager.stats.extra.items()
                             if isinstance(v, float)},
                   "timed": {k: round(v, 4) for k, v in sorted(acc.items())},
                   "faults, cpu s": {n: (e[0] - b[0], round(e[1] - b[1], 3))
                                     for n, b, e in zip(names, start, end)}}
            if prof:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
                row["cprofile"] = s.getvalue()
            rows.append(row)
    finally:
        manager.close()
        if engine is not None:
            engine.shutdown()
    return rows


def main() -> None:
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="qwen2-160m")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--cprofile", action="store_true")
    a = ap.parse_args()
    root = tempfile.mkdtemp(dir=a.dir)
    try:
        res = run_ranks(_rank, 2, a, root, timeout_s=900, env=spawn_env())
    finally:
        import shutil
        shutil.rmtree(root, ignore_errors=True)
    for rank_rows in res:
        for row in rank_rows:
            prof = row.pop("cprofile", None)
            print(json.dumps(row))
            if prof:
                print(prof)


if __name__ == "__main__":
    main()
