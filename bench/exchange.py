"""The exchange's cost per step at a real model's size, on the CPU: every mode and codec against plain Lightning.

    PYTHONPATH=. python -m bench exchange [--quick] [--rounds N] [--steps N] [--configs a,b,...] [--out FILE]
        [--torch-threads N]
    PYTHONPATH=. python -m bench exchange --pieces CONFIG [--steps N] [--quick]

One worker, one process (the embedded PS in its own), a model of four square ``nn.Linear`` layers with
biases (11.2M parameters at full size, ``--quick`` 1.05M) and almost no compute (batch 2), momentum SGD at
lr 0.05: what is left of a step is the memory traffic of the parameters, which the exchange adds to.
Each configuration's milliseconds per step over plain Lightning's, in the same round
(:mod:`bench.step_timing`); the median over the rounds, and the spread. Targets: asgd at most 1.10, the
others at most 1.30.

Two floors, run in the same rounds (``--configs`` names them too, ``floor-copy`` and ``floor-read``): plain
Lightning with, after each optimizer step, the least an exchange must do to the weights. ``floor-copy`` copies
them into buffers kept across steps, as a dense push of weights does into its lent buffers before the PS may
take them (the PS's own check and the round trip come on top); ``floor-read`` reads them beside a copy of the
model kept from the start, as the sparse codecs' selection reads ``w`` and ``c`` in one pass (the C pass itself,
``plug_asgd.compressors.native.above``, finding nothing above an infinite threshold, split over every core). A
target below its floor's ratio cannot be met by any placement of the work on that machine.

``asgd-staged`` (named in ``--configs``): asgd with the worker's tensors staged as a GPU's are
(:mod:`plug_asgd.worker.staging`, its seams driving that path on CPU tensors): each push copied into the PS's
memory, where a GPU's device-to-host copy lands. The host's side of a GPU worker's dense push, measured where no
GPU is; no target of its own.

``--pieces CONFIG``: where a step's time goes, one fit of plain Lightning and one of CONFIG (150 steps; ``--quick``:
the smaller model): the
median milliseconds of the step, of the forward and backward (from the batch's start to the optimizer's hook,
the wait for the push in flight included), and of the library's pieces, timed by wrapping its methods: the
encoding (``HeldBase.encode``), the push's round trip (``PSClient.push``) and the wait for the PS's answer in it
(``Transport._poll``), the reply taken on the training thread (``PushExchange.settle_held``), the momentum
masked (``PushExchange.mask_update``) and the held model added to (``HeldModel.add``), on the push's thread where
the update is sparse and the residual in the model (docs/design.md, "The push beside the next step").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from bench.step_timing import SquareLinears, fit_steps, quiet, rounds, strategies
from harness.ports import free_port_block
from plug_asgd import AsyncPSStrategy
from plug_asgd.compressors import native
from plug_asgd.worker.staging import Staging

WIDTH = {"full": 1673, "quick": 512}  # 4 * (w * w + w): 11,202,408 and 1,050,624 parameters
TARGETS = {"plain": None, "asgd": 1.10, "floor-copy": None, "floor-read": None, "asgd-staged": None}
OTHER_TARGET = 1.30
BATCH = 2
BATCHES = 2000  # the epoch each fit is stopped in: long enough that randomk's default fraction is 1%
# steps left untimed: past the worker's thread tuner's decision (worker/thread_tuner.py: 10 + 30, 3 + 30 steps), so
# that a codec's fit is timed at the threads it keeps; --quick's fits end before the tuner switches
WARMUP = {"full": 80, "quick": 10}


class Floor(pl.Callback):
    """After each optimizer step, the least an exchange does to the weights: copied into kept buffers (``copy``, by
    torch's threads), or read beside a copy of the model kept from the first step (``read``, one C pass over both,
    split over a thread per core; the C loop lets go of the interpreter's lock)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.kept: list[torch.Tensor] = []
        self.threads = os.cpu_count() or 1
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="floor") if kind == "read" else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        weights = [p.detach() for p in pl_module.parameters()]
        if not self.kept:
            self.kept = [w.clone() for w in weights]
        if self.kind == "copy":
            for kept, w in zip(self.kept, weights, strict=True):
                kept.copy_(w)
            return
        parts = []  # each tensor cut in as many parts as there are cores: the pass has every core
        for kept, w in zip(self.kept, weights, strict=True):
            bounds = np.linspace(0, w.numel(), self.threads + 1).astype(int)
            flat_w, flat_kept = w.numpy().reshape(-1), kept.numpy().reshape(-1)
            parts += [(flat_w[a:b], flat_kept[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
        assert self.pool is not None
        if any(found is None for found in self.pool.map(lambda part: native.above(
                np.inf, *part, None, 1.0, native.DIFFERENCE, 0), parts)):
            raise RuntimeError("the C loops are not available (no compiler, or PLUG_ASGD_NATIVE=0)")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.pool is not None:
            self.pool.shutdown()


FLOORS = ("floor-copy", "floor-read")


def staged_asgd() -> AsyncPSStrategy:
    """asgd whose worker stages its CPU tensors as a GPU worker does its CUDA ones (``asgd-staged``)."""
    done = SimpleNamespace(synchronize=lambda: None)  # a CPU copy is over when copy_ returns
    strategy = AsyncPSStrategy(mode="asgd")
    strategy._exchange.staging = Staging(staged=lambda device: True, pin=False, mark=lambda device: done)
    return strategy


def regression_data(width: int) -> TensorDataset:
    """The fits' data, seeded: ``BATCHES`` batches of ``BATCH`` inputs of ``width`` and their targets."""
    torch.manual_seed(0)
    return TensorDataset(torch.randn(BATCHES * BATCH, width), torch.randn(BATCHES * BATCH, width) * 0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 1.05M-parameter model, 2 rounds of 20 steps")
    parser.add_argument("--rounds", type=int, help="rounds of every configuration (default 5; quick 2)")
    parser.add_argument("--steps", type=int, help="steps timed per fit (default 60; quick 20)")
    parser.add_argument("--configs", help="comma-separated configurations (plain is always run): "
                                          + ", ".join([*strategies(), *FLOORS, "asgd-staged"]))
    parser.add_argument("--out", type=Path, help="where to write the results as JSON")
    parser.add_argument("--pieces", metavar="CONFIG", help="time the pieces of one configuration's steps instead")
    parser.add_argument("--torch-threads", type=int, metavar="N",
                        help="torch's threads in the strategies' fits, as OMP_NUM_THREADS=N sets them for a worker "
                             "(plain Lightning keeps torch's default: every core)")
    args = parser.parse_args(argv)
    size = "quick" if args.quick else "full"
    if args.pieces is not None:
        if args.pieces not in strategies():
            parser.error(f"unknown configuration {args.pieces}; choose from {', '.join(strategies())}")
        return pieces(args.pieces, args.steps or 150, WIDTH[size], WARMUP[size])
    count = args.rounds or (2 if args.quick else 5)
    steps = args.steps or (20 if args.quick else 60)
    configs = {**strategies(), **{name: (lambda name=name: name) for name in FLOORS}}
    extra = {"asgd-staged": staged_asgd}  # run where named
    if args.configs:
        wanted = ["plain", *[c for c in args.configs.split(",") if c and c != "plain"]]
        unknown = [c for c in wanted if c not in configs and c not in extra]
        if unknown:
            parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join([*configs, *extra])}")
        configs = {c: configs.get(c) or extra[c] for c in wanted}
    quiet()
    # the fits' embedded PS listens on Lightning's main port: one nothing else holds
    os.environ.setdefault("MASTER_PORT", str(free_port_block(4)))
    width = WIDTH[size]
    data = regression_data(width)
    loader = DataLoader(data, batch_size=BATCH)

    every_core = torch.get_num_threads()
    if args.torch_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # what the strategy then leaves as it is

    def fit(strategy: object) -> tuple[float, dict[str, object]]:
        if args.torch_threads:
            torch.set_num_threads(every_core if strategy is None or isinstance(strategy, str) else args.torch_threads)
        torch.manual_seed(0)
        floor = [Floor(strategy.split("-")[1])] if strategy in FLOORS else []  # before the step's clock
        return fit_steps(lambda: SquareLinears(width), loader, "auto" if floor else strategy, steps,
                         warmup=WARMUP[size], trainer_kwargs={"accelerator": "cpu", "devices": 1}, callbacks=floor)

    results = rounds(configs, fit, count)
    params = sum(p.numel() for p in SquareLinears(width).parameters())
    print(f"\nthe exchange at {params:,} parameters, batch {BATCH}, one worker, {os.cpu_count()} cores, "
          f"{count} rounds of {steps} steps: ms per step and its ratio to plain Lightning's in the same round")
    print(f"{'configuration':28s} {'ms/step':>8s} {'ratio':>7s} {'min':>6s} {'max':>6s} target")
    failed = []
    for name, r in results.items():
        target = TARGETS.get(name, OTHER_TARGET)
        mark = "" if target is None else ("ok" if r["ratio_median"] <= target else "MISSED")
        if mark == "MISSED":
            failed.append(name)
        print(f"{name:28s} {r['ms_per_step_median']:8.2f} {r['ratio_median']:7.3f} {r['ratio_min']:6.3f} "
              f"{r['ratio_max']:6.3f} {'' if target is None else f'<= {target:.2f} {mark}'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"size": size, "parameters": params, "batch": BATCH, "rounds": count,
                                        "steps": steps, "cores": os.cpu_count(), "results": results}, indent=1))
    return 1 if failed else 0


PIECES = (("HeldBase", "encode"), ("PSClient", "push"), ("Transport", "_poll"), ("PushExchange", "settle_held"),
          ("PushExchange", "mask_update"), ("HeldModel", "add"))


def pieces(config: str, steps: int, width: int, warmup: int) -> int:
    """``--pieces``: one fit of plain Lightning and one of ``config``, their steps' pieces' medians printed."""
    import statistics
    import time
    from collections import defaultdict

    from bench.common import time_calls
    from plug_asgd.worker.client import PSClient
    from plug_asgd.worker.exchange.held_base import HeldBase
    from plug_asgd.worker.exchange.push import PushExchange
    from plug_asgd.worker.held_model import HeldModel
    from plug_asgd.worker.transport import Transport

    quiet()
    os.environ.setdefault("MASTER_PORT", str(free_port_block(4)))
    owners = {"HeldBase": HeldBase, "PSClient": PSClient, "Transport": Transport, "PushExchange": PushExchange,
              "HeldModel": HeldModel}
    data = regression_data(width)
    forward: list[float] = []

    class Timed(SquareLinears):
        def on_train_batch_start(self, *args: object) -> None:
            self.started = time.perf_counter()

        def on_before_optimizer_step(self, *args: object) -> None:
            forward.append(time.perf_counter() - self.started)

    for name in ("plain", config):
        times: dict[str, list[float]] = defaultdict(list)
        if name != "plain":
            for owner, method in PIECES:
                time_calls(owners[owner], method, times[f"{owner}.{method}"])
        forward.clear()
        torch.manual_seed(0)
        step, _ = fit_steps(lambda: Timed(width), DataLoader(data, batch_size=BATCH), strategies()[name](), steps,
                            warmup=warmup, trainer_kwargs={"accelerator": "cpu", "devices": 1})
        forward_ms = statistics.median(forward[warmup:]) * 1e3
        print(f"{name}: step {step * 1e3:.2f} ms, forward and backward {forward_ms:.2f} ms")
        for piece, values in times.items():
            if values:
                print(f"  {piece:28s} {statistics.median(values) * 1e3:7.2f} ms  ({len(values)} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
