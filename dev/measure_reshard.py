"""Bytes and time of one export: per-rank buckets (`reshard.iter_rank_buckets`, host-shared and
all-to-all) against today's full buckets (`export.iter_buckets`, host-shared and all-gather).

    PYTHONPATH=. python dev/measure_reshard.py [--model qwen2-160m] [--ranks 2] [--tp 2]
        [--bucket-mb 64] [--dtype float32] [--fsdp 2] [--out reshard.json]

Prints (and writes) one JSON row per path: trainer_rank_bytes_in (the most bytes any trainer rank
received from its peers), engine_rank_shard_bytes (one engine rank's shard), the bytes the
bucketed all-gather receives per rank, and the seconds of the slowest rank. Not a benchmark of
the engine: nothing is loaded; the manager's transports will report end-to-end rows.
"""

from __future__ import annotations

import argparse
import json
import time


def _rank(rank, world, model, tp, bucket_mb, dtype_name, fsdp):
    import torch
    import torch.distributed as dist

    from fsdp_sync.weights import export, reshard
    from fsdp_sync.weights.layout import layout_for
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    cfg = load_config(model)
    module = wrap_fsdp(build_model(cfg, seed=0), fsdp)
    layout = layout_for(cfg, tp)
    bb = bucket_mb << 20
    rows = []
    for share in (True, True, False, False):   # each path twice: the first run pays first-touch page faults
        st = reshard.ReshardStats()
        dist.barrier()
        t0 = time.perf_counter()
        for rb in reshard.iter_rank_buckets(module, layout, bb, dtype=dtype, share_host_memory=share, stats=st):
            del rb
        dist.barrier()
        rows.append({"what": "layout=engine", "path": st.path, "seconds": time.perf_counter() - t0,
                     "trainer_rank_bytes_in": st.bytes_in, "trainer_rank_bytes_out": st.bytes_out,
                     "trainer_rank_bytes_written": st.bytes_written,
                     "allgather_bytes_in": st.allgather_bytes_in,
                     "engine_rank_shard_bytes": st.engine_shard_bytes, "buckets": st.buckets})
    for share in (True, True, False, False):
        total = 0
        dist.barrier()
        t0 = time.perf_counter()
        for bkt, flat in export.iter_buckets(module, bb, dtype=dtype, fsdp1_state_dict="local",
                                             share_host_memory=share):
            total += bkt.nbytes
            del flat
        dist.barrier()
        rows.append({"what": "layout=full", "path": "host-shared" if share else "all-gather",
                     "seconds": time.perf_counter() - t0,
                     "trainer_rank_bytes_in": 0 if share else total * (world - 1) // world,
                     "full_model_bytes": total})
    return rows[1::2]   # the second run of each path


def main() -> None:
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2-160m")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--fsdp", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    res = run_ranks(_rank, a.ranks, a.model, a.tp, a.bucket_mb, a.dtype, a.fsdp, timeout_s=900, env=spawn_env())
    rows = []
    for i, row in enumerate(res[0]):  # noqa: B007
        per = [r[i] for r in res]
        out = dict(row, model=a.model, ranks=a.ranks, tp=a.tp, bucket_mb=a.bucket_mb, dtype=a.dtype, fsdp=a.fsdp)
        out["seconds"] = max(p["seconds"] for p in per)
        out["trainer_rank_bytes_in"] = max(p["trainer_rank_bytes_in"] for p in per)
        rows.append(out)
        print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
