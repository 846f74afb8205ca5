"""Modes x optimizers x staleness compensation (on, off): test accuracy at equal samples, and the gap to DDP.

    PYTHONPATH=. python -m bench.momentum [--quick] [--workers 2 4] [--out DIR]

Every run trains the recipe CNN on the same Fashion-MNIST subset for one epoch with the same
per-worker batch (32), so all see the same samples; DDP (gloo, the same optimizer and learning
rate) is the reference of its optimizer and worker count. The runs of one worker count share
one launch of Lightning processes (``bench.train``). Writes ``momentum.json`` and ``momentum.md``
(the table the README shows) into ``--out`` (default: ``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import FASHION, ROOT, machine, write_json
from bench.runner import launch

OPTIMIZERS = (("sgd", 0.01), ("sgd", 0.05), ("nesterov", 0.05), ("adam", 0.001))
# (row name, strategy settings): every mode with an asynchronous fold, and asgd under each codec with error feedback
ROWS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("asgd", {"mode": "asgd"}), ("adacomp", {"mode": "adacomp"}), ("downpour", {"mode": "downpour"}),
    ("dynsgd", {"mode": "dynsgd"}), ("ssp", {"mode": "ssp"}), ("agn", {"mode": "agn"}),
    ("hogwild", {"mode": "hogwild"}),
    *((f"asgd+{codec}", {"mode": "asgd", "compressor": codec}) for codec in ("topk", "randomk", "sign", "powersgd")),
)
TARGET_POINTS = {2: 1.0, 4: 2.0}  # every compensated cell within this many points of DDP
# (workers, optimizer, lr) left out of the full run: 4 processes on 2 cores make it the longest column
SKIP = {(4, "sgd", 0.01)}
SIZES = {"full": {"train_subset": 8000, "test_subset": None, "timeout": 1800},
         "quick": {"train_subset": 1280, "test_subset": 500, "timeout": 600}}
QUICK_ROWS = ("asgd", "adacomp")
QUICK_OPTIMIZERS = (("sgd", 0.05),)


def plan(size: dict[str, Any], quick: bool, only: list[str] | None = None) -> list[dict[str, Any]]:
    """The runs of one launch: DDP per optimizer, then every row with compensation on and off (``only``: those
    rows, and no DDP: DDP is deterministic, its earlier figures stand)."""
    common = {"bench": "momentum", "batch_size": 32, "train_subset": size["train_subset"], "epochs": 1,
              "test": True, "momentum": 0.9}
    optimizers = QUICK_OPTIMIZERS if quick else OPTIMIZERS
    rows = [r for r in ROWS if r[0] in (only or (QUICK_ROWS if quick else [n for n, _ in ROWS]))]
    runs = []
    for optimizer, lr in optimizers:
        opt = {"optimizer": optimizer, "lr": lr}
        if not only:
            runs.append({**common, **opt, "name": f"ddp {optimizer} {lr:g}", "row": "ddp", "kind": "ddp"})
        for row, settings in rows:
            for on in (True, False):
                options = {} if on else {"staleness_compensation": False}
                runs.append({**common, **opt, **settings, "kind": "asgd", "options": options, "row": row,
                             "compensation": on, "name": f"{row} {optimizer} {lr:g} {'on' if on else 'off'}"})
    return runs


def table(results: list[dict[str, Any]], workers: int) -> dict[str, Any]:
    """Accuracy and gap to DDP per (row, optimizer, compensation); whether every compensated cell meets the target."""
    ddp = {(r["optimizer"], r["lr"]): r["test_acc"] for r in results if r["row"] == "ddp"}
    cells, worst = [], None
    for r in results:
        if r["row"] == "ddp":
            continue
        ref, acc = ddp.get((r["optimizer"], r["lr"])), r.get("test_acc")
        gap = None if ref is None or acc is None else round(100 * (acc - ref), 2)
        cells.append({"row": r["row"], "optimizer": r["optimizer"], "lr": r["lr"], "compensation": r["compensation"],
                      "test_acc": acc, "ddp_acc": ref, "gap_points": gap, "diverged": bool(r.get("diverged"))})
        if r["compensation"]:  # a compensated run that diverged misses the target by any measure
            value = -100.0 if gap is None else gap
            worst = value if worst is None else min(worst, value)
    target = TARGET_POINTS.get(workers)
    met = None if worst is None or target is None else worst >= -target
    return {"workers": workers, "ddp": {f"{o} {lr:g}": a for (o, lr), a in ddp.items()}, "cells": cells,
            "worst_gap_points": worst, "target_points": target, "met": met}


def _cell(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "-"
    if cell["test_acc"] is None:
        return "diverged" if cell["diverged"] else "failed"
    return f"{cell['test_acc']:.3f} ({cell['gap_points']:+.1f})"


def markdown(tables: list[dict[str, Any]]) -> str:
    lines = []
    for t in tables:
        opts = list(t["ddp"])
        lines += [f"### {t['workers']} workers: test accuracy, and points from DDP (compensation on / off)", "",
                  "| | " + " | ".join(opts) + " |", "|---|" + "---|" * len(opts),
                  "| DDP | " + " | ".join(f"{t['ddp'][o]:.4f}" for o in opts) + " |"]
        rows = dict.fromkeys(c["row"] for c in t["cells"])
        for row in rows:
            out = []
            for o in opts:
                got = {c["compensation"]: c for c in t["cells"]
                       if c["row"] == row and f"{c['optimizer']} {c['lr']:g}" == o}
                out.append(" / ".join(_cell(got.get(k)) for k in (True, False)))
            lines.append(f"| {row} | " + " | ".join(out) + " |")
        lines += ["", f"Worst compensated gap: {t['worst_gap_points']:+.2f} points; target: within "
                      f"{t['target_points']:g} (met: {t['met']}).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.momentum", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rows, 1 optimizer, 1,280 images (CI size)")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--optimizers", nargs="+", default=None, metavar="NAME",
                        help="rerun only these optimizers' columns (sgd, nesterov, adam), merging as --rows does")
    parser.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                        help="rerun only these rows (" + ", ".join(n for n, _ in ROWS) + ") and merge them into the "
                             "momentum.json already in --out")
    args = parser.parse_args(argv)
    unknown = set(args.rows or ()) - {n for n, _ in ROWS}
    if unknown:
        parser.error(f"unknown row(s) {sorted(unknown)}")
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        parser.error(f"needs Fashion-MNIST in {FASHION}: apt-get install dataset-fashion-mnist")
    out = args.out or (ROOT / "runs" / "bench-momentum-quick" if args.quick else ROOT / "bench" / "results")
    size = SIZES["quick" if args.quick else "full"]
    started = time.monotonic()
    command = "python -m bench.momentum " + " ".join(sys.argv[1:] if argv is None else argv)
    merging = bool(args.rows or args.optimizers)
    earlier = json.loads((out / "momentum.json").read_text()) if merging else None
    runs: dict[str, list[dict[str, Any]]] = dict(earlier["runs"]) if earlier else {}
    errors: list[str] = []
    for workers in args.workers:
        # a launch per optimizer: a worker process that runs many fits in a row grows (about 135 MB a run
        # here), and one launch of all 92 runs was killed for memory
        every = plan(size, args.quick, args.rows or ([n for n, _ in ROWS] if merging else None))
        every = [r for r in every if not args.optimizers or r["optimizer"] in args.optimizers]
        results = []
        for optimizer in dict.fromkeys((r["optimizer"], r["lr"]) for r in every):
            if (workers, *optimizer) in SKIP:
                continue
            chunk = [r for r in every if (r["optimizer"], r["lr"]) == optimizer]
            results += launch(workers, chunk, size, out / "work", label=f"_momentum_{optimizer[0]}{optimizer[1]:g}")
        errors += [r.pop("launch_error") for r in results if "launch_error" in r]
        fresh = {r["name"]: {**{k: v for k, v in r.items() if k != "ranks"}, "measured": machine()["commit"]}
                 for r in results if r}
        kept = [r for r in runs.get(str(workers), []) if r["name"] not in fresh]
        runs[str(workers)] = kept + list(fresh.values())
    tables = [table(runs[str(w)], int(w)) for w in sorted(runs, key=int)]
    report = {"machine": machine(), "command": command, "size": size, "tables": tables, "runs": runs,
              "errors": errors, "wall_s": round(time.monotonic() - started, 1),
              "earlier": (earlier.get("earlier", []) + [{k: earlier[k] for k in ("command", "machine", "wall_s")}]
                          if earlier else [])}
    write_json(out / "momentum.json", report)
    (out / "momentum.md").write_text(markdown(tables))
    print(markdown(tables))
    for e in errors:
        print(f"[bench.momentum] {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())

