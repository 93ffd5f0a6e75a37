#!/usr/bin/env bash
# Build the project's own venv (`make demo`, `make test`): the CPU build of torch first (TORCH_SPEC,
# found where pip's find-links point on CPU machines of this kind), then fsdp_sync editable with its
# `test` and `cli` extras, under a constraint that keeps that torch. Installs with uv
# (scripts/uv_env.sh says why and how).
#
#   VENV        the venv (default .venv)
#   TORCH_SPEC  the torch to install first (default torch==2.13.0, the CPU wheel on CPU machines)
#   EXTRAS      the project's extras (default test,cli)
#   PYTHON      interpreter for the venv (default python3)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/uv_env.sh

VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-test,cli}

start=$(date +%s)
ensure_uv
uv_venv "$VENV"
PIN="$VENV/torch-pin.txt"
uv_torch "$VENV" "$TORCH_SPEC" "$PIN"
uv_pip "$VENV" -c "$PIN" -e ".[$EXTRAS]"
echo "$VENV ready in $(( $(date +%s) - start )) s ($("$VENV/bin/python" -W ignore -c 'import torch; print("torch", torch.__version__)'))"
