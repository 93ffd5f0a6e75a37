"""`fsdp-sync demo`: train, sync, generate, check, on N local ranks with no download.

N trainer ranks train a small Qwen2 (built from a recipe) under FSDP2 or FSDP1 with AdamW on a fixed
synthetic corpus. After each step the `FSDPShardingManager` syncs the weights into a colocated
`ReferenceEngine` (TP workers as processes), or with ``method="distributed"``/``"disk"`` into a
disaggregated one held by trainer rank 0 (its TP workers in processes of their own, outside the
trainer's world, reached by a broadcast or a checkpoint); inside the ``with`` block the engine generates greedily
from a few prompts and its logits are compared with the trainer's own forward on the same prompts.
Each step's sync time, bytes, peak memory, max |logit diff| and token match are returned for the
table (and the JSON file). A mismatch makes the demo fail.

Not here: argument parsing and printing (cli).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DemoOptions", "demo_rank", "run_demo", "PROMPTS"]

# prompts of different lengths, all token ids < 256 so they fit every recipe's vocabulary
PROMPTS = [[11, 27, 93, 5], [201, 3, 64, 64, 17, 88, 42, 9, 120], [7]]


@dataclass(frozen=True)
class DemoOptions:
    ranks: int = 2
    tp: int = 2
    steps: int = 3
    strategy: str = "flattened"
    bucket_mb: float = 64.0
    fsdp: int = 2
    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    multi_stage_wake_up: bool = True
    max_new_tokens: int = 16
    atol: float = 1e-5
    lr: float = 1e-3
    progress: bool = True
    method: str = "tensor"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from .config import METHODS

        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {METHODS}, got {self.method!r}")
        if self.ranks < 1 or self.tp < 1 or (self.method == "tensor" and self.ranks % self.tp):
            raise ValueError(f"--ranks ({self.ranks}) must be a positive multiple of --tp ({self.tp})")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.fsdp not in (1, 2):
            raise ValueError(f"--fsdp must be 1 or 2, got {self.fsdp}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")


def _peak(stages: list[dict], who: str, key: str) -> int:
    vals = []
    for s in stages:
        m = s["memory"].get(who, {})
        if who == "engine":
            vals.append(sum(int(w.get(key, 0)) for w in m.get("workers", [])) if isinstance(m, dict) else 0)
        else:
            vals.append(int(m.get(key, 0)))
    return max(vals, default=0)


def demo_rank(rank: int, world: int, opts: DemoOptions) -> list[dict]:
    """One trainer rank of the demo; returns a record per step (rank-local view)."""
    from .config import SyncConfig
    from .engines import ReferenceEngine
    from .manager import FSDPShardingManager
    from .models import build_model, load_config
    from .topology import SyncTopology, make_mesh
    from .trainer import greedy_generate, last_logits, synthetic_batch, train_step, wrap_fsdp

    torch.set_num_threads(1)
    cfg = load_config(opts.model)
    model = wrap_fsdp(build_model(cfg, seed=0), opts.fsdp, device=opts.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    colocated = opts.method == "tensor"
    mesh = make_mesh(world // opts.tp, opts.tp, "cuda" if opts.device == "cuda" else "cpu") if colocated else None
    holds = SyncTopology.from_mesh(mesh).is_tp_src if colocated else rank == 0
    dtype = getattr(torch, opts.dtype)
    engine = None
    if holds:
        engine = ReferenceEngine(model_config=cfg, tp_size=opts.tp, device=opts.device, dtype=dtype)
    sync_cfg = SyncConfig(strategy=opts.strategy, bucket_bytes=int(opts.bucket_mb * 2**20), dtype=dtype,
                          multi_stage_wake_up=opts.multi_stage_wake_up, method=opts.method,
                          **opts.extra)
    manager = FSDPShardingManager(model, engine, mesh=mesh, config=sync_cfg)

    progress = None
    if opts.progress and rank == 0:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(TextColumn("[bold]demo[/] step {task.completed}/{task.total}"), BarColumn(),
                            TextColumn("{task.description}"), TimeElapsedColumn(), transient=True)
        progress.start()
        task = progress.add_task("training", total=opts.steps)
    records = []
    prev_logits = None
    try:
        for step in range(opts.steps):
            loss = train_step(model, optimizer, synthetic_batch(cfg.vocab_size, step=step, rank=rank,
                                                                device=opts.device))
            if progress:
                progress.update(task, description=f"loss {loss:.3f} · syncing")
            with manager:
                ref_logits = last_logits(model, PROMPTS)
                ref_tokens = greedy_generate(model, PROMPTS, opts.max_new_tokens)
                rec: dict[str, Any] = {"step": step, "loss": loss}
                if holds:
                    eng_logits = engine.forward_logits(PROMPTS).float().cpu()
                    eng_tokens = engine.generate(input_ids=PROMPTS, max_new_tokens=opts.max_new_tokens,
                                                 temperature=0.0)
                    rec["max_abs_logit_diff"] = float((eng_logits - ref_logits).abs().max())
                    rec["tokens_match"] = eng_tokens == ref_tokens
                    rec["changed_since_last_step"] = (prev_logits is None
                                                      or not torch.equal(prev_logits, eng_logits))
                    prev_logits = eng_logits
            stages = manager.timeline.to_dict()
            rec.update(sync_seconds=manager.stats.seconds, bytes=manager.stats.bytes,
                       tensors=manager.stats.tensors, engine_calls=manager.stats.engine_calls,
                       stages=stages, peak_trainer_rss=_peak(stages, "trainer", "rss"),
                       peak_engine_rss=_peak(stages, "engine", "rss"))
            records.append(rec)
            if progress:
                progress.update(task, advance=1, description=f"loss {loss:.3f} · synced "
                                f"{manager.stats.seconds * 1e3:.0f} ms")
    finally:
        if progress:
            progress.stop()
        manager.close()
        if engine is not None:
            engine.shutdown()
    return records


def run_demo(opts: DemoOptions, *, timeout_s: float = 600.0) -> dict:
    """Run the demo on ``opts.ranks`` local processes; return the JSON-ready result."""
    from .launch import run_ranks, spawn_env

    t0 = time.perf_counter()
    per_rank = run_ranks(demo_rank, opts.ranks, opts, timeout_s=timeout_s,
                         backend="nccl" if opts.device == "cuda" else "gloo", env=spawn_env())
    steps = []
    for i in range(opts.steps):
        recs = [r[i] for r in per_rank]
        srcs = [r for r in recs if "tokens_match" in r]
        steps.append({
            "step": i,
            "loss": sum(r["loss"] for r in recs) / len(recs),
            "sync_seconds": max(r["sync_seconds"] for r in recs),
            "bytes": recs[0]["bytes"],
            "tensors": recs[0]["tensors"],
            "engine_calls": recs[0]["engine_calls"],
            "peak_trainer_rss": max(r["peak_trainer_rss"] for r in recs),
            "peak_engine_rss": max(r["peak_engine_rss"] for r in srcs),
            "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in srcs),
            "tokens_match": all(r["tokens_match"] for r in srcs),
            "changed_since_last_step": all(r["changed_since_last_step"] for r in srcs),
            "stages": recs[0]["stages"],
        })
    cfg = {k: v for k, v in opts.__dict__.items() if k not in ("progress", "extra")}
    ok = all(s["tokens_match"] and s["max_abs_logit_diff"] <= opts.atol and s["changed_since_last_step"]
             for s in steps)
    return {"config": cfg, "steps": steps, "ok": ok, "wall_seconds": time.perf_counter() - t0}
