"""A Lightning job on the embedded PS in which a worker fails: killed, raising, diverging.

What each case must end in is written in docs/faults.md: the job exits (non-zero) within a bound
that the settings give, it says which rank failed and why, and it leaves no process behind, the
embedded PS above all (it stops when the rank that started it is gone: ``PSConfig.parent_pid``).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from harness.processes import group_members
from tests.conftest import PYTHON, free_port

pytestmark = [pytest.mark.integration, pytest.mark.faults]
SCRIPT = "tests/scripts/failing_fit.py"
LOST_TIMEOUT = 5.0  # the workers' lost_timeout: seconds they wait for a PS that went away


def steps(out: Path, rank: int) -> int:
    log = out / f"rank{rank}.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(1 for line in lines if line.startswith("step "))


def pid_of(out: Path, rank: int) -> int:
    return int((out / f"rank{rank}.log").read_text().split("\n", 1)[0].split()[1])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(condition, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - start


def embedded_ps(pgid: int) -> int:
    for pid in group_members(pgid):
        try:
            if b"plug_asgd.ps.embedded" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    raise AssertionError("no embedded PS process in the job's process group")


@pytest.mark.timeout(150)
def test_rank0_killed_takes_its_embedded_ps_down_and_the_other_rank_stops_with_a_clear_error(procs, tmp_path,
                                                                                             fault_report):
    port = free_port()
    job = procs.start([PYTHON, SCRIPT, str(tmp_path), str(port), "--lost-timeout", str(LOST_TIMEOUT)])
    wait_until(lambda: steps(tmp_path, 1) >= 10 and steps(tmp_path, 0) >= 10, 90, "both ranks to train 10 steps")
    ps, rank1 = embedded_ps(job.pid), pid_of(tmp_path, 1)
    assert pid_of(tmp_path, 0) == job.pid  # Lightning's launcher: rank 0 is the process the user started
    os.kill(job.pid, signal.SIGKILL)
    job.wait(10)
    ps_gone = wait_until(lambda: not alive(ps), 10, "the embedded PS to stop once its parent is gone")
    rank1_gone = wait_until(lambda: not alive(rank1), LOST_TIMEOUT + 30, "rank 1 to stop")
    out = job.stdout.read()  # EOF: every process that held the job's output has ended
    assert f"the parameter server at tcp://127.0.0.1:{port} went away" in out, out[-3000:]
    assert f"did not come back within {LOST_TIMEOUT:g} s" in out, out[-3000:]
    assert not group_members(job.pid)
    fault_report(fault="rank 0 SIGKILLed while it hosts the embedded PS", injected=1, handled=1,
                 pushes_lost="all since the last checkpoint", recovery_s=round(rank1_gone, 2),
                 detail=f"the PS stopped {ps_gone:.1f} s after (parent check), rank 1 {rank1_gone:.1f} s after "
                        f"(lost_timeout {LOST_TIMEOUT:g} s) naming the PS's address")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fault", ["raise", "nan"])
def test_a_worker_that_raises_or_diverges_mid_fit_ends_the_job_saying_why(procs, tmp_path, fault, fault_report):
    port = free_port()
    code, out = procs.run([PYTHON, SCRIPT, str(tmp_path), str(port), f"--{fault}-on", "1:20"], timeout=120)
    assert code != 0, out[-3000:]
    if fault == "raise":
        assert "rank 1 fails at step 20 on purpose" in out, out[-3000:]
    else:  # the PS refuses the update that holds NaN, and the worker says so
        assert "NaN" in out and "refused" in out, out[-3000:]
    assert steps(tmp_path, 1) == 20  # rank 1 went no further
    assert not procs.leftovers(), "the job left processes behind"
    fault_report(fault=f"a worker {'raises' if fault == 'raise' else 'diverges (NaN loss)'} mid-fit", injected=1,
                 handled=1, pushes_lost="all since the last checkpoint",
                 detail="the job stops non-zero with the rank's error (Lightning's launcher ends the others); "
                        "the embedded PS stops with its parent; no process is left")
