"""What the benchmarks share: the machine, the statistics of repeated ratios, process handling,
and the wire-size formulas of the README."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Debian's dataset-fashion-mnist; PLUG_ASGD_FASHION points elsewhere (a machine without the package)
FASHION = Path(os.environ.get("PLUG_ASGD_FASHION") or "/usr/share/datasets/fashion-mnist")
LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "WORLD_SIZE",
                      "GROUP_RANK")


def commit() -> str | None:
    """The code a run measured: the commit, marked ``+changes`` where the tree differs from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if changed else "")


def machine() -> dict[str, Any]:
    import torch

    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import zmq

        zmq_version = zmq.zmq_version()
    except ImportError:  # pragma: no cover
        zmq_version = None
    return {"cpu_count": os.cpu_count(), "cpu_model": model, "torch": torch.__version__,
            "python": platform.python_version(), "zmq": zmq_version, "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average_at_start": list(os.getloadavg()), "commit": commit()}


def ps_push_ms(stats: dict[str, Any]) -> dict[str, float | None] | None:
    """The PS's mean time per push (ms) from its stats, in all and on a core; None before any push."""
    from plug_asgd.cli.dashboard import push_ms  # (plug_asgd imports Lightning: not for every user of this module)

    per_push = push_ms(stats)
    if per_push is None:
        return None
    wall, cpu = per_push
    return {"wall": round(wall, 3), "on_a_core": None if cpu is None else round(cpu, 3)}


def summary(values: list[float]) -> dict[str, Any]:
    """Median and spread (min, max) of repeated measurements; None where nothing was measured."""
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    n = len(vals)
    median = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
    return {"median": median, "min": vals[0], "max": vals[-1], "n": n,
            "values": [None if v is None else round(v, 6) for v in values]}


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port_block(size: int = 40) -> int:
    """A port p such that p .. p+size-1 are free and below the ephemeral range (DDP's store, then one PS per run).

    Below that range no connection made during the runs (gloo's, the workers' own) can be given one
    of these ports as its local port, which would make a later run's PS fail to bind.
    """
    low, _ = _ephemeral_range()
    first, last = _port_band(10000, max(10001, low - size))
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(first, last)
        if any(base < b + n and b < base + size for b, n in _handed_out):
            continue  # this process handed it out already, and its user may not have bound it yet
        ok = True
        for p in range(base, base + size):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            with _handed_out_lock:
                _handed_out.append((base, size))
            return base
    raise RuntimeError("no block of free ports found below the ephemeral range")


_handed_out: list[tuple[int, int]] = []  # (base, size) of every block free_port_block returned in this process
_handed_out_lock = threading.Lock()


def _port_band(first: int, last: int) -> tuple[int, int]:
    """``first .. last``, or under pytest-xdist this worker's share of it: tests running side by side pick their
    ports apart, as a block is free when picked but is bound only once its processes start."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit() and int(count) > 1):
        return first, last
    width = (last - first) // int(count)
    start = first + int(worker[2:]) % int(count) * width
    return start, max(start + 1, start + width)


def child_env(**extra: str) -> dict[str, str]:
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
    """SIGTERM the process group led by ``proc``, SIGKILL what is left after ``grace``, reap the leader."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if not group_members(proc.pid):
            return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid`` (read from /proc, so zombies of other parents count too).

    The tests' process fixtures use this too (``tests/conftest.py``).
    """
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


def ports_needed(runs: list[dict[str, Any]]) -> int:
    """The ports above ``MASTER_PORT`` that a launch of ``runs`` takes (``bench.train``): one per run, one per
    shard of a sharded run (``ps_shards``)."""
    return sum(int(run.get("ps_shards") or 1) for run in runs)


def run_module(module: str, args: list[str], timeout: float, log: Path, env: dict[str, str]) -> int:
    """``python -m module args`` in its own process group; ended (all of it) on return or timeout."""
    proc = start([sys.executable, "-m", module, *args], env=env, log=log)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with open(log, "a") as f:
            f.write(f"\n[bench] {module} did not finish within {timeout:.0f} s: stopped\n")
        return -1
    finally:
        stop(proc)


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready within {timeout} s")
        time.sleep(0.05)


# -- wire sizes: the formulas of the README's compressor table ---------------------------------------

def sparse_bytes(numel: int, k: int) -> int:
    return 4 * max(1, -(-numel // 65536)) + 6 * k


def k_for(fraction: float, numel: int) -> int:
    return min(numel, max(1, math.ceil(fraction * numel)))


def payload_bytes(shapes: dict[str, tuple[int, ...]], compressor: str, *, fraction: float = 0.01, bits: int = 8,
                  rank: int = 4) -> int:
    """The tensor frames of one push of a float32 model, by the README's table (headers excluded)."""
    total = 0
    for shape in shapes.values():
        n = math.prod(shape)
        if compressor == "none":
            total += 4 * n
        elif compressor in ("fp16", "bf16"):
            total += 2 * n
        elif compressor in ("topk", "randomk", "adacomp"):
            total += sparse_bytes(n, k_for(fraction, n))
        elif compressor == "qsgd":
            total += -(-n * bits // 8) + -(-n // 8)  # the levels, then a sign bit each
        elif compressor == "sign":
            total += -(-n // 8)
        elif compressor == "powersgd":
            if len(shape) < 2:
                total += 4 * n
            else:
                a, b = shape[0], n // shape[0]
                total += 4 * rank * (a + b) if rank * (a + b) < a * b else 4 * n
        else:
            raise ValueError(compressor)
    return total


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def time_calls(owner: Any, name: str, into: list[float]) -> None:
    """Wrap ``owner.name`` so that each call's duration (s) is appended to ``into`` (diagnostic scripts).

    Nothing happens where ``owner`` has no such attribute (an older plug_asgd, in a comparison).
    """
    inner = getattr(owner, name, None)
    if inner is None:
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t)

    setattr(owner, name, timed)
