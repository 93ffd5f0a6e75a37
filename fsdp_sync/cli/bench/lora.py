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

What it does not sweep: one model, rank count, TP size and bucket size; the tensor method's
flattened buckets, float32 (the logit check), on CPU, the direct engine. `check_lora_args` refuses a
flag given with ``--lora-r`` that asks for anything else (``--dtype bfloat16``, ``--verify``,
``--plot``, a second ``--models`` entry, ...), since it would be silently ignored; each row says
what it ran with (``method``, ``strategy``, ``dtype``, ``device``, ``bucket_bytes``).

Not here: the sweep of full syncs (`main`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

__all__ = ["lora_bench_rank", "run_lora_bench", "print_lora_bench", "check_lora_args", "RUNS_WITH"]

PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120]]

RUNS_WITH: dict[str, tuple[tuple, str]] = {
    # bench flag dest -> (the only value the LoRA bench runs with, why)
    "methods": (("tensor",), "the colocated tensor method only"),
    "strategies": (("flattened",), "flattened buckets only"),
    "layout": (("auto",), "the default layout only"),
    "dtype": (("float32",), "float32 only (its check: the engine's logits within 1e-5 of the trainer's)"),
    "device": (("cpu",), "on CPU only"),
    "quantization": (("none",), "the rollout dtype only, no quantization"),
    "engine": (("direct",), "the direct engine only"),
    "ep": ((1,), "a dense model's engine only (ep 1)"),
    "multi_stage": ((True,), "with multi-stage wake-up only"),
    "share_host_memory": ((True,), "with host-shared buckets only"),
}
"""What ``--lora-r`` runs with, whatever the sweep flags say: a flag given with another value is
refused (`check_lora_args`)."""
ONE_VALUE = ("models", "ranks", "tp", "bucket_mb")     # one job: the first value would be used alone
NEVER = {"preset": "runs its own job, not a sweep", "recipe": "runs its own job, not a sweep",
         "verify": "does not time the verify step", "plot": "draws no plots"}


def _show(v: Any) -> str:
    items = v if isinstance(v, (tuple, list)) else (v,)
    return ",".join(("on" if x else "off") if isinstance(x, bool) else f"{x:g}" if isinstance(x, float)
                    else str(x) for x in items)


def check_lora_args(args: Any, given: set[str]) -> None:
    """Refuse (ValueError, one line naming the flag and why) every bench flag given with
    ``--lora-r`` that the LoRA bench would not honour; ``given``: the flags on the command line
    (`cli.args.explicit_dests`), so a sweep flag left at its default is never refused."""
    for dest, why in NEVER.items():
        if dest in given:
            raise ValueError(f"--{dest.replace('_', '-')}: the LoRA bench (--lora-r) {why}; "
                             f"leave it out or drop --lora-r")
    for dest in ONE_VALUE:
        v = getattr(args, dest)
        if dest in given and isinstance(v, (tuple, list)) and len(v) > 1:
            raise ValueError(f"--{dest.replace('_', '-')} {_show(v)}: the LoRA bench (--lora-r) runs one "
                             f"job; give one value")
    for dest, (allowed, why) in RUNS_WITH.items():
        v = getattr(args, dest)
        got = tuple(v) if isinstance(v, (tuple, list)) else (v,)
        if dest in given and got != allowed:
            raise ValueError(f"--{dest.replace('_', '-')} {_show(got)}: the LoRA bench (--lora-r) runs "
                             f"{why}; leave it out or drop --lora-r")


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
                kept = getattr(manager, "lora_export", None)
                figures[mode] = {"bytes": st.bytes + int(st.extra.get("base_bytes") or 0),
                                 "adapter_bytes": st.bytes, "enter_seconds": wall,
                                 "tensors": st.tensors + int(st.extra.get("base_tensors") or 0),
                                 "adapter_tensors": st.tensors, "adapter_engine_calls": st.engine_calls,
                                 "adapter_buffer_bytes": kept.bucket.nbytes if kept and kept.bucket else 0}
    finally:
        manager.close()
        if engine is not None:
            engine.shutdown()
    rows = []
    for mode in ("full", "adapter"):
        rows.append({"mode": mode, "model": opts["model"], "ranks": world, "tp": opts["tp"], "lora_r": opts["r"],
                     "method": "tensor", "strategy": "flattened", "dtype": "float32", "device": "cpu",
                     "bucket_bytes": int(opts["bucket_mb"] * 2**20),
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

    from ..plan import size

    spec = args.spec
    model, ranks, tp = spec.models[0], spec.ranks[0], spec.tp[0]
    console.print(f"[bold]fsdp-sync bench --lora-r {args.lora_r}[/]: {model}, {ranks} ranks, tp {tp}, "
                  f"adapter on every linear layer, {spec.repeats} repeats")
    res = run_lora_bench(model, ranks, tp, args.lora_r, args.lora_alpha, spec.repeats, spec.bucket_mb[0])
    table = Table(title="LoRA: adapter-only sync beside a full sync (median sync_weights seconds)")
    for c in ("sync", "bytes", "size", "tensors", "seconds", "bytes ratio", "speedup"):
        table.add_column(c, justify="right")
    for r in res["rows"]:       # size in the unit that shows it: a tiny adapter's 32 KiB is not 0.0 MiB
        table.add_row(r["mode"], f"{r['bytes']:,}", size(r["bytes"]), str(r["tensors"]),
                      f"{r['seconds']:.4f}", f"{r['bytes_ratio']:.4f}" if "bytes_ratio" in r else "-",
                      f"{r['speedup']:.1f}x" if "speedup" in r else "-")
    console.print(table)
    console.print(f"engine with the adapter vs the trainer: max |logit diff| {res['max_abs_logit_diff']:.2e}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
        console.print(f"wrote {args.json}")
    return 0 if res["ok"] else 1
