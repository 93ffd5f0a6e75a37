"""What ``SyncConfig.verify`` costs: ``fsdp-sync bench --verify sample,full``.

For each model and rollout format (``--quantization``: none, fp8) of the sweep (its first rank
count, TP size, EP size, bucket size and layout, and its dtype) one job runs, per update method of
``--methods``, a manager over a reference engine (the direct one, not ``--engine http``) and times
``--repeats`` syncs after a warm-up with ``verify`` off, then with each asked mode: a row per
(model, quantization, method, mode) with the median sync seconds and the median seconds the check
added (`verify.verify_engines` runs after the transport's sync, timed on its own, the slowest rank
counted). Each row says what it ran with (``quantization``, ``layout``, ``dtype``, ...): an FP8
sweep's check compares what the sync quantized, a different cost from the rollout dtype's.

Not here: the main sweep's rows (`bench`), the check itself (`verify`).
"""

from __future__ import annotations

import itertools
import os
import shutil
import statistics
import tempfile
from typing import Any

import torch
from ...topology import cpu_group, released_by_backend

__all__ = ["verify_rows"]


def _verify_rank(rank: int, world: int, job: dict) -> list[dict]:
    import torch.distributed as dist

    from ...config import SyncConfig
    from ...engines import ReferenceEngine
    from ...manager import FSDPShardingManager
    from ...models import build_model, load_config
    from ...topology import SyncTopology, make_mesh
    from ..trainer import synthetic_batch, train_step, wrap_fsdp

    torch.set_num_threads(1)
    cfg = load_config(job["model"])
    dtype = getattr(torch, job["dtype"])
    module = wrap_fsdp(build_model(cfg, seed=0), 2)
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    mesh = make_mesh(world // job["tp"], job["tp"], "cpu")
    holds = SyncTopology.from_mesh(mesh).is_tp_src
    quant = job.get("quantization")
    engine = ReferenceEngine(model_config=cfg, tp_size=job["tp"], ep_size=job.get("ep", 1), dtype=dtype,
                             **({"quantization": quant} if quant else {})) if holds else None
    rows = []
    step = [0]
    try:
        for method in job["methods"]:
            kw: dict[str, Any] = dict(method=method, dtype=dtype, bucket_bytes=job["bucket_bytes"],
                                      memory_probe="off", quantization=quant,
                                      layout=job.get("layout", "auto"))
            if method == "tensor":
                kw["free_cache_engine"] = False
            if method == "disk":
                kw["disk_dir"] = os.path.join(job["disk_root"], f"verify-{method}")
            if method == "tensor":
                eng, m_mesh = engine, mesh
            else:
                eng, m_mesh = ([engine] if rank == 0 else None), None
            m = FSDPShardingManager(module, eng, mesh=m_mesh, config=SyncConfig(**kw))
            try:
                for mode in ("off", *job["modes"]):
                    m.config = m.config.replace(verify=mode)
                    sync_s, verify_s, checked = [], [], 0
                    for i in range(1 + job["repeats"]):
                        step[0] += 1
                        train_step(module, opt, synthetic_batch(cfg.vocab_size, step=step[0], rank=rank))
                        with m:
                            pass
                        if i:       # the first is the warm-up
                            sync_s.append(m.stats.seconds)
                            verify_s.append(m.stats.extra.get("verify_s", 0.0))
                            checked = m.stats.extra.get("verify_tensors", 0)
                    t = torch.tensor([statistics.median(sync_s), statistics.median(verify_s)],
                                     dtype=torch.float64)
                    with released_by_backend(t):     # the slowest rank sets the pace
                        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
                    rows.append({"model": job["model"], "method": method, "verify": mode,
                                 "sync_seconds": float(t[0]), "verify_seconds": float(t[1]),
                                 "tensors_checked": checked, "repeats": job["repeats"],
                                 "ranks": world, "tp": job["tp"], "ep": job.get("ep", 1),
                                 "bucket_bytes": job["bucket_bytes"], "dtype": job["dtype"],
                                 "quantization": quant, "layout": job.get("layout", "auto")})
            finally:
                m.close()
    finally:
        if engine is not None:
            engine.shutdown()
    return rows


def verify_rows(spec: Any, modes: tuple[str, ...]) -> list[dict]:
    """Rows of the verify cost for a `bench.BenchSpec` (see the module docstring)."""
    from ..launch import run_ranks, spawn_env

    bad = [m for m in modes if m not in ("off", "sample", "full")]
    if bad or not modes:
        raise ValueError(f"--verify takes off, sample and/or full, got {list(modes)}")
    modes = tuple(dict.fromkeys(m for m in modes if m != "off"))   # off always runs first
    if spec.device != "cpu":
        raise ValueError("--verify measures on CPU only for now (the reference engine's read-back)")
    rows: list[dict] = []
    for model, quant in itertools.product(spec.models, spec.quantization):
        root = tempfile.mkdtemp(prefix="fsdp-sync-bench-verify-")
        try:
            job = {"model": model, "dtype": spec.dtype, "tp": spec.tp[0], "ep": spec.ep[0], "methods": list(spec.methods),
                   "modes": list(modes), "repeats": spec.repeats, "disk_root": root,
                   "bucket_bytes": int(spec.bucket_mb[0] * 2**20), "quantization": quant,
                   "layout": spec.layouts[0]}
            rows += run_ranks(_verify_rank, spec.ranks[0], job, timeout_s=1800, env=spawn_env())[0]
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows
