"""A Lightning job on the embedded PS in which a worker fails: killed, raising, diverging.

What each case must end in is written in docs/faults.md: the job exits (non-zero) within a bound
that the settings give, it says which rank failed and why, and it leaves no process behind, the
embedded PS above all (it stops when the rank that started it is gone: ``PSConfig.parent_pid``).
A rank that fails, whichever it is, ends the job's other ranks and the embedded PS: the PS tells the others at their
next request (``plug_asgd/ps/failure.py``), within ``TOLD_S``, and each stops by itself (it reaches its interpreter's
exit: ``exiting at`` in its log). The whole job has ended within ``JOB_ENDS_S``: most of that is the processes'
interpreter exits, which the library does not set (Python with torch and Lightning loaded takes 1.5 to 2.5 s to exit on
the 2-core machine, and rank 0 exits only once the ranks it launched have), hence a bound that tells "ended" from
"waited for a timeout" (lost_timeout 60 s, request_timeout 600 s) and is not a speed target.
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
TOLD_S = 2.0  # a rank failed: the others are told this long after at most (at their next request: a step is 20 ms)
# a rank failed: every process of the job has ended this long after, interpreter exits included. Measured: 2.6 to
# 3.9 s over 6 raising runs (3 with each rank raising) on 2 cores at a load average of 4 to 5 (other test runs
# beside them); CI's loaded machine went past the 5 s once held here, by how much was not recorded. 20 s is not
# that tail's measure: it sits 4x above the 5 s CI passed and well below the 60 s (lost_timeout) and 600 s
# (request_timeout) a job would otherwise wait for, which is what the bound tells apart.
JOB_ENDS_S = 20.0


def log_lines(out: Path, rank: int) -> list[str]:
    """The lines the rank has written so far (tests/scripts/failing_fit.py), none before its log exists."""
    log = out / f"rank{rank}.log"
    return log.read_text().splitlines() if log.exists() else []


def steps(out: Path, rank: int) -> int:
    return sum(1 for line in log_lines(out, rank) if line.startswith("step "))


def logged_at(out: Path, rank: int, what: str) -> float | None:
    """``time.time()`` of the rank's ``{what} at T`` line, None where it has none."""
    return next((float(line.split()[-1]) for line in log_lines(out, rank) if line.startswith(f"{what} at ")), None)


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
    killed_at = time.time()
    job.wait(10)
    killed = time.monotonic()
    rank1_gone = wait_until(lambda: not alive(rank1), JOB_ENDS_S, "rank 1 to stop")
    wait_until(lambda: not alive(ps), JOB_ENDS_S, "the embedded PS to stop once its parent is gone")
    ps_gone = time.monotonic() - killed
    out = job.stdout.read()  # EOF: every process that held the job's output has ended
    assert f"parameter server at tcp://127.0.0.1:{port}: the process that started this parameter server (rank 0 " \
           "of the job) is gone" in out, out[-3000:]
    assert "went away" not in out, out[-3000:]  # told, not left waiting lost_timeout for a PS that went away
    assert logged_at(tmp_path, 1, "failed") - killed_at < TOLD_S
    assert logged_at(tmp_path, 1, "exiting") is not None  # it stopped by itself
    assert not group_members(job.pid)
    fault_report(fault="rank 0 SIGKILLed while it hosts the embedded PS", injected=1, handled=1,
                 pushes_lost="all since the last checkpoint", recovery_s=round(rank1_gone, 2),
                 detail=f"the PS, its parent gone, told rank 1 at its next request: rank 1 stopped {rank1_gone:.1f} s "
                        f"after, saying rank 0 is gone (told, not left to wait lost_timeout for a PS that went "
                        f"away), the PS {ps_gone:.1f} s after")


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
    if fault == "raise":
        assert steps(tmp_path, 1) == 20  # rank 1 went no further
    else:
        # rank 1's 21st step makes the NaN update. Pushed the usual way its refusal ends that step before it is
        # logged: 20. Where rank 1's last push was answered "own" (rank 0 pushed nothing in between, which the
        # machine's timing decides), the weights go through shared memory from a thread and the reply is taken
        # before the next step writes them (PushExchange.push_weights): step 21 is logged, and the refusal ends
        # step 22 (seen once in a fresh-clone suite run). Never more.
        assert steps(tmp_path, 1) in (20, 21)
    assert not procs.leftovers(), "the job left processes behind"
    fault_report(fault=f"a worker {'raises' if fault == 'raise' else 'diverges (NaN loss)'} mid-fit", injected=1,
                 handled=1, pushes_lost="all since the last checkpoint",
                 detail="the job stops non-zero with the rank's error; the PS tells the other rank (job_failed), "
                        "and the embedded PS stops with its parent; no process is left")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_raises_ends_the_others_and_the_embedded_ps_within_seconds(procs, tmp_path, rank, fault_report):
    port = free_port()
    job = procs.start([PYTHON, SCRIPT, str(tmp_path), str(port), "--raise-on", f"{rank}:20"])
    wait_until(lambda: logged_at(tmp_path, rank, "raising") is not None, 120, f"rank {rank} to raise")
    ps = embedded_ps(job.pid)
    wait_until(lambda: not group_members(job.pid), 30, "the job to end")
    raised = logged_at(tmp_path, rank, "raising")
    ended = time.time() - raised  # an upper bound: polled every 50 ms
    out = job.stdout.read()
    assert job.wait(10) != 0
    assert f"rank {rank} fails at step 20 on purpose" in out, out[-3000:]
    other = 1 - rank
    assert f"the job failed: rank {rank} stopped on RuntimeError: rank {rank} fails at step 20" in out, out[-3000:]
    assert steps(tmp_path, rank) == 20 and steps(tmp_path, other) < 384  # the other rank did not train on
    assert not alive(ps)
    told = logged_at(tmp_path, other, "failed") - raised
    assert told < TOLD_S, f"rank {other} was told {told:.1f} s after rank {rank} raised"
    assert logged_at(tmp_path, other, "exiting") is not None  # it stopped by itself: not killed after the grace
    assert ended < JOB_ENDS_S, f"the job ended {ended:.1f} s after rank {rank} raised"
    fault_report(fault=f"rank {rank} of 2 raises mid-fit", injected=1, handled=1,
                 pushes_lost="all since the last checkpoint", recovery_s=round(ended, 2),
                 detail=f"the PS told rank {other} at its next request (job_failed, naming rank {rank} and its error) "
                        f"{told:.2f} s after the raise; it stopped by itself, and every process, the embedded PS too, "
                        f"had ended {ended:.1f} s after the raise (their interpreter exits included)")


@pytest.mark.timeout(150)
def test_rank0_failing_before_its_stage_ends_the_rank_it_launched(procs, start_ps, tmp_path, fault_report):
    """Rank 0 cannot reach its PS (the address is wrong); rank 1 reached the real one and waits in the stage's first
    collective for rank 0, which never comes: it would wait its request_timeout. Rank 0, failing, ends it."""
    address = start_ps("asgd", worker_timeout=60)
    job = procs.start([PYTHON, SCRIPT, str(tmp_path), str(free_port()), "--ps-address", address,
                       "--rank0-ps-address", "tcp://127.0.0.1:9"])
    wait_until(lambda: logged_at(tmp_path, 0, "failed") is not None, 120, "rank 0 to fail")
    wait_until(lambda: not group_members(job.pid), 30, "the job to end")
    ended = time.time() - logged_at(tmp_path, 0, "failed")  # an upper bound: polled every 50 ms
    out = job.stdout.read()
    assert job.wait(10) != 0
    assert "tcp://127.0.0.1:9" in out, out[-3000:]
    assert steps(tmp_path, 1) == 0  # it never trained: it waited for rank 0
    assert ended < JOB_ENDS_S, f"the job ended {ended:.1f} s after rank 0 failed"
    fault_report(fault="rank 0 of 2 fails before its stage (its PS address unreachable); rank 1 waits for it",
                 injected=1, handled=1, pushes_lost=0, recovery_s=round(ended, 2),
                 detail=f"rank 0 ended the rank it launched (as Lightning's launcher does where a rank fails): every "
                        f"process gone {ended:.1f} s after its failure, where rank 1 would have waited its "
                        "request_timeout")
