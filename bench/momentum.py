"""Modes x optimizers x staleness compensation (on, off): test accuracy at equal samples, and the gap to DDP.

    PYTHONPATH=. python -m bench.momentum [--quick] [--workers 2 4] [--seeds 0 1 2] [--rows ROW ...] [--out DIR]
    PYTHONPATH=. python -m bench.momentum --remedy nesterov|scale|... [--optimizer sgd] [--rows ROW ...] [--seeds ...]
    PYTHONPATH=. python -m bench.momentum --stability

Every run trains the recipe CNN on the same Fashion-MNIST subset for one epoch (``--epochs``) with the same
per-worker batch (32), so all see the same samples; DDP (gloo, the same optimizer and learning
rate) is the reference of its optimizer and worker count. The runs of one worker count share
one launch of Lightning processes (``bench.train``). Writes ``NAME.json`` and ``NAME.md`` (``--name``, default
``momentum``: the tables bench/results/README.md links) into ``--out`` (default: ``bench/results``).

``--remedy R`` pairs one remedy of the default staleness compensation on and off, by seed, against DDP: per seed,
one launch of ``--workers`` workers (one torch thread each) runs DDP and every row with the library's default
compensation, then one launch runs every row again with the same compensation but ``R=False`` (a field of
``StalenessCompensation``): ``--optimizer`` with momentum 0.9 where it has one, batch 32 per worker, one epoch of
``--train-subset`` images (default 16,000), the whole test set. Prints each run's points from DDP of its seed and
the rows' means; writes ``DIR/results.json`` (default ``runs/remedy-R``).

``--stability``: no training; the largest stable ``lr * h`` on a quadratic ``h w**2 / 2`` with exact gradients, N
workers taking turns, each with its own momentum buffer (0.9), each update ``N - 1`` versions stale, for each
remedy and pair of remedies: the smallest model of what ``docs/momentum.md`` compares (one process is stable up to
``2 (1 + mu) = 3.8``), found by bisection in a few seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import FASHION, ROOT, machine, write_json, write_report
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


REMEDIES = ("nesterov", "scale", "lookahead", "local_residual", "mask_momentum", "correct")
REMEDY_LR = {"sgd": 0.05, "nesterov": 0.05, "adam": 0.001}  # --remedy: each optimizer's default learning rate
REMEDY_ROWS = ("hogwild", "downpour", "agn", "asgd+randomk")  # --remedy's default rows


def default_compensation(settings: dict[str, Any]) -> dict[str, Any]:
    """A row's default compensation, as a dict of its fields."""
    from plug_asgd.modes import get
    from plug_asgd.worker.compensation import resolve

    mode = get(settings["mode"])
    return dataclasses.asdict(resolve(None, mode.name, mode.compensate))


def without(settings: dict[str, Any], remedy: str) -> dict[str, Any]:
    """A row's default compensation, as a dict of its fields, with ``remedy`` left out."""
    return {**default_compensation(settings), remedy: False}


def remedy_pairs(args: argparse.Namespace, out: Path) -> int:
    """``--remedy``: per seed, a launch of DDP and the rows with the default compensation, then one of the rows
    without the remedy; the points from DDP of each run and each row's mean over the seeds, on and off."""
    rows, (workers,) = dict(ROWS), args.workers
    common = {"bench": "momentum_remedy", "batch_size": 32, "train_subset": args.train_subset, "epochs": 1,
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
        got = (launch(workers, [ddp_run, *on], size, out / "work", label=f"_on_s{seed}", threads=1)
               + launch(workers, off, size, out / "work", label=f"_off_s{seed}", threads=1))
        failed = [r["launch_error"] for r in got if "launch_error" in r]
        if failed:
            print(f"[bench.momentum] {failed}", file=sys.stderr)
            return 1
        ddp = next(r["test_acc"] for r in got if r["kind"] == "ddp")
        for r in got:
            if r["kind"] != "ddp":
                gap = 100 * (r["test_acc"] - ddp)
                gaps.setdefault((r["row"], r["remedy_on"]), []).append(gap)
                print(f"seed {seed} {r['row']:14s} {args.remedy} {'on ' if r['remedy_on'] else 'off'} "
                      f"{r['test_acc']:.4f} ({gap:+.2f} points from DDP {ddp:.4f})", flush=True)
        results += got
    print(f"\npoints from DDP, mean over seeds {args.seeds} [min, max] ({workers} workers, {args.optimizer} lr "
          f"{args.lr:g}; {args.remedy} off, then on):")
    for row in args.rows:
        cells = []
        for remedy_on in (False, True):
            g = gaps[(row, remedy_on)]
            cells.append(f"{'on' if remedy_on else 'off'} {statistics.mean(g):+.2f} [{min(g):+.2f}, {max(g):+.2f}]")
        print(f"  {row:14s} " + "   ".join(cells))
    write_json(out / "results.json", {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                      "runs": results})
    return 0


def diverges(lrh: float, workers: int, mu: float = 0.9, steps_per_push: int = 1, scale: float = 1.0,
             lookahead: bool = False, worker_mu: float | None = None, nesterov: bool = False,
             rounds: int = 4000) -> bool:
    """Whether ``workers`` workers taking turns on the quadratic ``h w**2 / 2`` (``lrh``: ``lr * h``) diverge.

    ``nesterov``: each worker's heavy-ball step ``lr * m`` taken in Nesterov's form, ``lr * (g + mu * m)``; hogwild
    is the rows of one step per push with the scale (each step scaled by ``1/N``, each gradient read ``N - 1`` of the
    others' steps before its own lands).
    """
    mu_w = mu if worker_mu is None else worker_mu
    w, version = 1.0, 0
    local, base, seen, seen_version = [w] * workers, [w] * workers, [w] * workers, [0] * workers
    m = [0.0] * workers
    for t in range(rounds):
        k = t % workers
        for _ in range(steps_per_push):
            m[k] = mu_w * m[k] + local[k]
            local[k] -= lrh * (local[k] + mu_w * m[k] if nesterov else m[k])
        w += scale * (local[k] - base[k])
        version += 1
        velocity = (w - seen[k]) / max(1, version - seen_version[k])
        seen[k], seen_version[k] = w, version
        local[k] = base[k] = w + (workers - 1) * velocity if lookahead else w
        if abs(w) > 1e6:
            return True
    return abs(w) > 0.5


def stable_bound(**kw: float | int | bool | None) -> float:
    """The largest stable ``lr * h`` of :func:`diverges` with ``kw``, by bisection."""
    lo, hi = 1e-4, 10.0
    for _ in range(36):
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if diverges(mid, **kw) else (mid, hi)  # type: ignore[arg-type]
    return lo


def stability() -> None:
    """``--stability``: the quadratic's table (docs/momentum.md, "Why these remedies")."""
    print(f"one process: {stable_bound(workers=1):.3f} (heavy ball), "
          f"{stable_bound(workers=1, nesterov=True):.3f} (Nesterov)")
    print("workers  steps/push  none    scale   mcomp   la      la+mcomp  la+scale  scale+nesterov")
    for workers, steps in ((2, 1), (4, 1), (8, 1), (2, 4)):
        mcomp = max(0.0, 1 - workers * 0.1)
        kw = {"workers": workers, "steps_per_push": steps}
        row = [stable_bound(**kw), stable_bound(**kw, scale=1 / workers), stable_bound(**kw, worker_mu=mcomp),
               stable_bound(**kw, lookahead=True), stable_bound(**kw, lookahead=True, worker_mu=mcomp),
               stable_bound(**kw, lookahead=True, scale=1 / workers),
               stable_bound(**kw, scale=1 / workers, nesterov=True)]
        print(f"{workers:7d}  {steps:10d}  " + "  ".join(f"{b:6.3f}" for b in row))
    print("hogwild: the rows of 1 step per push, columns scale (heavy ball) and scale+nesterov (Nesterov's form)")


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
    parser.add_argument("--workers", type=int, nargs="+", default=None,
                        help="the tables' worker counts (default 2 4); --remedy: one count (default 2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results (--quick: runs/bench-momentum-quick; --remedy: runs/remedy-R)")
    parser.add_argument("--optimizers", nargs="+", default=None, metavar="NAME",
                        help="rerun only these optimizers' columns (sgd, nesterov, adam), merging as --rows does")
    parser.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                        help="rerun only these rows (" + ", ".join(n for n, _ in ROWS) + ") and merge them into the "
                             "NAME.json already in --out; --remedy: the rows paired (default: "
                             + " ".join(REMEDY_ROWS) + ")")
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="repeat every run with these seeds (model initialization and training subset); "
                             "the table shows means and the gap to DDP paired by seed (default 0; --remedy: 0 1 2)")
    parser.add_argument("--train-subset", type=int, default=None,
                        help="images per run (default 8,000; --remedy: 16,000)")
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
    parser.add_argument("--remedy", choices=REMEDIES, default=None,
                        help="pair this StalenessCompensation field on and off, by seed, against DDP (no table)")
    parser.add_argument("--optimizer", choices=tuple(REMEDY_LR), default="sgd", help="--remedy's optimizer")
    parser.add_argument("--lr", type=float, default=None,
                        help="--remedy's learning rate (default: the optimizer's, sgd 0.05, adam 0.001)")
    parser.add_argument("--stability", action="store_true",
                        help="print the quadratic's largest stable lr * h of each remedy (no training)")
    args = parser.parse_args(argv)
    if args.stability:
        stability()
        return 0
    rows = dict(ROWS)
    unknown = set(args.rows or ()) - set(rows)
    if unknown:
        parser.error(f"unknown row(s) {sorted(unknown)}: choose from {', '.join(rows)}")
    if args.remedy is not None:
        args.workers = args.workers or [2]
        args.seeds = args.seeds or [0, 1, 2]
        args.rows = args.rows or list(REMEDY_ROWS)
        args.train_subset = args.train_subset or 16000
        args.lr = REMEDY_LR[args.optimizer] if args.lr is None else args.lr
        if len(args.workers) != 1 or args.workers[0] < 2:
            parser.error(f"--remedy: --workers {' '.join(map(str, args.workers))}: one count, asynchrony needs 2 "
                         "or more")
        idle = [r for r in args.rows if not default_compensation(rows[r])[args.remedy]]
        if idle:  # the remedy is off by default there: both launches would run the same thing
            parser.error(f"rows {idle} do not take {args.remedy} by default: nothing to pair")
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        parser.error(f"needs Fashion-MNIST in {FASHION}: apt-get install dataset-fashion-mnist "
                     "(or set PLUG_ASGD_FASHION to a folder with its four .gz files)")
    if args.remedy is not None:
        return remedy_pairs(args, args.out or ROOT / "runs" / f"remedy-{args.remedy.replace('_', '-')}")
    args.workers = args.workers or [2, 4]
    args.seeds = args.seeds or [0]
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
    return write_report(out, args.name, report, markdown(tables), errors, "bench.momentum")


if __name__ == "__main__":
    raise SystemExit(main())

