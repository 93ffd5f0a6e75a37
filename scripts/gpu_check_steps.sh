# Sourced by scripts/gpu_check.sh (and tests/test_gpu_check_budget.py): `step NAME LIMIT_S CMD...`
# runs CMD under `timeout`, logs it to $OUT/NAME.log and records "NAME rc seconds" in $STEPS. Every
# step's limit is cut to what is left of GPU_CHECK_BUDGET_S (default 480) counted from START_S (the
# caller's start; else the moment this file is sourced), less 15 s for `timeout --kill-after` and
# the bookkeeping, so the run never goes past the budget; a step with under 10 s left is skipped
# and recorded with rc 125. GPU_CHECK_ONLY="a b" runs only the steps named. GPU_CHECK_DRY_RUN=1:
# each step's command is written to $OUT/dry_run.txt (one line, its words NUL-separated) and not run.
ONLY=" ${GPU_CHECK_ONLY:-} "   # e.g. GPU_CHECK_ONLY="test_gpu bench_7b": run only these steps
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
DEADLINE=$(( ${START_S:-$(date +%s)} + BUDGET_S ))
step() {   # step NAME LIMIT_S CMD...: run, log to OUT/NAME.log, record status and seconds
  local name=$1 limit=$2; shift 2
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ "$ONLY" != *" $name "* ]]; then return; fi
  if [ -n "${GPU_CHECK_DRY_RUN:-}" ]; then
    { printf '%s\0' "$name" "$@"; printf '\n'; } >> "$OUT/dry_run.txt"; return
  fi
  local left=$(( DEADLINE - $(date +%s) - 15 ))
  if (( left < 10 )); then
    printf '%s\t%s\t%s\n' "$name" 125 0 >> "$STEPS"
    echo "== $name: skipped, ${left}s left of the ${BUDGET_S}s budget (GPU_CHECK_BUDGET_S)"; return
  fi
  (( limit > left )) && limit=$left
  local t0=$(date +%s%N)
  echo "== $name (limit ${limit}s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local secs=$(awk -v a="$t0" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
  printf '%s\t%s\t%s\n' "$name" "$rc" "$secs" >> "$STEPS"
  echo "   rc=$rc in ${secs}s"; tail -n 4 "$OUT/$name.log"
}

