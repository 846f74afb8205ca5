"""``replicas_to_aggregate`` end to end: a sync PS process, 3 worker processes, 2 updates per round.

The slowest worker of each round is a backup worker (TensorFlow's SyncReplicasOptimizer): its push,
based on a version that is gone, is dropped and it gets the new model. The workers
(tests/scripts/ps_worker.py) each push a constant of their own and log every reply, so the
central model is computed here, by hand, from the logs: each version is the mean of the pushes
that made it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from plug_asgd.worker.client import PSClient
from tests.conftest import PYTHON

pytestmark = pytest.mark.integration
DELTAS = {0: 1.0, 1: 3.0, 2: 7.0}  # distinct, so that which pushes made a version shows in the sum
PUSHES = 40


def logged_pushes(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == "push"]


def test_two_of_three_updates_make_each_version_and_the_late_one_is_dropped(procs, start_ps, tmp_path):
    address = start_ps("sync", replicas_to_aggregate=2)
    workers = [procs.start([PYTHON, "tests/scripts/ps_worker.py", "--address", address, "--rank", str(rank),
                            "--world", "3", "--mode", "sync", "--pushes", str(PUSHES), "--delta", str(delta),
                            "--interval", "0.01", "--log", str(tmp_path / f"w{rank}.log")])
               for rank, delta in DELTAS.items()]
    for w in workers:
        out, _ = w.communicate(timeout=120)
        assert w.returncode == 0, out[-3000:]
    rounds: dict[int, list[float]] = {}
    dropped = 0
    for rank, delta in DELTAS.items():
        for r in logged_pushes(tmp_path / f"w{rank}.log"):
            if r["status"] == "applied":
                rounds.setdefault(r["version"], []).append(delta)
            else:
                assert r["status"] == "dropped" and r["version"] > r["base"], r  # a version made without it
                dropped += 1
    watcher = PSClient(address, rank=0, world_size=1, mode="sync", request_timeout=20, heartbeat_s=None)
    try:
        final = watcher.pull()
    finally:
        watcher.close()
    # every version from 1 to the last was made by one round, of at most 2 pushes (1 once a worker has left)
    assert sorted(rounds) == list(range(1, final.version + 1))
    assert all(1 <= len(d) <= 2 for d in rounds.values()), rounds
    expected = sum(sum(d) / len(d) for d in rounds.values())
    np.testing.assert_allclose(final.tensors["w"], np.full(4, expected), rtol=1e-6)
    # while all 3 train, a round closes at 2 pushes (never 3, the default), and the third push is late
    assert any(len(d) == 2 for d in rounds.values()) and dropped >= 1, (rounds, dropped)
    assert dropped + sum(map(len, rounds.values())) == 3 * PUSHES
