"""Modes x optimizers x staleness compensation (on, off): test accuracy at equal samples, and the gap to DDP.

    PYTHONPATH=. python -m bench.momentum [--quick] [--workers 2 4] [--out DIR]

Every run trains the recipe CNN on the same Fashion-MNIST subset for one epoch (``--epochs``) with the same
per-worker batch (32), so all see the same samples; DDP (gloo, the same optimizer and learning
rate) is the reference of its optimizer and worker count. The runs of one worker count share
one launch of Lightning processes (``bench.train``). Writes ``momentum.json`` and ``momentum.md``
(the table bench/results/README.md links) into ``--out`` (default: ``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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
SIZES = {"full": {"train_subset": 8000, "test_subset": None, "timeout": 1800, "epochs": 1},
         "quick": {"train_subset": 1280, "test_subset": 500, "timeout": 600, "epochs": 1}}
QUICK_ROWS = ("asgd", "adacomp")
QUICK_OPTIMIZERS = (("sgd", 0.05),)


FRACTION_ROWS = ("adacomp", "asgd+topk", "asgd+randomk")  # the rows with a ``fraction`` knob


def plan(size: dict[str, Any], quick: bool, only: list[str] | None = None, seeds: tuple[int, ...] = (0,),
         compensated_only: bool = False, ddp: bool = False, fraction: float | None = None,
         uncompensated_only: bool = False) -> list[dict[str, Any]]:
    """The runs: per seed, DDP per optimizer, then every row with compensation on and off (``only``: those
    rows, and no DDP unless ``ddp``: DDP is deterministic, its earlier figures stand; ``compensated_only``: on
    alone, ``uncompensated_only``: off alone, the side a table of ``compensated_only`` lacks;
    ``fraction``: that of the rows of FRACTION_ROWS, in place of their default)."""
    if compensated_only and uncompensated_only:
        raise ValueError("compensated_only and uncompensated_only leave no run")
    sides = (True,) if compensated_only else (False,) if uncompensated_only else (True, False)
    common = {"bench": "momentum", "batch_size": 32, "train_subset": size["train_subset"],
              "epochs": size["epochs"], "test": True, "momentum": 0.9}
    optimizers = QUICK_OPTIMIZERS if quick else OPTIMIZERS
    rows = [r for r in ROWS if r[0] in (only or (QUICK_ROWS if quick else [n for n, _ in ROWS]))]
    runs = []
    for seed in seeds:
        tag = f" seed {seed}" if seed else ""  # seed 0 keeps the names of the single-seed runs
        for optimizer, lr in optimizers:
            opt = {"optimizer": optimizer, "lr": lr, "seed": seed}
            if not only or ddp:
                runs.append({**common, **opt, "name": f"ddp {optimizer} {lr:g}{tag}", "row": "ddp", "kind": "ddp"})
            for row, settings in rows:
                for on in sides:
                    options = {} if on else {"staleness_compensation": False}
                    if fraction is not None and row in FRACTION_ROWS:
                        options["fraction"] = fraction
                    runs.append({**common, **opt, **settings, "kind": "asgd", "options": options, "row": row,
                                 "compensation": on,
                                 "name": f"{row} {optimizer} {lr:g} {'on' if on else 'off'}{tag}"})
    return runs


def table(results: list[dict[str, Any]], workers: int) -> dict[str, Any]:
    """Accuracy and gap to DDP per (row, optimizer, compensation), over the seeds run; whether every
    compensated cell meets the target.

    A cell's gap is the mean over seeds of its accuracy minus DDP's of the same seed (the same
    initialization and training subset): paired, so the seed's own luck cancels.
    """
    ddp = {(r["optimizer"], r["lr"], r.get("seed", 0)): r["test_acc"] for r in results if r["row"] == "ddp"}
    grouped: dict[tuple[str, str, float, bool], list[dict[str, Any]]] = {}
    for r in results:
        if r["row"] != "ddp":
            grouped.setdefault((r["row"], r["optimizer"], r["lr"], r["compensation"]), []).append(r)
    cells, worst = [], None
    for (row, optimizer, lr, on), runs in grouped.items():
        accs = [r.get("test_acc") for r in runs]
        refs = [ddp.get((optimizer, lr, r.get("seed", 0))) for r in runs]
        gaps = [None if a is None or d is None else 100 * (a - d) for a, d in zip(accs, refs, strict=True)]
        known = [g for g in gaps if g is not None]
        gap = round(sum(known) / len(known), 2) if known and len(known) == len(gaps) else None
        acc = sum(accs) / len(accs) if None not in accs else None
        cells.append({"row": row, "optimizer": optimizer, "lr": lr, "compensation": on, "test_acc": acc,
                      "ddp_acc": (sum(refs) / len(refs)) if None not in refs else None, "gap_points": gap,
                      "gap_range": [round(min(known), 2), round(max(known), 2)] if len(known) > 1 else None,
                      "seeds": [r.get("seed", 0) for r in runs],
                      "diverged": any(r.get("diverged") for r in runs)})
        if on:  # a compensated run that diverged misses the target by any measure
            value = -100.0 if gap is None else gap
            worst = value if worst is None else min(worst, value)
    target = TARGET_POINTS.get(workers)
    met = None if worst is None or target is None else worst >= -target
    ddp_mean: dict[str, float] = {}
    order = {opt: i for i, opt in enumerate(OPTIMIZERS)}
    for (o, lr) in sorted(dict.fromkeys((o, lr) for o, lr, _ in ddp), key=lambda k: order.get(k, len(order))):
        values = [a for (o2, lr2, _), a in ddp.items() if (o2, lr2) == (o, lr) and a is not None]
        if values:
            ddp_mean[f"{o} {lr:g}"] = sum(values) / len(values)
    return {"workers": workers, "ddp": ddp_mean, "seeds": sorted({s for *_, s in ddp}), "cells": cells,
            "worst_gap_points": worst, "target_points": target, "met": met}


def _cell(cell: dict[str, Any] | None) -> str:
    if cell is None:
        return "-"
    if cell["test_acc"] is None:
        return "diverged" if cell["diverged"] else "failed"
    spread = cell.get("gap_range")
    tail = f" [{spread[0]:+.1f}, {spread[1]:+.1f}]" if spread else ""
    return f"{cell['test_acc']:.3f} ({cell['gap_points']:+.1f}{tail})"


def markdown(tables: list[dict[str, Any]]) -> str:
    lines = []
    for t in tables:
        opts = list(t["ddp"])
        seeds = t.get("seeds") or [0]
        over = (f", means over seeds {', '.join(map(str, seeds))} (the gap paired by seed, [min, max])"
                if len(seeds) > 1 else "")
        for on, side in ((True, "on"), (False, "off")):  # a side run with fewer seeds says so
            own = sorted({s for c in t["cells"] if c["compensation"] is on for s in c.get("seeds", [0])})
            if own and len(seeds) > 1 and own != sorted(seeds):
                over += f"; compensation {side}: seed{'s' if len(own) > 1 else ''} {', '.join(map(str, own))}"
        lines += [f"### {t['workers']} workers: test accuracy, and points from DDP (compensation on / off){over}", "",
                  "| | " + " | ".join(opts) + " |", "|---|" + "---|" * len(opts),
                  "| DDP | " + " | ".join(f"{t['ddp'][o]:.4f}" for o in opts) + " |"]
        order = {name: i for i, (name, _) in enumerate(ROWS)}  # a row rerun and merged keeps its place
        rows = sorted(dict.fromkeys(c["row"] for c in t["cells"]), key=lambda r: order.get(r, len(order)))
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


def _launches(workers: int, every: list[dict[str, Any]], size: dict[str, Any], out: Path,
              parallel: int, threads: int | None) -> list[dict[str, Any]]:
    """One launch per (optimizer, seed), ``parallel`` at a time."""
    # a launch per (optimizer, seed), so that ``parallel`` launches run side by side (it began as a way round a
    # process that grew 135 MB a fit, each strategy kept until exit: fixed since, docs/momentum.md)
    keys = list(dict.fromkeys((r["optimizer"], r["lr"], r.get("seed", 0)) for r in every))

    def one(key: tuple[str, float, int]) -> list[dict[str, Any]]:
        chunk = [r for r in every if (r["optimizer"], r["lr"], r.get("seed", 0)) == key]
        label = f"_momentum_{key[0]}{key[1]:g}" + (f"_seed{key[2]}" if key[2] else "")
        return launch(workers, chunk, size, out / "work", label=label, threads=threads)

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return [r for chunk in pool.map(one, keys) for r in chunk]


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
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="repeat every run with these seeds (model initialization and training subset); "
                             "the table shows means and the gap to DDP paired by seed")
    parser.add_argument("--train-subset", type=int, default=None, help="images per run (default 8,000)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs over them (default 1)")
    parser.add_argument("--ddp", action="store_true",
                        help="with --rows, run DDP too (its earlier figures are of another size, say)")
    side = parser.add_mutually_exclusive_group()
    side.add_argument("--compensated-only", action="store_true", help="leave out the runs without compensation")
    side.add_argument("--uncompensated-only", action="store_true",
                      help="only the runs without compensation, merged into the NAME.json in --out (its DDP runs "
                           "stand unless --ddp)")
    parser.add_argument("--fraction", type=float, default=None,
                        help=f"the fraction of the rows {', '.join(FRACTION_ROWS)}, in place of their default "
                             "(randomk's follows the fit's length)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="launches at a time (a machine with many cores); give --threads with it")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--name", default="momentum", help="the files written: NAME.json and NAME.md")
    args = parser.parse_args(argv)
    unknown = set(args.rows or ()) - {n for n, _ in ROWS}
    if unknown:
        parser.error(f"unknown row(s) {sorted(unknown)}")
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        parser.error(f"needs Fashion-MNIST in {FASHION}: apt-get install dataset-fashion-mnist "
                     "(or set PLUG_ASGD_FASHION to a folder with its four .gz files)")
    out = args.out or (ROOT / "runs" / "bench-momentum-quick" if args.quick else ROOT / "bench" / "results")
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.train_subset:
        size["train_subset"] = args.train_subset
    if args.epochs:
        size["epochs"] = args.epochs
    started = time.monotonic()
    command = "python -m bench.momentum " + " ".join(sys.argv[1:] if argv is None else argv)
    merging = bool(args.rows or args.optimizers or args.uncompensated_only) and (out / f"{args.name}.json").exists()
    earlier = json.loads((out / f"{args.name}.json").read_text()) if merging else None
    runs: dict[str, list[dict[str, Any]]] = dict(earlier["runs"]) if earlier else {}
    errors: list[str] = []
    for workers in args.workers:
        every = plan(size, args.quick, args.rows or ([n for n, _ in ROWS] if merging else None),
                     seeds=tuple(args.seeds), compensated_only=args.compensated_only, ddp=args.ddp,
                     fraction=args.fraction, uncompensated_only=args.uncompensated_only)
        every = [r for r in every if not args.optimizers or r["optimizer"] in args.optimizers]
        results = _launches(workers, every, size, out, args.parallel, args.threads)
        errors += [r.pop("launch_error") for r in results if "launch_error" in r]
        fresh = {r["name"]: {**{k: v for k, v in r.items() if k != "ranks"}, "measured": machine()["commit"]}
                 for r in results if r}
        kept = [r for r in runs.get(str(workers), []) if r["name"] not in fresh]
        runs[str(workers)] = kept + list(fresh.values())
    tables = [table(runs[str(w)], int(w)) for w in sorted(runs, key=int)]
    report = {"machine": machine(), "command": command, "size": size, "tables": tables, "runs": runs,
              "errors": errors, "wall_s": round(time.monotonic() - started, 1),
              # a table put together by hand from several commands has "commands" in place of "command"
              "earlier": (earlier.get("earlier", []) + [{k: earlier[k] for k in ("command", "commands", "machine",
                                                                                  "wall_s") if k in earlier}]
                          if earlier else [])}
    write_json(out / f"{args.name}.json", report)
    (out / f"{args.name}.md").write_text(markdown(tables))
    print(markdown(tables))
    for e in errors:
        print(f"[bench.momentum] {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())

