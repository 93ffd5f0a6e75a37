#!/usr/bin/env bash
# The GPU check (issue 35), for a bare GPU machine that reaches no package index. Run from the
# work tree:   bash scripts/gpu_check.sh [OUTDIR]      (default OUTDIR: gpu-check-out)
#
# The machine has torch (CUDA build), transformers, accelerate, pytest (+ pytest-timeout, -xdist),
# safetensors, xxhash, psutil, rich, matplotlib. omegaconf and antlr4-python3-runtime come as
# wheels in .whl/ (made on a machine with an index:
#   pip download --no-deps --only-binary=:all: omegaconf==2.3.0 -d .whl
#   pip wheel --no-deps antlr4-python3-runtime==4.9.3 -w .whl          # an sdist: build the wheel
# ), installed into a scratch directory; the project runs from the work tree (PYTHONPATH).
#
# Within GPU_CHECK_BUDGET_S seconds (default 480: 8 minutes) it runs, each step under its own time
# limit cut to what is left of the budget (scripts/gpu_check_steps.sh: a step with under 10 s left
# is skipped and recorded as such, rc 125), going on past a failure: `make test-gpu`, the demo, `bench --preset gpu`, an FP8 bench, a 7B-class bench, `plan`
# beside each bench row, a per-bucket profile (dev/gpu_profile.py), and records a real CUDA IPC
# payload (protocols 5 and 2) for the CPU tests. GPU_CHECK_ONLY="step step" runs only the named steps. It writes OUTDIR/gpu_check.json (every step's
# status and seconds, every bench row beside its plan) and OUTDIR/gpu_check.md (a short table).
set -uo pipefail
START_S=$(date +%s)
cd "$(dirname "$0")/.."
OUT="${1:-gpu-check-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fsdp_sync_site .whl/*.whl || exit 1
  export PYTHONPATH="$PWD:/tmp/fsdp_sync_site"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
"$PY" -c "import torch, omegaconf; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
FS=("$PY" -m fsdp_sync.cli)
STEPS="$OUT/steps.tsv"
: > "$STEPS"

. scripts/gpu_check_steps.sh      # step NAME LIMIT_S CMD...: within the budget

BENCH=(--ranks 1 --tp 1 --device cuda --dtype bfloat16 --bucket-mb 512 --repeats 3)
PLAN=(--ranks 1 --tp 1 --dtype bfloat16 --bucket-mb 512 --cluster h100-node --engine reference --gpu-memory-utilization 0.3)

step test_gpu 150 make test-gpu PY="$PY" STAMP= PYTEST_GPU_ARGS="-n 8 --timeout 140"
step payload 60 "$PY" - "$OUT" <<'EOF'
import sys, pickle, torch
from fsdp_sync.weights import handles
t = torch.arange(1000, dtype=torch.float32, device="cuda").view(10, 100)
with handles.make_payloads(t, 1, tagged=False) as ps:
    open(f"{sys.argv[1]}/cuda_payload_p5.bin", "wb").write(ps.payloads[0])
    buf = __import__("io").BytesIO()
    handles._Pickler.__mro__[1](buf, 2).dump(t)              # ForkingPickler, protocol 2
    open(f"{sys.argv[1]}/cuda_payload_p2.bin", "wb").write(buf.getvalue())
    print("protocol 5:", handles.open_payload(ps.payloads[0]).value.sum().item())
print("protocol 2:", handles.open_payload(buf.getvalue()).value.sum().item())
EOF
step demo 90 "${FS[@]}" demo --device cuda --ranks 1 --tp 1 --dtype bfloat16 --no-progress --json "$OUT/demo.json"
step bench_gpu 150 "${FS[@]}" bench --preset gpu --json "$OUT/bench_gpu.json"
step bench_fp8 120 "${FS[@]}" bench --models qwen2-1500m --quantization fp8 --strategies flattened \
  --layout engine "${BENCH[@]}" --json "$OUT/bench_fp8.json"
step bench_7b 170 "${FS[@]}" bench --models qwen2-7b --strategies flattened,per_tensor --layout full,engine \
  "${BENCH[@]}" --json "$OUT/bench_7b.json"
step plan 60 "${FS[@]}" plan --models qwen2-1500m,qwen2-7b --quantization none,fp8 --layout full,engine \
  "${PLAN[@]}" --json "$OUT/plan.json"
step profile 120 "$PY" dev/gpu_profile.py --model qwen2-1500m --out "$OUT/profile.txt"

"$PY" - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
steps = [dict(zip(("step", "rc", "seconds"), l.split("\t"))) for l in open(f"{out}/steps.tsv").read().splitlines()]
def load(name):
    try:
        return json.load(open(f"{out}/{name}.json"))
    except (OSError, ValueError):
        return None
plans = {}
for name in ("plan",):
    for r in (load(name) or {}).get("rows", []):
        plans[(r.get("model"), r.get("layout"), r.get("quantization") or None)] = r.get("seconds")
rows = []
for name in ("bench_gpu", "bench_fp8", "bench_7b"):
    for r in (load(name) or {}).get("rows", []):
        layout = r.get("layout")
        planned = plans.get((r.get("model"), layout, r.get("quantization") or None)) if r.get("strategy") == "flattened" else None
        rows.append({"bench": name, "model": r.get("model"), "strategy": r.get("strategy"), "layout": layout,
                     "pipelined": r.get("pipelined"), "quantization": r.get("quantization"),
                     "seconds": r.get("seconds"), "copy_seconds": r.get("copy_seconds"),
                     "x_copy": r.get("ratio_to_copy"), "bytes": r.get("bytes"),
                     "quantize_s": r.get("quantize_s"), "gpu_memory": r.get("gpu_memory"),
                     "memory_budget_mib": (r.get("memory_budget_bytes") or 0) / 2**20,
                     "plan_seconds": planned,
                     "bench_over_plan": (r["seconds"] / planned) if planned else None})
import torch
json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": steps, "rows": rows},
          open(f"{out}/gpu_check.json", "w"), indent=1)
f = lambda v, p=3: "" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))
lines = ["| step | rc | s |", "|---|---|---|"] + [f"| {s['step']} | {s['rc']} | {s['seconds']} |" for s in steps]
lines += ["", "| model | strategy | layout | piped | quant | s | copy s | x copy | plan s | bench/plan | trainer peak MiB (alloc/res) | engine peak MiB | budget MiB |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    g = r["gpu_memory"] or {}
    lines.append(f"| {r['model']} | {r['strategy']} | {r['layout']} | {r['pipelined']} | {r['quantization']} | {f(r['seconds'], 4)} | "
                 f"{f(r['copy_seconds'], 4)} | {f(r['x_copy'], 1)} | {f(r['plan_seconds'], 4)} | {f(r['bench_over_plan'], 2)} | "
                 f"{f(g.get('trainer_peak_allocated_mib'), 0)}/{f(g.get('trainer_peak_reserved_mib'), 0)} | "
                 f"{f(g.get('engine_peak_allocated_mib'), 0)}/{f(g.get('engine_peak_reserved_mib'), 0)} | {f(r['memory_budget_mib'], 0)} |")
open(f"{out}/gpu_check.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
