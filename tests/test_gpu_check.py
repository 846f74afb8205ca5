"""scripts/gpu_check.sh, without a GPU: run against a fake interpreter that prints what each step prints on a GPU
(the torch check, the CUDA tests, bench.gpu_staging, bench.gpu_smoke's GPU CHECK line, bench gpu's table), except
for the one step a case makes fail. The script must fail naming that step, fail where a mode's two fits print
different figures, and pass, with its table, where every step does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # bash, and the fake interpreter it runs, are processes

SCRIPT = "scripts/gpu_check.sh"
MODES = ("plain", "asgd", "adacomp", "adacomp-overlap")
STEPS = ["CUDA tests", "staging benchmark", *(f"fit {m} (run {r})" for r in (1, 2) for m in MODES),
         *(f"{m}: runs 1 and 2 agree" for m in MODES), "bench gpu"]

# The fake: each call's key (FAKE_FAIL names one) and output as the real step's; a fit's run counted per mode in
# FAKE_DIR, its wall time different at each run (the one figure the two runs need not share); FAKE_DIFFER: the mode
# whose second run prints another loss (one bit of a float32 apart).
FAKE = r"""#!/usr/bin/env bash
if [[ $1 == -c ]]; then
    key=torch out="torch 2.11.0+cu130 python 3.12.3"
else
    case $2 in
    pytest) key=pytest out=$'..................   [100%]\n18 passed in 8.47s' ;;
    bench.gpu_staging)
        key=bench.gpu_staging
        out=$'NVIDIA H100 80GB HBM3, 8 tensors, 4.8 MB, median of 200:\n  push: Staging.to_host  0.139 ms\n'
        out+=$'  reply: Staging.load  0.519 ms' ;;
    bench.gpu_smoke)
        mode=$4 n=$(( $(cat "$FAKE_DIR/$mode" 2>/dev/null || echo 0) + 1 ))
        echo "$n" >"$FAKE_DIR/$mode"
        key="bench.gpu_smoke $mode $n" loss=0.5998650789260864 staging="pinned=True allocations=16"
        if [[ $mode == "${FAKE_DIFFER:-}" && $n == 2 ]]; then loss=0.5998650789260865; fi
        if [[ $mode == plain ]]; then staging="no staging (plain Lightning)"; fi
        out="GPU CHECK devices=1 mode=$mode trained on cuda:0, $staging, test=[{'test_loss': $loss, "
        out+="'test_acc': 0.91015625}] fit_s=$((n + 1)).$n cuda=NVIDIA H100 80GB HBM3" ;;
    bench)
        key="bench $3"
        out=$'\nNVIDIA H100 80GB HBM3: samples/s and their ratio to plain Lightning\'s\n\n32-true, batch 256\n'
        out+=$'  plain      9000   1.000\n  asgd       8500   0.944  >= 0.90 ok' ;;
    *) echo "fake python: no such step: $*" >&2; exit 99 ;;
    esac
fi
if [[ $key == "${FAKE_FAIL:-}" ]]; then
    case $FAKE_HOW in
    exit) echo "${out%%$'\n'*}"; echo "RuntimeError: CUDA error: an illegal memory access was encountered" >&2
        exit 1 ;;
    traceback) printf '%s\n' "Exception in thread Thread-3 (push):" "Traceback (most recent call last):" \
        '  File "plug_asgd/worker/exchange.py", line 1, in push' "RuntimeError: CUDA error: unspecified launch failure"
        echo "$out"; exit 0 ;;
    silent) exit 0 ;;
    skip) echo "16 passed, 2 skipped in 8.10s"; exit 0 ;;
    hang) sleep 60 ;;
    esac
fi
echo "$out"
"""


def run_check(procs, tmp_path: Path, timeout: float = 60, **env: str) -> tuple[int, str, dict[str, str]]:
    """The script's exit status, its output and its table's rows (step -> result)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    code, out = procs.run(["bash", SCRIPT], timeout=timeout, env={"PYTHON": str(fake), "FAKE_DIR": str(tmp_path),
                                                                   **env})
    table = out.split("\nstep ", 1)[1].splitlines()[1:] if "\nstep " in out else []
    rows = {}
    for line in table:
        name = next((s for s in STEPS if line.startswith(s + " ")), None)
        if name is not None:
            rows[name] = re.sub(r"\s+[0-9.]+$", "", line[len(name):]).strip()
    return code, out, rows


def test_every_step_passing_passes_with_its_table(procs, tmp_path):
    code, out, rows = run_check(procs, tmp_path)
    assert code == 0, out
    assert rows == dict.fromkeys(STEPS, "ok"), out  # the fits' wall times differ between runs: not compared
    assert re.search(r"^step +result +seconds$", out, re.M) and re.search(r"^total +[0-9]+$", out, re.M)
    assert out.rstrip().endswith(f"gpu_check: all {len(STEPS)} steps ok")


@pytest.mark.parametrize("key, how, step", [
    ("pytest", "exit", "CUDA tests"),
    ("pytest", "skip", "CUDA tests"),
    ("bench.gpu_staging", "traceback", "staging benchmark"),
    ("bench.gpu_smoke plain 1", "silent", "fit plain (run 1)"),
    ("bench.gpu_smoke asgd 2", "exit", "fit asgd (run 2)"),
    ("bench.gpu_smoke adacomp-overlap 1", "traceback", "fit adacomp-overlap (run 1)"),
    ("bench gpu", "exit", "bench gpu"),
])
def test_a_step_that_fails_fails_the_check_naming_it(procs, tmp_path, key, how, step):
    code, out, rows = run_check(procs, tmp_path, FAKE_FAIL=key, FAKE_HOW=how)
    assert code != 0, out
    failed = out.rstrip().splitlines()[-1]
    assert failed.startswith("gpu_check: FAILED: ") and step in failed.split(": ", 2)[2].split("; "), out
    assert rows[step].startswith("FAILED"), out
    # every other step ran and passed, but the comparison that needed the failed fit
    mode = step.split()[1] if step.startswith("fit ") else None
    others = {s: r for s, r in rows.items() if s != step and s != f"{mode}: runs 1 and 2 agree"}
    assert set(rows) == set(STEPS) and set(others.values()) == {"ok"}, out
    if mode:
        assert rows[f"{mode}: runs 1 and 2 agree"] == "FAILED: not compared, a run failed"


def test_two_runs_of_a_mode_that_print_different_figures_fail_the_check(procs, tmp_path):
    code, out, rows = run_check(procs, tmp_path, FAKE_DIFFER="adacomp")
    assert code != 0, out
    assert rows["adacomp: runs 1 and 2 agree"] == "FAILED: the two runs printed different figures", out
    assert out.rstrip().endswith("gpu_check: FAILED: adacomp: runs 1 and 2 agree"), out
    assert "test_loss': 0.5998650789260864" in out and "test_loss': 0.5998650789260865" in out  # both shown


def test_a_broken_interpreter_fails_and_a_machine_without_cuda_passes_unchecked(procs, tmp_path):
    code, out, _ = run_check(procs, tmp_path, FAKE_FAIL="torch", FAKE_HOW="exit")
    assert code == 1 and "gpu_check: FAILED: python and torch" in out, out
    fake_without_cuda = tmp_path / "nocuda"
    fake_without_cuda.write_text("#!/bin/sh\nexit 3\n")  # the torch check's status where CUDA is not available
    fake_without_cuda.chmod(0o755)
    code, out = procs.run(["bash", SCRIPT], timeout=30, env={"PYTHON": str(fake_without_cuda)})
    assert code == 0 and "no CUDA GPU: nothing checked" in out, out


def test_a_step_past_the_budget_is_stopped_and_the_rest_fail_unrun(procs, tmp_path):
    code, out, rows = run_check(procs, tmp_path, FAKE_FAIL="bench.gpu_staging", FAKE_HOW="hang",
                                GPU_CHECK_BUDGET_S="3")
    assert code != 0, out
    assert rows["CUDA tests"] == "ok" and re.fullmatch(r"FAILED: stopped after [1-3] s", rows["staging benchmark"])
    assert all(rows[s].startswith("FAILED: not run") or s.endswith("agree") for s in STEPS[2:]), out
