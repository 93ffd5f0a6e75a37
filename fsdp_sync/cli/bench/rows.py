"""A bench job's rows beyond what each one measures: a tensor row's fields (`tensor_row`), what
every row of a job carries (`finish_rows`), and the rows a job measured before it stopped: rank 0
writes them into the job's own temp directory after each row (`save_rows`), the parent reads them
when the job fails (`measured_rows`), so a sweep that fails part-way still reports its rows
(`BenchIncomplete`, `report_incomplete`) instead of dropping every one in a traceback.

Not here: measuring (`main.bench_rank`, `methods`), the sweep (`main.run_bench`), printing (`table`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from .methods import memory_budget
from .sampling import DeviceSampler, rises

__all__ = ["tensor_row", "largest_bytes", "finish_rows", "save_rows", "measured_rows", "BenchIncomplete",
           "write_json", "report_incomplete"]

ROWS_FILE = "bench-rows.json"


class BenchIncomplete(RuntimeError):
    """A job of the sweep failed (a rank raised, died or ran past the deadline): ``str()`` is the
    launcher's error, ``result`` what `run_bench` returns for the rows measured before it (the
    jobs that finished, and the failed job's rows its rank 0 had finished), ``incomplete`` set to
    the error's first line."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def largest_bytes(module, job: Any) -> int:
    from ...weights.export import param_metas

    return max(m.nbytes for m in param_metas(module, getattr(torch, job.dtype)))


def tensor_row(job: Any, strategy: str, bucket_bytes: int, params: int, tensors: int, stats, secs,
               secs_med, floor: float, manager, sampler: DeviceSampler | None) -> dict:
    """A tensor-method row as measured (`finish_rows` adds the job's fields)."""
    from ...weights.export import param_metas

    metas = param_metas(manager.module, getattr(torch, job.dtype))
    largest = max(m.nbytes for m in metas)
    timeline = manager.timeline.to_dict()
    peak_extra, curve = 0, []
    if sampler is not None and sampler.samples:
        peak_extra = max(rises(timeline, sampler))
        curve = [[round(ts, 5), int(sum(s))] for ts, s in sampler.samples]
        for st in timeline:
            st["t"] = round(st["started"] - sampler.t0, 5)
    return {
        **{k: stats.extra[k] for k in ("quantize_s", "quantized_tensors") if k in stats.extra},
        # where the last sync's time went, engine call by engine call (per tensor: the sums only)
        "call_seconds": stats.extra.get("call_seconds"),
        **({"calls": stats.extra["calls"]} if strategy != "per_tensor" and "calls" in stats.extra else {}),
        "strategy": strategy, "model": job.model, "params": params, "tensors": tensors,
        "bytes": stats.bytes, "bucket_bytes": bucket_bytes, "largest_tensor_bytes": largest,
        "ranks": job.ranks, "tp": job.tp, "multi_stage": job.multi_stage, "device": job.device,
        "dtype": job.dtype, "seconds": secs_med, "repeats": secs, "floor_seconds": floor,
        "baseline_seconds": None, "peak_extra_bytes": int(peak_extra),
        **memory_budget("tensor", bucket_bytes, largest), "engine_calls": stats.engine_calls,
        "stages": timeline, "memory_curve": curve,
    }


def finish_rows(rows: list[dict], baseline: float | None, *, job: Any, served: Any, metas: list,
                pinned: Any, cfg: Any, model: torch.nn.Module) -> list[dict]:
    """``rows`` (changed in place and returned) with what the job knows of them all: the tensor
    rows (`tensor_row`'s, no ``method`` yet) their method, engine, HTTP counts and baseline;
    every row the exported tensor count, the pinned mmap threshold, EP, quantization and (FP8)
    the budget of its quantized buckets."""
    for r in rows:
        if "method" in r:
            continue            # `methods.method_rows`' rows carry their own
        r["method"] = "tensor"
        r["engine"] = job.engine
        if served is not None:
            r["http_requests"] = dict(served.server.hits)
            r["http_connections"] = served.client._http.connections
        r["baseline_seconds"] = baseline
        r["speedup_vs_baseline"] = (baseline / r["seconds"]) if baseline else None
    for r in rows:
        # ``tensors`` counts the module's parameters; a fused MoE expert parameter is exported
        # as one tensor per expert and projection, so a sync moves more tensors than that
        r["exported_tensors"] = len(metas)
        r["malloc_mmap_threshold"] = pinned     # glibc's, pinned in the trainer ranks (None: not glibc)
        r["ep"] = job.ep
        r["quantization"] = job.quantization
        if job.quantization and "memory_budget_bytes" in r:   # its quantized buckets, as the plan counts them
            r.update(memory_budget(r["method"], r["bucket_bytes"], r["largest_tensor_bytes"], r.get("layout") or "full",
                                   bool(r.get("pipelined", True)), job=job, cfg=cfg, model=model))
    return rows


def save_rows(directory: str, rows: list[dict]) -> None:
    """Rank 0: the rows finished so far, replacing the last ones written (never half a file)."""
    path = os.path.join(directory, ROWS_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(rows, f)
    os.replace(path + ".tmp", path)


def measured_rows(directory: str) -> list[dict]:
    """The parent: the rows `save_rows` last wrote in ``directory`` ([] if none)."""
    try:
        with open(os.path.join(directory, ROWS_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def write_json(console, args, result: dict) -> None:
    """``--json``: the sweep's result."""
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
        console.print(f"wrote {args.json}")


def report_incomplete(console, args, result: dict, exc: BenchIncomplete) -> int:
    """A sweep one job of which failed: the rows measured before it written (``--json``, its
    ``incomplete`` the error's first line) and one line on stderr saying why; exit code 1."""
    write_json(console, args, result)
    lines = str(exc).strip().splitlines()
    why = lines[0].rstrip(":") + (f": {lines[-1]}" if len(lines) > 1 else "")
    n = len(result["rows"])
    kept = f"{n} row(s) measured before it, shown above" if n else "no row measured"
    print(f"fsdp-sync bench: error: {why} ({kept}{'; written to ' + args.json if args.json else ''})",
          file=sys.stderr)
    return 1
