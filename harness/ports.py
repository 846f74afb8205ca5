"""Free ports for the processes a benchmark or a test starts: a block of them, below the ephemeral range."""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path


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
