"""Every mode against DDP on two models: the final loss and accuracy of the central model, over seeds.

    python -m bench learning [--seeds 0 1 2] [--models cnn,lm] [--rows asgd sync ...] [--inner-steps H]
                             [--quick] [--out DIR]

Issue 58's learning table: each mode of :data:`plug_asgd.modes.MODES` at its defaults with 2 workers, and DDP
(gloo) as the reference, on the same data, optimizer, learning rate, batch, samples and seed:

- ``cnn``: the recipe CNN on Fashion-MNIST (``bench.momentum``'s runs): SGD with momentum 0.9 at lr 0.05 (the
  recipe's rate for ``optimizer="sgd"``), batch 32 per worker, one epoch of 8,000 training images shared out
  among the workers (125 steps each), tested on the whole test set: loss (cross-entropy) and accuracy;
- ``lm``: the language-model recipe's ByteGPT (``tests/test_lm.py``'s LM_SMALL and ``bench.diloco``'s size:
  d_model 64, 2 blocks, 4 heads, windows of 32 bytes) on Debian's fortunes, split by document, with the recipe's
  own optimizer (AdamW at 1e-3, a warmup of 20 steps, a cosine decay over the fit), batch 32 windows per worker,
  400 steps per worker, tested on 512 held-out windows: validation loss (nats per byte) and next-byte accuracy.

The model tested is the central one: the PS's model (the strategy's test loads it), DDP's rank 0 model. A DiLoCo
row whose default ``inner_steps`` would make fewer than :data:`MIN_ROUNDS` rounds in the run's steps runs with a
smaller one, a divisor of the steps (:func:`inner_steps`), and its row says so. Per seed and model one launch of
``bench.train`` runs DDP and every row; a run that stops its launch (a crash, or no run finished in
:data:`STALL_S`) is recorded as failed and a new launch goes on with the runs after it. The gaps are paired by
seed: a row's accuracy minus DDP's of the same seed (points), its loss over DDP's (a ratio). Writes
``learning.json`` and ``learning.md`` into ``--out`` (default ``bench/results/learning``; ``--quick``:
``runs/bench-learning-quick``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import FASHION, ROOT, machine, write_report
from bench.runner import train

WORKERS = 2
BATCH = 32
MIN_ROUNDS = 4  # a DiLoCo row makes at least this many rounds, or its inner_steps is lowered (and said)
DILOCO = ("diloco", "async_diloco")
# tests/test_lm.py's LM_SMALL (bench.diloco's MODEL): 118,528 parameters
LM_MODEL = {"d_model": 64, "layers": 2, "heads": 4, "max_context": 32, "warmup_steps": 20}
# per model: what every row of it shares (optimizer, batch, data) and its sizes
MODELS: dict[str, dict[str, Any]] = {
    "cnn": {"common": {"model": "cnn", "optimizer": "sgd", "lr": 0.05, "momentum": 0.9},
            "full": {"train_subset": 8000, "test_subset": None},
            "quick": {"train_subset": 1280, "test_subset": 500},
            "describe": "recipe CNN on Fashion-MNIST, SGD lr 0.05 momentum 0.9, batch 32 per worker, one epoch of "
                        "{train_subset} training images ({steps} steps per worker), tested on {test}; loss: "
                        "cross-entropy"},
    "lm": {"common": {"model": "lm", "optimizer": "adamw", "lr": 1e-3},
           "full": {"train_subset": 400 * WORKERS * BATCH, "test_subset": 512, "lm": LM_MODEL},
           "quick": {"train_subset": 40 * WORKERS * BATCH, "test_subset": 128, "lm": {**LM_MODEL, "warmup_steps": 5}},
           "describe": "ByteGPT (d_model 64, 2 blocks, 4 heads, 32-byte windows) on Debian's fortunes, AdamW lr 1e-3 "
                       "with a warmup of {warmup} steps and a cosine decay, batch 32 windows per worker, {steps} "
                       "steps per worker ({train_subset} windows), tested on {test} held-out windows; loss: nats "
                       "per byte, accuracy: next-byte"},
}
QUICK_ROWS = ("asgd", "sync", "diloco")
# rows of a mode with other knobs than its defaults: (the mode, its knobs, the row's note). async_diloco's outer SGD
# without momentum is docs/modes.md's setting for 2 workers and a few rounds, where the default delayed Nesterov
# swings (docs/benchmarks.md, "Where async_diloco swings")
VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    "async_diloco-sgd": ("async_diloco", {"outer": {"name": "sgd", "lr": 1.0, "momentum": 0.0}},
                         "outer SGD lr 1.0, no momentum"),
    "async_diloco-m05": ("async_diloco", {"outer": {"name": "nesterov", "lr": 0.7, "momentum": 0.5},
                                          "momentum_lookahead": False},
                         "delayed Nesterov lr 0.7, momentum 0.5, without the momentum lookahead"),
    "async_diloco-nolookahead": ("async_diloco", {"momentum_lookahead": False},
                                 "without the momentum lookahead (each reply the central model itself)"),
    # diloco's outer step at other settings than the paper's (Nesterov lr 0.7, momentum 0.9): at a few rounds a
    # lower momentum ends nearer DDP (docs/benchmarks.md, "The outer momentum at a few rounds")
    **{f"diloco-{key}": ("diloco", {"outer": outer}, note) for key, outer, note in (
        ("sgd", {"name": "sgd", "lr": 1.0, "momentum": 0.0}, "outer SGD lr 1.0, no momentum (the models averaged)"),
        ("sgd15", {"name": "sgd", "lr": 1.5, "momentum": 0.0}, "outer SGD lr 1.5, no momentum"),
        ("sgd2", {"name": "sgd", "lr": 2.0, "momentum": 0.0}, "outer SGD lr 2.0, no momentum"),
        ("lr1", {"name": "nesterov", "lr": 1.0, "momentum": 0.9}, "outer Nesterov lr 1.0, momentum 0.9"),
        ("m03", {"name": "nesterov", "lr": 0.7, "momentum": 0.3}, "outer Nesterov lr 0.7, momentum 0.3"),
        ("m05", {"name": "nesterov", "lr": 0.7, "momentum": 0.5}, "outer Nesterov lr 0.7, momentum 0.5"),
        ("m07", {"name": "nesterov", "lr": 0.7, "momentum": 0.7}, "outer Nesterov lr 0.7, momentum 0.7"),
        ("lr1-m05", {"name": "nesterov", "lr": 1.0, "momentum": 0.5}, "outer Nesterov lr 1.0, momentum 0.5"))},
    "async_diloco-overlap": ("async_diloco", {"overlap": True},
                             "overlap=True (each push sent while the inner steps go on, its reply merged once come)"),
}
# variants run by --rows only, not in the default table
OPT_IN = ("async_diloco-m05", "async_diloco-nolookahead", "async_diloco-overlap",
          *(row for row in VARIANTS if row.startswith("diloco-")))
# the modes that refuse the models' optimizer: eamsgd is EASGD whose workers train with Nesterov momentum SGD (it
# checks at fit), so it runs with that optimizer, paired with a DDP run of the same (NESTEROV_DDP)
NESTEROV_ONLY = ("eamsgd",)
NESTEROV_DDP = "ddp+nesterov"
NESTEROV_TEXT = {"cnn": "Nesterov SGD lr 0.05 momentum 0.9", "lm": "Nesterov SGD lr 0.05 momentum 0.9, not AdamW"}
# a launch is stopped where no run finishes in this long (the first's includes the processes' start-up)
STALL_S = {"full": 480, "quick": 180}


def all_rows(opt_in: bool = False) -> list[str]:
    """Every mode's name, in :data:`plug_asgd.modes.MODES`' order, each :data:`VARIANTS` row after its mode's.

    Args:
        opt_in: with the variants of :data:`OPT_IN` too (the rows ``--rows`` takes); else the default table's.
    """
    from plug_asgd.modes import MODES

    return [row for mode in MODES for row in (mode, *(v for v, spec in VARIANTS.items()
                                                      if spec[0] == mode and (opt_in or v not in OPT_IN)))]


def default_inner_steps() -> int:
    """DiLoCo's default ``inner_steps`` (its H), read from the mode itself."""
    from plug_asgd.modes import MODES

    return next(f.default for f in dataclasses.fields(MODES["diloco"]) if f.name == "inner_steps")


def inner_steps(steps: int, default: int, min_rounds: int = MIN_ROUNDS) -> int:
    """The ``inner_steps`` of a DiLoCo row of ``steps`` steps per worker: ``default`` where it makes at least
    ``min_rounds`` rounds; else the largest divisor of ``steps`` that does (no steps trained after the last round
    and left out of the central model), or ``steps // min_rounds`` where that divisor would be below half of it.

    Args:
        steps: the steps each worker trains.
        default: the mode's default ``inner_steps``.
        min_rounds: the fewest rounds wanted.

    Raises:
        ValueError: where ``steps`` is below ``min_rounds``.
    """
    if steps < min_rounds:
        raise ValueError(f"{steps} steps make fewer than {min_rounds} rounds whatever inner_steps")
    if steps // default >= min_rounds:
        return default
    most = steps // min_rounds
    best = max(h for h in range(1, most + 1) if steps % h == 0)
    return best if 2 * best >= most else most


def steps_per_worker(model: str, size: str) -> int:
    """The training steps each worker (and each DDP rank) takes: its share of the training samples, per batch."""
    return math.ceil(MODELS[model][size]["train_subset"] / WORKERS / BATCH)


def plan(models: list[str], seeds: list[int], rows: list[str], size: str = "full",
         forced_inner_steps: int | None = None) -> list[dict[str, Any]]:
    """The runs: per model and seed, DDP then every row, all with the model's settings and the seed.

    Args:
        models: keys of :data:`MODELS`.
        seeds: the seeds (the model's initialization, the training subset and its order).
        rows: mode names; DDP is always run, as the reference of each seed.
        size: ``"full"`` or ``"quick"``.
        forced_inner_steps: the DiLoCo rows' ``inner_steps`` whatever their rounds; None: :func:`inner_steps`.

    Raises:
        ValueError: an unknown model or row.
    """
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(rows) - set(all_rows(opt_in=True)))
    if unknown:
        raise ValueError(f"unknown model(s) or row(s) {unknown}: models {list(MODELS)}, rows {all_rows(opt_in=True)}")
    runs = []
    for model in models:
        steps = steps_per_worker(model, size)
        h = forced_inner_steps or inner_steps(steps, default_inner_steps())
        common = {**MODELS[model]["common"], **MODELS[model][size], "batch_size": BATCH, "epochs": 1,
                  "test": True, "bench": "learning", "steps_per_worker": steps}
        if model == "lm":  # ByteGPT takes AdamW as "adam" and the recipe's default rate
            common["lm"] = {**common["lm"], "optimizer": "adam", "lr": common["lr"]}
        for seed in seeds:
            runs.append({**common, "seed": seed, "row": "ddp", "kind": "ddp", "name": f"{model} ddp seed {seed}"})
            for row in rows:
                if row in NESTEROV_ONLY:
                    runs.append({**common, **nesterov(common, model), "seed": seed, "row": NESTEROV_DDP, "kind": "ddp",
                                 "name": f"{model} {NESTEROV_DDP} seed {seed}",
                                 "note": f"DDP with {NESTEROV_TEXT[model]}: the reference of {row}; gaps to ddp"})
                runs.append(_mode_run(common, model, row, seed, steps, h))
    return runs


def nesterov(common: dict[str, Any], model: str) -> dict[str, Any]:
    """The settings that give a model's runs Nesterov momentum SGD: the CNN at its rate and momentum, the language
    model at the recipe's SGD rate (0.05, momentum 0.9) with its own warmup and decay.

    Args:
        common: the model's settings, as the plan has them.
        model: a key of :data:`MODELS`.
    """
    if model != "lm":
        return {"optimizer": "nesterov"}
    sgd = {"optimizer": "nesterov", "lr": 0.05, "momentum": 0.9}
    return {**sgd, "lm": {**common["lm"], **sgd}}


def _mode_run(common: dict[str, Any], model: str, row: str, seed: int, steps: int, h: int) -> dict[str, Any]:
    """A mode's run: the model's settings, DiLoCo's ``inner_steps`` where not its default, and the Nesterov
    optimizer (paired with DDP of that optimizer) for a mode that refuses any other."""
    mode, knobs, note = VARIANTS.get(row, (row, {}, ""))
    run = {**common, "seed": seed, "row": row, "kind": "asgd", "mode": mode, "name": f"{model} {row} seed {seed}"}
    if knobs:
        run["options"], run["note"] = dict(knobs), note
    if mode in DILOCO:
        run["inner_steps"] = h
        rounds = f"{steps // h} rounds" if mode == "diloco" else f"about {steps // h} rounds per worker"
        run["note"] = "; ".join(n for n in (note, f"inner_steps {h} ({rounds})" + (
            "" if h == default_inner_steps() else f", not the default {default_inner_steps()}")) if n)
        if h != default_inner_steps():
            run["options"] = {**run.get("options", {}), "inner_steps": h}
    if mode in NESTEROV_ONLY:
        run.update(nesterov(common, model), reference=NESTEROV_DDP,
                   note=f"{NESTEROV_TEXT[model]}, which the mode requires; gaps to {NESTEROV_DDP}")
    return run


def _ok(run: dict[str, Any]) -> bool:
    return not run.get("diverged") and not run.get("failed") and all(
        isinstance(run.get(k), (int, float)) and math.isfinite(run[k]) for k in ("test_loss", "test_acc"))


def _why(run: dict[str, Any]) -> str:
    return "diverged" if run.get("diverged") or isinstance(run.get("test_loss"), float) else "failed"


def _spread(values: list[float], digits: int) -> dict[str, Any]:
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": round(statistics.mean(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def table(results: list[dict[str, Any]], model: str) -> list[dict[str, Any]]:
    """One row per mode (DDP first) of ``model``'s runs: loss and accuracy over the seeds that finished, and
    their gaps to DDP paired by seed (accuracy minus DDP's, in points; loss over DDP's), each as its mean, min and
    max; the seeds that diverged or failed, by name.

    Args:
        results: the runs' results (``row``, ``model``, ``seed``, ``test_loss``, ``test_acc``, ``diverged``,
            ``failed``).
        model: the model whose runs are tabled.
    """
    mine = [r for r in results if r.get("model", "cnn") == model]
    ddp = {(r["row"], r["seed"]): r for r in mine if r["row"] in ("ddp", NESTEROV_DDP) and _ok(r)}
    order = ["ddp", *[n for m in all_rows(opt_in=True) for n in ((NESTEROV_DDP, m) if m in NESTEROV_ONLY else (m,))]]
    out = []
    for row in sorted(dict.fromkeys(r["row"] for r in mine), key=lambda n: order.index(n) if n in order else 99):
        runs = sorted((r for r in mine if r["row"] == row), key=lambda r: r["seed"])
        ok = [r for r in runs if _ok(r)]
        ref = runs[0].get("reference", None if row == "ddp" else "ddp")
        paired = [(r, ddp[ref, r["seed"]]) for r in ok if (ref, r["seed"]) in ddp]
        out.append({"row": row, "reference": ref, "seeds": [r["seed"] for r in runs],
                    "finished": [r["seed"] for r in ok],
                    "lost": {str(r["seed"]): _why(r) for r in runs if not _ok(r)},
                    "loss": _spread([r["test_loss"] for r in ok], 4), "acc": _spread([r["test_acc"] for r in ok], 4),
                    "loss_ratio": _spread([r["test_loss"] / d["test_loss"] for r, d in paired], 3),
                    "acc_points": _spread([100 * (r["test_acc"] - d["test_acc"]) for r, d in paired], 2),
                    "note": next((r["note"] for r in runs if r.get("note")), "")})
    return out


def _cell(spread: dict[str, Any], fmt: str, sign: str = "") -> str:
    if spread["mean"] is None:
        return "-"
    text = format(spread["mean"], sign + fmt)
    if spread["min"] != spread["max"]:
        text += f" ({format(spread['min'], sign + fmt)}..{format(spread['max'], sign + fmt)})"
    return text


def markdown_rows(rows: list[dict[str, Any]]) -> list[str]:
    """A model's table in Markdown: a row per mode, ``-`` where no seed finished, the lost seeds named."""
    lines = ["| row | loss | loss / DDP | accuracy | points from DDP | seeds | notes |", "|---" * 7 + "|"]
    for r in rows:
        lost = ", ".join(f"seed {s} {why}" for s, why in r["lost"].items())
        if not r["finished"]:
            lost = "all " + ("diverged" if set(r["lost"].values()) == {"diverged"} else "failed or diverged") + \
                   f" ({lost})"
        notes = "; ".join(n for n in (r["note"], lost) if n)
        ratio = "1 (reference)" if r["row"] == "ddp" else _cell(r["loss_ratio"], ".3f")
        points = "0 (reference)" if r["row"] == "ddp" else _cell(r["acc_points"], ".2f", "+")
        lines.append(f"| {r['row']} | {_cell(r['loss'], '.4f')} | {ratio} | {_cell(r['acc'], '.4f')} | {points} "
                     f"| {len(r['finished'])}/{len(r['seeds'])} | {notes} |")
    return lines


def describe(model: str, size: str) -> str:
    """The sentence that states a model's settings in the table's text."""
    sizes = MODELS[model][size]
    test = sizes["test_subset"]
    if model == "cnn":
        test = f"{test:,} test images" if test else "the whole test set (10,000 images)"
    return MODELS[model]["describe"].format(train_subset=f"{sizes['train_subset']:,}", test=test,
                                            steps=steps_per_worker(model, size),
                                            warmup=sizes.get("lm", {}).get("warmup_steps"))


def markdown(report: dict[str, Any]) -> str:
    """``learning.md``: the command, the machine, and per model its settings and its table."""
    m = report["machine"]
    seeds = ("seeds " if len(report["seeds"]) > 1 else "seed ") + ", ".join(map(str, report["seeds"]))
    lines = ["# Every mode against DDP: final loss and accuracy of the central model", "",
             f"`{report['command']}` ({report['wall_s']:.0f} s) on {m['cpu_count']} cores ({m['cpu_model']}), "
             f"torch {m['torch']}, commit {m['commit']}, {m['date']}.", "",
             f"{WORKERS} workers, every mode at its defaults (a row named after its mode and a knob, such as "
             f"{next(iter(VARIANTS))}: at the knobs its note gives), DDP (gloo) the reference: the same optimizer, "
             f"rate, batch, samples and seed. Values are means over {seeds} with "
             "(min..max) where they differ; the gaps are paired by seed (a row's accuracy minus DDP's of the same "
             "seed, in points; its loss over DDP's). The model tested is the PS's central model (DDP: rank 0's).", ""]
    for model, rows in report["tables"].items():
        lines += [f"## {model}", "", describe(model, report["size"]) + ".", ""]
        if any("not the default" in r["note"] for r in rows):
            lines += [f"The DiLoCo rows do **not** run at their default inner_steps ({default_inner_steps()}): at "
                      f"{steps_per_worker(model, report['size'])} steps per worker the default would make fewer than "
                      f"{MIN_ROUNDS} rounds; their notes give the inner_steps run.", ""]
        if any(r["reference"] == NESTEROV_DDP for r in rows):
            lines += [f"{', '.join(NESTEROV_ONLY)} refuses any optimizer but Nesterov momentum SGD: it runs with "
                      f"{NESTEROV_TEXT[model]}, and its gaps are to DDP with that optimizer ({NESTEROV_DDP}, whose "
                      "own gaps are to ddp).", ""]
        lines += [*markdown_rows(rows), ""]
    for e in report["errors"]:
        lines.append(f"- error: {e}")
    return "\n".join(lines) + "\n"


def run_launch(model: str, seed: int, runs: list[dict[str, Any]], size: str, work: Path) -> tuple[list, list]:
    """``runs`` in launches of ``bench.train``: after a launch stops at a run (a crash, a hang), that run is
    recorded as failed and a new launch runs the ones after it. Returns the results and the errors."""
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    left = list(runs)
    while left:
        t = time.monotonic()
        done, why = train(WORKERS, left, work, f"_learning_{model}_s{seed}_{len(runs) - len(left)}", test_subset=None,
                          timeout=None, stall_s=STALL_S[size])
        print(f"[bench.learning] {model} seed {seed}: {len(done)} of {len(left)} runs in "
              f"{time.monotonic() - t:.0f} s" + (f"; {why}" if why else ""), flush=True)
        results += [{k: v for k, v in r.items() if k != "ranks"} for r in done]
        if why is None:
            break
        stopped = left[len(done)]
        errors.append(f"{stopped['name']}: {why}")
        results.append({**stopped, "failed": True, "test_loss": None, "test_acc": None})
        left = left[len(done) + 1:]
    return results, errors


def main(argv: list[str] | None = None) -> int:
    """``python -m bench learning``: run the plan, write ``learning.json`` and ``learning.md``.

    Args:
        argv: the flags, without the program's name; None: ``sys.argv``'s.

    Returns:
        0, or 1 where a run failed (its row says so).
    """
    parser = argparse.ArgumentParser(prog="python -m bench learning", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--quick: 0)")
    parser.add_argument("--models", default="cnn,lm", help="comma-separated: cnn, lm (default: both)")
    parser.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                        help="these rows only: modes, or " + ", ".join(VARIANTS) + " (default: every mode and "
                             "those but " + ", ".join(OPT_IN) + "; --quick: " + " ".join(QUICK_ROWS) + ")")
    parser.add_argument("--inner-steps", type=int, default=None,
                        help="the DiLoCo rows' inner_steps on every model (default: the mode's, or lower where it "
                             f"makes fewer than {MIN_ROUNDS} rounds)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 3 rows, tiny sizes: the test's")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/learning (--quick: runs/bench-learning-quick)")
    args = parser.parse_args(argv)
    size = "quick" if args.quick else "full"
    seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    models = [m for m in args.models.split(",") if m]
    rows = args.rows or (list(QUICK_ROWS) if args.quick else all_rows())
    try:
        runs = plan(models, seeds, rows, size, args.inner_steps)
    except ValueError as exc:
        parser.error(str(exc))
    if "cnn" in models and not (FASHION / "train-images-idx3-ubyte.gz").exists():
        parser.error(f"needs Fashion-MNIST in {FASHION}: apt-get install dataset-fashion-mnist")
    out = args.out or (ROOT / "runs" / "bench-learning-quick" if args.quick else ROOT / "bench/results/learning")
    command = "python -m bench learning " + " ".join(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    results, errors = [], []
    for model in models:
        for seed in seeds:
            got, lost = run_launch(model, seed, [r for r in runs if r["model"] == model and r["seed"] == seed],
                                   size, out / "work")
            results += got
            errors += lost
            for r in got:
                print(f"[bench.learning] {r['name']}: loss {r.get('test_loss')}, acc {r.get('test_acc')}, "
                      f"fit {r.get('fit_s')} s", flush=True)
    report = {"command": command.strip(), "machine": machine(), "size": size, "seeds": seeds, "workers": WORKERS,
              "sizes": {m: {**MODELS[m][size], "steps_per_worker": steps_per_worker(m, size),
                            "settings": describe(m, size)} for m in models},
              "wall_s": round(time.monotonic() - started, 1),
              "tables": {m: table(results, m) for m in models}, "errors": errors, "runs": results}
    return write_report(out, "learning", report, markdown(report), errors, "bench.learning")


if __name__ == "__main__":
    raise SystemExit(main())
