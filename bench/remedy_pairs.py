"""One remedy of the default staleness compensation, on and off: paired by seed against DDP, on Fashion-MNIST.

    PYTHONPATH=. python -m bench.remedy_pairs [--remedy nesterov|scale|...] [--seeds 0 1 2]
        [--rows hogwild downpour agn asgd+randomk] [--workers 2] [--optimizer sgd|nesterov|adam] [--lr 0.05]
        [--train-subset 16000] [--out DIR]

Per seed, one launch of ``--workers`` workers (one torch thread each) runs DDP and every row with the
library's default compensation, then one launch runs every row again with the same compensation but
``REMEDY=False`` (a field of ``StalenessCompensation``; ``bench.nesterov_form`` is this with
``--remedy nesterov``): momentum 0.9 where the optimizer has one, batch 32 per worker, one epoch of
``--train-subset`` images, the whole test set. Prints each run's points from DDP of its seed and the rows'
means; writes ``DIR/results.json``. ``docs/momentum.md`` holds the figures and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path
from typing import Any

from bench.common import FASHION, ROOT, machine, write_json
from bench.momentum import ROWS
from bench.runner import launch

REMEDIES = ("nesterov", "scale", "lookahead", "local_residual", "mask_momentum", "correct")
OPTIMIZERS = {"sgd": 0.05, "nesterov": 0.05, "adam": 0.001}  # each one's default learning rate


def default(settings: dict[str, Any]) -> dict[str, Any]:
    """The row's default compensation, as a dict of its fields."""
    from plug_asgd.modes import get
    from plug_asgd.worker.compensation import resolve

    mode = get(settings["mode"])
    return dataclasses.asdict(resolve(None, mode.name, mode.compensate))


def without(settings: dict[str, Any], remedy: str) -> dict[str, Any]:
    """The row's default compensation, as a dict of its fields, with ``remedy`` left out."""
    return {**default(settings), remedy: False}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--remedy", choices=REMEDIES, default="nesterov",
                        help="the StalenessCompensation field turned off in the second launch (default: nesterov)")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="sgd")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", default=["hogwild", "downpour", "agn", "asgd+randomk"],
                        help="rows of bench.momentum")
    parser.add_argument("--workers", type=int, default=2, help="ranks of each launch, DDP's too (default 2)")
    parser.add_argument("--lr", type=float, default=None, help="default: the optimizer's (sgd 0.05, adam 0.001)")
    parser.add_argument("--train-subset", type=int, default=16000)
    parser.add_argument("--out", type=Path, default=None, help="default: runs/remedy-REMEDY")
    args = parser.parse_args(argv)
    args.lr = OPTIMIZERS[args.optimizer] if args.lr is None else args.lr
    args.out = args.out or ROOT / "runs" / f"remedy-{args.remedy.replace('_', '-')}"
    rows = dict(ROWS)
    unknown = [r for r in args.rows if r not in rows]
    if unknown:
        parser.error(f"unknown rows {unknown}: choose from {', '.join(rows)}")
    idle = [r for r in args.rows if not default(rows[r])[args.remedy]]
    if idle:  # the remedy is off by default there: both launches would run the same thing
        parser.error(f"rows {idle} do not take {args.remedy} by default: nothing to pair")
    if args.workers < 2:
        parser.error(f"--workers {args.workers}: asynchrony needs at least 2")
    if not FASHION.is_dir():
        parser.error(f"Fashion-MNIST is not at {FASHION}: install Debian's dataset-fashion-mnist (scripts/setup.sh)")
    common = {"bench": "remedy_pairs", "batch_size": 32, "train_subset": args.train_subset, "epochs": 1,
              "test": True, "optimizer": args.optimizer, "lr": args.lr, "momentum": 0.9}
    size = {"test_subset": None, "timeout": 1800}
    gaps: dict[tuple[str, bool], list[float]] = {}
    results: list[dict[str, Any]] = []
    for seed in args.seeds:
        ddp_run = {**common, "seed": seed, "kind": "ddp", "name": f"ddp seed {seed}"}
        on = [{**common, **rows[r], "seed": seed, "kind": "asgd", "name": f"{r} on seed {seed}", "row": r,
               "remedy_on": True} for r in args.rows]
        off = [{**common, **rows[r], "seed": seed, "kind": "asgd", "name": f"{r} off seed {seed}", "row": r,
                "remedy_on": False, "options": {"staleness_compensation": without(rows[r], args.remedy)}}
               for r in args.rows]
        got = (launch(args.workers, [ddp_run, *on], size, args.out / "work", label=f"_on_s{seed}", threads=1)
               + launch(args.workers, off, size, args.out / "work", label=f"_off_s{seed}", threads=1))
        failed = [r["launch_error"] for r in got if "launch_error" in r]
        if failed:
            print(f"[remedy_pairs] {failed}", file=sys.stderr)
            return 1
        ddp = next(r["test_acc"] for r in got if r["kind"] == "ddp")
        for r in got:
            if r["kind"] != "ddp":
                gap = 100 * (r["test_acc"] - ddp)
                gaps.setdefault((r["row"], r["remedy_on"]), []).append(gap)
                print(f"seed {seed} {r['row']:14s} {args.remedy} {'on ' if r['remedy_on'] else 'off'} "
                      f"{r['test_acc']:.4f} ({gap:+.2f} points from DDP {ddp:.4f})", flush=True)
        results += got
    print(f"\npoints from DDP, mean over seeds {args.seeds} [min, max] ({args.workers} workers, {args.optimizer} lr "
          f"{args.lr:g}; {args.remedy} off, then on):")
    for row in args.rows:
        cells = []
        for on in (False, True):
            g = gaps[(row, on)]
            cells.append(f"{'on' if on else 'off'} {statistics.mean(g):+.2f} [{min(g):+.2f}, {max(g):+.2f}]")
        print(f"  {row:14s} " + "   ".join(cells))
    write_json(args.out / "results.json", {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                           "runs": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
