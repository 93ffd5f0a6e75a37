#!/usr/bin/env bash
# GRPO with verl's own trainer on a CPU machine, rollout on fsdp_sync's reference engine, weights
# synced (and verified) by fsdp_sync every step. Needs verl 0.9.1 and fsdp_sync in one environment
# on the CPU build of torch: `make demo-verl` builds it (.venv-verl) and runs this script.
#   recipes/verl/run_tiny_grpo_cpu.sh [hydra overrides...]
# TINY_DIR (default ./tiny_grpo) holds the assets, made by tiny/make_assets.py on first use.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PY=${PYTHON:-python3}
TINY_DIR=$(mkdir -p "${TINY_DIR:-tiny_grpo}" && cd "${TINY_DIR:-tiny_grpo}" && pwd)
[[ -f "$TINY_DIR/train.parquet" ]] || "$PY" "$HERE/tiny/make_assets.py" "$TINY_DIR"

export VERL_PLATFORM=cpu                        # fsdp_sync's CPU platform for verl
export TOKENIZERS_PARALLELISM=false
# Ray's socket paths must stay under ~107 characters: a short session directory of its own
# (removed after a run that succeeded when this script made it; kept, with Ray's logs, after a failure)
if [[ -z "${RAY_TMPDIR:-}" ]]; then RAY_TMPDIR=$(mktemp -d /tmp/fsr.XXXXXX); OWN_RAY_TMP=1; fi
export RAY_TMPDIR
# Ray SIGKILLs its workers at shutdown, so what multiprocessing made in their temp directory (a
# forkserver's pymp-* directory) is never removed by them: the run's temp directory goes at its end
RUN_TMP=$(mktemp -d "${TMPDIR:-/tmp}/fsr-tmp.XXXXXX")
export TMPDIR=$RUN_TMP

status=0
"$PY" -m verl.trainer.main_ppo --config-path "$HERE" --config-name tiny_grpo_cpu \
  data.train_files="$TINY_DIR/train.parquet" data.val_files="$TINY_DIR/test.parquet" \
  actor_rollout_ref.model.path="$TINY_DIR/model" \
  reward.custom_reward_function.path="$HERE/tiny/reward.py" \
  "$@" || status=$?
rm -rf "$RUN_TMP"
if [[ -n "${OWN_RAY_TMP:-}" && $status -eq 0 ]]; then rm -rf "$RAY_TMPDIR"; fi
exit $status
