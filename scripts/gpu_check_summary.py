"""The GPU check's summary (scripts/gpu_check.sh runs it last): OUT/gpu_check.json (every step's
status and seconds, each bench row beside its plans: `plan --cluster h100-node`, spec figures, and
`plan --cluster this-machine`, the costs measured on this machine) and OUT/gpu_check.md (a short
table). Rows of the flattened strategy are paired with the plan of the same model, layout and
quantization; a missing file (a step that failed or was skipped) leaves its columns empty.

Usage: python scripts/gpu_check_summary.py OUT
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

BENCHES = ("bench_gpu", "bench_fp8", "bench_7b")
PLANS = ("plan", "plan_here")


def _load(out: Path, name: str) -> dict:
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


def summarize(out: Path, device: str | None = None, torch_version: str | None = None) -> dict:
    steps = [dict(zip(("step", "rc", "seconds"), line.split("\t")))
             for line in (out / "steps.tsv").read_text().splitlines() if line.strip()]
    plans: dict = {name: {} for name in PLANS}
    for name in PLANS:
        for r in _load(out, name).get("rows", []):
            if not r.get("refused"):
                plans[name][(r.get("model"), r.get("layout"), r.get("quantization") or None)] = r.get("seconds")
    rows = []
    for name in BENCHES:
        for r in _load(out, name).get("rows", []):
            key = (r.get("model"), r.get("layout"), r.get("quantization") or None)
            flat = r.get("strategy") == "flattened"
            g = r.get("gpu_memory") or {}
            row = {"bench": name, "model": r.get("model"), "strategy": r.get("strategy"), "layout": r.get("layout"),
                   "pipelined": r.get("pipelined"), "quantization": r.get("quantization"),
                   "seconds": r.get("seconds"), "copy_seconds": r.get("copy_seconds"),
                   "x_copy": r.get("ratio_to_copy"), "bytes": r.get("bytes"), "quantize_s": r.get("quantize_s"),
                   "gpu_memory": r.get("gpu_memory"), "memory_budget_mib": (r.get("memory_budget_bytes") or 0) / 2**20,
                   "trainer_within_budget": g.get("trainer_within_budget"), "within_budget": g.get("within_budget"),
                   "call_seconds": r.get("call_seconds"), "calls": r.get("calls")}
            for name_, col in (("plan", "plan"), ("plan_here", "plan_here")):
                planned = plans[name_].get(key) if flat else None
                row[f"{col}_seconds"] = planned
                row[f"bench_over_{col}"] = r["seconds"] / planned if planned and r.get("seconds") else None
            rows.append(row)
    cluster = _load(out, "this_machine") or None
    try:    # the quantizer's block-amax A/B (dev/fp8_reductions_ab.py): its printed lines
        fp8_ab = (out / "fp8_ab.log").read_text(errors="replace").strip() or None
    except OSError:
        fp8_ab = None
    result = {"device": device, "torch": torch_version, "steps": steps, "tests": gpu_tests(out),
              "rows": rows, "this_machine": cluster, "fp8_ab": fp8_ab}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_check.md").write_text(table(result))
    return result


def gpu_tests(out: Path) -> dict | None:
    """The test_gpu step's outcome per test, from its log (pytest -vv under xdist: a line per test
    as it ends, so a step cut at its limit still tells what ran): counts and the names of those
    that failed or errored, and whether the log has pytest's closing line (None: no log)."""
    try:
        text = (out / "test_gpu.log").read_text(errors="replace")
    except OSError:
        return None
    seen: dict[str, str] = {}
    for outcome, name in re.findall(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S+)", text):
        seen.setdefault(name, outcome)     # the -rfE summary repeats a failure: its first word counts
    counts: dict = {}
    for outcome in seen.values():
        counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    return {**counts, "failed_tests": sorted(n for n, o in seen.items() if o in ("FAILED", "ERROR")),
            "finished": bool(re.search(r"^=+ .* in [\d.]+s", text, re.M))}


def _f(v, p: int = 3) -> str:
    return "" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))


def table(result: dict) -> str:
    lines = ["| step | rc | s |", "|---|---|---|"]
    lines += [f"| {s['step']} | {s['rc']} | {s['seconds']} |" for s in result["steps"]]
    t = result.get("tests")
    if t is not None:
        lines += ["", "test_gpu: " + ", ".join(f"{t[k]} {k}" for k in ("passed", "failed", "error", "skipped") if k in t)
                  + ("" if t["finished"] else " (cut at the step's limit: the tests not named did not finish)")
                  + "".join(f"\n- {n}" for n in t["failed_tests"])]
    if result.get("fp8_ab"):
        lines += ["", "fp8_ab:", "", "```", result["fp8_ab"], "```"]
    lines += ["", "| model | strategy | layout | piped | quant | s | copy s | x copy | plan s (h100-node) | "
              "bench/plan | plan s (this machine) | bench/plan | trainer rise MiB (alloc/res) | "
              "engine rise MiB | GPU rise MiB | budget MiB | within (GPU/trainer) |", "|" + "---|" * 17]
    for r in result["rows"]:
        g = r["gpu_memory"] or {}
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['layout']} | {_f(r['pipelined'])} | {_f(r['quantization'])} | "
            f"{_f(r['seconds'], 4)} | {_f(r['copy_seconds'], 4)} | {_f(r['x_copy'], 1)} | {_f(r['plan_seconds'], 4)} | "
            f"{_f(r['bench_over_plan'], 2)} | {_f(r['plan_here_seconds'], 4)} | {_f(r['bench_over_plan_here'], 2)} | "
            f"{_f(g.get('trainer_peak_allocated_mib'), 0)}/{_f(g.get('trainer_peak_reserved_mib'), 0)} | "
            f"{_f(g.get('engine_peak_allocated_mib'), 0)}/{_f(g.get('engine_peak_reserved_mib'), 0)} | "
            f"{_f(g.get('device_peak_allocated_mib'), 0)} | {_f(r['memory_budget_mib'], 0)} | "
            f"{_f(r['within_budget'])}/{_f(r['trainer_within_budget'])} |")
    lines += ["", "Rises: each allocator's peak over its level during the sync stage alone (after the engine's "
                  "weights woke, before its KV cache did); GPU: the trainer's plus its GPU's engine worker's.",
              "", "Per engine call (bucket), ms, the sampled sync: make / gather / engine / agree / release "
                  "(engine call: the engine's own; in its workers: stage, of which opening the payloads, and "
                  "commit, of which the copies and the acknowledgement's stream sync)", ""]
    for r in result["rows"]:
        for k, c in enumerate(r.get("calls") or []):
            lines.append(f"- {r['model']} {r['layout']}{' fp8' if r['quantization'] else ''} "
                         f"{'piped ' if r['pipelined'] else ''}#{k}: "
                         + " / ".join(_f((c.get(p) or 0) * 1e3, 1) for p in
                                      ("make_s", "gather_s", "engine_s", "agree_s", "release_s"))
                         + f" (engine call {_f((c.get('engine_call_s') or 0) * 1e3, 1)}"
                         + ("" if "worker_stage_s" not in c else
                            f"; workers: stage {_f(c['worker_stage_s'] * 1e3, 2)} (open "
                            f"{_f(c.get('worker_open_s', 0) * 1e3, 2)}), commit {_f(c.get('worker_commit_s', 0) * 1e3, 2)} "
                            f"(copies {_f(c.get('worker_apply_s', 0) * 1e3, 2)}, ack {_f(c.get('worker_ack_s', 0) * 1e3, 2)})")
                         + ")")
    c = result.get("this_machine")
    if c:
        lines += ["", f"This machine, measured: d2d {c['d2d_gbps']:.0f} GB/s, {c['tensor_s'] * 1e6:.0f} us/tensor, "
                      f"{c['bucket_s'] * 1e3:.2f} ms/bucket, {c['sync_s'] * 1e3:.2f} ms/sync, FP8 quantizer "
                      f"{c.get('quantize_gbps', 0):.0f} GB/s + {c.get('quantize_tensor_s', 0) * 1e6:.0f} us/tensor"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        import torch
        dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        ver = torch.__version__
    except ImportError:
        dev = ver = None
    print(table(summarize(Path(sys.argv[1]), dev, ver)), end="")
