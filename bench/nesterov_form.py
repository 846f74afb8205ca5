"""Heavy-ball SGD steps in Nesterov's form, or as they are: paired by seed against DDP, on Fashion-MNIST.

    PYTHONPATH=. python -m bench.nesterov_form [--seeds 0 1 2] [--rows hogwild downpour agn asgd+randomk]
        [--workers 2] [--lr 0.05] [--train-subset 16000] [--out DIR]

Per seed, one launch of ``--workers`` workers (one torch thread each) runs DDP and every row with the
library's default compensation, then one launch runs every row again with the same compensation but
``nesterov=False`` (``StalenessCompensation``):
SGD lr 0.05, momentum 0.9, batch 32 per worker, one epoch of ``--train-subset`` images, the whole test set.
Prints each run's points from DDP of its seed and the rows' means; writes ``DIR/results.json``.
``docs/momentum.md`` ("Nesterov's form") holds the figures and why.
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


def without_form(settings: dict[str, Any]) -> dict[str, Any]:
    """The row's default compensation, as a dict of its fields, with Nesterov's form left out."""
    from plug_asgd.modes import get
    from plug_asgd.staleness import resolve

    mode = get(settings["mode"])
    return dataclasses.asdict(dataclasses.replace(resolve(None, mode.name, mode.compensate), nesterov=False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", default=["hogwild", "downpour", "agn", "asgd+randomk"],
                        help="rows of bench.momentum")
    parser.add_argument("--workers", type=int, default=2, help="ranks of each launch, DDP's too (default 2)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--train-subset", type=int, default=16000)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "nesterov-form")
    args = parser.parse_args(argv)
    rows = dict(ROWS)
    unknown = [r for r in args.rows if r not in rows]
    if unknown:
        parser.error(f"unknown rows {unknown}: choose from {', '.join(rows)}")
    if args.workers < 2:
        parser.error(f"--workers {args.workers}: asynchrony needs at least 2")
    if not FASHION.is_dir():
        parser.error(f"Fashion-MNIST is not at {FASHION}: install Debian's dataset-fashion-mnist (scripts/setup.sh)")
    common = {"bench": "nesterov_form", "batch_size": 32, "train_subset": args.train_subset, "epochs": 1,
              "test": True, "optimizer": "sgd", "lr": args.lr, "momentum": 0.9}
    size = {"test_subset": None, "timeout": 1800}
    gaps: dict[tuple[str, bool], list[float]] = {}
    results: list[dict[str, Any]] = []
    for seed in args.seeds:
        ddp_run = {**common, "seed": seed, "kind": "ddp", "name": f"ddp seed {seed}"}
        on = [{**common, **rows[r], "seed": seed, "kind": "asgd", "name": f"{r} form seed {seed}", "row": r,
               "form": True} for r in args.rows]
        off = [{**common, **rows[r], "seed": seed, "kind": "asgd", "name": f"{r} as-is seed {seed}", "row": r,
                "form": False, "options": {"staleness_compensation": without_form(rows[r])}} for r in args.rows]
        got = (launch(args.workers, [ddp_run, *on], size, args.out / "work", label=f"_form_s{seed}", threads=1)
               + launch(args.workers, off, size, args.out / "work", label=f"_asis_s{seed}", threads=1))
        failed = [r["launch_error"] for r in got if "launch_error" in r]
        if failed:
            print(f"[nesterov_form] {failed}", file=sys.stderr)
            return 1
        ddp = next(r["test_acc"] for r in got if r["kind"] == "ddp")
        for r in got:
            if r["kind"] != "ddp":
                gap = 100 * (r["test_acc"] - ddp)
                gaps.setdefault((r["row"], r["form"]), []).append(gap)
                print(f"seed {seed} {r['row']:14s} {'form ' if r['form'] else 'as-is'} {r['test_acc']:.4f} "
                      f"({gap:+.2f} points from DDP {ddp:.4f})", flush=True)
        results += got
    print(f"\npoints from DDP, mean over seeds {args.seeds} [min, max] ({args.workers} workers, SGD lr {args.lr:g}, "
          "momentum 0.9):")
    for row in args.rows:
        cells = []
        for form in (False, True):
            g = gaps[(row, form)]
            cells.append(f"{'form' if form else 'as-is'} {statistics.mean(g):+.2f} [{min(g):+.2f}, {max(g):+.2f}]")
        print(f"  {row:14s} " + "   ".join(cells))
    write_json(args.out / "results.json", {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                           "runs": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
