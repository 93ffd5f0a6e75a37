"""Plan a sync before running it: bytes, engine calls, peak extra memory and a time estimate of one
weight sync, for any model the layout map knows and any cluster, without a process or a byte of
model memory.

`plan_row(job, cluster)` takes a `PlanJob` (model: a recipe name, a config.json path or a
``transformers`` config; method, layout, bucket size, rollout dtype and quantization, trainer world
size and FSDP version, engine TP/EP and replicas) and a `Cluster` (GPUs per node, memory per GPU,
the bandwidth of each link, per-call overheads: `CLUSTERS` has H100 and H200 nodes; ``fsdp-sync
plan --cluster this-machine`` measures this machine) and returns one row under the bench's field
names, so a plan row and a bench row of the same job compare key by key:

- bytes come from the planners the sync itself runs, so they are exact by construction: the model
  is built on the meta device (no memory, even for 235B) and exported by `export.param_metas`;
  buckets by `bucket.plan_buckets` / `plan_tight` / `reshard.plan_rank_buckets` (and, for FP8,
  `quantize.StreamQuantizer.plan`); the engine's shard by the layout map; the trainer ranks'
  all-to-all bytes by `reshard.exchange_bytes` over the FSDP split; checkpoint file sizes by
  `hf_checkpoint.safetensors_file_bytes`;
- ``memory_budget_bytes``: the rule the bench holds every measured row to (`memory_budget`: two
  buckets + the largest tensor; disk one bucket more; FP8 the quantized buckets held at once too),
  and whether it fits the memory left on each device: a plan that cannot fit raises `PlanError`
  naming the figures and the largest bucket that would fit;
- ``seconds``: an estimate, the floor of each link the bytes cross (bytes / that link's bandwidth,
  phase after phase; a pipelined method overlaps its phases) plus the per-call and per-collective
  overheads. It is a model: docs/plan.md sets it beside measured and published figures.

Not here: what an engine refuses (`fsdp_sync.plan_checks`), the clusters (`fsdp_sync.cluster`),
measuring one (``fsdp-sync plan --cluster this-machine``, in the CLI), printing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from .cluster import CLUSTERS, Cluster, load_cluster
from .plan_bytes import (disk_bytes, exchange_in, fsdp_counts, gather_bytes_in, largest_quantized_bucket,
                         quantize_scratch, quantizer_load, state_dict_bytes_in)
from .plan_checks import engine_refusal

__all__ = ["Cluster", "CLUSTERS", "PlanJob", "PlanError", "plan_row", "memory_budget",
           "quantized_bucket_bytes", "quantized_buffers", "meta_model", "load_cluster", "GB", "MiB", "GiB"]

GB, MiB, GiB = 1e9, 2**20, 2**30


# --------------------------------------------------------------------------- the memory rule

def memory_budget(method: str, bucket_bytes: int, largest: int, quantization: str | None = None,
                  dtype: torch.dtype = torch.bfloat16, *, layout: str = "full",
                  pipelined: bool = True, turns: bool = False, state_dict: str | None = None,
                  model_bytes: int = 0, ranks: int = 1, rank_buffers: int = 1,
                  quantized_bytes: int | None = None, quantize_scratch: int = 0) -> dict:
    """The most extra memory one trainer rank (colocated: its device, trainer rank and engine
    together) may take during a sync, and the rule it comes from (the bench flags every measured
    row above it): k buckets in flight, each up to max(bucket, largest tensor) (a tensor larger
    than a bucket goes alone, and two such tensors can follow each other), plus the largest tensor
    gathered whole. k: 2 for tensor and distributed with full tensors (the bucket being sent, the
    next being made); 3 for disk (the one being made, safetensors' serialized copy, the one the
    writer thread writes) and for distributed per-rank buckets on trainer rank 0, which assembles
    every engine rank's buffer (two buffer sets and the pieces the exchange brings it for one
    bucket; 2 when not pipelined). FP8: plus the quantized buckets held at once
    (`quantized_buffers`), each ``quantized_bytes``: the largest quantized bucket of the sync's
    plan, which the transports size their buffers for (`plan_row` counts it; default
    `quantized_bucket_bytes`, a bucket all of whose tensors are quantized), and the quantizer's
    ``quantize_scratch`` while it quantizes a tensor (`plan_bytes.quantize_scratch`). With buckets at least as large as the largest tensor (the usual
    case: verl's default is 2 GiB) this is k x bucket + largest tensor. ``turns``: the tensor
    method into an engine that may answer before every rank read (SGLang at TP > 1 on CUDA), whose
    buffers take turns (`transport.tensor.ReusedBuffer`): one bucket more where two are in flight
    (per-rank buckets, pipelined) and one more quantized bucket. ``rank_buffers``: the per-rank
    buckets a trainer rank builds a bucket (a disk writer: one per engine rank whose files it
    writes, ceil(tp / ranks)), k x that many, and as many quantized buckets. ``state_dict``: an
    FSDP1 state dict torch builds first (``model_bytes``: the model in the trainer's dtype):
    "full" 2 x the model (its clones of every parameter, held until streamed, and the flat
    parameters they are cloned from, unsharded unit by unit with the root's held throughout: at
    most the model), "sharded" the model + its sharded copy (model / ``ranks``)."""
    k = 3 if method == "disk" or (method == "distributed" and layout == "engine" and pipelined) else 2
    turns = turns and method == "tensor"
    if turns and layout == "engine" and pipelined:
        k += 1
    times = f"{k} x {rank_buffers}" if rank_buffers > 1 else f"{k}"
    out = {"memory_budget_bytes": k * rank_buffers * max(bucket_bytes, largest) + largest,
           "memory_budget_rule": f"{times} x max(bucket, largest tensor) + largest tensor"}
    if state_dict in ("full", "sharded"):
        full = state_dict == "full"
        out["memory_budget_bytes"] += 2 * model_bytes if full else model_bytes + model_bytes // ranks
        out["memory_budget_rule"] += (f" + FSDP1's {state_dict} state dict "
                                      + ("2 x the model" if full else "the model + model / ranks"))
    if quantization:
        n = quantized_buffers(method, layout, pipelined, turns) * rank_buffers   # one per engine rank's buffer
        q = quantized_bucket_bytes(bucket_bytes, dtype) if quantized_bytes is None else quantized_bytes
        out["memory_budget_bytes"] += n * q
        out["memory_budget_rule"] += f" + {n} quantized buckets" if n > 1 else " + the quantized bucket"
        if quantize_scratch:
            out["memory_budget_bytes"] += quantize_scratch
            out["memory_budget_rule"] += " + the quantizer's scratch"
    return out


def quantized_buffers(method: str, layout: str, pipelined: bool, turns: bool = False) -> int:
    """How many quantized buckets a trainer rank holds at once, as each transport allocates them:
    the tensor method one buffer per bucket in flight (full tensors: one, `ReusedBuffer`; per-rank
    buckets: two when pipelined, `BufferPool`), one more where its buffers take turns (``turns``);
    the distributed method's trainer rank 0 two for full tensors (bucket k on the wire while k+1
    is quantized, whatever ``pipelined``) and one per buffer set for per-rank buckets (two
    pipelined); the disk method one (the quantized bucket replaces the copy its writer takes)."""
    if method == "tensor":
        return (2 if layout == "engine" and pipelined else 1) + (1 if turns else 0)
    if method == "distributed":
        return 2 if layout == "full" or pipelined else 1
    return 1


def engine_memory_budget(method: str, bucket_bytes: int, largest: int, shard: int,
                         staged: bool, quantization: str | None = None,
                         dtype: torch.dtype = torch.bfloat16, *, layout: str = "full",
                         pipelined: bool = True, turns: bool = False) -> dict:
    """The most extra memory one engine rank of a disaggregated method (distributed, disk) may
    take during a sync, and its rule: what it receives at once (a broadcast bucket, a per-rank
    bucket, one file's slices: never more than the larger of a bucket and the largest tensor)
    and, on an engine that stages an update (fsdp_sync's reference engine while it holds loaded
    weights: what is pushed is copied aside until the commit, so a failed update leaves the old
    weights serving; not for per-rank disk files: `reference_engine_stages`), its whole shard.
    SGLang loads in place: no staging. The colocated tensor method's engine maps the trainer's
    buckets on the trainer's GPU: one device, one budget, the trainer's `memory_budget` with the
    same job (quantization, layout, pipelining, turns; the bench holds the device's rise, trainer
    plus engine worker, to it: `cli.bench.gpu_memory`), + its shard where it stages (its weights
    still valid at the sync: `reference_engine_stages`)."""
    if method == "tensor":
        rule = memory_budget(method, bucket_bytes, largest, quantization, dtype, layout=layout,
                             pipelined=pipelined, turns=turns)
        return {"engine_memory_budget_bytes": rule["memory_budget_bytes"] + (shard if staged else 0),
                "engine_memory_budget_rule": rule["memory_budget_rule"] + (
                    " + the engine's shard (staged until the commit)" if staged else "")
                + " (the trainer's device)"}
    unit = max(bucket_bytes, largest)
    return {"engine_memory_budget_bytes": unit + (shard if staged else 0),
            "engine_memory_budget_rule": "max(bucket, largest tensor)" + (
                " + its shard (staged until the commit)" if staged else "")}


def reference_engine_stages(engine: str, method: str, layout: str, weights_valid: bool = False) -> bool:
    """Whether the engine stages an update's shard until the commit: the reference engine does
    while it holds valid weights (its update transaction copies what is pushed aside, so a failed
    update leaves them serving): always for the disaggregated methods (distributed; disk with
    Hugging Face files), except for per-rank disk files, which each worker hashes first and then
    reads straight into its weights (`weights.verified_file`); for the colocated tensor method
    where ``weights_valid``: the sync did not release them (``free_cache_engine=False``) or they
    were released with ``weights_cpu_backup``. Released without a backup they resume as zeros,
    nothing to protect: the update writes in place."""
    if engine != "reference" or (method == "disk" and layout == "engine"):
        return False
    return method != "tensor" or weights_valid


def quantized_bucket_bytes(bucket_bytes: int, dtype: torch.dtype) -> int:
    """The most a quantized copy of one bucket of ``dtype`` tensors takes: one byte per element,
    a float32 scale per 128 x 128 block, 16-byte alignment per tensor (bounded by a page)."""
    elements = bucket_bytes // dtype.itemsize
    return elements + 4 * (elements // (128 * 128) + 1) + 4096


# --------------------------------------------------------------------------- the job

ENGINES = ("sglang", "reference")    # the rollout engine: SGLang, or fsdp_sync's reference engine


class PlanError(ValueError):
    """A plan that cannot run: the message names the figures; ``suggested_bucket_bytes`` is the
    largest bucket that fits (None when none does)."""

    def __init__(self, message: str, suggested_bucket_bytes: int | None = None) -> None:
        super().__init__(message)
        self.suggested_bucket_bytes = suggested_bucket_bytes


@dataclass(frozen=True)
class PlanJob:
    """One sync to plan. ``layout``: ``full`` (full tensors to every engine rank; disk: a Hugging
    Face checkpoint) or ``engine`` (per-rank buckets / per-rank files). ``share_host_memory``
    applies only where the trainer ranks' shards are in one host's memory (a CPU cluster).
    ``replicas``: engines fed by one sync (tensor: one per ``ranks / tp`` group, the colocated
    rule). ``trainer_resident_bytes``: what the trainer keeps on a GPU during the sync (None:
    its FSDP shard of the parameters in ``trainer_dtype``; 0 when offloaded).
    ``fsdp1_state_dict``: with ``fsdp=1``, the state-dict type the sync exports through
    (`SyncConfig.fsdp1_state_dict`, default "full": torch all-gathers the whole model on every
    rank first; "sharded" too, then the FSDP2-like split is gathered; "local" exchanges only the
    flat parameters' pieces). ``free_cache_engine`` (`SyncConfig.free_cache_engine`, default True)
    and ``weights_cpu_backup`` (the reference engine's, default False): whether a colocated
    engine's weights are still valid when the sync begins (not released, or released with a
    backup); the reference engine then stages the tensor method's update beside them
    (`reference_engine_stages`)."""

    model: Any
    method: str = "tensor"
    layout: str = "full"
    bucket_bytes: int = 64 * 2**20
    dtype: str = "bfloat16"
    quantization: str | None = None
    ranks: int = 8
    fsdp: int = 2
    tp: int = 8
    ep: int = 1
    replicas: int | None = None
    share_host_memory: bool = True
    pipelined: bool = True
    gpu_memory_utilization: float = 0.85
    trainer_dtype: str = "float32"
    trainer_resident_bytes: int | None = None
    engine: str = "sglang"
    fsdp1_state_dict: str = "full"
    free_cache_engine: bool = True
    weights_cpu_backup: bool = False
    label: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        from .config import METHODS, QUANTIZATIONS

        # types before values: YAML's quoted "no" is a str (truthy), True is an int (== 1)
        for f in ("share_host_memory", "pipelined", "free_cache_engine", "weights_cpu_backup"):
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"{f} must be a bool (True or False), got {getattr(self, f)!r}")
        ints = ("ranks", "tp", "ep", "bucket_bytes", "fsdp")
        for f in ints + ("replicas", "trainer_resident_bytes"):
            v = getattr(self, f)
            if (v is not None or f in ints) and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"{f} must be an integer{'' if f in ints else ' or None'}, got {v!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u < 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1), got {u!r}")
        if self.trainer_resident_bytes is not None and self.trainer_resident_bytes < 0:
            raise ValueError(f"trainer_resident_bytes must be >= 0 or None, got {self.trainer_resident_bytes}")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; expected one of {METHODS}")
        if self.layout not in ("full", "engine"):
            raise ValueError(f"layout must be full or engine, got {self.layout!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be none or fp8, got {self.quantization!r}")
        for f in ("ranks", "tp", "ep", "bucket_bytes"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be a positive integer, got {getattr(self, f)!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.fsdp not in (1, 2):
            raise ValueError(f"fsdp must be 1 or 2, got {self.fsdp!r}")
        if self.fsdp1_state_dict not in ("full", "sharded", "local"):
            raise ValueError(f"fsdp1_state_dict must be full, sharded or local (SyncConfig's, for "
                             f"--fsdp 1), got {self.fsdp1_state_dict!r}")
        if self.method == "tensor" and self.ranks % self.tp:
            raise ValueError(f"ranks ({self.ranks}) must be a multiple of tp ({self.tp}) for the "
                             f"colocated tensor method")
        if self.tp % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide tp ({self.tp}) (SGLang's rule)")
        if self.method == "tensor" and self.replicas not in (None, self.ranks // self.tp):
            raise ValueError(f"the tensor method runs one engine per tp group: replicas is "
                             f"ranks / tp = {self.ranks // self.tp}, got {self.replicas}")
        if self.replicas is not None and self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        for f in ("dtype", "trainer_dtype"):
            if getattr(self, f) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{f} must be float32, bfloat16 or float16, got {getattr(self, f)!r}")

    @property
    def engines(self) -> int:
        return self.replicas or (self.ranks // self.tp if self.method == "tensor" else 1)

    @property
    def stages(self) -> bool:
        """Whether the engine stages this sync's update beside its shard (`reference_engine_stages`)."""
        return reference_engine_stages(self.engine, self.method, self.layout,
                                       weights_valid=not self.free_cache_engine or self.weights_cpu_backup)


# --------------------------------------------------------------------------- the model

_META_CACHE: dict[str, tuple] = {}


def meta_model(model: Any) -> tuple[Any, torch.nn.Module]:
    """(``transformers`` config, the causal LM built on the meta device: shapes, no memory) of a
    recipe name, a config.json / YAML path or a config; kept for the next plan of the same model."""
    from .models import load_config

    cfg = load_config(model)
    key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    hit = _META_CACHE.get(key)
    if hit is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            module = AutoModelForCausalLM.from_config(cfg)
        if len(_META_CACHE) > 8:
            _META_CACHE.clear()
        hit = _META_CACHE[key] = (cfg, module)
    return hit


# --------------------------------------------------------------------------- the plan

def _fmt(n: float) -> str:
    """Bytes for a message: GiB, MiB, or KiB below one MiB (a tiny model's tensors: not "0 MiB")."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"


def plan_row(job: PlanJob, cluster: Cluster | str = "h100-node") -> dict:
    """One row for ``job`` on ``cluster`` (see the module docstring). Raises `PlanError` when the
    sync cannot fit the memory left on a device or the engine would refuse it
    (`plan_checks.engine_refusal`), ValueError for a model or split the layout map refuses."""
    from .weights import bucket as bk
    from .weights import reshard
    from .weights.export import param_metas
    from .weights.fp8_config import config_refusal, held_layout
    from .weights.layout import layout_for
    from .weights.quantize import StreamQuantizer, expand_metas

    cl = load_cluster(cluster)
    dtype = getattr(torch, job.dtype)
    cfg, module = meta_model(job.model)
    layout = layout_for(cfg, job.tp, job.ep)
    why = (engine_refusal(job.engine, job.method, job.layout, cfg, layout.spec, job.quantization)
           or config_refusal(cfg, job.quantization))     # what the sync refuses of its config too
    if why:
        name = str(job.model) if not hasattr(job.model, "to_dict") else cfg.model_type
        raise PlanError(f"{job.method} ({job.layout}) {name} into --engine {job.engine}: {why}")
    held = held_layout(cfg, layout, job.quantization)    # FP8: the config's ignored layers stay unquantized
    metas = param_metas(module, dtype)
    want = {n for n in layout.hf_shapes}
    have = {m.name for m in metas}
    if have - want - ({"lm_head.weight"} if layout.spec.tie_word_embeddings else set()) or want - have:
        raise ValueError(f"the model exports other tensors than the {layout.spec.model_type} layout "
                         f"map knows: unknown {sorted(have - want)[:3]}, missing {sorted(want - have)[:3]}")
    quant = StreamQuantizer(held, tight=job.method == "distributed") if job.quantization else None
    sent = expand_metas(metas, quant.hf) if quant else metas
    model_bytes = sum(m.nbytes for m in metas)          # the rollout dtype, before quantization
    largest = max(m.nbytes for m in metas)
    shard = held.engine_bytes(dtype.itemsize)
    world, engines = job.ranks, job.engines
    one_host_cpu = cl.device == "cpu" and world <= cl.gpus_per_node
    # FSDP1's full state dict hands every rank every tensor whole (after gathering each unit):
    # nothing is left to gather or exchange; its sharded state dict holds FSDP2's split
    whole = job.fsdp == 1 and job.fsdp1_state_dict == "full"
    gathers = world > 1 and not whole
    shared = job.share_host_memory and one_host_cpu and gathers
    split = 2 if job.fsdp == 2 or job.fsdp1_state_dict == "sharded" else 1
    counts = fsdp_counts(module, world, split) if gathers else {}
    sd_in = state_dict_bytes_in(module, world, job.fsdp1_state_dict, getattr(torch, job.trainer_dtype).itemsize) \
        if job.fsdp == 1 else 0
    allgather_in = max((sum((math.prod(m.shape) - counts[m.name][r]) * dtype.itemsize for m in metas)
                        for r in range(world)), default=0) if gathers else 0

    row: dict[str, Any] = {
        "plan": True, "method": job.method, "model": str(job.model) if not hasattr(job.model, "to_dict") else cfg.model_type,
        "model_type": layout.spec.model_type, "params": sum(math.prod(m.shape) for m in metas),
        "tensors": len(list(module.parameters())), "exported_tensors": len(metas), "bytes": sum(m.nbytes for m in sent),
        "model_bytes": model_bytes, "bucket_bytes": job.bucket_bytes, "largest_tensor_bytes": largest,
        "ranks": world, "tp": job.tp, "ep": job.ep, "replicas": engines, "fsdp": job.fsdp,
        "device": cl.device, "dtype": job.dtype, "quantization": job.quantization, "layout": job.layout,
        "engine_rank_shard_bytes": shard, "cluster": cl.name,
    }
    engine_layout = job.layout == "engine"

    def rank_plan(bucket: int) -> list:
        plan = reshard.plan_rank_buckets(layout, dtype, bucket)
        return [quant.plan(b, engine=True) for b in plan] if quant else plan

    # ---- bytes and calls, as each transport counts them
    if job.method == "tensor":
        row["strategy"] = "flattened"
        if engine_layout:
            plan = rank_plan(job.bucket_bytes)
            path = "host-shared" if shared else ("all-to-all" if gathers else "local")
            trainer_in = exchange_in(reshard, layout, dtype, counts, None) if path == "all-to-all" else 0
            row.update(engine_rank_bytes_in=sum(b.nbytes for b in plan), trainer_rank_bytes_in=trainer_in,
                       reshard_path=path, pipelined=job.pipelined)
        else:
            plan = bk.plan_buckets(metas, job.bucket_bytes)
            path = "host-shared" if shared else ("all-gather" if gathers else "local")
            row.update(engine_rank_bytes_in=row["bytes"], pipelined=False,
                       trainer_rank_bytes_in=gather_bytes_in(plan, counts, world) if path == "all-gather" else 0)
        row.update(buckets=len(plan), engine_calls=len(plan), share_host_memory=shared,
                   sync_tensors=sum(len(b.entries) for b in plan))   # as the sync counts them
    elif job.method == "distributed":
        if engine_layout:
            plan = rank_plan(max(1, job.bucket_bytes // job.tp))
            path = "host-shared" if shared else ("all-to-all" if gathers else "local")
            trainer_in = exchange_in(reshard, layout, dtype, counts, [[0]] * job.tp) if path == "all-to-all" else 0
            row.update(strategy="distributed:per_rank_bucket", engine_rank_bytes_in=sum(b.nbytes for b in plan),
                       trainer_rank_bytes_in=trainer_in, reshard_path=path, pipelined=job.pipelined,
                       share_host_memory=shared)
        else:
            plan = bk.plan_tight(metas, job.bucket_bytes)
            path = "gather" if gathers else "local"
            # gathered to trainer rank 0: the others' pieces of every tensor
            row.update(strategy="distributed:flattened_bucket", engine_rank_bytes_in=row["bytes"],
                       trainer_rank_bytes_in=gather_bytes_in(plan, counts, world, dst=0) if gathers else 0,
                       pipelined=False, share_host_memory=False)
        # as the transport counts them: one per engine per sync (its flush); requests: per bucket
        row.update(buckets=len(plan), engine_calls=engines, engine_requests=len(plan) * engines)
    else:
        row.update(disk_bytes(job, layout, held, quant, metas, dtype, counts, shared, gathers, reshard, bk))
        row.update(strategy="disk:checkpoint", engine_calls=engines, share_host_memory=shared)
        path = row.get("reshard_path") or ("host-shared" if shared else ("all-gather" if gathers else "local"))
        # full: HF files cut from gathered buckets; without the host-shared buffer every rank
        # all-gathers each bucket (`transport.disk`), as the tensor method's full path does
        row.setdefault("trainer_rank_bytes_in", gather_bytes_in(bk.plan_buckets(metas, job.bucket_bytes), counts,
                                                                world) if path == "all-gather" else 0)
    row["path"] = path
    row["allgather_bytes_in"] = allgather_in
    # FSDP1 "full" / "sharded": torch's state dict all-gathers every unit first, on every rank
    row.update(fsdp1_state_dict=job.fsdp1_state_dict if job.fsdp == 1 else None, state_dict_bytes_in=sd_in)
    row["trainer_rank_bytes_in"] += sd_in
    if quant is not None:
        row.update(quantizer_load(job, layout, dtype, metas, quant, reshard, bk, path=row.get("reshard_path")),
                   quantize_scratch_bytes=quantize_scratch(job.layout, layout, quant, dtype))
    unit = max((b.nbytes for b in plan), default=0) if job.method != "disk" else 0   # its largest bucket

    sizes: dict[int, int] = {}

    def quantized_bytes(bucket: int) -> int | None:
        """The largest quantized bucket at ``bucket``, as the transports size their FP8 buffers:
        over the bucket plan they quantize (an unquantized embedding or lm_head keeps its bytes;
        the distributed per-rank path: a buffer per engine rank, each for its largest part);
        the disk method: None (`quantized_bucket_bytes`). Kept per size: the fit check asks again."""
        if bucket not in sizes:
            sizes[bucket] = largest_quantized_bucket(job.method, job.layout, layout, metas, quant, dtype, bucket)
        return sizes[bucket]

    # ---- memory
    same = dict(layout=job.layout, pipelined=job.pipelined, turns=_turns(job, cl))
    row.update(_trainer_rule(job, cl, row, job.bucket_bytes, quantized_bytes))
    if quant is not None:       # each quantized bucket of the budget (its rule says how many)
        q = quantized_bytes(job.bucket_bytes)
        row["quantized_bucket_bytes"] = quantized_bucket_bytes(job.bucket_bytes, dtype) if q is None else q
    staged = job.stages
    row.update(engine_memory_budget(job.method, job.bucket_bytes, largest, shard, staged, job.quantization,
                                    dtype, **same), engine=job.engine)
    if job.method == "tensor":       # one device, one budget: the trainer's, state dict and staging included
        row.update(engine_memory_budget_bytes=row["memory_budget_bytes"],
                   engine_memory_budget_rule=row["memory_budget_rule"] + " (the trainer's device)")
    row["trainer_rank_peak_extra_bytes"] = row["memory_budget_bytes"]
    row["engine_rank_peak_extra_bytes"] = row["engine_memory_budget_bytes"]
    # bounds: a measured row stays at or below them (a device: colocated, trainer and engine together)
    row["peak_extra_bytes"] = max(row["memory_budget_bytes"], row["engine_memory_budget_bytes"])
    _check_fit(job, cl, row, quantized_bytes)

    # ---- time
    row.update(_estimate(job, cl, row, shard, unit))
    return row


def _turns(job: PlanJob, cl: Cluster) -> bool:
    """SGLang at TP > 1 on CUDA may answer before every rank read: the trainer's buffers take
    turns (`memory_budget`'s ``turns``)."""
    return job.engine == "sglang" and job.tp > 1 and cl.device == "cuda"


def _trainer_rule(job: PlanJob, cl: Cluster, row: dict, bucket: int, quantized_bytes: Any = None) -> dict:
    """`memory_budget` of ``job`` with ``bucket``: an FSDP1 state dict's own memory included, and
    a per-rank disk writer's buffers of every engine rank it writes for (ceil(tp / ranks));
    FP8: each quantized bucket ``quantized_bytes(bucket)``, the largest of the plan at that size
    (None: the rule's bound)."""
    sd = job.fsdp1_state_dict if job.fsdp == 1 else None
    # per-rank disk files: a writer builds the buffers of the engine ranks whose files it writes,
    # at most ceil(tp / ranks) a bucket (`transport.disk_ranked.write_rank_buckets`: the owner
    # i mod ranks on the all-to-all path; (k tp + i) mod ranks where every rank holds every
    # tensor, FSDP1's full state dict or one rank). The tensor method's rank builds its own engine
    # rank's; the distributed method's rank 0 every engine rank's, each cut from bucket / tp
    per_rank = job.layout == "engine" and job.method == "disk"
    out = memory_budget(job.method, bucket, row["largest_tensor_bytes"], job.quantization,
                        getattr(torch, job.dtype), layout=job.layout, pipelined=job.pipelined,
                        turns=_turns(job, cl), state_dict=sd, ranks=job.ranks,
                        model_bytes=row["params"] * getattr(torch, job.trainer_dtype).itemsize,
                        rank_buffers=-(-job.tp // job.ranks) if per_rank else 1,
                        quantized_bytes=quantized_bytes(bucket) if quantized_bytes else None,
                        quantize_scratch=row.get("quantize_scratch_bytes", 0))
    if job.method == "tensor" and job.stages:   # the colocated engine's staged shard: the same device
        out["memory_budget_bytes"] += row["engine_rank_shard_bytes"]
        out["memory_budget_rule"] += " + the engine's shard (staged until the commit)"
    return out


def _check_fit(job: PlanJob, cl: Cluster, row: dict, quantized_bytes: Any = None) -> None:
    """Refuse a sync whose budget exceeds the memory left on a device (`PlanError`, with the
    largest bucket that fits): colocated, the trainer's rule on the engine's GPU beside the
    trainer's resident shard; disaggregated, the trainer's rule on a trainer GPU and the engine's
    rule (`engine_memory_budget`) on an engine GPU. A CPU host holds them all: the sum of every
    trainer rank's rule and every engine worker's against its RAM, less the trainer ranks' shards
    and the engine workers' weights (no GPU memory fraction: the reference engine on CPU reserves
    none)."""
    util = job.gpu_memory_utilization
    resident = job.trainer_resident_bytes
    if resident is None:      # the trainer's FSDP shard of the parameters, in its own dtype
        resident = row["params"] * getattr(torch, job.trainer_dtype).itemsize // job.ranks
    row["trainer_resident_bytes"] = resident
    engine_free = int(cl.memory_per_gpu * (1 - util))
    largest, shard = row["largest_tensor_bytes"], row["engine_rank_shard_bytes"]
    dtype = getattr(torch, job.dtype)
    staged = job.stages

    def trainer_need(b: int) -> int:
        return _trainer_rule(job, cl, row, b, quantized_bytes)["memory_budget_bytes"]

    def engine_need(b: int) -> int:
        return engine_memory_budget(job.method, b, largest, shard, staged)["engine_memory_budget_bytes"]

    rule = _trainer_rule(job, cl, row, job.bucket_bytes, quantized_bytes)["memory_budget_rule"]
    # the rule with this job's figures: "2 x bucket 8.0 GiB + largest tensor 594 MiB"
    trainer_what = rule.replace("bucket", "bucket {}", 1).replace("largest tensor", f"largest tensor {_fmt(largest)}")
    engine_what = (f"the larger of bucket {{}} and largest tensor {_fmt(largest)}"
                   + (f" + its shard {_fmt(shard)} (staged)" if staged else ""))
    if cl.device == "cpu":         # one host: every trainer rank and engine worker shares its RAM
        workers = 0 if job.method == "tensor" else job.engines * job.tp    # colocated: in the device's rule
        held = job.ranks * resident + job.engines * job.tp * shard        # shards and engine weights

        def host_need(b: int) -> int:
            return job.ranks * trainer_need(b) + workers * engine_need(b)

        sides = [(host_need, cl.memory_per_gpu - held,
                  f"{job.ranks} trainer rank(s) x ({trainer_what})"
                  + (f" + {workers} engine worker(s) x ({engine_what})" if workers else ""),
                  f"left of the host's {_fmt(cl.memory_per_gpu)} RAM beside the trainer ranks' "
                  f"{_fmt(job.ranks * resident)} resident and the engine workers' "
                  f"{_fmt(job.engines * job.tp * shard)} weights (a CPU host: every rank and engine "
                  f"worker of the sync is on it; gpu_memory_utilization is a GPU's, not applied)")]
    elif job.method == "tensor":   # colocated: the trainer's shard and the sync share the engine's GPU
        sides = [(trainer_need, engine_free - resident, trainer_what,
                  f"left on the GPU at gpu_memory_utilization {util} beside the trainer's "
                  f"{_fmt(resident)} resident")]
    else:                          # disaggregated: each side on its own GPUs
        sides = [(trainer_need, cl.memory_per_gpu - resident, trainer_what,
                  f"left on a trainer GPU beside its {_fmt(resident)} resident"),
                 (engine_need, engine_free, engine_what, f"left on an engine GPU at gpu_memory_utilization {util}")]
    row["memory_free_bytes"] = min(free for _, free, _, _ in sides)
    row["trainer_memory_free_bytes"], row["engine_memory_free_bytes"] = sides[0][1], sides[-1][1]
    failing = [side for side in sides if side[0](job.bucket_bytes) > side[1]]
    if not failing:
        return

    def fits(b: int) -> bool:
        return all(need(b) <= free for need, free, _, _ in sides)

    def largest_fit(unit: int, top: int) -> int:      # the largest whole unit that fits (bisection)
        lo, hi = 0, top
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid * unit) else (lo, mid - 1)
        return lo * unit

    # whole MiB; under one MiB (a model whose tensors are smaller) whole KiB, as --bucket-mb takes
    best = largest_fit(MiB, job.bucket_bytes // MiB) or largest_fit(1024, min(job.bucket_bytes, MiB) // 1024) or None
    need, free, what, where = failing[0]
    floor = max(largest, 1024)      # at buckets up to the largest tensor the rule needs the least
    mb = str(best // MiB) if best and best % MiB == 0 else repr((best or 0) / MiB)    # exact: KiB / 1024
    hint = (f"; the largest bucket that fits is {mb} MiB (--bucket-mb {mb})" if best else
            f"; no bucket fits: at any bucket up to the largest tensor ({_fmt(largest)}) it needs "
            f"{_fmt(need(floor))}, over the {_fmt(max(free, 0))} left")
    raise PlanError(f"{job.method} {row['model']}: {what.replace('{}', _fmt(job.bucket_bytes))} = "
                    f"{_fmt(need(job.bucket_bytes))} exceeds the {_fmt(max(free, 0))} {where}{hint}", best)


# --------------------------------------------------------------------------- time

def _link(cl: Cluster, ranks_on_link: int) -> float:
    """Bandwidth (bytes/s) of the link between ``ranks_on_link`` GPUs placed node by node."""
    return (cl.intra_gbps if ranks_on_link <= cl.gpus_per_node else cl.inter_gbps) * GB


def _fresh_bytes(job: PlanJob, row: dict, unit: int) -> tuple[int, int]:
    """(bytes of fresh buffers one trainer rank first-touches in a sync, bytes one engine rank
    maps or first-touches): the sync's buffers are made each sync and freed after it.
    ``unit``: the largest bucket (tensor and distributed; disk's buffers are left unpriced)."""
    world, tp, m = job.ranks, job.tp, job.method
    sets = 2 if job.pipelined else 1
    shared = row.get("share_host_memory") and row["path"] == "host-shared"
    if m == "disk" or not unit:
        return 0, 0
    if job.layout == "engine":
        # one buffer per engine TP rank (and set); host-shared: the group's ranks touch a part each
        trainer = tp * sets * unit // world if shared else tp * sets * unit
        if row["path"] == "local" and m == "tensor":     # whole tensors: its own engine rank's only
            trainer = sets * unit
        # tensor: the engine keeps its buffers mapped across the sync; distributed: it receives
        # each bucket into a fresh buffer
        engine = sets * unit if m == "tensor" else row["engine_rank_bytes_in"]
    elif m == "tensor":
        trainer = unit // world if shared else unit       # one buffer, reused bucket after bucket
        engine = row["engine_rank_bytes_in"]               # each bucket's handle mapped afresh
    else:
        trainer = 2 * unit                                 # trainer rank 0's two gather buffers
        engine = row["engine_rank_bytes_in"]
    return trainer, engine


_TOUCH = "first touch of the sync's fresh buffers"
_SEND = "trainer rank 0 sends to the engines"
# per-call and per-sync costs: paid in turn, whatever overlaps
_NOT_MOVING = ("engine calls", "engine requests", "per-tensor host work", "per-sync engine bracket")


def _estimate(job: PlanJob, cl: Cluster, row: dict, shard: int, unit: int = 0) -> dict:
    """``seconds``: each phase's floor (its bytes over its link) plus overheads; a pipelined
    method overlaps the trainer's phases with the link's and the engine's bucket by bucket (the
    slowest side, plus one bucket of the others; a colocated engine's copies share the trainer's
    memory bandwidth), unless its processes outnumber a CPU host's cores. ``phases`` says which bytes
    crossed which link."""
    world, tp, engines = job.ranks, job.tp, job.engines
    d2d, n = cl.d2d_gbps * GB, max(1, row["buckets"])
    trainer_link = _link(cl, world)
    coll_link = cl.collective_gbps * GB if cl.collective_gbps else trainer_link
    coll_name = "host" if cl.collective_gbps else ("intra" if trainer_link == cl.intra_gbps * GB else "inter")
    # disaggregated engines sit beside the trainer only when every GPU fits one node
    engine_link = _link(cl, world + engines * tp) if cl.device == "cuda" else cl.intra_gbps * GB
    phases: list[tuple[str, float, str]] = []       # (what, seconds, link)
    own = row["model_bytes"] // world
    path = row["path"]
    m = job.method
    fill = ("copy my shard into the buffers", own / d2d, "d2d")
    exchange = None
    if path == "all-gather" or path == "gather":
        b = row["allgather_bytes_in"] if path == "all-gather" else row["model_bytes"] - own
        exchange = ("gather the other ranks' shards", b / coll_link + n * cl.collective_s, coll_name)
    elif path == "all-to-all":
        exchange = ("all-to-all of the engine ranks' pieces",
                    (row["trainer_rank_bytes_in"] - row["state_dict_bytes_in"]) / coll_link
                    + n * cl.collective_s, coll_name)
    elif path == "host-shared":
        exchange = ("barriers around the shared buffers", 2 * n * cl.collective_s, "host")
    first = [fill] + ([exchange] if exchange else [])
    if row["state_dict_bytes_in"]:     # FSDP1 full / sharded: torch unshards every unit first
        first.insert(0, ("FSDP1's state dict all-gathers every unit", row["state_dict_bytes_in"] / coll_link,
                         coll_name))
    if job.quantization and cl.quantize_gbps:
        first.append(("quantize to FP8 on the trainer", row["quantize_bytes_in"] / (cl.quantize_gbps * GB)
                      + row["quantized_tensors"] * cl.quantize_tensor_s, "device"))
    touch, mapped = _fresh_bytes(job, row, unit)
    if cl.touch_gbps and touch:
        first.append((_TOUCH, touch / (cl.touch_gbps * GB), "host"))
    staged = job.stages      # the reference engine's second copy; not for per-rank disk files
    in_bytes = row["engine_rank_bytes_in"] if job.layout == "engine" else shard
    load = ("engine rank copies its shard in" + (", then commits it (staged: a second copy)" if staged else ""),
            in_bytes / d2d * (2 if staged else 1), "d2d")
    receive = []
    if mapped and m == "tensor" and cl.map_gbps:
        receive = [("engine rank maps the shared buckets", mapped / (cl.map_gbps * GB), "host")]
    elif mapped and cl.touch_gbps:
        receive = [("first touch of the engine's receive buffers", mapped / (cl.touch_gbps * GB), "host")]
    if m == "tensor":
        # per call: the handles gathered to infer-TP rank 0, the outcome agreed on every rank
        per_call = cl.bucket_s or cl.call_s + 2 * cl.collective_s
        phases = first + receive + [load, ("engine calls", row["engine_calls"] * per_call, "call")]
        if cl.tensor_s:
            phases.append(("per-tensor host work", row["sync_tensors"] * cl.tensor_s, "host"))
        if cl.sync_s:
            phases.append(("per-sync engine bracket", cl.sync_s, "call"))
        overlap = job.layout == "engine" and job.pipelined
    elif m == "distributed":
        sent = row["engine_rank_bytes_in"] * (tp * engines if job.layout == "engine" else 1)
        phases = first + [
            (_SEND, sent / engine_link + n * cl.collective_s,
             "intra" if engine_link == cl.intra_gbps * GB else "inter")] + receive + [
            load, ("engine requests", row["engine_requests"] * cl.call_s, "call")]
        overlap = job.layout == "full" or job.pipelined
    else:
        written = row["file_bytes"]
        read = row["engine_rank_bytes_in"] * tp * engines
        phases = first + [
            ("write and fsync the files", written / (cl.disk_write_gbps * GB), "disk"),
            ("engine ranks read their bytes", read / (cl.disk_read_gbps * GB), "disk"),
            load, ("engine calls", row["engine_calls"] * cl.call_s, "call")]
        overlap = False
    total = sum(s for _, s, _ in phases)
    rule = "sum of phase floors + overheads"
    procs = world + engines * tp
    if overlap and n > 1 and cl.cores and procs > cl.cores:
        overlap = False          # every process copies: on too few cores the phases take turns
        rule += f" (not overlapped: {procs} processes on {cl.cores} cores)"
    if overlap and n > 1:
        # bucket k+1 is made while bucket k is on the wire. The trainer's phases follow one
        # another, so do the engine's; what pipelining overlaps is the trainer's side with the
        # link's and the engine's. A colocated engine copies through the memory the trainer fills
        # (one GPU's, or the host's): those copies share its bandwidth and take turns. The
        # slowest of these, plus one bucket of the rest (the pipeline's fill and drain).
        engine_side = {load[0]} | {w for w, _, _ in receive}
        moving = [(w, s, ln) for w, s, ln in phases if w not in _NOT_MOVING]
        sides = [sum(s for w, s, _ in moving if w in engine_side),
                 sum(s for w, s, _ in moving if w == _SEND),
                 sum(s for w, s, _ in moving if w not in engine_side and w != _SEND)]
        if m == "tensor":
            sides.append(sum(s for w, s, ln in moving if ln == "d2d" or w == _TOUCH))
        slowest = max(sides)
        calls = total - sum(s for _, s, _ in moving)
        total = slowest + (sum(s for _, s, _ in moving) - slowest) / n + calls
        rule += " (pipelined)"
    return {"seconds": total, "phases": [{"what": w, "seconds": s, "link": ln} for w, s, ln in phases],
            "estimate_rule": rule}

