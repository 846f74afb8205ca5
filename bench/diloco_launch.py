"""The launches of ``bench.diloco``: one run's processes on the emulated hosts, its link counters read while it
trains, and its snapshots evaluated on the held-out windows afterwards.

A Lightning run (DDP, or a PS mode) is ``bench.diloco_train`` on each worker host; a PS mode adds a
``plug-asgd serve-ps`` and ``bench.diloco_observe`` on the PS's host. A hivemind run is ``bench.diloco_hivemind`` in
``.venv-hivemind`` on each worker host. :class:`LinkMeter` reads every host's interface counters each second of a
launch, so each snapshot's model gets the bytes the worker hosts' links had carried by its time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from bench.slowlink import HIVEMIND_PYTHON, MASTER_PORT, PS_PORT, _wait
from harness.netns import DEVICE, Topology
from harness.processes import child_env, start, stop

WORKER_HOSTS = ("w0", "w1")
OBSERVER_GRACE_S = 60.0  # the observer's last pull and its file, once the workers are done
# lines of hivemind 1.1.12's log counted per peer: its epochs, its failed averaging rounds, its resynchronisations
HIVEMIND_LINES = {"epochs": "Transitioning to epoch", "averaging_failed": "Averaging step failed",
                  "out_of_sync": "Peer is out of sync"}


class LinkMeter:
    """Every host's interface counters (tx + rx) read every ``every_s`` seconds in a thread, on the wall clock.

    Args:
        topo: the emulated hosts.
        every_s: seconds between two readings.
    """

    def __init__(self, topo: Topology, every_s: float = 1.0) -> None:
        self.topo = topo
        self.every_s = every_s
        self.readings: list[tuple[float, dict[str, dict[str, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="link-meter", daemon=True)

    def _read(self) -> None:
        while True:
            self.readings.append((time.time(), self.topo.counters()))
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> LinkMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        self.readings.append((time.time(), self.topo.counters()))

    def wire(self) -> dict[str, dict[str, int]]:
        """Each host's bytes sent (``tx``) and received (``rx``) between the first reading and the last."""
        (_, first), (_, last) = self.readings[0], self.readings[-1]
        return {h: {k: last[h][k] - first[h][k] for k in ("tx", "rx")} for h in last}

    def worker_bytes_at(self, when: float) -> float:
        """The worker hosts' links' bytes (tx + rx of both) since the first reading, at wall-clock ``when``:
        interpolated between the two readings around it.

        Args:
            when: a ``time.time()``.
        """
        def total(c: dict[str, dict[str, int]]) -> float:
            return sum(c[h]["tx"] + c[h]["rx"] for h in WORKER_HOSTS)

        points = [(t, total(c) - total(self.readings[0][1])) for t, c in self.readings]
        if when <= points[0][0]:
            return 0.0
        for (t0, b0), (t1, b1) in zip(points, points[1:], strict=False):
            if when <= t1:
                return b0 + (b1 - b0) * ((when - t0) / (t1 - t0) if t1 > t0 else 1.0)
        return points[-1][1]


def launch_lightning(topo: Topology, spec: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    """One ``bench.diloco_train`` run, a process per worker host; for a PS mode a ``serve-ps`` and the observer on
    the PS's host, stopped once the workers are done and the observer has kept the last version.

    Args:
        topo: the emulated hosts.
        spec: the run's spec (:func:`bench.diloco.run_spec`).
        out: the launch's folder.
        timeout: seconds the workers may take.

    Returns:
        ``records`` (each rank's, in rank order) and ``snapshots`` (``(wall time, state, counters)``), or ``error``.
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    ps_host = topo.hosts["ps"]
    stop_file = out / "observer.stop"
    stop_file.unlink(missing_ok=True)
    servers: list[subprocess.Popen] = []
    procs: list[subprocess.Popen] = []
    codes: list[int | None] = []
    observed: int | None = 0
    try:
        if spec["kind"] == "ps":
            servers.append(start([*ps_host.prefix, sys.executable, "-m", "plug_asgd.cli.app", "serve-ps", "--host",
                                  ps_host.address, "--port", str(PS_PORT), "--mode", spec["mode"], "--insecure",
                                  "--quiet", "--log-every", "0",
                                  *(["--outer", json.dumps(spec["outer"])] if spec.get("outer") else []),
                                  *(["--downlink-codec", spec["downlink_codec"]]
                                    if spec.get("downlink_codec") else [])],
                                 log=out / "ps.log"))
            servers.append(start([*ps_host.prefix, sys.executable, "-m", "bench.diloco_observe", "--address",
                                  spec["ps_address"], "--mode", spec["mode"], "--out", str(out / "central.pt"),
                                  "--stop-file", str(stop_file)], env=child_env(OMP_NUM_THREADS="1"),
                                 log=out / "observer.log"))
        threads = max(1, (os.cpu_count() or 1) // len(WORKER_HOSTS))
        for rank, name in enumerate(WORKER_HOSTS):
            env = child_env(OMP_NUM_THREADS=str(threads), MASTER_ADDR=topo.hosts["w0"].address,
                            MASTER_PORT=str(MASTER_PORT), NODE_RANK=str(rank), WORLD_SIZE=str(len(WORKER_HOSTS)),
                            GLOO_SOCKET_IFNAME=DEVICE)
            procs.append(start([*topo.hosts[name].prefix, sys.executable, "-m", "bench.diloco_train", "--spec",
                                str(out / "spec.json"), "--out", str(out)], env=env, log=out / f"rank{rank}.log"))
        codes = _wait(procs, timeout)
        if spec["kind"] == "ps":
            stop_file.touch()
            observed = _wait(servers[1:], OBSERVER_GRACE_S)[0]
    finally:
        for p in procs:
            stop(p)
        for p in reversed(servers):
            stop(p, grace=3.0)
    records = [out / f"rank{r}.json" for r in range(len(WORKER_HOSTS))]
    if any(c != 0 for c in codes) or not all(p.exists() for p in records) or observed != 0:
        return {"error": f"no result: exit codes {codes} (None: stopped after {timeout:g} s), observer {observed}; "
                         f"logs in {out}"}
    if spec["kind"] == "ps":
        snapshots = [(s["time"], s["tensors"], {k: s[k] for k in ("version", "pushes_applied", "pushes_by_rank")})
                     for s in torch.load(out / "central.pt")]
    else:
        snapshots = [(t, state, {}) for t, state in torch.load(out / "snapshots.pt")]
    return {"records": [json.loads(p.read_text()) for p in records], "snapshots": snapshots,
            "threads_per_process": threads}


def launch_hivemind(topo: Topology, spec: dict[str, Any], out: Path, timeout: float) -> dict[str, Any]:
    """Two ``bench.diloco_hivemind`` peers, one per worker host, in ``.venv-hivemind``.

    Args:
        topo: the emulated hosts.
        spec: the run's spec.
        out: the launch's folder.
        timeout: seconds the peers may take.

    Returns:
        ``records`` (each peer's) and ``snapshots`` (peer 0's ``(wall time, state, {steps})``), or ``error``.
    """
    if not HIVEMIND_PYTHON.exists():
        return {"error": f"{HIVEMIND_PYTHON} not found: python3.11 -m venv .venv-hivemind && .venv-hivemind/bin/pip "
                         "install -c constraints.txt torch==2.13.0 && .venv-hivemind/bin/pip install -c "
                         "constraints.txt hivemind==1.1.12 pytorch-lightning==2.6.6 pyzmq==27.3.0"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    peers_file = out / "peers.json"
    for stale in (peers_file, out / "snapshots.pt", *(out / f"{f}{r}" for f in ("ready", "done") for r in range(2))):
        stale.unlink(missing_ok=True)
    threads = max(1, (os.cpu_count() or 1) // len(WORKER_HOSTS))
    procs = []
    codes: list[int | None] = []
    try:
        for rank, name in enumerate(WORKER_HOSTS):
            host = topo.hosts[name]
            procs.append(start([*host.prefix, str(HIVEMIND_PYTHON), "-m", "bench.diloco_hivemind", "--spec",
                                str(out / "spec.json"), "--peer", str(rank), "--address", host.address,
                                "--peers-file", str(peers_file), "--out", str(out)],
                               env=child_env(OMP_NUM_THREADS=str(threads)), log=out / f"peer{rank}.log"))
        codes = _wait(procs, timeout)
    finally:
        for p in procs:
            stop(p)
    records = [out / f"peer{r}.json" for r in range(len(WORKER_HOSTS))]
    if not all(p.exists() for p in records) or not (out / "snapshots.pt").exists():
        return {"error": f"no result: exit codes {codes} (None: stopped after {timeout:g} s); logs in {out}"}
    # what each peer's log says of its rounds (hivemind.Optimizer(verbose=True)): the bytes say how many averaged
    logs = [(out / f"peer{r}.log").read_text(errors="replace") for r in range(len(WORKER_HOSTS))]
    said = {key: [log.count(line) for log in logs] for key, line in HIVEMIND_LINES.items()}
    return {"records": [json.loads(p.read_text()) for p in records],
            "snapshots": torch.load(out / "snapshots.pt"), "hivemind_log": said,
            "threads_per_process": threads, "exit_codes": codes}


def held_out(spec: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out windows every snapshot is evaluated on: ``(x, y)``, ``val_windows`` of the validation stream.

    Args:
        spec: a run's spec (its ``data``).
    """
    from plug_asgd.recipes.lm_data import FortunesDataModule

    data = spec["data"]
    dm = FortunesDataModule(data["data_dir"], context=data["context"], val_windows=data["val_windows"])
    dm.setup("validate")
    xs, ys = zip(*(dm.val_set[i] for i in range(len(dm.val_set))), strict=True)
    return torch.stack(xs), torch.stack(ys)


@torch.no_grad()
def val_loss(model: torch.nn.Module, state: dict[str, Any], x: torch.Tensor, y: torch.Tensor) -> float:
    """The mean loss per byte (nats) of ``model`` holding ``state`` on ``(x, y)``, as the recipe's ``val_loss``.

    Args:
        model: a ByteGPT of the run's size.
        state: a state dict (DDP's, hivemind's) or the PS's tensors by name (the parameters; a tied weight once).
        x: the windows' inputs.
        y: their targets.
    """
    import torch.nn.functional as F

    if set(state) >= set(model.state_dict()):
        model.load_state_dict({k: torch.as_tensor(state[k]) for k in model.state_dict()})
    else:
        for name, p in model.named_parameters():
            p.copy_(torch.as_tensor(state[name]).reshape(p.shape))
    model.eval()
    total = 0.0
    for i in range(0, len(x), 256):
        total += float(F.cross_entropy(model(x[i:i + 256]), y[i:i + 256], reduction="sum"))
    return total / y.numel()
