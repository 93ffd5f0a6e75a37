# Sourced (not run) by the scripts that build this project's venvs: scripts/project_env.sh (.venv,
# `make demo` and `make test`), scripts/sglang_env.sh and scripts/verl_env.sh (the optional tiers).
# They install with uv instead of pip: on a 2-core CPU machine with a cold cache, verl's tier env
# took 203 s with pip and 13 s with uv, and the torch wheel 44 s against 4 s. uv comes from PyPI
# into a venv of its own (.venv-uv), installed once with pip.
#
# uv reads no pip configuration. What matters of it here is where the CPU build of torch lies (pip's
# find-links on CPU machines of this kind): FIND_LINKS, else PIP_FIND_LINKS, else pip's own
# `global.find-links`, is passed to every install. torch is installed first, from TORCH_SPEC, and
# every later install runs under a constraint pinning the torch that is there, so no range can swap
# it for a CUDA build; `uv_torch` refuses a CUDA build on a machine without an NVIDIA GPU.
#
#   UV          a uv binary to use (default: .venv-uv/bin/uv of the clone, made on first use)
#   PYTHON      the interpreter for the venvs and for bootstrapping uv (default python3)

_UV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-python3}

ensure_uv() {
  if [[ -n "${UV:-}" ]]; then
    "$UV" --version >/dev/null || { echo "UV=$UV does not run" >&2; return 1; }
    return 0
  fi
  local tools="$_UV_ROOT/.venv-uv"
  UV="$tools/bin/uv"
  [[ -x "$UV" ]] && return 0
  "$PYTHON" -m venv "$tools"
  "$tools/bin/python" -m pip install -q --disable-pip-version-check "uv>=0.9" >"$tools/pip.log" 2>&1 || {
    cat "$tools/pip.log" >&2; echo "could not install uv from PyPI into $tools (pip install uv)" >&2
    return 1; }
}

# The find-links directories that exist, one a line: FIND_LINKS, else PIP_FIND_LINKS, else pip's.
_find_links_dirs() {
  local links=${FIND_LINKS:-${PIP_FIND_LINKS:-}} d
  [[ -n "$links" ]] || links=$("$PYTHON" -m pip config get global.find-links 2>/dev/null || true)
  for d in $links; do [[ -e "${d#file://}" ]] && printf '%s\n' "${d#file://}"; done
}

# uv_venv DIR: a venv with pip in it (some steps still use pip: `pip download`, `pip wheel`).
uv_venv() {
  [[ -x "$1/bin/python" ]] || "$UV" venv -q --seed -p "$PYTHON" "$1"
}

# uv_pip VENV ARGS...: uv pip install into VENV, with pip's find-links, compiling the bytecode as
# pip does (uv does not by default): where PYTHONDONTWRITEBYTECODE is set, as on these machines, a
# venv without it compiles torch and transformers anew in every process that imports them.
# This costs 61/76/77 s of CPU for .venv/.venv-verl/.venv-sglang, of which a run imports about 30%;
# leaving it to the first import (with make's recipes allowed to write bytecode) was tried and
# gained nothing: the venvs were built 71 s faster in all, but the tests ran 30-50 s slower per tier
# on the same host (make test 651 s against 601-619 s, the verl tier 484 s against 438-454 s): a
# tier starts many processes at once (xdist workers, Ray's actors, servers), each compiling the
# same torch and transformers modules.
uv_pip() {
  local venv=$1; shift
  local links=() d
  while read -r d; do links+=(--find-links "$d"); done < <(_find_links_dirs)
  "$UV" pip install -q --compile-bytecode -p "$venv/bin/python" "${links[@]}" "$@"
}

# uv_torch VENV SPEC PIN: install SPEC (unless torch imports already), refuse a CUDA build on a
# machine with no NVIDIA GPU, and write the constraint file PIN that keeps that torch.
# Where no NVIDIA GPU is seen and no torch wheel lies in the find-links, uv takes torch from
# PyTorch's CPU index (--torch-backend cpu) instead of PyPI, whose Linux x86_64 torch is a CUDA build.
_no_gpu() { ! command -v nvidia-smi >/dev/null 2>&1 && [[ ! -e /dev/nvidia0 ]]; }
_local_torch_wheel() {
  local d
  while read -r d; do compgen -G "$d/torch-*.whl" >/dev/null && return 0; done < <(_find_links_dirs)
  return 1
}
uv_torch() {
  local venv=$1 spec=$2 pin=$3 backend=()
  if ! "$venv/bin/python" -W ignore -c "import torch" 2>/dev/null; then
    if _no_gpu && ! _local_torch_wheel; then backend=(--torch-backend cpu); fi
    uv_pip "$venv" "${backend[@]}" "$spec" || {
      echo "could not install $spec into $venv${backend:+ (from PyTorch's CPU index: no torch wheel where pip's find-links point)}" >&2
      return 1; }
  fi
  "$venv/bin/python" -W ignore - "$pin" <<'PYEOF'
import os, shutil, sys, torch
if torch.version.cuda is not None and not (shutil.which("nvidia-smi") or os.path.exists("/dev/nvidia0")):
    sys.exit(f"refusing to go on: {torch.__version__} in {sys.prefix} is a CUDA build on a machine "
             "without an NVIDIA GPU; put the CPU wheel where pip's find-links (or FIND_LINKS) "
             "points, or set TORCH_SPEC to a CPU build")
with open(sys.argv[1], "w") as f:
    f.write(f"torch=={torch.__version__.split('+')[0]}\n")
PYEOF
}
