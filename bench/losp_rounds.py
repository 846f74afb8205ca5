"""losp's round in flight with momentum SGD: what a worker keeps of the progress made meanwhile.

    PYTHONPATH=. python -m bench.losp_rounds                 # the simulated table of docs/momentum.md
    PYTHONPATH=. python -m bench.losp_rounds --fashion DIR   # losp on Fashion-MNIST, remedy on and off, and DDP

The simulation runs N workers in lockstep in this process on the regression case of
``tests/scripts/momentum_regression.py`` (the same model, data and ``SGD(lr=0.05, momentum=0.9)``,
each worker on its own part of the data as Lightning's sampler splits it, 3 epochs), with the
round's average applied a round late as losp's PS and exchange do, and prints the central model's
validation loss for each variant of what a worker keeps (``docs/momentum.md``, "losp: a round in
flight"). ``--fashion`` launches the real strategy (bench.runner: 2 Lightning workers, the embedded PS).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import ROOT

sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from momentum_regression import EPOCHS, SAMPLES, Regression, dataset, val_loss  # noqa: E402

# (kept share of the progress made while the round was in flight, scale of what is sent): None = 1/N
VARIANTS: dict[str, tuple[float | None, float]] = {
    "as written (w = central + p)": (1.0, 1.0),
    "own share, sent whole": (None, 1.0),
    "own share, sent at 1/2 (the default)": (None, 0.5),
    "whole, sent at 1/2": (1.0, 0.5),
}
COLUMNS: dict[str, dict[str, Any]] = {
    "2 workers, lr 0.05": {}, "4 workers": {"workers": 4}, "Nesterov": {"nesterov": True},
    "lr 0.01": {"lr": 0.01}, "momentum 0": {"momentum": 0.0}, "push_every 8": {"push_every": 8},
    "osp (1 step), 4 workers": {"push_every": 1, "workers": 4},
}


def simulate(variant: str, *, workers: int = 2, push_every: int = 4, lr: float = 0.05, momentum: float = 0.9,
             nesterov: bool = False, seed: int = 0) -> float:
    """The central model's validation loss after the fit; ``variant`` "localsgd": blocking rounds instead."""
    torch.manual_seed(seed)
    model = Regression()
    x, y = dataset(0, SAMPLES).tensors
    models = [copy.deepcopy(model) for _ in range(workers)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum, nesterov=nesterov) for m in models]
    central = [p.detach().clone() for p in model.parameters()]
    since = [[p.detach().clone() for p in m.parameters()] for m in models]  # the weights at the last round
    share, scale = (1.0, 1.0) if variant == "localsgd" else VARIANTS[variant]
    share = 1.0 / workers if share is None else share
    in_flight: list[torch.Tensor] | None = None
    part = SAMPLES // workers
    g = torch.Generator().manual_seed(seed)
    step = 0
    for _ in range(EPOCHS):
        orders = [torch.randperm(part, generator=g) + i * part for i in range(workers)]
        for s in range(part // 32):
            for i, (m, opt) in enumerate(zip(models, opts, strict=True)):
                batch = orders[i][s * 32:(s + 1) * 32]
                opt.zero_grad()
                F.mse_loss(m.net(x[batch]), y[batch]).backward()
                opt.step()
            step += 1
            if step % push_every:
                continue
            params = [list(m.parameters()) for m in models]
            if variant == "localsgd":  # the round's average, at once
                central = [sum(ps).detach() / workers for ps in zip(*params, strict=True)]
                for ps in params:
                    for p, c in zip(ps, central, strict=True):
                        p.data.copy_(c)
                continue
            progress = [[p.detach() - b for p, b in zip(ps, bs, strict=True)] for ps, bs in zip(params, since,
                                                                                                 strict=True)]
            if in_flight is not None:  # the last round lands; each worker keeps its share of the progress since
                central = [c + u for c, u in zip(central, in_flight, strict=True)]
            for ps, prog, bs in zip(params, progress, since, strict=True):
                for k, (p, c, d) in enumerate(zip(ps, central, prog, strict=True)):
                    p.data.copy_(c + share * d)
                    bs[k] = p.detach().clone()
            in_flight = [scale * sum(ds) / workers for ds in zip(*progress, strict=True)]  # this round, sent
    if in_flight is not None:
        central = [c + u for c, u in zip(central, in_flight, strict=True)]
    for p, c in zip(model.parameters(), central, strict=True):
        p.data.copy_(c)
    return val_loss(model)


def fashion(out: Path, train_subset: int) -> list[dict[str, Any]]:
    """losp with its remedy (on) and without (off), and DDP, SGD lr 0.05 momentum 0.9: seeds 0 to 2 (Nesterov
    for seed 0), one epoch, 5,000 test images."""
    from bench.runner import launch

    common = {"bench": "losp_rounds", "batch_size": 32, "train_subset": train_subset, "epochs": 1, "test": True,
              "momentum": 0.9, "lr": 0.05}
    runs = []
    for seed in (0, 1, 2):
        for optimizer in ("sgd", "nesterov") if seed == 0 else ("sgd",):
            o = {**common, "optimizer": optimizer, "seed": seed}
            runs += [{**o, "kind": "ddp", "name": f"ddp {optimizer} {seed}"},
                     {**o, "kind": "asgd", "mode": "losp", "name": f"losp on {optimizer} {seed}"},
                     {**o, "kind": "asgd", "mode": "losp", "options": {"staleness_compensation": False},
                      "name": f"losp off {optimizer} {seed}"}]
    return launch(2, runs, {"test_subset": 5000, "timeout": 900}, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=4, help="simulated fits per cell (seeds 0 to N - 1)")
    parser.add_argument("--fashion", type=Path, default=None, metavar="DIR",
                        help="launch losp on Fashion-MNIST instead, its files in DIR")
    parser.add_argument("--train-subset", type=int, default=8000, help="--fashion's training images")
    args = parser.parse_args(argv)
    if args.fashion is not None:
        args.fashion.mkdir(parents=True, exist_ok=True)
        for r in fashion(args.fashion, args.train_subset):
            print(json.dumps({k: r.get(k) for k in ("name", "test_acc", "launch_error") if k in r}))
        return 0
    print("| variant | " + " | ".join(COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for variant in ("localsgd", *VARIANTS):
        cells = []
        for settings in COLUMNS.values():
            losses = [simulate(variant, seed=s, **settings) for s in range(args.seeds)]
            cells.append(f"{min(losses):.3g} to {max(losses):.3g}")
        print(f"| {variant} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
