"""`fsdp-sync bench`: where every second and byte of a sync goes, beside a floor and a baseline.

A sweep (from flags, a recipe: a name from ``fsdp_sync/recipes/memory_tuning/`` or a YAML path, or ``--preset targets``) is split
into jobs, one per (model, ranks, tp, ep, device, multi-stage) group (``ep``: the engine's MoE
expert-parallel size inside its TP group, 1 for dense models); each job stands up the trainer
ranks (FSDP2) and a colocated `ReferenceEngine` once, then measures every (strategy, bucket size)
row of the group:

- ``seconds``: the median over ``repeats`` of the manager's ``sync_weights`` stage, after a warm-up
  (``warmup_seconds``; the disk method's rows warm up ``disk_keep`` syncs more: a run's steady
  state reuses the files of the version keep-N dropped);
- ``floor_seconds``: measured beside it in the same job, timed as the sync is (``warmup`` runs,
  then the median of ``repeats``): a bare all-gather of the same bytes over the same group (in
  bucket-sized pieces) plus one copy of a TP rank's shard (the engine's: an FP8 row's FP8 shard);
  ``floor_bytes``: what it moved;
- ``baseline_seconds``: the ``per_tensor`` strategy (verl's original loop) on the same model;
- ``share_host_memory``: whether the sync took the host-shared path (flattened only: no
  all-gather), not whether it was asked to (`floors.layout_figures`); such a row's own floor,
  ``floor_shared_seconds`` (``floor_shared_bytes``): one copy of each rank's shard plus one copy of
  a TP rank's shard (None on the other rows);
- ``copy_seconds`` (tensor-method rows): one copy of the model's bytes on rank 0's device (device
  to device on CUDA, in 1 GiB chunks), measured once per job (the median of max(repeats, 5) after one warm-up):
  ``ratio_to_copy`` is the sync's seconds over it;
- per-rank buckets across hosts (``layout="engine"`` without shared memory): ``floor_seconds`` is
  the host-shared floor's two copies plus a bare ``all_to_all`` of the bytes a trainer rank received;
- ``engine``: ``direct`` (default) hands the manager the `ReferenceEngine` itself; ``http`` puts
  it behind `fsdp-sync serve`'s server (`EngineServer`, loopback) and hands the manager an
  `SGLangEngine` client of it, so a sync pays what an HTTP engine costs (SGLang's wire: the calls
  as JSON, the payloads as base64 strings): the like-for-like figure for verl's adapter, which
  reaches its engine over HTTP (docs/verl.md);
- ``peak_extra_bytes``: in one more, sampled, sync: the largest rise of one device's memory (the
  trainer rank plus its engine worker, RSS from /proc with the shared-memory pages a worker maps
  from a trainer counted once) above its level just before the sync stage, and the stage timeline
  with the sampled memory curve.

Not here: the sync itself (manager) or printing (cli).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .. import args as ca
from .allocator import pin_malloc
from .floors import (copy_seconds, floor_all_to_all_seconds, floor_seconds, floor_shared_seconds,
                     layout_figures)
from .gpu_memory import CudaPeaks
from .methods import memory_budget
from .rows import (BenchIncomplete, finish_rows, largest_bytes, measured_rows, report_incomplete, save_rows,
                   tensor_row, write_json)
from .sampling import DeviceSampler, sampled_sync
from .served import Served
from .table import BenchProgress
from .targets import check_targets
from ...topology import cpu_group

__all__ = ["BenchSpec", "Job", "run_bench", "add_bench_parser", "cmd_bench", "PRESETS", "check_targets"]

MiB = 2**20
ENGINES = ("direct", "http")

PRESETS: dict[str, dict[str, Any]] = {
    # The configuration the targets are judged on (2 ranks, TP 2, >=100M params, >=200 tensors, fp32).
    "targets": {"models": ["qwen2-160m"], "strategies": ["flattened", "per_tensor"],
                "bucket_mb": [64], "ranks": [2], "tp": [2], "multi_stage": [True], "dtype": "float32",
                "share_host_memory": [True, False], "repeats": 3, "layouts": ["full", "engine"],
                "pipelined": [True, False]},
    # Issue 13's GPU check: one trainer rank and a TP-1 engine on one CUDA device (CUDA IPC), a
    # model of ~3 GB in bf16; each row's copy_seconds is one device-to-device copy of its bytes.
    "gpu": {"models": ["qwen2-1500m"], "strategies": ["flattened", "per_tensor"], "bucket_mb": [512],
            "ranks": [1], "tp": [1], "multi_stage": [True], "device": "cuda", "dtype": "bfloat16",
            "repeats": 3, "layouts": ["full", "engine"], "pipelined": [True, False]},
    # A quick sweep that runs in about a minute.
    "quick": {"models": ["small"], "strategies": ["flattened", "bucketed", "per_tensor"],
              "bucket_mb": [4, 16, 64], "ranks": [2], "tp": [2], "multi_stage": [True, False],
              "dtype": "float32", "repeats": 3},
}


def sweep_recipes() -> list[str]:
    """The bench sweeps shipped with the package (``fsdp_sync/recipes/memory_tuning/<name>.yaml``)."""
    return ca.shipped_sweeps("bench")


sweep_recipe = ca.sweep_of("bench")     # ``--recipe``: a YAML path, or a shipped sweep's name


# list-valued keys of a bench recipe (a scalar counts as a one-item list); the rest take one value
_LISTS = ("models", "strategies", "bucket_mb", "ranks", "tp", "ep", "multi_stage", "share_host_memory",
          "methods", "layouts", "pipelined", "quantization")


def _quantization(text: str) -> str | None:
    return None if text.lower() in ("none", "null", "") else ca.choice_of(("none", "fp8"))(text)


def _checks() -> dict:
    """Each key's check of one value, on its text (YAML's ``2`` as ``"2"``): its flag's ``type=``,
    so a recipe and the command line refuse the same values (``device``: either, as its flag
    only checks a GPU is there afterwards, `check_bench_args`; ``warmup``, no flag: >= 0)."""
    from ...config import LAYOUTS, METHODS, STRATEGIES

    return {"models": ca.model_spec, "strategies": ca.choice_of(STRATEGIES), "bucket_mb": ca.mib,
            "ranks": ca.positive_int, "tp": ca.positive_int, "ep": ca.positive_int,
            "multi_stage": ca.on_off, "share_host_memory": ca.on_off, "methods": ca.choice_of(METHODS),
            "layouts": ca.choice_of(LAYOUTS), "pipelined": ca.on_off, "quantization": _quantization,
            "device": ca.choice_of(("cpu", "cuda")), "dtype": ca.dtype_name, "repeats": ca.positive_int,
            "warmup": ca.non_negative_int, "engine": ca.choice_of(ENGINES)}


@dataclass(frozen=True)
class BenchSpec:
    models: tuple[str, ...] = ("small",)
    strategies: tuple[str, ...] = ("flattened", "per_tensor")
    bucket_mb: tuple[float, ...] = (64.0,)
    ranks: tuple[int, ...] = (2,)
    tp: tuple[int, ...] = (2,)
    ep: tuple[int, ...] = (1,)              # the engine's expert-parallel size (MoE models)
    multi_stage: tuple[bool, ...] = (True,)
    share_host_memory: tuple[bool, ...] = (True,)
    device: str = "cpu"
    dtype: str = "float32"
    repeats: int = 3
    warmup: int = 1
    methods: tuple[str, ...] = ("tensor",)
    layouts: tuple[str, ...] = ("auto",)    # SyncConfig.layout of the flattened rows
    pipelined: tuple[bool, ...] = (True,)   # SyncConfig.pipelined of the per-rank rows
    quantization: tuple[str | None, ...] = (None,)   # SyncConfig.quantization: one job each
    engine: str = "direct"                  # the tensor rows' engine: direct, or http (served)

    def __post_init__(self) -> None:
        from ...config import LAYOUTS, METHODS, QUANTIZATIONS, STRATEGIES

        bad = [q for q in self.quantization if q not in QUANTIZATIONS]
        if bad or not self.quantization:
            raise ValueError(f"unknown quantization {bad or '(none)'} (--quantization); expected some "
                             f"of none, fp8")

        bad = [x for x in self.layouts if x not in LAYOUTS]
        if bad or not self.layouts:
            raise ValueError(f"unknown layouts {bad or '(none)'}; expected some of {LAYOUTS}")

        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r} (--engine); expected one of {ENGINES}")
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"unknown methods {bad or '(none)'}; expected some of {METHODS}")

        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad:
            raise ValueError(f"unknown strategies {bad}; expected {STRATEGIES}")
        def whole(x: Any, least: int) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= least

        for name in ("ranks", "tp", "ep"):      # a 0 divided by, a text compared: a traceback
            if not getattr(self, name) or not all(whole(x, 1) for x in getattr(self, name)):
                raise ValueError(f"{name} must be positive integers (--{name}), got {getattr(self, name)!r}")
        if not whole(self.warmup, 0):
            raise ValueError(f"warmup must be an integer >= 0 (syncs before each row's timed ones), "
                             f"got {self.warmup!r}")
        if not whole(self.repeats, 3):
            raise ValueError(f"repeats must be >= 3 (--repeats; rows report a median), got {self.repeats!r}")
        if self.dtype not in ("float32", "bfloat16", "float16") or self.device not in ("cpu", "cuda"):
            raise ValueError(f"dtype (--dtype) must be float32, bfloat16 or float16 and device "
                             f"(--device) cpu or cuda, got {self.dtype!r} and {self.device!r}")
        for r, t in itertools.product(self.ranks, self.tp):
            if r % t:
                raise ValueError(f"ranks ({r}) must be a multiple of tp ({t}) (--ranks, --tp)")
        for t, e in itertools.product(self.tp, self.ep):
            if t % e:
                raise ValueError(f"ep ({e}) must divide tp ({t}) (--ep, --tp; SGLang's rule)")
        if any(b <= 0 for b in self.bucket_mb):
            raise ValueError(f"bucket sizes must be positive, got {self.bucket_mb}")

    @classmethod
    def checked(cls, d: dict[str, Any]) -> dict[str, Any]:
        """A recipe's (or preset's) keys as `BenchSpec` takes them (``layout``, the flag's name, as
        ``layouts``), each value checked as its flag's text is; ValueError names the key and value."""
        checks = _checks()
        d = ca.recipe_keys_named(d)
        unknown = sorted(set(map(str, d)) - set(checks))
        if unknown:
            raise ValueError(f"unknown bench keys {unknown}; known: {sorted(checks)}")
        out = {}
        for k, v in d.items():
            if k not in _LISTS and isinstance(v, (list, tuple, dict)):
                raise ValueError(f"bench key {k!r} takes one value, got {v!r}")
            items = list(v) if isinstance(v, (list, tuple)) else [v]   # a scalar is a one-item list
            try:
                if not items or any(isinstance(x, (list, tuple, dict)) for x in items):
                    raise argparse.ArgumentTypeError(f"expected one value or a list of them, got {v!r}")
                got = tuple(checks[k](str(x)) for x in items)
            except argparse.ArgumentTypeError as exc:
                raise ValueError(f"bench key {k!r}: {exc}" + (f" (in {v!r})" if isinstance(v, (list, tuple)) else "")) from None
            out[k] = got if k in _LISTS else got[0]
        return out

    @classmethod
    def from_mapping(cls, d: dict[str, Any]) -> "BenchSpec":
        return cls(**cls.checked(d))

    @classmethod
    def from_recipe(cls, path: str | Path) -> "BenchSpec":
        return cls(**recipe_keys(path))

    def jobs(self) -> list["Job"]:
        return [Job(model=m, ranks=r, tp=t, multi_stage=ms, device=self.device, dtype=self.dtype,
                    strategies=self.strategies, bucket_mb=self.bucket_mb, repeats=self.repeats,
                    warmup=self.warmup, share_host_memory=self.share_host_memory, methods=self.methods,
                    layouts=self.layouts, pipelined=self.pipelined, ep=e, quantization=q,
                    engine=self.engine)
                for m, r, t, e, ms, q in itertools.product(self.models, self.ranks, self.tp, self.ep,
                                                           self.multi_stage, self.quantization)]


def recipe_keys(path: str | Path) -> dict[str, Any]:
    """A bench recipe's keys, checked (`BenchSpec.checked`); ValueError ``--recipe PATH: ...``."""
    d = ca.recipe_mapping(str(path), "bench")      # a file YAML cannot read: --recipe PATH: ...
    try:
        return BenchSpec.checked(d)
    except ValueError as exc:
        raise ValueError(f"--recipe {path}: {exc}") from None


@dataclass(frozen=True)
class Job:
    model: str
    ranks: int
    tp: int
    multi_stage: bool
    device: str
    dtype: str
    strategies: tuple[str, ...]
    bucket_mb: tuple[float, ...]
    repeats: int
    warmup: int
    share_host_memory: tuple[bool, ...] = (True,)
    methods: tuple[str, ...] = ("tensor",)
    layouts: tuple[str, ...] = ("auto",)
    pipelined: tuple[bool, ...] = (True,)
    ep: int = 1
    quantization: str | None = None
    engine: str = "direct"

    @property
    def engine_kw(self) -> dict:
        """The reference engine's format arguments: its EP split and quantization."""
        return {"ep_size": self.ep, **({"quantization": self.quantization} if self.quantization else {})}


# --------------------------------------------------------------------------- one job on N ranks

def bench_rank(rank: int, world: int, job: Job, records: str | None = None) -> dict:
    """Run every (strategy, bucket) row of ``job`` on this rank; rank 0 returns the rows (and
    writes those finished so far into ``records`` after each: `rows.save_rows`)."""
    import copy
    import functools

    import torch.distributed as dist

    from ...config import SyncConfig
    from ...engines import ReferenceEngine
    from ...weights.export import param_metas
    from ...manager import FSDPShardingManager
    from ...models import build_model, count_params, load_config
    from ...topology import SyncTopology, make_mesh
    from ..trainer import wrap_fsdp

    pinned = pin_malloc()       # what a sync frees leaves RSS: its peaks are what it holds
    torch.set_num_threads(1)
    cfg = load_config(job.model)
    if job.device == "cuda":    # this rank's GPU (wrap_fsdp's) before the model lands on cuda:0
        torch.cuda.set_device(rank % torch.cuda.device_count())
    model = build_model(cfg, seed=0, device="cuda" if job.device == "cuda" else None)
    params, tensors = count_params(model)
    model = wrap_fsdp(model, 2, device=job.device)
    # before the engine takes its memory: two model-sized buffers for a moment
    copy_s = copy_seconds(sum(m.nbytes for m in param_metas(model, getattr(torch, job.dtype))),
                           job.device, max(job.repeats, 5))
    mesh = make_mesh(world // job.tp, job.tp, "cuda" if job.device == "cuda" else "cpu")
    topo = SyncTopology.from_mesh(mesh)
    dtype = getattr(torch, job.dtype)
    colocated = "tensor" in job.methods
    # on CUDA each TP group's engine on that group's GPUs (trainer rank r is on cuda:r), as the demo's
    engine = ReferenceEngine(model_config=cfg, tp_size=job.tp, device=job.device, dtype=dtype,
                             base_gpu_id=topo.tp_ranks[0] if job.device == "cuda" else 0,
                             **job.engine_kw) if topo.is_tp_src and colocated else None
    served = Served(engine, job.tp) if engine is not None and job.engine == "http" else None
    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=cpu_group())
    metas = param_metas(model, dtype)
    finish = functools.partial(finish_rows, job=job, served=served, metas=metas, pinned=pinned, cfg=cfg,
                               model=model)

    def save(baseline: float | None) -> None:     # what a failed job still reports
        if records is not None and rank == 0:
            save_rows(records, finish(copy.deepcopy(rows), baseline))
    progress = BenchProgress(rank == 0, len(job.strategies) * len(job.bucket_mb) * len(job.share_host_memory)
                         * len(job.layouts) * len(job.pipelined), job)
    rows = []
    baseline: float | None = None
    try:
        order = sorted(job.strategies, key=lambda s: s != "per_tensor") if colocated else []
        for strategy, bucket_mb, share, layout, piped in itertools.product(
                order, job.bucket_mb, job.share_host_memory, job.layouts, job.pipelined):
            if layout == "full" and piped != job.pipelined[0]:
                continue  # only per-rank buckets are pipelined
            if strategy == "per_tensor" and bucket_mb != job.bucket_mb[0] and baseline is not None:
                continue  # per_tensor ignores the bucket size: measure it once
            if strategy != "flattened" and (share != job.share_host_memory[0] or layout != job.layouts[0]):
                continue  # only the flattened strategy can share host memory or cut per-rank buckets
            bucket_bytes = int(bucket_mb * MiB)
            sync_cfg = SyncConfig(strategy=strategy, bucket_bytes=bucket_bytes, dtype=dtype,
                                  multi_stage_wake_up=job.multi_stage, memory_probe="rss",
                                  share_host_memory=share,
                                  layout=layout if strategy == "flattened" else "full", pipelined=piped,
                                  quantization=job.quantization)
            manager = FSDPShardingManager(model, served.client if served else engine, mesh=mesh,
                                          config=sync_cfg)
            progress.update(f"{strategy} {bucket_mb:g} MiB: warm-up")
            warm = []
            for _ in range(job.warmup):
                with manager:
                    pass
                warm.append(manager.stats.seconds)
            secs = []
            for i in range(job.repeats):
                progress.update(f"{strategy} {bucket_mb:g} MiB: repeat {i + 1}/{job.repeats}")
                dist.barrier(group=cpu_group())
                with manager:
                    pass
                secs.append(manager.stats.seconds)
            stats = manager.stats
            progress.update(f"{strategy} {bucket_mb:g} MiB: memory")
            sampler = None
            if rank == 0:
                workers = list(getattr(engine, "worker_pids", []) or [])
                pairs = [(pids[r], workers[j] if j < len(workers) else None)
                         for j, r in enumerate(topo.tp_ranks)]
                sampler = DeviceSampler(pairs)
            peaks = CudaPeaks(engine) if job.device == "cuda" else None
            if peaks:   # the sync stage alone: not the engine's weights and KV cache it wakes
                manager.watch["sync_weights"] = peaks
            sampled_sync(manager, sampler)
            manager.watch.pop("sync_weights", None)
            lay = layout_figures(model, cfg, job, stats, share and strategy == "flattened")
            gpu_mem = peaks.result(
                memory_budget("tensor", bucket_bytes, largest_bytes(manager.module, job), lay["layout"],
                              lay["pipelined"], job=job, cfg=cfg, model=model)["memory_budget_bytes"],
                manager.timeline) if peaks else None
            progress.update(f"{strategy} {bucket_mb:g} MiB: floor")
            # the floors of the path the sync took (`layout_figures`: not the one asked for), each
            # timed as the sync is (job.warmup runs, then the median of job.repeats); the engine's
            # copy is its own shard (an FP8 row's FP8 shard). A host-shared row keeps the
            # all-gather floor beside its own (the targets' ratio_to_all_gather_floor)
            shard, moved, moved_shared, floor_shared = lay["engine_rank_shard_bytes"], {}, {}, None
            if lay["layout"] == "engine" and not lay["share_host_memory"]:
                floor = floor_all_to_all_seconds(lay["trainer_rank_bytes_in"], bucket_bytes, shard, job.device,
                                                  job.repeats, total_bytes=lay["model_bytes"],
                                                  warmup=job.warmup, moved=moved)
            else:
                floor = floor_seconds(lay["model_bytes"], bucket_bytes, job.tp, job.device, job.repeats,
                                      shard=shard, warmup=job.warmup, moved=moved)
            if lay["share_host_memory"]:
                floor_shared = floor_shared_seconds(lay["model_bytes"], job.tp, job.device, job.repeats, shard,
                                                     warmup=job.warmup, moved=moved_shared)
            secs_med = statistics.median(secs)
            if strategy == "per_tensor":
                baseline = secs_med
            if rank == 0:
                row = tensor_row(job, strategy, bucket_bytes, params, tensors, stats, secs, secs_med,
                                 floor, manager, sampler)
                row["warmup_seconds"] = warm
                if gpu_mem is not None:
                    row["gpu_memory"] = gpu_mem
                row["floor_shared_seconds"] = floor_shared
                row["floor_bytes"], row["floor_shared_bytes"] = moved, moved_shared or None
                row["copy_seconds"] = copy_s
                row["ratio_to_copy"] = secs_med / copy_s if copy_s > 0 else None
                row.update({k: v for k, v in lay.items() if k != "model_bytes"})   # the path taken
                rows.append(row)
                save(baseline)
            progress.advance()
    finally:
        progress.stop()
        if served is not None:
            served.close()
        if engine is not None:
            engine.shutdown()
    if any(m != "tensor" for m in job.methods):
        from .methods import method_rows

        largest = max(m.nbytes for m in metas)
        for method in job.methods:
            if method != "tensor":
                rows.extend(method_rows(rank, world, job, model, cfg, params, tensors, method, pids, largest))
                save(baseline)
    return {"rows": finish(rows, baseline)}


# --------------------------------------------------------------------------- the sweep

def run_bench(spec: BenchSpec, *, timeout_s: float = 1800.0) -> dict:
    """Run the sweep's jobs one after another; the rows of all. Each job's ranks (and their engine
    workers) get a temp directory of the job's own (``TMPDIR``), removed when the job ends however
    it ends: a job stopped part-way (Ctrl-C, a rank that died) leaves no disk row's checkpoint
    behind. A failed job raises `BenchIncomplete` with the rows measured before the failure."""
    import shutil
    import tempfile

    from ..launch import RankError, run_ranks, spawn_env
    from .methods import flag_over_budget

    rows: list[dict] = []
    t0 = time.perf_counter()

    def result() -> dict:
        return {"spec": asdict(spec), "rows": flag_over_budget(rows),
                "wall_seconds": time.perf_counter() - t0, "machine": _machine()}

    for job in spec.jobs():
        tmp = tempfile.mkdtemp(prefix="fsdp-sync-bench-")
        try:
            out = run_ranks(bench_rank, job.ranks, job, tmp, timeout_s=timeout_s,
                            backend="nccl" if job.device == "cuda" else "gloo", env=spawn_env({"TMPDIR": tmp}))
            rows.extend(out[0]["rows"])
        except RankError as exc:
            rows.extend(measured_rows(tmp))
            raise BenchIncomplete(str(exc), {**result(), "incomplete": str(exc).strip().splitlines()[0]}) from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return result()


def _machine() -> dict:
    import platform

    out = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}
    if torch.cuda.is_available():
        out["cuda_device"] = torch.cuda.get_device_name(0)
    return out


# --------------------------------------------------------------------------- CLI

# flag dest -> BenchSpec key: a flag given with --preset or --recipe overrides that key
_FLAG_KEYS = {"models": "models", "strategies": "strategies", "bucket_mb": "bucket_mb",
              "ranks": "ranks", "tp": "tp", "ep": "ep", "multi_stage": "multi_stage",
              "share_host_memory": "share_host_memory", "device": "device", "dtype": "dtype",
              "repeats": "repeats", "methods": "methods", "layout": "layouts",
              "quantization": "quantization", "engine": "engine"}


def add_bench_parser(sub) -> None:
    from ...config import LAYOUTS, METHODS, STRATEGIES

    p = sub.add_parser(
        "bench", help="sweep strategies/bucket sizes/models; time and memory beside a floor and baseline",
        description="Measure weight-sync time and peak extra memory over a sweep. Every row is the median "
                    "of --repeats syncs after a warm-up (disk rows: disk_keep more, the steady state), with the floor (bare all-gather of the same bytes "
                    "+ one copy of each TP rank's shard) and the per_tensor baseline measured in the same "
                    "run. Sweep from --preset, --recipe (a name: " + ", ".join(sweep_recipes()) + "; or a YAML path) or the flags; "
                    "flags given with --preset or --recipe override the preset's or recipe's values.",
        formatter_class=ca.DefaultsFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", type=ca.choice_of(sorted(PRESETS)),
                     help=f"a named sweep: {', '.join(sorted(PRESETS))} ('targets' judges the targets, unless "
                          "flags change its models, ranks, tp, ep, dtype, quantization or device)")
    src.add_argument("--recipe", type=sweep_recipe,
                     help="a sweep shipped with fsdp_sync (" + ", ".join(sweep_recipes()) + ") or a "
                          "YAML file (keys as the flags, under 'bench:')")
    p.add_argument("--models", type=ca.csv_of(ca.model_spec), default="small",
                   help="comma-separated model recipes")
    p.add_argument("--strategies", type=ca.csv_of(ca.choice_of(STRATEGIES)), default="flattened,per_tensor",
                   help=f"comma-separated strategies ({', '.join(STRATEGIES)})")
    p.add_argument("--methods", type=ca.csv_of(ca.choice_of(METHODS)), default="tensor",
                   help="comma-separated update methods side by side: tensor, distributed, disk")
    p.add_argument("--layout", type=ca.csv_of(ca.choice_of(LAYOUTS)), default="auto",
                   help="comma-separated SyncConfig.layout values side by side: auto (per-rank "
                        "shards where the engine takes them), full (every engine rank gets full "
                        "tensors; the disk method writes a Hugging Face checkpoint), engine")
    p.add_argument("--bucket-mb", type=ca.csv_of(ca.positive_float), default="64",
                   help="comma-separated bucket sizes in MiB (> 0)")
    p.add_argument("--ranks", type=ca.csv_of(ca.positive_int), default="2",
                   help="comma-separated trainer rank counts (each a multiple of every --tp)")
    p.add_argument("--tp", type=ca.csv_of(ca.positive_int), default="2", help="comma-separated engine TP sizes")
    p.add_argument("--ep", type=ca.csv_of(ca.positive_int), default="1",
                   help="comma-separated engine expert-parallel sizes inside the TP group (MoE models: "
                        "SGLang's --ep-size; each divides every --tp and the model's number of experts)")
    p.add_argument("--multi-stage", type=ca.csv_of(ca.on_off), default="on", help="comma-separated: on, off")
    p.add_argument("--share-host-memory", type=ca.csv_of(ca.on_off), default="on",
                   help="comma-separated: on, off (flattened only: host-shared buckets instead of an all-gather)")
    p.add_argument("--device", type=ca.device, default="cpu", help="cpu or cuda (cuda needs a visible GPU)")
    p.add_argument("--dtype", type=ca.dtype_name, default="float32",
                   help=f"rollout dtype: {', '.join(ca.DTYPES)}")
    p.add_argument("--quantization", type=ca.csv_of(ca.choice_of(("none", "fp8"))), default="none",
                   help="comma-separated rollout formats side by side, one job each: none (the "
                        "rollout dtype), fp8 (block FP8 as SGLang's --quantization fp8: quantized on "
                        "the trainer, about half the bytes of bf16; rows add quantize_s)")
    p.add_argument("--engine", type=ca.choice_of(ENGINES), default="direct",
                   help="the tensor rows' engine: direct (the reference engine's client in the "
                        "trainer's process) or http (the same engine behind fsdp-sync serve's server "
                        "on loopback, reached as SGLang is: verl's adapter's path)")
    p.add_argument("--repeats", type=ca.positive_int, default=3, help="timed syncs per row (median), >= 3")
    p.add_argument("--verify", type=ca.csv_of(ca.choice_of(("off", "sample", "full"))), default=None,
                   help="also time SyncConfig.verify per method and --quantization (the first --ranks, --tp, "
                        "--bucket-mb and --layout; the direct engine): comma-separated off, sample, full "
                        "(off always runs, as the reference; rows under 'verify' in the JSON: sync seconds "
                        "and the seconds the check adds)")
    p.add_argument("--lora-r", type=ca.positive_int, default=None,
                   help="instead of the sweep: a LoRA adapter of rank R on every linear layer of the "
                        "first --models entry, its adapter-only sync beside a full sync (`bench.lora`)")
    p.add_argument("--lora-alpha", type=ca.positive_float, default=32.0, help="--lora-r: lora_alpha")
    p.add_argument("--json", metavar="PATH", help="write {'rows': [...]} here")
    p.add_argument("--plot", metavar="DIR", help="write PNG plots here")
    p.set_defaults(check=check_bench_args)


def _csv(s: str, cast) -> tuple:
    return tuple(cast(x.strip()) for x in str(s).split(",") if x.strip())


def spec_from_args(args, given: set[str] | None = None) -> BenchSpec:
    """The sweep the parsed flags ask for. With --preset or --recipe, the flags in ``given`` (the
    ones on the command line, `cliargs.explicit_dests`) override the preset's or recipe's values."""
    def flag(dest: str) -> Any:
        v = getattr(args, dest)
        v = _csv(v, str) if isinstance(v, str) and dest in ("models", "strategies", "quantization") else v
        return tuple(None if x == "none" else x for x in v) if dest == "quantization" else v

    if args.preset or args.recipe:
        # the preset's or recipe's values checked as their flags' text, then the flags given
        d = BenchSpec.checked(PRESETS[args.preset]) if args.preset else recipe_keys(args.recipe)
        d.update({key: flag(dest) for dest, key in _FLAG_KEYS.items() if dest in (given or ())})
        return BenchSpec(**d)
    return BenchSpec(**{key: flag(dest) for dest, key in _FLAG_KEYS.items()})


def check_bench_args(args, given: set[str]) -> None:
    """Cross-flag checks before anything starts (ValueError names the flags); keeps the spec."""
    if "lora_alpha" in given and not args.lora_r:
        raise ValueError("--lora-alpha configures the adapter of --lora-r; add --lora-r R")
    if args.lora_r:             # a sweep flag it would ignore is refused, not dropped
        from .lora import check_lora_args

        check_lora_args(args, given)
    args.spec = spec_from_args(args, given)
    if getattr(args, "verify", None) and args.spec.device != "cpu":   # refused after the sweep, JSON lost
        raise ValueError(f"--verify {','.join(args.verify)} measures on CPU only (the reference engine's "
                         f"read-back); the sweep runs on {args.spec.device}: drop --verify or run on cpu")
    if ("engine" in given or args.spec.engine != "direct") and "tensor" not in args.spec.methods:
        raise ValueError(f"--engine {args.spec.engine} is the tensor method's engine; --methods "
                         f"{','.join(args.spec.methods)} has no tensor rows: add tensor or drop --engine")
    if "strategies" in given and "tensor" not in args.spec.methods:    # distributed, disk: their own formats
        raise ValueError(f"--strategies {','.join(args.spec.strategies)} are the tensor method's; --methods "
                         f"{','.join(args.spec.methods)} has no tensor rows: add tensor or drop --strategies")
    if args.spec.engine == "http" and "engine" in args.spec.layouts and "flattened" in args.spec.strategies:
        lays = ",".join(args.spec.layouts)
        src = f"--layout {lays}" if "layout" in given else f"--{'preset' if args.preset else 'recipe'} " \
              f"{args.preset or args.recipe} (layouts {lays})"
        raise ValueError(f"--engine http {src}: the http engine (an SGLangEngine client of fsdp-sync serve's "
                         f"server) takes no per-rank buckets (layout engine); give --layout full or auto, "
                         f"or --engine direct")
    ca.check_mib(args.spec.bucket_mb, "--bucket-mb")      # the flag's or the sweep's: 1e-7 MiB is 0 bytes
    from ...models import load_config
    from ...weights.fp8_config import held_layout
    from ...weights.layout import ModelSpec, TPLayout
    from ...engines.reference.tp_model import check_runnable
    from ..demo_check import check_fits

    configs = {}
    for model in args.spec.models:
        try:
            configs[model] = load_config(model)
            check_runnable(spec := ModelSpec.from_config(configs[model]))   # the engine runs it
        except (ValueError, TypeError, OSError) as exc:
            raise ValueError(f"--models: {exc}" if str(model) in str(exc) else f"--models {model}: {exc}") from None
        for t, e in itertools.product(args.spec.tp, args.spec.ep):
            try:
                TPLayout(spec, t)
            except ValueError as exc:
                raise ValueError(f"--models {model} --tp {t}: {exc}") from None
            try:
                lay = TPLayout(spec, t, e)               # an MoE model whose experts split this way
            except ValueError as exc:
                raise ValueError(f"--ep {e}: {exc}") from None
            for q in args.spec.quantization:
                try:
                    held_layout(configs[model], lay, q)  # FP8: whole 128 blocks on every rank
                except ValueError as exc:
                    raise ValueError(f"--quantization {q} --models {model} --tp {t}: {exc}") from None
    if args.spec.device == "cuda":   # a sweep's device: cuda needs a GPU as much as the flag does
        import argparse

        from ..args import device

        try:
            device("cuda")
        except argparse.ArgumentTypeError as exc:
            sweep = (f"--preset {args.preset}" if args.preset else
                     f"--recipe {args.recipe}" if args.recipe else "--device cuda")
            raise ValueError(f"{sweep} runs on cuda: {exc}") from None
        for method, r, t in itertools.product(args.spec.methods, args.spec.ranks, args.spec.tp):
            ca.check_gpus(method, "cuda", r, t, method_flag="--methods")   # a GPU per rank, engine's own
    for (model, config), r, t, q in itertools.product(configs.items(), args.spec.ranks, args.spec.tp,
                                                      args.spec.quantization):   # this host's memory:
        if args.spec.device == "cpu":       # on cuda every rank builds its model on its GPU
            check_fits(model, config, ranks=r, tp=t, method=args.spec.methods, dtype=args.spec.dtype,
                       quantization=q, device="cpu", command="bench")


def cmd_bench(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .table import bench_table

    console = Console(width=None if sys.stdout.isatty() else 180)
    if args.lora_r:
        from .lora import print_lora_bench

        return print_lora_bench(args, console)
    spec = getattr(args, "spec", None) or spec_from_args(args)
    console.print(f"[bold]fsdp-sync bench[/]: {len(spec.jobs())} jobs; models {', '.join(spec.models)}; "
                  f"methods {', '.join(spec.methods)}"
                  + (f"; strategies {', '.join(spec.strategies)}" if "tensor" in spec.methods else "")
                  + f"; buckets {', '.join(f'{b:g}' for b in spec.bucket_mb)} MiB")
    try:
        result, failed = run_bench(spec), None
    except BenchIncomplete as exc:    # a rank failed, died or ran out of time: its last line, the rows before it
        result, failed = exc.result, exc
    for r in result["rows"]:
        if r.get("skipped"):
            console.print(f"{r['method']}: skipped ({r['skipped']})")
    if result["rows"]:
        table = bench_table(result["rows"])
        if not sys.stdout.isatty():     # a log or a file: as wide as the table, nothing folded
            console.width = max(console.width, console.measure(table).maximum)
        console.print(table)
    over = [r for r in result["rows"] if r.get("over_budget")]
    if over:
        from .methods import over_budget_line

        console.print(f"[red]{len(over)} row(s) over their memory budget[/] ("
                      + "; ".join(over_budget_line(r) for r in over) + ")")
    if failed is not None:
        return report_incomplete(console, args, result, failed)
    if args.preset == "targets":    # judged only on the targets' own problem (`judge_targets`)
        from .table import targets_lines
        from .targets import judge_targets

        result["targets"] = judge_targets(result["rows"], asdict(spec),
                                          asdict(BenchSpec.from_mapping(PRESETS["targets"])))
        for line in targets_lines(result["targets"]):
            console.print(line)
    if getattr(args, "verify", None):
        from ..launch import RankError
        from .verify import verify_rows

        try:
            result["verify"] = verify_rows(spec, tuple(args.verify))
        except RankError as exc:    # a failed check (or rank): the sweep's rows still written, exit 1
            result["incomplete"] = "--verify: " + str(exc).strip().splitlines()[0]
            return report_incomplete(console, args, result, exc)
        vt = Table(title="verify after sync: median seconds it adds")
        for c in ("model", "method", "verify", "tensors checked", "sync s", "verify s", "× sync"):
            vt.add_column(c, justify="right")
        for r in result["verify"]:
            vt.add_row(r["model"] + (f" ({r['quantization']})" if r.get("quantization") else ""), r["method"],
                       r["verify"], str(r["tensors_checked"]),
                       f"{r['sync_seconds']:.3f}", f"{r['verify_seconds']:.3f}",
                       f"{r['verify_seconds'] / r['sync_seconds']:.2f}" if r["sync_seconds"] else "-")
        console.print(vt)
    write_json(console, args, result)
    if args.plot:
        from ..plots import plot_bench

        tensor_rows = [r for r in result["rows"] if r.get("method", "tensor") == "tensor" and not r.get("skipped")]
        for path in plot_bench({**result, "rows": tensor_rows}, args.plot):
            console.print(f"wrote {path}")
    return 0
