"""`fsdp-sync bench --lora-r R`: an adapter-only sync beside a full sync of the same model.

One job: ``ranks`` trainer ranks (FSDP2) hold a model with a peft-shaped LoRA adapter of rank
``r`` on every linear layer (`cli.lora_model`) and a colocated `ReferenceEngine` of TP ``tp``, with
``SyncConfig(lora="adapter")``. Each repeat trains nothing (the figures do not depend on the
values) and times two syncs with the manager's ``sync_weights`` stage:

- ``full``: ``base_sync_done=False``: every base weight through the tensor method (flattened
  buckets) and then the adapter, as the first sync of a LoRA run, or any sync of a full-weight
  run of the same model, does; its ``bytes`` are the base's plus the adapter's;
- ``adapter``: the adapter alone (`fsdp_sync.lora_sync`): ``lora_A``/``lora_B`` gathered, one
  flattened bucket, loaded as the engine's LoRA adapter.

Both rows carry the median seconds over ``repeats``; the adapter row carries ``bytes_ratio`` and
``speedup`` against the full row. Each row is checked: after it the engine's logits with the
adapter equal the trainer's own forward within 1e-5 (float32).

Not here: the sweep of full syncs (`main`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

__all__ = ["lora_bench_rank", "run_lora_bench", "print_lora_bench"]

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120]]


def _stage_seconds(manager: Any) -> float:
    return next(s.seconds for s in manager.timeline.stages if s.name == "sync_weights")


def lora_bench_rank(rank: int, world: int, opts: dict) -> dict:
    from ...config import SyncConfig
    from ...engines import ReferenceEngine
    from ...manager import FSDPShardingManager
    from ...models import build_model, load_config
    from ...topology import SyncTopology, make_mesh
    from ..lora_model import add_lora
    from ..trainer import last_logits, wrap_fsdp

    torch.set_num_threads(1)
    cfg = load_config(opts["model"])
    model = wrap_fsdp(add_lora(build_model(cfg, seed=0), opts["r"], opts["alpha"]), 2)
    mesh = make_mesh(world // opts["tp"], opts["tp"])
    holds = SyncTopology.from_mesh(mesh).is_tp_src
    engine = ReferenceEngine(model_config=cfg, tp_size=opts["tp"], max_lora_rank=opts["r"]) if holds else None
    manager = FSDPShardingManager(model, engine, mesh=mesh, config=SyncConfig(
        dtype=torch.float32, lora="adapter", bucket_bytes=int(opts["bucket_mb"] * 2**20)))
    times: dict[str, list[float]] = {"full": [], "adapter": []}
    figures: dict[str, dict] = {}
    diffs: list[float] = []
    try:
        for i in range(opts["repeats"] + 1):          # the first round warms up
            for mode in ("full", "adapter"):
                manager.base_sync_done = mode == "adapter"
                t0 = time.perf_counter()
                with manager:
                    wall = time.perf_counter() - t0
                    st = manager.stats
                    if i == opts["repeats"]:          # the last round: check what the engine serves
                        want = last_logits(model, PROMPTS)
                        if engine is not None:
                            got = engine.forward_logits(PROMPTS, lora_path=manager.config.lora_name).float()
                            diffs.append(float((got - want).abs().max()))
                if i:
                    times[mode].append(_stage_seconds(manager))
                figures[mode] = {"bytes": st.bytes + int(st.extra.get("base_bytes") or 0),
                                 "adapter_bytes": st.bytes, "enter_seconds": wall,
                                 "tensors": st.tensors + int(st.extra.get("base_tensors") or 0)}
    finally:
        manager.close()
        if engine is not None:
            engine.shutdown()
    rows = []
    for mode in ("full", "adapter"):
        rows.append({"mode": mode, "model": opts["model"], "ranks": world, "tp": opts["tp"], "lora_r": opts["r"],
                     "lora_alpha": opts["alpha"], "seconds": statistics.median(times[mode]),
                     "all_seconds": times[mode], **figures[mode]})
    full, ad = rows
    ad["bytes_ratio"] = ad["bytes"] / full["bytes"]
    ad["speedup"] = full["seconds"] / ad["seconds"]
    return {"rows": rows, "max_abs_logit_diff": max(diffs) if diffs else None}


def run_lora_bench(model: str, ranks: int, tp: int, r: int, alpha: float, repeats: int = 3,
                   bucket_mb: float = 64.0, timeout_s: float = 1800.0) -> dict:
    """Run the job on ``ranks`` local processes; rank 0's rows and the worst logit difference."""
    from ..launch import run_ranks, spawn_env

    opts = {"model": model, "tp": tp, "r": r, "alpha": alpha, "repeats": repeats, "bucket_mb": bucket_mb}
    per_rank = run_ranks(lora_bench_rank, ranks, opts, timeout_s=timeout_s, env=spawn_env())
    out = per_rank[0]
    diffs = [p["max_abs_logit_diff"] for p in per_rank if p["max_abs_logit_diff"] is not None]
    out["max_abs_logit_diff"] = max(diffs)
    out["ok"] = out["max_abs_logit_diff"] <= 1e-5
    return out


def print_lora_bench(args: Any, console: Any) -> int:
    """`cmd_bench` for ``--lora-r``: run, print the two rows and the ratio, write ``--json``."""
    import json
    from pathlib import Path

    from rich.table import Table

    spec = args.spec
    model, ranks, tp = spec.models[0], spec.ranks[0], spec.tp[0]
    console.print(f"[bold]fsdp-sync bench --lora-r {args.lora_r}[/]: {model}, {ranks} ranks, tp {tp}, "
                  f"adapter on every linear layer, {spec.repeats} repeats")
    res = run_lora_bench(model, ranks, tp, args.lora_r, args.lora_alpha, spec.repeats, spec.bucket_mb[0])
    table = Table(title="LoRA: adapter-only sync beside a full sync (median sync_weights seconds)")
    for c in ("sync", "bytes", "MiB", "tensors", "seconds", "bytes ratio", "speedup"):
        table.add_column(c, justify="right")
    for r in res["rows"]:
        table.add_row(r["mode"], f"{r['bytes']:,}", f"{r['bytes'] / 2**20:.1f}", str(r["tensors"]),
                      f"{r['seconds']:.4f}", f"{r['bytes_ratio']:.4f}" if "bytes_ratio" in r else "-",
                      f"{r['speedup']:.1f}x" if "speedup" in r else "-")
    console.print(table)
    console.print(f"engine with the adapter vs the trainer: max |logit diff| {res['max_abs_logit_diff']:.2e}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
        console.print(f"wrote {args.json}")
    return 0 if res["ok"] else 1
