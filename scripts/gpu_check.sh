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
# is skipped and recorded as such, rc 125), going on past a failure: `make test-gpu`, the demo,
# `bench --preset gpu`, an FP8 bench (and an A/B of the quantizer's block amax), a 7B-class bench, `plan` beside each bench row (on h100-node's
# spec figures, and on this machine's costs measured here: `--cluster this-machine`, kept as
# OUTDIR/this_machine.json), a per-bucket profile (dev/gpu_profile.py), and records a real CUDA IPC
# payload (protocols 5 and 2) for the CPU tests. GPU_CHECK_ONLY="step step" runs only the named
# steps; GPU_CHECK_DRY_RUN=1 runs none and writes their commands to OUTDIR/dry_run.txt (no GPU needed:
# tests/test_gpu_check_budget.py parses every fsdp-sync step's flags with the CLI's own parser).
# scripts/gpu_check_summary.py writes OUTDIR/gpu_check.json (every step's status and
# seconds, every bench row beside its plans) and OUTDIR/gpu_check.md (a short table).
set -uo pipefail
START_S=$(date +%s)
cd "$(dirname "$0")/.."
OUT="${1:-gpu-check-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
  : > "$OUT/dry_run.txt"
elif ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/fsdp_sync_site .whl/*.whl || exit 1
  export PYTHONPATH="$PWD:/tmp/fsdp_sync_site"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
# torch's store looks up every peer's name; on a machine that reaches no network a lost DNS query
# costs glibc's 5 s per try and rendezvous (docs/reliability.md): 1 s, one try, in this check
export RES_OPTIONS="${RES_OPTIONS:-timeout:1 attempts:1}"
[ -n "${GPU_CHECK_DRY_RUN:-}" ] || "$PY" -c "import torch, omegaconf; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
FS=("$PY" -m fsdp_sync.cli)
STEPS="$OUT/steps.tsv"
[ -n "${GPU_CHECK_DRY_RUN:-}" ] || : > "$STEPS"     # a dry run leaves a real run's record be

. scripts/gpu_check_steps.sh      # step NAME LIMIT_S CMD...: within the budget

BENCH=(--ranks 1 --tp 1 --device cuda --dtype bfloat16 --bucket-mb 512 --repeats 3)
PLAN=(--ranks 1 --tp 1 --dtype bfloat16 --bucket-mb 512 --engine reference --gpu-memory-utilization 0.3)

# -vv: each test's outcome on a line of its own as it ends, so a step cut at its limit still says
# which tests passed and failed (xdist's dots would not)
step test_gpu 150 make test-gpu PY="$PY" STAMP= PYTEST_GPU_ARGS="-n 8 --timeout 140 -vv -rfE"
step payload 60 "$PY" - "$OUT" <<'EOF'
# CUDA opens an IPC handle only in another process than its producer's ("invalid device context"):
# the payloads are written here and opened by a child while this process holds the tensor
import io, subprocess, sys, torch
import torch.multiprocessing                              # registers torch's reductions
from multiprocessing.reduction import ForkingPickler
from fsdp_sync.weights import handles
out = sys.argv[1]
t = torch.arange(1000, dtype=torch.float32, device="cuda").view(10, 100)
with handles.make_payloads(t, 1, tagged=False) as ps:
    open(f"{out}/cuda_payload_p5.bin", "wb").write(ps.payloads[0])
    buf = io.BytesIO()
    ForkingPickler(buf, 2).dump(t)                           # what verl's workers send: protocol 2
    open(f"{out}/cuda_payload_p2.bin", "wb").write(buf.getvalue())
    child = ("import sys, torch.multiprocessing\n"
             "from fsdp_sync.weights import handles\n"
             "for p in (5, 2):\n"
             "    v = handles.open_payload(open(f'{sys.argv[1]}/cuda_payload_p{p}.bin', 'rb').read()).value\n"
             "    print(f'protocol {p}: opened in a child, sum {v.sum().item()} on {v.device}')\n"
             "    assert v.sum().item() == 499500.0, v\n")
    subprocess.run([sys.executable, "-c", child, out], check=True, timeout=50)
EOF
step demo 90 "${FS[@]}" demo --device cuda --ranks 1 --tp 1 --dtype bfloat16 --no-progress --json "$OUT/demo.json"
step bench_gpu 150 "${FS[@]}" bench --preset gpu --json "$OUT/bench_gpu.json"
step bench_fp8 120 "${FS[@]}" bench --models qwen2-1500m --quantization fp8 --strategies flattened \
  --layout full,engine "${BENCH[@]}" --json "$OUT/bench_fp8.json"
# the quantizer's block amax, one-step reduction (before 2026-11-29) against two-step (now), same bits
step fp8_ab 45 "$PY" dev/fp8_reductions_ab.py cuda
step bench_7b 170 "${FS[@]}" bench --models qwen2-7b --strategies flattened,per_tensor --layout full,engine \
  "${BENCH[@]}" --json "$OUT/bench_7b.json"
step plan 60 "${FS[@]}" plan --models qwen2-1500m,qwen2-7b --quantization none,fp8 --layout full,engine \
  "${PLAN[@]}" --cluster h100-node --json "$OUT/plan.json"
# the same rows priced by this machine's own costs (its GPU's copy rate, per tensor, per bucket, per
# sync, the FP8 quantizer; measured by real syncs here), kept for `plan --cluster FILE` elsewhere
step plan_here 120 "${FS[@]}" plan --models qwen2-1500m,qwen2-7b --quantization none,fp8 --layout full,engine \
  "${PLAN[@]}" --cluster this-machine --save-cluster "$OUT/this_machine.json" --json "$OUT/plan_here.json"
# what the engine keeping a rank's bucket buffer open for the whole update saves, beside opening it per bucket
step kept 90 "$PY" dev/gpu_profile.py --model qwen2-1500m --kept --out "$OUT/kept.txt"
step profile 120 "$PY" dev/gpu_profile.py --model qwen2-1500m --out "$OUT/profile.txt"

[ -n "${GPU_CHECK_DRY_RUN:-}" ] || "$PY" scripts/gpu_check_summary.py "$OUT"
