"""Where a per-rank (``layout="engine"``) tensor sync's time goes, on 2 CPU trainer ranks and a TP-2
reference engine: per sync, on each trainer rank, the time in each phase (writing the per-rank
buffers, making and sharing them, barriers, the handle gather, the per-bucket agreement, the
engine's load on infer-TP rank 0), the minor page faults and CPU seconds of the trainer ranks and
of the engine workers (from ``/proc``), and the sync seconds (mean of ``--syncs`` after a warm-up).

``--keep-buffers`` is an experiment, not a feature: it keeps the one-host per-rank buffers from
one sync to the next (they are normally made at the start of each sync and freed at its end), to
show what making them and faulting in their pages costs.

Usage: PYTHONPATH=. .venv/bin/python dev/profile_rank_sync.py [--model qwen2-160m]
           [--bucket-mb 64] [--pipelined] [--all-to-all] [--keep-buffers] [--syncs 5]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import time

import _timing      # dev/_timing.py (run as dev/NAME.py: dev/ is on the path)


def _proc(pid: int) -> tuple[int, float]:
    """Minor faults and CPU seconds (user + system) of a process."""
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[7]), (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _rank(rank, world, a):
    import torch
    import torch.distributed as dist

    from fsdp_sync.weights import hostbuf, reshard
    from fsdp_sync.config import SyncConfig
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.manager import FSDPShardingManager
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.topology import SyncTopology, make_mesh
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.transport import tensor as tensor_transport

    torch.set_num_threads(1)
    acc: dict[str, float] = collections.defaultdict(float)

    timed = functools.partial(_timing.timed, acc)

    if a.keep_buffers:
        made = hostbuf.HostShared.create.__func__
        kept: dict = {}

        def create(cls, group, count, nbytes):
            if (count, nbytes) not in kept:
                kept[(count, nbytes)] = made(cls, group, count, nbytes)
            return kept[(count, nbytes)]
        hostbuf.HostShared.create = classmethod(create)
    timed(hostbuf.HostShared, "create", "make and share the buffers")
    timed(reshard, "_write_local", "write the per-rank buffers")
    timed(reshard, "_exchange", "all-to-all exchange")
    timed(dist, "barrier", "barriers")
    timed(tensor_transport, "gather_to_src", "gather handles")
    timed(tensor_transport, "agree", "agree per bucket")
    cfg = load_config(a.model)
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    dtype = getattr(torch, a.dtype)
    mesh = make_mesh(world // a.tp, a.tp, "cpu")
    engine = ReferenceEngine(model_config=cfg, tp_size=a.tp, dtype=dtype) \
        if SyncTopology.from_mesh(mesh).is_tp_src else None
    workers = list(engine.worker_pids) if engine is not None else []
    if engine is not None:
        load = type(engine).load_rank_bucket

        def load_timed(self, *args, **kw):
            before = [_proc(p) for p in workers]
            t0 = time.perf_counter()
            try:
                return load(self, *args, **kw)
            finally:
                acc["engine load"] += time.perf_counter() - t0
                after = [_proc(p) for p in workers]
                acc["engine workers: faults in load"] += sum(x[0] - y[0] for x, y in zip(after, before))
        type(engine).load_rank_bucket = load_timed
    conf = SyncConfig(strategy="flattened", bucket_bytes=a.bucket_mb << 20, dtype=dtype,
                      memory_probe="off", share_host_memory=not a.all_to_all, layout="engine",
                      pipelined=a.pipelined)
    manager = FSDPShardingManager(module, engine, mesh=mesh, config=conf)
    with manager:
        pass
    acc.clear()
    start = [_proc(p) for p in [os.getpid()] + workers]
    secs = []
    for _ in range(a.syncs):
        dist.barrier()
        with manager:
            pass
        secs.append(manager.stats.seconds)
    end = [_proc(p) for p in [os.getpid()] + workers]
    names = [f"trainer{rank}"] + [f"worker{i}" for i in range(len(workers))]
    out = {"rank": rank, "sync_seconds": [round(s, 4) for s in secs],
           "per_sync": {k: round(v / a.syncs, 4) for k, v in sorted(acc.items())},
           "faults_and_cpu_s_per_sync": {n: (round((e[0] - b[0]) / a.syncs), round((e[1] - b[1]) / a.syncs, 3))
                                         for n, b, e in zip(names, start, end)},
           "path": manager.stats.extra.get("reshard_path")}
    manager.close()
    if engine is not None:
        engine.shutdown()
    return out


def main() -> None:
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="qwen2-160m")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--pipelined", action="store_true")
    ap.add_argument("--all-to-all", action="store_true", help="share_host_memory=False")
    ap.add_argument("--keep-buffers", action="store_true", help="the experiment (see the docstring)")
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--tp", type=int, default=2, help="engine TP size (2 trainer ranks: 1 or 2)")
    ap.add_argument("--dtype", default="float32", help="rollout dtype: float32, bfloat16")
    a = ap.parse_args()
    for row in run_ranks(_rank, 2, a, timeout_s=900, env=spawn_env()):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
