#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one call (a lent machine's time is short): the staging tests (the PS's
# memory pinned in place among them) and the selection on the device, the staged copies against per-tensor ones
# (bench.gpu_staging), one worker's fit under plain Lightning and the strategy, twice each (deterministic: the two
# runs of a mode must print the same figures: the script compares their GPU CHECK lines, less the wall time), and
# `python -m bench gpu`. A step fails where it exits non-zero, is stopped for time, prints a traceback or skips a
# test; a fit also where it prints no GPU CHECK line saying it trained on the GPU (and, under the strategy, through
# pinned buffers); two runs of a mode that differ fail too. Every step runs; the script ends with a table (step,
# result, seconds) and exits 1 naming each step that failed. The steps share a budget of GPU_CHECK_BUDGET_S seconds
# (480: the 8 minutes the check has on an H100): a step still running when it is spent is stopped and fails, and
# the steps after it fail unrun. No GPU here: nothing to do (exit 0).
#   PYTHON=python3 bash scripts/gpu_check.sh        # PYTHON: the interpreter, its words split (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
read -ra PY <<<"${PYTHON:-python3}"
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
START_S=$(date +%s)

set +e
"${PY[@]}" -c "import sys, torch; print('torch', torch.__version__, 'python', sys.version.split()[0]);
sys.exit(0 if torch.cuda.is_available() else 3)"
rc=$?
set -e
if ((rc == 3)); then
    echo "no CUDA GPU: nothing checked"
    exit 0
elif ((rc != 0)); then
    echo "gpu_check: FAILED: python and torch: '${PY[*]}' could not import torch (exit $rc)"
    exit 1
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi

NAMES=() RESULTS=() TIMES=() FAILED=()

record() { # NAME RESULT START_NS: one row of the table
    local ms=$((($(date +%s%N) - $3) / 1000000))
    NAMES+=("$1") RESULTS+=("$2") TIMES+=("$((ms / 1000)).$((ms % 1000 / 100))")
    if [[ $2 == FAILED* ]]; then FAILED+=("$1"); fi
    echo "== $1: $2"
}

# step NAME LIMIT_S EXPECT REFUSE COMMAND...: runs COMMAND (its output shown, and kept in $LOG), stopped after
# LIMIT_S or what is left of the budget; fails where it exits non-zero, is stopped, prints a traceback, prints no
# line matching the regex EXPECT (where not empty) or prints one matching the regex REFUSE (where not empty)
step() {
    local name=$1 limit=$2 expect=$3 refuse=$4 t0 left result codes
    shift 4
    t0=$(date +%s%N)
    LOG="$LOGS/${#NAMES[@]}.log"
    : >"$LOG"
    left=$((BUDGET_S - ($(date +%s) - START_S)))
    if ((left < limit)); then limit=$left; fi
    if ((limit <= 0)); then
        record "$name" "FAILED: not run, the ${BUDGET_S} s budget spent" "$t0"
        return 0
    fi
    echo "== $name: $*"
    set +e
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$LOG"
    codes=("${PIPESTATUS[@]}")
    set -e
    if ((codes[0] == 124 || codes[0] == 137)); then
        result="FAILED: stopped after $limit s"
    elif ((codes[0] != 0)); then
        result="FAILED: exit ${codes[0]}"
    elif ((codes[1] != 0)); then
        result="FAILED: its output could not be kept (tee: exit ${codes[1]})"
    elif grep -q "Traceback (most recent call last)" "$LOG"; then
        result="FAILED: printed a traceback"
    elif [[ -n $expect ]] && ! grep -Eq -- "$expect" "$LOG"; then
        result="FAILED: printed no line matching '$expect'"
    elif [[ -n $refuse ]] && grep -Eq -- "$refuse" "$LOG"; then
        result="FAILED: printed '$(grep -Eo -m1 -- "$refuse" "$LOG")'"
    else
        result=ok
    fi
    record "$name" "$result" "$t0"
}

step "CUDA tests" 180 " passed" "[0-9]+ (skipped|failed|errors?)" \
    "${PY[@]}" -m pytest -n 0 -p no:cacheprovider -q tests/test_staging.py \
    tests/test_held_base.py::test_the_selection_on_a_gpu_is_the_hosts
step "staging benchmark" 120 "Staging.load" "" "${PY[@]}" -m bench.gpu_staging 200

# a fit's figures: its GPU CHECK line less the wall time (fit_s), the one figure two runs need not share
figures() { grep -m1 "^GPU CHECK" "$1" | sed -E 's/ fit_s=[0-9.]+//' || true; }

MODES=(plain asgd adacomp adacomp-overlap)
declare -A FIT_LOG FIT_OK
for run in 1 2; do
    for mode in "${MODES[@]}"; do
        where="^GPU CHECK .* trained on cuda:[0-9]+, "  # and, under the strategy, through pinned buffers
        [[ $mode == plain ]] || where+="pinned=True"
        step "fit $mode (run $run)" 300 "$where" "" "${PY[@]}" -m bench.gpu_smoke 1 "$mode"
        FIT_LOG[$mode.$run]=$LOG
        FIT_OK[$mode.$run]=${RESULTS[-1]}
    done
done
for mode in "${MODES[@]}"; do
    t0=$(date +%s%N)
    if [[ ${FIT_OK[$mode.1]} != ok || ${FIT_OK[$mode.2]} != ok ]]; then
        record "$mode: runs 1 and 2 agree" "FAILED: not compared, a run failed" "$t0"
    elif [[ "$(figures "${FIT_LOG[$mode.1]}")" == "$(figures "${FIT_LOG[$mode.2]}")" ]]; then
        record "$mode: runs 1 and 2 agree" ok "$t0"
    else
        echo "run 1: $(figures "${FIT_LOG[$mode.1]}")"
        echo "run 2: $(figures "${FIT_LOG[$mode.2]}")"
        record "$mode: runs 1 and 2 agree" "FAILED: the two runs printed different figures" "$t0"
    fi
done

step "bench gpu" 600 "samples/s and their ratio" "" "${PY[@]}" -m bench gpu
missed=$(grep -c "MISSED" "$LOG" || true)  # a target missed is a figure to report, not a failed run
if [[ ${RESULTS[-1]} == ok ]] && ((missed)); then RESULTS[-1]="ok, $missed target(s) MISSED"; fi

echo
printf '%-36s %-52s %8s\n' step result seconds
for i in "${!NAMES[@]}"; do
    printf '%-36s %-52s %8s\n' "${NAMES[i]}" "${RESULTS[i]}" "${TIMES[i]}"
done
printf '%-36s %-52s %8s\n' total "" "$(($(date +%s) - START_S))"
if ((${#FAILED[@]})); then
    printf -v failed '%s; ' "${FAILED[@]}"
    echo "gpu_check: FAILED: ${failed%; }"
    exit 1
fi
echo "gpu_check: all ${#NAMES[@]} steps ok"
