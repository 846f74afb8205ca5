#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one call (a lent machine's time is short): the staging tests (the PS's
# memory pinned in place among them), the selection on the device, the staged copies against per-tensor ones, and
# one worker's fit under plain Lightning and the strategy, twice each (deterministic: the two runs of a mode must
# print the same figures). No GPU here: nothing to do.
#   PYTHON=python3 bash scripts/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
$PY -c "import sys, torch; print('torch', torch.__version__, 'python', sys.version.split()[0]);
sys.exit(0 if torch.cuda.is_available() else 3)" || { echo "no CUDA GPU: nothing checked"; exit 0; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
status=0
$PY -m pytest -n 0 -p no:cacheprovider -q tests/test_staging.py tests/test_held_base.py::test_the_selection_on_a_gpu_is_the_hosts || status=1
$PY -m bench.gpu_staging 200 || status=1
for mode in plain asgd adacomp adacomp-overlap plain asgd adacomp adacomp-overlap; do
    timeout 300 $PY -m bench.gpu_smoke 1 "$mode" 2>&1 | grep -E "GPU CHECK|Error|error" || status=1
done
exit $status
