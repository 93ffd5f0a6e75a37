#!/usr/bin/env bash
# Build the environment of the optional SGLang tier (`make test-sglang`): a venv of its own with
# the CPU build of torch, sglang without its dependencies, and only the packages that importing
# SGLang's serializer (sglang.srt.utils.common) and flattened bucket
# (sglang.srt.weight_sync.tensor_bucket) needs. Nothing may replace the CPU torch: every install
# runs under a constraint that pins it, and the script fails if a CUDA build or an nvidia-*
# package shows up anyway.
#
#   SGLANG_VENV     the venv (default .venv-sglang; `.venv-*/` is gitignored)
#   SGLANG_VERSION  sglang release from PyPI (default 0.5.23)
#   SGLANG_OLD_VERSIONS  older releases also checked (default 0.5.12, verl 0.9.1's `verl[sglang]`
#                   pin; empty: none): each goes, without dependencies, into "$VENV/sglang-$V"
#                   (`uv pip install --target`), which `make test-sglang` puts first on PYTHONPATH
#                   for a second run of the wire-contract, receiver and adapter tests in this same
#                   venv (the shared packages serve them: ~20 s and ~40 MB per release, instead of
#                   a second venv). 0.5.12 imports torchvision at module level, which no CPU wheel
#                   provides: tests/sglang_tier/old_release/sitecustomize.py stands in for it.
#   TORCH_SPEC      the CPU torch (default torch==2.13.0, the wheel that lies on CPU machines)
#   PYTHON          interpreter for the venv (default python3)
#
# Why triton: sglang/srt/utils/common.py does `import triton` at module level, and every sglang
# module imports the package's __init__, which reaches it. The triton wheel has no dependencies
# (no torch) and imports without a GPU; it is ~1 GB installed. sglang's Engine module itself
# cannot be imported on a CPU-only torch (its import chain needs torchvision, whose PyPI wheels
# are CUDA builds), so the tier reads Engine's signatures and the HTTP routes from the installed
# source instead.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/uv_env.sh"   # installs with uv: ensure_uv, uv_venv, uv_pip, uv_torch

VENV=${SGLANG_VENV:-.venv-sglang}
VERSION=${SGLANG_VERSION:-0.5.23}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PYTHON=${PYTHON:-python3}
TRITON_SPEC=${TRITON_SPEC:-triton==3.8.0}   # the triton SGLang 0.5.23's torch (2.14.1) pairs with
STAMP="$VENV/.sglang-tier-$VERSION-models-router-xdist"   # -models: transformers for the model-class checks; -router: sglang-router; -xdist: the tier runs two test files at a time
OLD_VERSIONS=${SGLANG_OLD_VERSIONS-0.5.12}
STAND_IN="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tests/sglang_tier/old_release"

# What importing SGLang's serializer and bucket modules needs (found by importing them in a bare
# venv until they import), plus what the tests themselves use. transformers (at SGLang's pin) and
# omegaconf: building SGLang's Qwen2/Llama classes on CPU and fsdp_sync's model recipes
# (tests/sglang_tier/sglang_models.py); xxhash: fsdp_sync's disk digests (it runs from the tree here).
SGLANG_TRANSFORMERS=${SGLANG_TRANSFORMERS:-transformers==5.19.0}   # sglang 0.5.23's pin
# sglang-router: SGLang's router (a Rust binary, CPU only) in front of `fsdp-sync serve` replicas
# (tests/sglang_tier/test_router_fleet.py, examples/fleet_router.py).
SGLANG_ROUTER=${SGLANG_ROUTER:-sglang-router==0.3.2}
DEPS=(numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq
      tqdm IPython aiohttp pytest pytest-timeout pytest-xdist omegaconf xxhash "$SGLANG_TRANSFORMERS" "$SGLANG_ROUTER")

# verl's own SGLang HTTP client (HttpServerAdapter), which the tier runs against `fsdp-sync serve`
# (tests/sglang_tier/verl_client_check.py), is read from verl's wheel: verl itself is not installed
# here, its dependencies pin another torch.
VERL_CLIENT=${VERL_CLIENT:-verl==0.9.1}
verl_wheel() {
  local dir="$VENV/verl-wheel"
  ls "$dir"/verl-*.whl >/dev/null 2>&1 && return 0
  "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps -d "$dir" \
    "$VERL_CLIENT" >/dev/null 2>&1 || { echo "could not download $VERL_CLIENT's wheel" >&2; exit 1; }
}

# An older release beside the venv's own: its files only, checked to import (through the stand-in)
# as itself, ahead of the venv's sglang.
old_releases() {
  local v dir
  for v in $OLD_VERSIONS; do
    dir="$VENV/sglang-$v"
    [[ -f "$dir/.fsdp_sync-installed" ]] && continue
    rm -rf "$dir"
    local t0=$(date +%s)
    uv_pip "$VENV" --no-deps --target "$dir" "sglang==$v" >>"$VENV/sglang-tier-install.log" 2>&1 || {
        tail -20 "$VENV/sglang-tier-install.log" >&2; echo "uv pip install sglang==$v failed" >&2; exit 1; }
    PYTHONPATH="$dir:$STAND_IN" "$VENV/bin/python" -W ignore - "$v" <<'PYEOF'
import sys
import sglang
from sglang.srt.utils import MultiprocessingSerializer                  # noqa: F401
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket  # noqa: F401
if sglang.__version__ != sys.argv[1]:
    sys.exit(f"expected sglang {sys.argv[1]} first on the path, got {sglang.__version__} "
             f"from {sglang.__file__}")
PYEOF
    touch "$dir/.fsdp_sync-installed"
    echo "sglang $v installed beside it in $(( $(date +%s) - t0 )) s: $dir"
  done
}

ensure_uv
if [[ -f "$STAMP" ]]; then
  verl_wheel
  old_releases
  echo "sglang tier env: $VENV (sglang $VERSION${OLD_VERSIONS:+; $OLD_VERSIONS beside it}) already built"
  exit 0
fi

start=$(date +%s)
uv_venv "$VENV"

# The installer's log goes to a file; on a failure it is shown.
LOG="$VENV/sglang-tier-install.log"
quiet_pip() {
  uv_pip "$VENV" "$@" >>"$LOG" 2>&1 || {
    cat "$LOG" >&2
    echo "uv pip install $* failed" >&2
    exit 1
  }
}
PIN="$VENV/torch-pin.txt"
uv_torch "$VENV" "$TORCH_SPEC" "$PIN" >>"$LOG" 2>&1 || { cat "$LOG" >&2; exit 1; }

echo "installing sglang==$VERSION (no dependencies), $TRITON_SPEC and ${#DEPS[@]} packages" \
     "(log: $LOG)"
quiet_pip --no-deps "sglang==$VERSION" "$TRITON_SPEC"
quiet_pip -c "$PIN" "${DEPS[@]}"

# Loud checks: the CPU torch is still there, no CUDA runtime crept in, and the modules import.
"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md, sys, torch
bad = sorted(d.metadata["Name"] for d in md.distributions()
             if d.metadata["Name"].lower().startswith(("nvidia-", "cuda-")))
if torch.version.cuda is not None or bad:
    sys.exit(f"sglang tier env is not CPU-only: torch {torch.__version__}, {bad}")
from sglang.srt.utils import MultiprocessingSerializer            # noqa: F401
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket  # noqa: F401
import sglang
print(f"sglang {sglang.__version__} imports with torch {torch.__version__}")
PYEOF

verl_wheel
touch "$STAMP"
old_releases
echo "sglang tier env built in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1) on disk"
