"""Where a colocated CUDA sync's time goes (issue 35): one trainer rank on a NCCL-only group, a
TP-1 reference engine on the same GPU, ``--model`` in bf16, one sync per layout after warm-ups.

For each layout it prints the manager's stages, a cProfile of one sync on the trainer (Python
functions by cumulative time: per-bucket work, handle making, the engine call and its wait), and
torch.profiler's CPU/CUDA operator table of another (kernel launches, copies, syncs). The engine
worker is another process: its share is the trainer's wait inside the engine call.

With ``--kept`` instead: the engine layout's syncs with each rank's bucket buffer kept open by the
engine for the whole update (the default) and opened anew every bucket (a second engine, started
with ``keep_bucket_buffers=False``), in turn (the GPU check's ``kept`` step).

Usage (a GPU machine): PYTHONPATH=. python dev/gpu_profile.py [--model qwen2-1500m] [--bucket-mb 512]
           [--out profile.txt]
``--device cpu`` runs the same on the CPU (gloo, shared memory; tests/test_gpu_check_budget.py runs it
so with the tiny model, so the GPU check's profile step does not meet its first error on a GPU).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def _rank(rank, world, a):
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fsdp_sync import FSDPShardingManager, SyncConfig, make_mesh
    from fsdp_sync.cli.trainer import wrap_fsdp
    from fsdp_sync.engines import ReferenceEngine
    from fsdp_sync.models import build_model, load_config

    cfg = load_config(a.model)
    t0 = time.perf_counter()
    model = wrap_fsdp(build_model(cfg, seed=0, device=a.device), 2, device=a.device)
    out = [f"model {a.model} built and sharded on {a.device} in {time.perf_counter() - t0:.1f} s"]
    engine = ReferenceEngine(model_config=cfg, tp_size=1, device=a.device, dtype=torch.bfloat16)
    mesh = make_mesh(1, 1, a.device)
    cuda = a.device == "cuda"
    try:
        if a.kept:
            out.append(_kept_against_reopened(model, cfg, engine, mesh, a))
            return "\n".join(out)
        for layout in ("engine", "full"):
            m = FSDPShardingManager(model, engine, mesh=mesh, config=SyncConfig(
                bucket_bytes=int(a.bucket_mb * 2**20), dtype=torch.bfloat16, layout=layout))
            secs = []
            for _ in range(4):
                with m:
                    pass
                secs.append(m.stats.seconds)
            out.append(f"\n===== layout={layout}: syncs {[round(s * 1e3, 1) for s in secs]} ms, "
                       f"{m.stats.bytes / 2**20:.0f} MiB, {m.stats.engine_calls} engine calls, "
                       f"extra {({k: v for k, v in m.stats.extra.items() if not isinstance(v, (list, dict))})}")
            out.append("stages: " + ", ".join(f"{s['name']} {s['seconds'] * 1e3:.1f} ms"
                                               for s in m.timeline.to_dict()))
            out.append("per bucket (ms; engine call: the engine's own, on the pipeline's thread when pipelined):\n"
                       + "\n".join(f"  {c['what'][:48]:48s} make {c.get('make_s', 0) * 1e3:6.1f}  gather "
                                    f"{c.get('gather_s', 0) * 1e3:5.1f}  engine {c.get('engine_s', 0) * 1e3:6.1f}  "
                                    f"agree {c.get('agree_s', 0) * 1e3:5.1f}  release {c.get('release_s', 0) * 1e3:5.1f}  "
                                    f"engine call {c.get('engine_call_s', 0) * 1e3:6.1f}  workers: stage "
                                    f"{c.get('worker_stage_s', 0) * 1e3:6.2f} (open {c.get('worker_open_s', 0) * 1e3:5.2f}) "
                                    f"commit {c.get('worker_commit_s', 0) * 1e3:6.2f} (copies "
                                    f"{c.get('worker_apply_s', 0) * 1e3:5.2f}, ack {c.get('worker_ack_s', 0) * 1e3:5.2f})"
                                    for c in m.stats.extra.get("calls", [])))
            prof = cProfile.Profile()
            prof.enable()
            with m:
                pass
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
            out.append(f"--- cProfile, one sync ({m.stats.seconds * 1e3:.1f} ms)\n" + s.getvalue())
            with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as p:
                with m:
                    pass
            if cuda:
                torch.cuda.synchronize()
            out.append(f"--- torch.profiler, one sync ({m.stats.seconds * 1e3:.1f} ms), by CPU time\n"
                       + p.key_averages().table(sort_by="cpu_time_total", row_limit=30))
            if cuda:
                out.append("--- by CUDA time\n" + p.key_averages().table(sort_by="cuda_time_total", row_limit=15))
            m.close()
    finally:
        engine.shutdown()
    return "\n".join(out)


def _kept_against_reopened(model, cfg, engine, mesh, a) -> str:
    """Engine layout into the engine above (each rank's bucket buffer kept open for the whole
    update) and into a second one started with ``keep_bucket_buffers=False`` (opened and closed
    every bucket), syncs taken in turn: medians of the last five each, and the median engine call
    per bucket."""
    import statistics

    import torch

    from fsdp_sync import FSDPShardingManager, SyncConfig
    from fsdp_sync.engines import ReferenceEngine

    other = ReferenceEngine(model_config=cfg, tp_size=1, device=a.device, dtype=torch.bfloat16,
                            keep_bucket_buffers=False)
    try:
        managers = {kept: FSDPShardingManager(model, e, mesh=mesh, config=SyncConfig(
            bucket_bytes=int(a.bucket_mb * 2**20), dtype=torch.bfloat16, layout="engine"))
            for kept, e in (("kept open", engine), ("opened per bucket", other))}
        secs: dict = {k: [] for k in managers}
        calls: dict = {k: [] for k in managers}
        for i in range(6):
            for k, m in managers.items():
                with m:
                    pass
                if i:
                    secs[k].append(m.stats.seconds)
                    calls[k] += [c.get("engine_call_s", 0.0) for c in m.stats.extra.get("calls", [])]
        for m in managers.values():
            m.close()
    finally:
        other.shutdown()
    return "\n===== bucket buffers, layout engine, syncs in turn (median of 5; engine call per bucket):\n" + \
        "\n".join(f"  {k:18s} sync {statistics.median(secs[k]) * 1e3:7.1f} ms   engine call "
                  f"{statistics.median(calls[k]) * 1e3:6.2f} ms" for k in managers)


def main() -> None:
    from fsdp_sync.cli.launch import run_ranks, spawn_env

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2-1500m")
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--out", default=None)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--kept", action="store_true",
                   help="instead: engine-layout syncs with the bucket buffers kept open against opened "
                        "per bucket (a second engine), in turn")
    a = p.parse_args()
    (text,) = run_ranks(_rank, 1, a, backend="nccl" if a.device == "cuda" else "gloo", timeout_s=400,
                        env=spawn_env())
    print(text[:6000])
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
