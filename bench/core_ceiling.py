"""What the cores can train: one process alone, two at once (each on a core of its own), and 2 workers of a mode.

    PYTHONPATH=. python -m bench.core_ceiling [--seconds 20] [--mode adacomp] [--compression 0.0033] [--overlap]
        [--out DIR]

Where a time to accuracy is bound by compute (the slow-link benchmark's figure against hivemind, on 2
cores), the most 2 workers can train is what 2 independent processes train at once on the same cores:
they share the memory bandwidth and the caches (on a machine whose 2 CPUs are one core's hardware
threads, the core too), so each trains less than one alone. This measures that ceiling, in the same
run as 2 workers of a mode with their embedded PS over loopback (the workers and the PS floating over
the cores, as Lightning starts them): one torch thread per process, batch 32, Adam 1e-3, the recipe
CNN on Fashion-MNIST, samples/s over each run's training window (``bench.train``'s count), the three
in turn, ``--repeats`` times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import FASHION, ROOT, child_env, free_port_block, machine, start, stop, write_json
from bench.runner import launch

BASE: dict[str, Any] = {"bench": "core_ceiling", "batch_size": 32, "epochs": 100, "max_steps": 1_000_000,
                        "optimizer": "adam", "lr": 0.001}
TEST_SUBSET = 500  # each run's closing evaluation: small, it is not what is measured


def singles_at_once(seconds: float, out: Path, cores: list[int]) -> list[float]:
    """samples/s of one process per core in ``cores``, all started together, each pinned (``taskset``)."""
    procs, dirs = [], []
    for core in cores:
        work = out / f"single_core{core}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        spec = {"workers": 1, "data_dir": str(FASHION), "test_subset": TEST_SUBSET,
                "runs": [{**BASE, "name": "single", "kind": "single", "time_limit_s": seconds}]}
        (work / "spec.json").write_text(json.dumps(spec))
        env = child_env(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port_block(4)))
        procs.append(start(["taskset", "-c", str(core), sys.executable, "-m", "bench.train", "--spec",
                            str(work / "spec.json"), "--out", str(work / "train")], env=env, log=work / "train.log"))
        dirs.append(work)
    try:
        codes = [p.wait(timeout=seconds + 240) for p in procs]
    finally:
        for p in procs:
            stop(p)
    rates = []
    for work, code in zip(dirs, codes, strict=True):
        results = work / "train" / "results.json"
        if code != 0 or not results.exists():
            raise RuntimeError(f"a single process failed (exit {code}); its log: {work / 'train.log'}")
        rates.append(json.loads(results.read_text())[0]["samples_per_s"])
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="training time of each run (default 20)")
    parser.add_argument("--mode", default="adacomp", help="the 2 workers' mode (default adacomp)")
    parser.add_argument("--compression", type=float, default=0.0033,
                        help="adacomp's fraction (default 0.0033, the slow-link benchmark's)")
    parser.add_argument("--overlap", action="store_true", help="overlapped pushes (overlap=True)")
    parser.add_argument("--repeats", type=int, default=1, help="the three measurements, this many times in turn")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "core-ceiling", help="work folder, emptied")
    args = parser.parse_args(argv)
    if not args.seconds > 0 or args.repeats < 1:
        parser.error(f"--seconds {args.seconds} --repeats {args.repeats}: the seconds must be above 0 and the "
                     "repeats at least 1")
    if not FASHION.is_dir():
        parser.error(f"Fashion-MNIST is not at {FASHION}: install Debian's dataset-fashion-mnist (scripts/setup.sh)")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        parser.error(f"needs 2 cores, this process may use {len(cores)}")
    cores = cores[:2]
    shutil.rmtree(args.out, ignore_errors=True)
    worker = {**BASE, "name": args.mode, "kind": "asgd", "mode": args.mode, "time_limit_s": args.seconds,
              "shm_pushes": False}  # as between machines: the slow-link benchmark's setting
    if args.mode == "adacomp":
        worker["compression"] = args.compression
    if args.overlap:
        worker["overlap"] = True
    size = {"test_subset": TEST_SUBSET, "timeout": args.seconds * 3 + 240}
    rows: dict[str, list[float]] = {"one process alone": [], "two processes at once (sum)": [],
                                    f"2 workers of {args.mode}": []}
    for rep in range(args.repeats):
        alone = launch(1, [{**BASE, "name": "single", "kind": "single", "time_limit_s": args.seconds}], size,
                       args.out, f"alone{rep}", threads=1)
        pair = singles_at_once(args.seconds, args.out / f"pair{rep}", cores)
        workers = launch(2, [worker], size, args.out, f"workers{rep}", threads=1)
        failed = [r["launch_error"] for r in alone + workers if "launch_error" in r]
        if failed:
            print(f"[core_ceiling] {failed}", file=sys.stderr)
            return 1
        rows["one process alone"].append(alone[0]["samples_per_s"])
        rows["two processes at once (sum)"].append(sum(pair))
        rows[f"2 workers of {args.mode}"].append(workers[0]["samples_per_s"])
        print(f"[core_ceiling] repeat {rep}: alone {alone[0]['samples_per_s']:.0f}, at once "
              f"{' + '.join(f'{r:.0f}' for r in pair)}, workers {workers[0]['samples_per_s']:.0f} samples/s",
              flush=True)
    ceiling = statistics.median(rows["two processes at once (sum)"])
    print(f"\nsamples/s, median of {args.repeats} (one torch thread per process, {args.seconds:.0f} s each):")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"  {name:34s} {med:7.0f}   {med / ceiling:5.2f} of the ceiling (two at once)")
    write_json(args.out / "results.json", {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                           "samples_per_s": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
