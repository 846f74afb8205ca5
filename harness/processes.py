"""Processes a benchmark or a test starts: each in a session of its own, ended with its whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # the repository: each process starts here, with it on PYTHONPATH
# what Lightning's launcher and torch.distributed read: a child started from a rank must not inherit them
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "WORLD_SIZE",
                      "GROUP_RANK")


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without the launcher's variables, the repository on PYTHONPATH, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def start(cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own session (so its whole process group can be ended by its pid)."""
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(cmd, cwd=ROOT, env=env or child_env(), start_new_session=True,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log is not None:
            out.close()


def stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL what is left after ``grace``, reap the leader.

    Returns once no live member is left (or 10 s after the SIGKILL): a member signalled with its leader may still
    be exiting when the leader has been reaped, and a caller that checks the group at once must not see it.
    """
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + wait
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        while group_members(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if not group_members(proc.pid):
            return


def group_members(pgid: int) -> list[int]:
    """Live pids whose process group is ``pgid``, read from /proc so that members of any parent count (zombies do
    not: they have ended): the test suite's process fixtures check with it that a test left none behind."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms until it is true; TimeoutError after ``timeout`` s, naming ``what``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready within {timeout} s")
        time.sleep(0.05)
