"""What ``fsdp-sync demo`` checks before any rank starts: the model, its size against this
machine's memory, and ``--disk-dir``; and the same size check for each ``fsdp-sync bench`` job.

`check_model` loads the config and refuses a family the reference engine does not know, a split
that ``--tp``/``--ep`` cannot make, and an FP8 layout that cuts a 128 block. `check_fits` sizes the
model on the meta device (`fsdp_sync.plan.meta_model`: shapes, no memory) and refuses a model whose
demo cannot fit the memory this machine has available, naming the parameters and the bytes: every
trainer rank builds the float32 model whole before FSDP shards it, so ``--ranks`` copies of it are
held at once (``{"model_type": "qwen2"}`` takes Qwen2's defaults, 10.8 B parameters: 80 GiB on
2 ranks before the first step); ``command="bench"`` sizes a bench job so (`bench_memory`: no
gradients or optimizer; the engines of the methods it runs). `check_disk_dir` makes sure the disk
method can create its versions there. `check_sync_config` builds the `SyncConfig` the ranks will
build, so a combination it refuses (``--strategy per_tensor --layout engine``) is refused before
they start. Each raises ValueError whose message names the flag and the value (the command prints
it as one line, exit code 2).

Not here: parsing the flags (`app`, `args`), running the demo (`demo`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["check_model", "demo_memory", "bench_memory", "check_fits", "check_disk_dir", "check_sync_config"]

GiB = 2**30


def check_model(model: str, tp: int, ep: int, quantization: str | None) -> Any:
    """The ``transformers`` config of ``model``, checked as the demo will use it: a family the
    reference engine knows (`fsdp_sync.weights.layout.FAMILIES`), split over ``tp`` TP ranks and
    ``ep`` expert ranks, in whole FP8 blocks under ``quantization="fp8"``, with a vocabulary
    that holds the demo's prompts."""
    from ..engines.reference.quant import engine_layout, resolve
    from ..models import load_config
    from ..weights.layout import ModelSpec, TPLayout
    from .demo import PROMPTS

    try:
        config = load_config(model)
        spec = ModelSpec.from_config(config)
    except (ValueError, TypeError, OSError) as exc:
        said = str(exc)
        raise ValueError(f"argument --model: {'' if model in said else model + ': '}{said}") from None
    top = max(max(p) for p in PROMPTS)
    if spec.vocab_size <= top:
        raise ValueError(f"argument --model: {model}: vocab_size {spec.vocab_size} is too small for "
                         f"the demo's prompts (token ids up to {top}): give at least {top + 1}")
    try:
        TPLayout(spec, tp)
    except ValueError as exc:
        raise ValueError(f"argument --tp: model {model!r} cannot be split over {tp} TP ranks: "
                         f"{exc}") from None
    try:
        TPLayout(spec, tp, ep)
    except ValueError as exc:
        raise ValueError(f"argument --ep: --ep {ep}: {exc}") from None
    try:
        engine_layout(spec, tp, ep, resolve(config, quantization))
    except ValueError as exc:
        flag = f"--quantization {quantization}" if quantization else "--model"
        raise ValueError(f"argument {flag}: --model {model} --tp {tp}: {exc}") from None
    return config


def demo_memory(params: int, *, ranks: int, tp: int, method: str, dtype_bytes: int,
                low_precision: bool, process_bytes: int) -> dict:
    """The least host memory the demo of a ``params``-parameter model takes (CPU device), with what
    it is made of: the larger of two moments. At the start every trainer rank builds the float32
    model whole (4 bytes a parameter) before FSDP shards it. From the first sync on, the ranks
    hold the float32 parameters, gradients and AdamW's two states (16 bytes a parameter, sharded
    over the ranks), and every engine its weights in the rollout dtype (one engine per ``tp``
    ranks with the colocated tensor method, one for the disaggregated ones, which stage an
    update beside their weights until the commit), and with a 16-bit or FP8 rollout an unsharded
    reference copy in that dtype beside each engine. ``process_bytes``: what one process takes
    before it holds any weight (torch and transformers imported: this process's own memory at the
    check), counted for every trainer rank and engine worker."""
    engines = ranks // tp if method == "tensor" else 1
    engine_weights = params * dtype_bytes * (1 if method == "tensor" else 2)   # + the staged copy
    build = ranks * 4 * params
    train = 16 * params + engines * engine_weights + (engines * params * dtype_bytes if low_precision else 0)
    processes = ranks + engines * tp
    need = max(build, train) + processes * process_bytes
    return {"params": params, "need_bytes": need, "build_bytes": build, "train_bytes": train,
            "engine_bytes": engines * engine_weights, "processes": processes,
            "process_bytes": process_bytes, "per_rank_build_bytes": 4 * params,
            "trainer_bytes": 16 * params, "larger": "build" if build >= train else "train"}


def bench_memory(params: int, *, ranks: int, tp: int, methods: tuple[str, ...], dtype_bytes: int,
                 process_bytes: int) -> dict:
    """The least host memory one ``fsdp-sync bench`` job takes (CPU device), as `demo_memory`
    counts the demo's: the build (every rank's float32 model whole) or, after it, the float32
    shards (4 bytes a parameter, no gradients or optimizer), beside the larger of rank 0's two
    model-sized buffers in the rollout dtype (the copy it is timed against, before any engine)
    and the largest engine of ``methods`` (they run one after the other: colocated, one per
    ``tp`` ranks; disaggregated, one that stages an update beside its weights)."""
    engines = {m: ranks // tp if m == "tensor" else 1 for m in methods}
    engine_weights = max(n * params * dtype_bytes * (1 if m == "tensor" else 2) for m, n in engines.items())
    build = ranks * 4 * params
    train = 4 * params + max(2 * params * dtype_bytes, engine_weights)
    processes = ranks + max(engines.values()) * tp
    need = max(build, train) + processes * process_bytes
    return {"params": params, "need_bytes": need, "build_bytes": build, "train_bytes": train,
            "engine_bytes": engine_weights, "processes": processes, "process_bytes": process_bytes,
            "per_rank_build_bytes": 4 * params, "trainer_bytes": 4 * params,
            "larger": "build" if build >= train else "train"}


def check_fits(model: str, config: Any, *, ranks: int, tp: int, method: str | tuple[str, ...], dtype: str,
               quantization: str | None, device: str, available: int | None = None,
               command: str = "demo") -> dict:
    """Size ``config`` on the meta device and refuse (ValueError naming the parameters and the
    memory) a demo that cannot fit the memory this machine has available (``available``: psutil's
    figure unless given). On ``device="cuda"`` only the build is on the host. ``command="bench"``:
    one CPU bench job instead (`bench_memory`; ``method``: the methods it runs), named by --models
    (a cuda bench builds on its GPUs: `check_bench_args` does not size it here)."""
    import psutil
    import torch

    from ..models import count_params
    from ..plan import meta_model

    params = count_params(meta_model(config)[1])[0]
    dtype_bytes = 1 if quantization == "fp8" else getattr(torch, dtype).itemsize
    low = dtype != "float32" or quantization is not None
    process_bytes = psutil.Process().memory_full_info().uss
    if command == "bench":
        m = bench_memory(params, ranks=ranks, tp=tp, methods=tuple(method), dtype_bytes=dtype_bytes,
                         process_bytes=process_bytes)
        flag, held, beside = "--models", "float32 weight shards", "rank 0's timed copy or the engine"
    else:
        m = demo_memory(params, ranks=ranks, tp=tp, method=method, dtype_bytes=dtype_bytes,
                        low_precision=low, process_bytes=process_bytes)
        flag, held, beside = "--model", "float32 weights, gradients and AdamW state", "the engine"
    if device == "cuda":    # the weights on the GPUs; every process (rank, engine worker) on the host
        m["need_bytes"] = m["build_bytes"] + m["processes"] * m["process_bytes"]
        m["larger"] = "build"
    free = psutil.virtual_memory().available if available is None else available
    m["available_bytes"] = free
    if m["need_bytes"] > free:
        if m["larger"] == "build":
            why = (f"{ranks} ranks x {m['per_rank_build_bytes'] / GiB:.1f} GiB: each rank builds the "
                   f"float32 model whole before FSDP shards it")
        else:
            why = (f"{m['trainer_bytes'] / GiB:.1f} GiB of {held} over {ranks} ranks + "
                   f"{(m['train_bytes'] - m['trainer_bytes']) / GiB:.1f} GiB for {beside} in "
                   f"{'fp8' if quantization else dtype}")
        job = f" at --ranks {ranks} --tp {tp}" if command == "bench" else ""
        # where the processes themselves take more than the model does, a smaller model (the
        # advice was "--model small" for the 0.1 M-parameter tiny on 64 ranks) does not help
        procs = m["processes"] * m["process_bytes"]
        todo = (f"fewer --ranks (each of the {m['processes']} processes takes "
                f"{m['process_bytes'] / GiB:.2f} GiB before it holds any weight)"
                if procs > max(m["build_bytes"], m["train_bytes"]) else
                f"use a smaller model (e.g. {flag} small) or fewer --ranks")
        raise ValueError(
            f"argument {flag}: {model} has {params:,} parameters ({params / 1e9:.2f} B); the {command}"
            f"{job} needs about {m['need_bytes'] / GiB:.1f} GiB of this machine's memory ({why}; "
            f"+ {m['processes']} processes x {m['process_bytes'] / GiB:.2f} GiB), "
            f"{free / GiB:.1f} GiB available: {todo}")
    return m


def check_disk_dir(disk_dir: str) -> None:
    """``--disk-dir``: a directory the disk method can create (``makedirs``) and write its
    ``step_<N>`` versions in, holding no ``step_*`` version of an earlier run (a published version
    is never overwritten). Probed by making and removing an empty directory in the nearest folder
    that exists: nothing is left behind."""
    path = Path(os.path.abspath(disk_dir))
    base = path
    while not base.exists():
        base = base.parent
    if not base.is_dir():
        raise ValueError(f"argument --disk-dir: {disk_dir}: {base} is not a directory")
    if base == path:
        old = sorted(p.name for p in path.glob("step_*"))
        if old:
            raise ValueError(f"argument --disk-dir: {disk_dir} holds {', '.join(old[:3])} of an earlier "
                             f"run; a published version is never overwritten: give a fresh directory")
    try:
        probe = tempfile.mkdtemp(prefix=".fsdp-sync-probe-", dir=base)
    except OSError as exc:
        raise ValueError(f"argument --disk-dir: cannot create {disk_dir}: "
                         f"{exc.strerror or exc} in {base}") from None
    os.rmdir(probe)


def check_sync_config(*, strategy: str, bucket_mb: float, method: str, layout: str, dtype: str,
                      quantization: str | None, lora: bool) -> None:
    """The flags' `SyncConfig` (as `demo.run_demo`'s ranks build it), built once here: what it
    refuses is refused now, naming the flags, not on every rank after they started."""
    from ..config import SyncConfig

    try:
        SyncConfig(strategy=strategy, bucket_bytes=int(bucket_mb * 2**20), method=method, layout=layout,
                   dtype=dtype, quantization=quantization, disk_dir="unchecked-here",
                   lora="adapter" if lora else "off")
    except ValueError as exc:
        raise ValueError(f"--method {method} --strategy {strategy} --layout {layout}: {exc}") from None
