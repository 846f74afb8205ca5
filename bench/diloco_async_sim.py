"""async_diloco's outer update on the language model, simulated in one process: where its central model swings.

``python -m bench async_sim [--seeds 3] [--inner-steps 100] [--steps 600] [--slow-factor 2] [--configs ...]
[--jobs N] [--out DIR] [--quick]``. ``bench diloco`` measures async_diloco on emulated hosts, where its central
model rises and falls between arrivals; this benchmark takes the hosts, the network and the timing away to find out
why. Two workers train ``bench diloco``'s ByteGPT on the fortunes corpus (AdamW at 1e-3, a warmup of 5 steps, then
constant; batch 32 windows; each its own half of the training windows), worker 1 ``--slow-factor`` times slower on a
simulated clock. Under ``async_diloco`` worker 1 makes ``inner_steps / slow_factor`` inner steps a round (the
dynamic local steps' aim: both arrive as often), and each arrival is folded by the library's own
:class:`~plug_asgd.modes.diloco_async.AsyncDiLoCoRule`; the worker then starts its next round from the central model
after its own arrival, as a PS's reply gives it (the ``lookahead`` configurations: that model less the momentum
step the delayed Nesterov's cycle under way is expected to take before the worker's next arrival, ``lr * mu * (mu
* b + mean)`` with the cycle's arrivals so far for its mean, as the base the worker trains and measures its
pseudo-gradient from: the rule's :meth:`~plug_asgd.modes.diloco_async.AsyncDiLoCoRule.ahead`, which the library's
replies carry under ``AsyncDiLoCo(momentum_lookahead=True)``, its default; the ``async`` configurations reply with
the central model itself, as ``momentum_lookahead=False`` does; ``extrapolate``, a guess the worker could make
alone: that model plus ``mu`` times its move since the worker's previous reply). ``diloco`` is the synchronous
reference: both make ``inner_steps`` steps from the same model, the round's mean pseudo-gradient stepped by the
library's :class:`~plug_asgd.modes.outer.OuterOptimizer`, a round lasting the slow worker's time. The central model
is evaluated on the same held-out windows after each arrival (each round). Reported per configuration and seed: the
final loss, the simulated time to the synchronous run's final loss of the same seed (over the synchronous run's
time), and the largest rise of the loss from one evaluation to the next (the swing).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine

BATCH = 32
LR, WARMUP, VAL_WINDOWS = 1e-3, 5, 512
# name: (kind, outer optimizer); "diloco" first: every other row is read against it. The default run leaves out
# "diloco sgd lr 0.7" (synchronous diloco without momentum: --configs "diloco,diloco sgd lr 0.7")
DEFAULT_CONFIGS = ("diloco", "async_diloco", "async nesterov m 0.5", "async sgd lr 0.7", "async sgd lr 1.0")
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "diloco": ("sync", {"name": "nesterov", "lr": 0.7, "momentum": 0.9}),
    "diloco sgd lr 0.7": ("sync", {"name": "sgd", "lr": 0.7, "momentum": 0.0}),
    "async_diloco": ("async", {"name": "nesterov", "lr": 0.7, "momentum": 0.9}),
    "async nesterov m 0.5": ("async", {"name": "nesterov", "lr": 0.7, "momentum": 0.5}),
    "async nesterov m 0.7": ("async", {"name": "nesterov", "lr": 0.7, "momentum": 0.7}),
    "async nesterov lr 1.0 m 0.5": ("async", {"name": "nesterov", "lr": 1.0, "momentum": 0.5}),
    "async sgd lr 0.7": ("async", {"name": "sgd", "lr": 0.7, "momentum": 0.0}),
    "async sgd lr 1.0": ("async", {"name": "sgd", "lr": 1.0, "momentum": 0.0}),
    # a reply that looks ahead, as the library's momentum lookahead (see simulate)
    "async lookahead": ("lookahead", {"name": "nesterov", "lr": 0.7, "momentum": 0.9}),
    "async lookahead m 0.5": ("lookahead", {"name": "nesterov", "lr": 0.7, "momentum": 0.5}),
    "async extrapolate": ("extrapolate", {"name": "nesterov", "lr": 0.7, "momentum": 0.9}),
}


class Worker:
    """One simulated worker: its model, its AdamW (kept across rounds, as DiLoCo's inner optimizer), its windows."""

    def __init__(self, model: Any, windows: list[int], seed: int, speed: float, steps: int) -> None:
        import torch

        self.model = copy.deepcopy(model)
        self.optimizer = self.model.configure_optimizers()["optimizer"]  # the recipe's AdamW and its groups
        self.windows, self.speed, self.steps, self.step = windows, speed, steps, 0
        self.generator = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def train(self, dataset: Any, steps: int) -> None:
        """``steps`` inner steps of AdamW at the recipe's rate after its warmup."""
        import torch
        import torch.nn.functional as F

        for _ in range(steps):
            if len(self.order) < BATCH:
                self.order += torch.randperm(len(self.windows), generator=self.generator).tolist()
            picked, self.order = self.order[:BATCH], self.order[BATCH:]
            x, y = (torch.stack(t) for t in zip(*(dataset[self.windows[i]] for i in picked), strict=True))
            for group in self.optimizer.param_groups:
                group["lr"] = LR * min(1.0, (self.step + 1) / WARMUP)
            loss = F.cross_entropy(self.model(x), y)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            self.step += 1


def simulate(config: str, seed: int, size: dict[str, Any]) -> dict[str, Any]:
    """One configuration and seed: the central model's loss after each arrival (or round), on the simulated clock
    (one fast step = 1)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from bench.diloco import MODEL
    from plug_asgd.modes.diloco_async import AsyncDiLoCoRule
    from plug_asgd.modes.outer import OuterOptimizer
    from plug_asgd.recipes.lm import ByteGPT
    from plug_asgd.recipes.lm_data import FortunesDataModule

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    kind, outer_spec = CONFIGS[config]
    outer = OuterOptimizer.get(outer_spec)
    h, steps, slow = size["inner_steps"], size["steps"], size["slow_factor"]
    data = FortunesDataModule(context=MODEL["max_context"], batch_size=BATCH, train_windows=steps * 2 * BATCH,
                              val_windows=size["val_windows"], seed=seed)
    data.setup()
    central = ByteGPT(**{**MODEL, "warmup_steps": WARMUP})
    names = [n for n, _ in central.named_parameters()]
    vx, vy = (torch.stack(t) for t in zip(*(data.val_set[i] for i in range(len(data.val_set))), strict=True))

    def weights(model: Any) -> dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}

    def load(model: Any, w: dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(torch.from_numpy(w[n]))

    def loss(w: dict[str, np.ndarray]) -> float:
        load(central, w)
        with torch.no_grad():
            return float(F.cross_entropy(central(vx), vy))

    w = weights(central)
    workers = [Worker(central, list(range(r, len(data.train_set), 2)), seed * 10 + r, (1.0, slow)[r], steps)
               for r in range(2)]
    curve = [(0.0, loss(w))]
    if kind == "sync":
        slots: dict[str, dict[str, np.ndarray]] = {n: {} for n in names}
        for t in range(1, steps // h + 1):
            ends = []
            for worker in workers:
                load(worker.model, w)
                worker.train(data.train_set, h)
                ends.append(weights(worker.model))
            for n in names:  # the round's mean pseudo-gradient, w_base - w, stepped by the outer optimizer
                outer.step(t, w[n], w[n] - (ends[0][n] + ends[1][n]) / 2, slots[n])
            curve.append((t * h * slow, loss(w)))
        return {"config": config, "seed": seed, "curve": curve}
    rule = AsyncDiLoCoRule(outer)
    rule.training_ranks = frozenset({0, 1})
    state = type("State", (), {"tensors": w, "version": 0})()
    rounds = [h, max(1, round(h / slow))]  # the dynamic local steps' aim: both arrive about as often
    bases = [{n: a.copy() for n, a in w.items()} for _ in workers]
    replies: list[dict[str, np.ndarray] | None] = [None, None]  # "extrapolate": each worker's last reply
    arrive = [rounds[r] * workers[r].speed for r in range(2)]
    while min(worker.step for worker in workers) < steps:
        r = min(range(2), key=lambda i: (arrive[i], i))
        load(workers[r].model, bases[r])
        workers[r].train(data.train_set, rounds[r])
        end = weights(workers[r].model)
        push = type("Push", (), {"update": {n: end[n] - bases[r][n] for n in names}, "token": (r, arrive[r])})()
        rule.push(state, push)
        bases[r] = {n: a.copy() for n, a in w.items()}  # the reply: the central model after this arrival
        if kind == "lookahead":  # ... less the momentum step the cycle under way will take before r's next arrival
            for n, step in rule.ahead().items():
                bases[r][n] -= step
        elif kind == "extrapolate":  # ... moved on by momentum x its move since r's last reply (the worker's guess)
            last, replies[r] = replies[r], {n: a.copy() for n, a in w.items()}
            if last is not None:
                for n in names:
                    bases[r][n] += np.float32(outer.momentum) * (w[n] - last[n])
        curve.append((arrive[r], loss(w)))
        arrive[r] += rounds[r] * workers[r].speed
    return {"config": config, "seed": seed, "curve": curve}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: the final loss, the time to the same seed's synchronous final loss over the synchronous
    run's time (None where it never got there), and the swing, each as its median and per seed."""
    reference = {r["seed"]: r["curve"][-1] for r in runs if r["config"] == "diloco"}
    rows = []
    for config in CONFIGS:
        mine = sorted((r for r in runs if r["config"] == config), key=lambda r: r["seed"])
        if not mine:
            continue
        finals, times, swings = [], [], []
        for r in mine:
            t_ref, target = reference[r["seed"]]
            curve = r["curve"]
            finals.append(curve[-1][1])
            reached = next((t for t, v in curve if v <= target), None)
            times.append(None if reached is None else reached / t_ref)
            swings.append(max(b[1] - a[1] for a, b in zip(curve[1:], curve[2:], strict=False)))
        rows.append({"config": config, "outer": CONFIGS[config][1], "final_loss": finals,
                     "time_to_diloco_final": times, "swing": swings,
                     "final_loss_median": statistics.median(finals), "swing_median": statistics.median(swings)})
    return rows


def markdown(rows: list[dict[str, Any]], command: str, size: dict[str, Any]) -> str:
    """The table of :func:`summarize`'s rows."""
    def cells(values: list[float | None], fmt: str) -> str:
        return ", ".join("never" if v is None else format(v, fmt) for v in values)

    lines = [f"`{command}`: 2 workers, H = {size['inner_steps']}, {size['steps']} steps each, worker 1 "
             f"{size['slow_factor']:g}x slower (simulated clock); per seed.", "",
             "| configuration | outer optimizer | final loss | time to diloco's final loss (x diloco's) | "
             "largest rise between evaluations |", "|---|---|---|---|---|"]
    for row in rows:
        outer = row["outer"]
        lines.append(f"| {row['config']} | {outer['name']} lr {outer['lr']:g} momentum {outer['momentum']:g} | "
                     f"{cells(row['final_loss'], '.3f')} | {cells(row['time_to_diloco_final'], '.2f')} | "
                     f"{cells(row['swing'], '+.3f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m bench async_sim``: simulate, write ``async_sim.json`` and ``async_sim.md`` into ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m bench async_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 (default 3)")
    parser.add_argument("--inner-steps", type=int, default=100, help="H, a fast worker's inner steps (default 100)")
    parser.add_argument("--steps", type=int, default=600, help="inner steps per worker in all (default 600)")
    parser.add_argument("--slow-factor", type=float, default=2.0, help="worker 1's slowness (default 2)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help="comma-separated, among: " + ", ".join(CONFIGS))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="simulations side by side (1: in this process)")
    parser.add_argument("--quick", action="store_true", help="H = 5, 20 steps, 1 seed, 64 windows: a check")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results/diloco/async_sim)")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or "diloco" not in configs:
        parser.error(f"configurations are among {', '.join(CONFIGS)}, diloco among them; got {args.configs}")
    if not args.inner_steps >= 1 or not args.steps >= args.inner_steps or not args.slow_factor >= 1:
        parser.error("needs --inner-steps >= 1, --steps >= --inner-steps and --slow-factor >= 1")
    size = {"inner_steps": 5, "steps": 20, "slow_factor": args.slow_factor, "val_windows": 64} if args.quick else {
        "inner_steps": args.inner_steps, "steps": args.steps, "slow_factor": args.slow_factor,
        "val_windows": VAL_WINDOWS}
    seeds = range(1 if args.quick else args.seeds)
    jobs = [(c, s) for s in seeds for c in configs]
    if args.jobs <= 1:  # in this process
        runs = [simulate(config, seed, size) for config, seed in jobs]
    else:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            runs = list(pool.map(simulate, *zip(*jobs, strict=True), [size] * len(jobs)))
    rows = summarize(runs)
    command = "python -m bench async_sim " + " ".join(sys.argv[1:] if argv is None else argv)
    out = args.out or ROOT / "bench/results/diloco/async_sim"
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_sim.json").write_text(json.dumps({"machine": machine(), "command": command, "size": size,
                                                    "rows": rows, "runs": runs}, indent=1))
    text = markdown(rows, command.strip(), size)
    (out / "async_sim.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
