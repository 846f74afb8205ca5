"""What a hot standby costs on one machine: the MNIST recipe's samples/s with a standby against without one.

``python -m bench standby [--rounds 3] [--modes asgd,adacomp] [--out bench/results/standby_cost.json]``: each round
runs the recipe (2 workers, Fashion-MNIST, 8,000 images, one epoch) against a PS process alone, then against a PS
with a standby (``serve-ps --standby-of``), in alternating order; samples/s is the images trained over the fit's
seconds. The PS's extra traffic (its records to the standby) is read from the primary's counters. Over emulated
1 Gbit/s links the same pair runs in ``python -m bench slowlink --configs asgd,asgd-standby``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import FASHION, ROOT, machine, write_json
from harness.ports import free_port_block
from harness.processes import start, stop

TRAIN = 8000
RECIPE = [sys.executable, str(ROOT / "recipes" / "mnist.py"), "--data-dir", str(FASHION), "--no-download", "--quiet",
          "--no-val", "--train-subset", str(TRAIN), "--test-subset", "1000", "--workers", "2"]


def _stats(address: str) -> dict[str, Any]:
    from plug_asgd.worker.client import PSClient

    client = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=10, heartbeat_s=None)
    try:
        return client.stats(timeout=10)
    finally:
        client.close()


def one_run(mode: str, standby: bool, port: int, work: Path) -> dict[str, Any]:
    """The recipe against a PS on ``port`` (and its standby on ``port + 1``); samples/s and the PS's records."""
    from plug_asgd.ps import PSConfig, embedded_command

    primary = f"tcp://127.0.0.1:{port}"
    procs = [start(embedded_command(PSConfig(bind=primary, mode=mode, expected_workers=2, linger=1.0)),
                   log=work / f"ps-{port}.log")]
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                _stats(primary)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        if standby:
            procs.append(start(embedded_command(PSConfig(bind=f"tcp://127.0.0.1:{port + 1}", standby_of=primary)),
                               log=work / f"standby-{port}.log"))
            while _stats(primary)["standby"] is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("the standby did not join within 30 s")
                time.sleep(0.1)
        metrics = work / f"m-{port}.json"
        runner = start([*RECIPE, "--mode", mode, "--ps-address", primary, "--run-dir", str(work / f"runs-{port}"),
                        "--metrics-json", str(metrics)], log=work / f"recipe-{port}.log")
        last = {}
        while runner.poll() is None:
            try:
                last = _stats(primary)
            except Exception:
                pass
            time.sleep(0.5)
        if runner.returncode != 0:
            raise RuntimeError(f"the recipe failed: see {work / f'recipe-{port}.log'}")
        result = json.loads(metrics.read_text())
    finally:
        for p in procs:
            stop(p, grace=3.0)
    return {"samples_per_s": TRAIN / result["fit_seconds"], "test_acc": result["test_acc"],
            "ps_version": result["ps_version"], "standby_records": last.get("standby_records"),
            "standby_bytes": last.get("standby_bytes"), "ps_bytes_in": result["ps_bytes_in"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench standby", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs, alternating (default 3)")
    parser.add_argument("--modes", default="asgd,adacomp", help="comma-separated modes (default asgd,adacomp)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "standby_cost.json")
    args = parser.parse_args(argv)
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        parser.error(f"needs Fashion-MNIST in {FASHION}: apt-get install dataset-fashion-mnist")
    results: dict[str, Any] = {"machine": machine(), "command": "python -m bench standby " + " ".join(argv or []),
                               "modes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mode in args.modes.split(","):
            runs: dict[str, list[dict[str, Any]]] = {"alone": [], "standby": []}
            for i in range(args.rounds):
                order = (False, True) if i % 2 == 0 else (True, False)
                for standby in order:
                    got = one_run(mode, standby, free_port_block(4), work)
                    runs["standby" if standby else "alone"].append(got)
                    print(f"[standby] {mode} {'with' if standby else 'without'} a standby: "
                          f"{got['samples_per_s']:.0f} samples/s, acc {got['test_acc']:.3f}", flush=True)
            ratios = [s["samples_per_s"] / a["samples_per_s"] for a, s in zip(runs["alone"], runs["standby"],
                                                                            strict=True)]
            results["modes"][mode] = {"runs": runs, "ratios": ratios, "median_ratio": statistics.median(ratios)}
            print(f"[standby] {mode}: with/without {statistics.median(ratios):.3f} (median of {ratios})", flush=True)
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
