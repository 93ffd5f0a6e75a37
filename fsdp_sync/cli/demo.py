"""`fsdp-sync demo`: train, sync, generate, check, on N local ranks with no download.

N trainer ranks train a small Qwen2 (built from a recipe) under FSDP2 or FSDP1 with AdamW on a fixed
synthetic corpus. After each step the `FSDPShardingManager` syncs the weights into a colocated
`ReferenceEngine` (TP workers as processes), or with ``method="distributed"``/``"disk"`` into a
disaggregated one held by trainer rank 0 (its TP workers in processes of their own, outside the
trainer's world, reached by a broadcast or a checkpoint: ``disk_dir``, by default a temp directory
removed at the end); inside the ``with`` block the engine generates greedily
from a few prompts and its logits are compared with the trainer's own forward on the same prompts.
Each step's sync time, bytes, peak memory, max |logit diff| and token match are returned for the
table (and the JSON file). A mismatch makes the demo fail. With ``lora_r`` (``--lora``) the base is
frozen and a peft-shaped adapter on every linear layer is trained (`lora_model`); the first sync
sends the base and the adapter, every later one the adapter alone (``SyncConfig.lora="adapter"``),
and the engine is checked with the adapter applied (``lora_path``).

Not here: argument parsing and printing (cli).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DemoOptions", "DemoIncomplete", "StepCheck", "demo_rank", "run_demo", "default_timeout_s", "PROMPTS"]

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
    atol: float | None = None       # None: 1e-5 in float32; ATOL_EPS × eps × max|logit| below it
    lr: float = 1e-3
    progress: bool = True
    method: str = "tensor"
    disk_dir: str | None = None     # method="disk": where the versions go (None: a temp dir, removed)
    layout: str = "auto"            # SyncConfig.layout
    ep: int = 1                     # the engine's expert-parallel size (MoE models)
    quantization: str | None = None  # SyncConfig.quantization and the engine's ("fp8": block FP8)
    backend: str | None = None      # the trainer ranks' process group (None: gloo on cpu, nccl on cuda)
    lora_r: int = 0                 # > 0: a LoRA adapter of this rank on every linear layer, synced as an adapter
    lora_alpha: float = 32.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from ..config import METHODS

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
        if self.lora_r < 0:
            raise ValueError(f"--lora-r must be >= 1, got {self.lora_r}")
        if self.lora_r and (self.dtype != "float32" or self.quantization or self.fsdp != 2):
            raise ValueError(f"--lora runs with --dtype float32, no --quantization and --fsdp 2, got "
                             f"--dtype {self.dtype} --quantization {self.quantization or 'none'} --fsdp {self.fsdp}")


# In bfloat16/float16 the engine's TP split rounds partial sums differently from the reference
# (row-parallel layers add per-rank partials): logits may differ by a few units of the dtype's
# rounding at the largest logit, and a greedy step may pick the other of two near-tied tokens.
ATOL_EPS = 4


def tolerance(opts: DemoOptions, ref_logits: torch.Tensor) -> float:
    """The |logit diff| accepted: ``opts.atol`` if given; 1e-5 in float32; in a 16-bit rollout
    dtype ATOL_EPS units of its rounding (eps) at the largest reference logit."""
    if opts.atol is not None:
        return float(opts.atol)
    dtype = getattr(torch, opts.dtype)
    if dtype == torch.float32:
        return 1e-5
    return ATOL_EPS * torch.finfo(dtype).eps * max(1.0, float(ref_logits.abs().max()))


def _rollout_copy(model: torch.nn.Module, ref: torch.nn.Module | None, dtype: torch.dtype,
                  quantization: str | None = None) -> None:
    """Load the trainer's current weights, cast to the rollout dtype, into ``ref`` (an unsharded
    model on infer-TP rank 0, None elsewhere); ``quantization="fp8"``: each weight the engine holds
    in block FP8 as ``dequantize(quantize(w))``, what the engine computes with. Every rank
    iterates: the export gathers shards."""
    from ..weights import fp8, quantize
    from ..weights.experts import hub_views
    from ..weights.export import iter_params

    params = hub_views(ref) if ref is not None else {}
    fake = quantize.quantized_hf_names(ref) if ref is not None and quantization else frozenset()
    seen = set()
    with torch.no_grad():
        for name, t in iter_params(model, dtype=dtype):
            if ref is not None:
                if name in fake:
                    t = fp8.dequantize_block(*fp8.quantize_block(name, t), dtype=dtype)
                params[name].copy_(t)
                seen.add(name)
    if ref is not None and seen != set(params):
        raise RuntimeError(f"the rollout-dtype reference missed {sorted(set(params) - seen)[:3]}")


@torch.no_grad()
def tokens_agree(ref: torch.nn.Module, prompts: list[list[int]], tokens: list[list[int]],
                 tol: float) -> bool:
    """Teacher-forced check of the engine's greedy tokens against ``ref``: at every step the
    engine's token is the reference's argmax, or within ``tol`` of it (a near tie that rounding
    in the rollout dtype may flip)."""
    dev = next(ref.parameters()).device
    for p, toks in zip(prompts, tokens):
        if not toks:
            continue
        ids = torch.tensor([p + toks[:-1]], device=dev)
        logits = ref(input_ids=ids).logits[0, len(p) - 1:].float()
        for row, tok in zip(logits, toks):
            if float(row.max() - row[tok]) > tol:
                return False
    return True


class StepCheck:
    """One engine's verdict at each step, against the trainer's reference: the largest |logit
    diff| and its tolerance, greedy tokens identical (or, in a 16-bit rollout, teacher-forced
    within the tolerance: `tokens_agree`), and logits changed since the last step (a sync
    that left the engine as it was, after a training step that changed nothing, is not a pass)."""

    def __init__(self, opts: DemoOptions) -> None:
        self.opts = opts
        self.prev_logits: torch.Tensor | None = None

    def check(self, eng_logits: torch.Tensor, ref_logits: torch.Tensor, eng_tokens: list[list[int]],
              ref_tokens: list[list[int]], ref_model: torch.nn.Module | None = None) -> dict:
        """This step's fields of the record; ``ref_model``: the 16-bit rollout's reference (None:
        tokens must be identical)."""
        tol = tolerance(self.opts, ref_logits)
        exact = eng_tokens == ref_tokens
        out = {"atol": tol, "max_abs_logit_diff": float((eng_logits - ref_logits).abs().max()),
               "tokens_exact": exact,
               "tokens_match": exact or (ref_model is not None and tokens_agree(ref_model, PROMPTS, eng_tokens, tol)),
               "changed_since_last_step": self.prev_logits is None or not torch.equal(self.prev_logits, eng_logits)}
        self.prev_logits = eng_logits
        return out


def _peak(stages: list[dict], who: str, key: str) -> int:
    vals = []
    for s in stages:
        m = s["memory"].get(who, {})
        if who == "engine":
            vals.append(sum(int(w.get(key, 0)) for w in m.get("workers", [])) if isinstance(m, dict) else 0)
        else:
            vals.append(int(m.get(key, 0)))
    return max(vals, default=0)


def demo_rank(rank: int, world: int, opts: DemoOptions, records_dir: str | None = None) -> list[dict]:
    """One trainer rank of the demo; returns a record per step (rank-local view), each also
    written to ``records_dir`` as the step ends (`run_demo` keeps the finished steps of a run
    stopped at its deadline or by a failure)."""
    from ..config import SyncConfig
    from ..engines import ReferenceEngine
    from ..manager import FSDPShardingManager
    from ..models import build_model, load_config
    from ..topology import SyncTopology, make_mesh
    from .trainer import greedy_generate, last_logits, synthetic_batch, train_step, wrap_fsdp

    torch.set_num_threads(1)
    cfg = load_config(opts.model)
    model = build_model(cfg, seed=0)
    if opts.lora_r:       # LoRA RL: the base frozen, the adapter trained and synced alone
        from .lora_model import add_lora

        model.requires_grad_(False)
        model = add_lora(model, opts.lora_r, opts.lora_alpha)
    model = wrap_fsdp(model, opts.fsdp, device=opts.device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opts.lr)
    lora_path = "fsdp_sync_lora" if opts.lora_r else None
    colocated = opts.method == "tensor"
    mesh = make_mesh(world // opts.tp, opts.tp, "cuda" if opts.device == "cuda" else "cpu") if colocated else None
    topo = SyncTopology.from_mesh(mesh) if colocated else None
    holds = topo.is_tp_src if colocated else rank == 0
    dtype = getattr(torch, opts.dtype)
    # In a 16-bit rollout dtype the engine is compared with the trainer's weights cast to that
    # dtype (an unsharded copy on infer-TP rank 0), not with the float32 training forward.
    low = dtype != torch.float32 or opts.quantization is not None
    ref_model = None
    if low and holds:
        ref_model = build_model(cfg, seed=0, dtype=dtype).eval().to(opts.device)
    engine = None
    if holds:
        # a disaggregated engine's workers go on the GPUs after the trainer ranks' (NCCL refuses
        # one GPU on both ends of the update group; `cli.args.check_gpus` checked there are enough);
        # a colocated engine's on its TP group's own GPUs: trainer rank r is on cuda:r, so the
        # group's first rank's GPU (rank - tp_rank) first, one engine per data-parallel group
        base_gpu = 0
        if opts.device == "cuda" and opts.method == "distributed":
            base_gpu = world
        elif opts.device == "cuda" and colocated:
            base_gpu = topo.tp_ranks[0]
        engine = ReferenceEngine(model_config=cfg, tp_size=opts.tp, device=opts.device, dtype=dtype,
                                 ep_size=opts.ep, base_gpu_id=base_gpu, **({"quantization": opts.quantization}
                                                     if opts.quantization else {}),
                                 **({"max_lora_rank": opts.lora_r} if opts.lora_r else {}))
    sync_cfg = SyncConfig(strategy=opts.strategy, bucket_bytes=int(opts.bucket_mb * 2**20), dtype=dtype,
                          multi_stage_wake_up=opts.multi_stage_wake_up, method=opts.method,
                          layout=opts.layout, quantization=opts.quantization,
                          **({"disk_dir": opts.disk_dir} if opts.method == "disk" else {}),
                          **({"lora": "adapter", "lora_name": lora_path} if opts.lora_r else {}),
                          **opts.extra)
    manager = FSDPShardingManager(model, engine, mesh=mesh, config=sync_cfg)

    progress = None
    if opts.progress and rank == 0:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        # a live bar only on a terminal: piped (tee, a CI log) rich draws nothing until the
        # end and a long run looked hung; there, one plain line a step on stderr
        progress = (Progress(TextColumn("[bold]demo[/] step {task.completed}/{task.total}"), BarColumn(),
                             TextColumn("{task.description}"), TimeElapsedColumn(), transient=True)
                    if Console().is_terminal else _LineProgress(opts.steps))
        progress.start()
        task = progress.add_task("training", total=opts.steps)
    records = []
    checker = StepCheck(opts)
    try:
        for step in range(opts.steps):
            loss = train_step(model, optimizer, synthetic_batch(cfg.vocab_size, step=step, rank=rank,
                                                                device=opts.device))
            if progress:
                progress.update(task, description=f"loss {loss:.3f} · syncing")
            with manager:
                if low:
                    _rollout_copy(model, ref_model, dtype, opts.quantization)
                    ref_logits = last_logits(ref_model, PROMPTS) if ref_model is not None else None
                    ref_tokens = (greedy_generate(ref_model, PROMPTS, opts.max_new_tokens)
                                  if ref_model is not None else None)
                else:
                    ref_logits = last_logits(model, PROMPTS)
                    ref_tokens = greedy_generate(model, PROMPTS, opts.max_new_tokens)
                rec: dict[str, Any] = {"step": step, "loss": loss}
                if holds:
                    eng_logits = engine.forward_logits(PROMPTS, lora_path=lora_path).float().cpu()
                    eng_tokens = engine.generate(input_ids=PROMPTS, max_new_tokens=opts.max_new_tokens,
                                                 temperature=0.0, lora_path=lora_path)
                    rec.update(checker.check(eng_logits, ref_logits, eng_tokens, ref_tokens,
                                             ref_model if low else None))
            stages = manager.timeline.to_dict()
            extra = manager.stats.extra or {}
            rec["layout"] = extra.get("layout")
            rec["base_bytes"] = extra.get("base_bytes")   # lora: the base went too (first sync)
            if extra.get("path"):                 # the disk method: what the version holds
                files = sorted(os.listdir(extra["path"])) if os.path.isdir(extra["path"]) else []
                rec["checkpoint"] = {
                    "path": extra["path"], "files": files,
                    "kind": ("per-rank shard files (layout engine: each engine rank reads its own)"
                             if extra.get("layout") == "engine" else
                             "a Hugging Face checkpoint: safetensors + config.json, portable")}
            rec.update(sync_seconds=manager.stats.seconds, bytes=manager.stats.bytes,
                       tensors=manager.stats.tensors, engine_calls=manager.stats.engine_calls,
                       stages=stages, peak_trainer_rss=_peak(stages, "trainer", "rss"),
                       peak_engine_rss=_peak(stages, "engine", "rss"))
            records.append(rec)
            if records_dir is not None:     # written whole, then renamed: a step is there or not
                path = os.path.join(records_dir, f"rank{rank}-step{step}.pkl")
                with open(path + ".part", "wb") as f:
                    pickle.dump(rec, f)
                os.replace(path + ".part", path)
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


class _LineProgress:
    """The progress bar's calls where stdout is no terminal: a line on stderr after each step."""

    def __init__(self, steps: int) -> None:
        self.steps, self.done, self.t0 = steps, 0, time.perf_counter()

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def add_task(self, _name: str, total: int) -> int:
        return 0

    def update(self, _task: int, advance: int = 0, description: str = "") -> None:
        import sys

        if advance:
            self.done += advance
            print(f"demo step {self.done}/{self.steps}: {description} "
                  f"({time.perf_counter() - self.t0:.1f} s)", file=sys.stderr, flush=True)


def default_timeout_s(opts: DemoOptions) -> float:
    """The whole run's wall-clock limit unless ``--timeout-s`` gives one: 600 s to start (the
    ranks' imports, the model's build, the engine) and 60 s a step, each plus 1 s per 10 M
    parameters (tiny, 3 steps: 780 s; qwen2-1500m: 754 s + 214 s a step). It was 600 s whatever
    the run, so ``--steps 1000`` passed it however well every step went."""
    from ..models import count_params
    from ..plan import meta_model

    per = count_params(meta_model(opts.model)[1])[0] / 1e7
    return 600.0 + per + opts.steps * (60.0 + per)


class DemoIncomplete(RuntimeError):
    """The demo stopped before its last step (a rank failed, died or passed the deadline):
    ``str()`` is the launcher's error, ``result`` what `run_demo` returns for the steps every rank
    finished (``ok`` False, ``incomplete`` the error's first line)."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def run_demo(opts: DemoOptions, *, timeout_s: float | None = None) -> dict:
    """Run the demo on ``opts.ranks`` local processes; return the JSON-ready result. Past
    ``timeout_s`` (None: `default_timeout_s`), or when a rank fails, every rank is stopped and
    `DemoIncomplete` raised, holding the steps every rank had finished."""
    from .launch import RankError, run_ranks, spawn_env

    t0 = time.perf_counter()
    timeout_s = default_timeout_s(opts) if timeout_s is None else timeout_s
    tmp = None
    if opts.method == "disk" and opts.disk_dir is None and "disk_dir" not in opts.extra:
        tmp = tempfile.mkdtemp(prefix="fsdp-sync-demo-disk-")   # one host: every rank sees it
        opts = dataclasses.replace(opts, disk_dir=tmp)
    records = tempfile.mkdtemp(prefix="fsdp-sync-demo-steps-")
    try:
        per_rank = run_ranks(demo_rank, opts.ranks, opts, records, timeout_s=timeout_s,
                             backend=opts.backend or ("nccl" if opts.device == "cuda" else "gloo"),
                             env=spawn_env())
    except RankError as exc:
        done = _finished_steps(records, opts)
        result = _result(opts, done, t0)
        result.update(ok=False, incomplete=str(exc).strip().splitlines()[0])
        raise DemoIncomplete(str(exc), result) from exc
    finally:
        shutil.rmtree(records, ignore_errors=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            opts = dataclasses.replace(opts, disk_dir=None)
    return _result(opts, per_rank, t0)


def _finished_steps(records: str, opts: DemoOptions) -> list[list[dict]]:
    """Each rank's records of the steps every rank finished (the first ones, in order)."""
    per_rank: list[list[dict]] = [[] for _ in range(opts.ranks)]
    for step in range(opts.steps):
        paths = [os.path.join(records, f"rank{r}-step{step}.pkl") for r in range(opts.ranks)]
        if not all(os.path.exists(p) for p in paths):
            break
        for r, p in enumerate(paths):
            with open(p, "rb") as f:
                per_rank[r].append(pickle.load(f))
    return per_rank


def _result(opts: DemoOptions, per_rank: list[list[dict]], t0: float) -> dict:
    """The JSON-ready result of the steps in ``per_rank`` (every rank's records, step by step)."""
    steps = []
    for i in range(min(len(r) for r in per_rank)):
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
            "tokens_exact": all(r["tokens_exact"] for r in srcs),
            "atol": min(r["atol"] for r in srcs),
            "changed_since_last_step": all(r["changed_since_last_step"] for r in srcs),
            "stages": recs[0]["stages"],
            "layout": next((r.get("layout") for r in recs if r.get("layout")), None),
            "base_bytes": recs[0].get("base_bytes"),
            "checkpoint": next((r["checkpoint"] for r in recs if r.get("checkpoint")), None),
        })
    cfg = {k: v for k, v in opts.__dict__.items() if k not in ("progress", "extra")}
    cfg["backend"] = opts.backend or ("nccl" if opts.device == "cuda" else "gloo")
    ok = bool(steps) and all(s["tokens_match"] and s["max_abs_logit_diff"] <= s["atol"]
                             and s["changed_since_last_step"] for s in steps)
    return {"config": cfg, "steps": steps, "ok": ok, "wall_seconds": time.perf_counter() - t0}
