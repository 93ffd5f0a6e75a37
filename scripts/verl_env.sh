#!/usr/bin/env bash
# Build the environment of the verl tier (`make test-verl`): a venv of its own with the CPU build
# of torch, verl pinned (no extras: verl's `cpu`/`fsdp`/`sglang` extras pin another torch), what
# verl needs to import and compose its configs on CPU, and fsdp_sync itself installed editable, so
# its `verl.plugins` entry point is what `import verl` finds. Nothing may replace the CPU torch:
# every install runs under a constraint that pins it, and the script fails if a CUDA build or an
# nvidia-* package shows up anyway.
#
#   VERL_VENV     the venv (default .venv-verl; `.venv-*/` is gitignored)
#   VERL_VERSION  verl release from PyPI (default 0.9.1)
#   TORCH_SPEC    the CPU torch (default torch==2.13.0, the wheel that lies on CPU machines)
#   PYTHON        interpreter for the venv (default python3)
#
# Why the extra packages: verl's base requirements do not cover what its trainer, rollout and
# config modules import on CPU (its `verl-core` extra lists them, together with packages that
# need CUDA). TransferQueue, cachetools, fastapi, uvicorn, msgspec and pyzmq are the ones a CPU
# import of verl.workers.* needs; pytest, pytest-timeout and pytest-xdist run the tier; xxhash is
# fsdp_sync's own (installed --no-deps below).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/uv_env.sh"   # installs with uv: ensure_uv, uv_venv, uv_pip, uv_torch

VENV=${VERL_VENV:-.venv-verl}
VERSION=${VERL_VERSION:-0.9.1}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.verl-tier-$VERSION-xdist"   # -xdist: the tier runs two test files at a time

DEPS=(TransferQueue cachetools fastapi uvicorn msgspec pyzmq pytest pytest-timeout pytest-xdist xxhash)

start=$(date +%s)
ensure_uv
if [[ ! -f "$STAMP" ]]; then
  uv_venv "$VENV"
  LOG="$VENV/verl-tier-install.log"
  quiet_pip() {
    uv_pip "$VENV" "$@" >>"$LOG" 2>&1 || {
      tail -50 "$LOG" >&2
      echo "uv pip install $* failed (whole log: $LOG)" >&2
      exit 1
    }
  }
  PIN="$VENV/torch-pin.txt"
  uv_torch "$VENV" "$TORCH_SPEC" "$PIN" >>"$LOG" 2>&1 || { cat "$LOG" >&2; exit 1; }
  echo "installing verl==$VERSION (no extras) and ${#DEPS[@]} packages (log: $LOG)"
  quiet_pip -c "$PIN" "verl==$VERSION" "${DEPS[@]}"
  touch "$STAMP"
fi

# fsdp_sync itself, editable, every time (cheap): its entry points are read from its metadata.
uv_pip "$VENV" --no-deps -e . >/dev/null

"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md, sys, torch
bad = sorted(d.metadata["Name"] for d in md.distributions()
             if (d.metadata["Name"] or "").lower().startswith(("nvidia-", "cuda-")))
if torch.version.cuda is not None or bad:
    sys.exit(f"verl tier env is not CPU-only: torch {torch.__version__}, {bad}")
import verl
eps = [e.value for e in md.entry_points(group="verl.plugins")]
if not any(v.startswith("fsdp_sync") for v in eps):
    sys.exit(f"fsdp_sync's verl.plugins entry point is not installed (found {eps})")
print(f"verl {verl.__version__} imports with torch {torch.__version__}; plug-ins {eps}")
PYEOF
echo "verl tier env ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1) on disk"
