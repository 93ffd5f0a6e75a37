"""Export alone against the floor, on 2 CPU ranks: where a flattened sync's time goes before the
engine sees anything. Prints, per rank, the export time of every bucket of the model (median of 3
after a warm-up) on the all-gather path and on the host-shared path, the time spent waiting in the
all-gather, and the floor (bare all-gather of the same bytes + one copy of a TP rank's shard).

Usage: PYTHONPATH=. .venv/bin/python dev/profile_export.py [recipe=qwen2-160m] [bucket_mb=64]
"""
import statistics
import sys
import time

import torch

from fsdp_sync.cli.launch import run_ranks, spawn_env


def job(rank, world, model, bucket_mb):
    import torch.distributed as dist

    from fsdp_sync.weights import export, gather
    from fsdp_sync.cli.bench.floors import floor_seconds
    from fsdp_sync.transport.buffers import ReusedBuffer
    from fsdp_sync.models import build_model, load_config
    from fsdp_sync.cli.trainer import wrap_fsdp

    torch.set_num_threads(1)
    module = wrap_fsdp(build_model(load_config(model)), 2)
    bucket_bytes = int(bucket_mb * 2**20)
    waited = [0.0]
    real = gather.all_gather

    def timed(out, inp, group):
        t = time.perf_counter()
        real(out, inp, group)
        waited[0] += time.perf_counter() - t

    gather.all_gather = timed
    out = {}
    for share in (False, True):
        times, waits = [], []
        for _ in range(4):
            buf = ReusedBuffer(0, torch.device("cpu"))
            waited[0] = 0.0
            dist.barrier()
            t = time.perf_counter()
            for _, flat in export.iter_buckets(module, bucket_bytes, alloc=buf.take, share_host_memory=share):
                del flat
                buf.give_back()
            times.append(time.perf_counter() - t)
            waits.append(waited[0])
        key = "host_shared" if share else "all_gather"
        out[key] = {"seconds": round(statistics.median(times[1:]), 3),
                    "in_all_gather": round(statistics.median(waits[1:]), 3)}
    total = sum(m.nbytes for m in export.param_metas(module))
    out["floor"] = round(floor_seconds(total, bucket_bytes, 2, "cpu", 3), 3)
    return out


if __name__ == "__main__":
    model = sys.argv[1] if len(sys.argv) > 1 else "qwen2-160m"
    bucket_mb = float(sys.argv[2]) if len(sys.argv) > 2 else 64.0
    for rank, res in enumerate(run_ranks(job, 2, model, bucket_mb, env=spawn_env(), timeout_s=900)):
        print(f"rank {rank}: {res}")
