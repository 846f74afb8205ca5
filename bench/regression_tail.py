"""The regression case of ``tests/test_momentum.py`` fitted many times, with and without the PS's correction.

    PYTHONPATH=. python -m bench.regression_tail [--modes downpour,asgd] [--fits 8] [--load 2] [--rounds 1]

Each launch is ``tests/scripts/momentum_regression.py``: one mode, ``--fits`` fits of 2 workers (SGD lr 0.05,
momentum 0.9), the central model's validation loss after each (one process reaches 6.81; the test's bound is
twice that). ``--load N`` runs N busy processes beside each launch, as the test suite's other tests load the
machine in CI: that is where single fits had a heavy tail. For every mode, a launch with the default
compensation and one with ``StalenessCompensation(correct=False)`` (the worker's median estimate only, as before
the correction) alternate, ``--rounds`` times. Prints each launch's fits sorted, and the median and worst of all
fits of each setting. Diagnostic: it prints and keeps nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import ROOT, child_env, free_port_block, start, stop

sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from momentum_regression import one_process_loss  # noqa: E402

BOUND = 2.0  # tests/test_momentum.py's REGRESSION_BOUND: the median of 3 fits at most this times one process's loss

SETTINGS = {"correct": None, "uncorrected": {"correct": False}}


def launch(mode: str, fits: int, compensation: dict | None, load: int, out: Path) -> list[float]:
    busy = [start([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        port = free_port_block(fits + 2)
        cmd = [sys.executable, "tests/scripts/momentum_regression.py", "--out", str(out), "--modes", mode,
               "--repeats", str(fits)]
        if compensation is not None:
            cmd += ["--compensation", json.dumps(compensation)]
        proc = start(cmd, env=child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
                     log=out / "launch.log")
        try:
            code = proc.wait(timeout=60 + 30 * fits)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop(proc)
        if code != 0:
            raise SystemExit(f"{mode}: the launch ended with {code}; see {out / 'launch.log'}")
        return json.loads((out / "on" / f"{mode}.json").read_text())["runs"]
    finally:
        for p in busy:
            stop(p, grace=1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="downpour,asgd")
    parser.add_argument("--fits", type=int, default=8, help="fits per launch")
    parser.add_argument("--load", type=int, default=2, help="busy processes beside each launch")
    parser.add_argument("--rounds", type=int, default=1, help="launches of each setting, alternating")
    args = parser.parse_args()
    bound = BOUND * one_process_loss()
    print(f"the test's bound: {bound:.2f} ({BOUND:g}x one process's loss)")
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            fits: dict[str, list[float]] = {name: [] for name in SETTINGS}
            for r in range(args.rounds):
                for name, compensation in SETTINGS.items():
                    out = Path(tmp) / f"{mode}-{name}-{r}"
                    out.mkdir()
                    runs = launch(mode, args.fits, compensation, args.load, out)
                    fits[name] += runs
                    print(f"{mode:9} {name:12} load {args.load}: " + " ".join(f"{x:.1f}" for x in sorted(runs)),
                          flush=True)
            for name, values in fits.items():
                print(f"{mode:9} {name:12} median {statistics.median(values):.2f}, worst {max(values):.1f}, "
                      f"above {bound:.1f} (the test's bound): {sum(v > bound for v in values)} of {len(values)}")


if __name__ == "__main__":
    main()
