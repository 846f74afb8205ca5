"""Timing a worker's training steps under each strategy, in one process, fits alternated: what ``bench.exchange``
and ``bench.gpu`` share.

A *configuration* is a name and a function that makes the Trainer's strategy (``"auto"``: plain Lightning).
Each round fits every configuration once, in an order rotated from round to round, for ``steps`` steps
after ``warmup``; a fit's figure is its median step time. Ratios are taken within a round (the
configuration's median over plain Lightning's, measured minutes apart at most) and their median over the
rounds is reported, with the spread: this machine's pace drifts by more than the differences measured.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from plug_asgd import AdaComp, AsyncPSStrategy

MakeStrategy = Callable[[], Any]


def strategies(codecs: bool = True) -> dict[str, MakeStrategy]:
    """Plain Lightning, asgd, AdaComp at its default and at 0.33% overlapped, and asgd with each codec."""
    out: dict[str, MakeStrategy] = {
        "plain": lambda: "auto",
        "asgd": lambda: AsyncPSStrategy(mode="asgd"),
        "adacomp": lambda: AsyncPSStrategy(mode="adacomp"),
        "adacomp-0.0033-overlap": lambda: AsyncPSStrategy(mode=AdaComp(fraction=0.0033, overlap=True)),
    }
    if codecs:
        for codec in ("topk", "randomk", "qsgd", "sign", "powersgd"):
            out[f"asgd+{codec}"] = lambda codec=codec: AsyncPSStrategy(mode="asgd", compressor=codec)
    return out


class StepClock(pl.Callback):
    """The wall-clock end of each training step; stops the fit after ``steps`` (its epoch is longer: a codec whose
    default follows the fit's length, randomk's, sees a fit of realistic length)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())
        if len(self.ends) >= self.steps:
            trainer.should_stop = True


def fit_steps(make_module: Callable[[], pl.LightningModule], loader: Any, strategy: Any, steps: int, warmup: int,
              trainer_kwargs: Mapping[str, Any],
              callbacks: Sequence[pl.Callback] = ()) -> tuple[float, dict[str, Any]]:
    """The median seconds per step of one fit of ``steps`` after ``warmup``, and the strategy's counters;
    ``callbacks`` run before the step's clock reads the time."""
    clock = StepClock(warmup + steps + 1)
    trainer = pl.Trainer(**{"max_epochs": 1, "strategy": strategy, "callbacks": [*callbacks, clock], "logger": False,
                            "enable_checkpointing": False, "enable_progress_bar": False,
                            "enable_model_summary": False, **trainer_kwargs})
    trainer.fit(make_module(), loader)
    times = [b - a for a, b in zip(clock.ends[warmup:], clock.ends[warmup + 1:], strict=False)]
    if not times:
        raise RuntimeError(f"the fit ended after {len(clock.ends)} steps, before {warmup + 2}")
    counters = strategy.comm_stats() if isinstance(strategy, AsyncPSStrategy) else {}
    if isinstance(strategy, AsyncPSStrategy) and strategy.threads_kept is not None:
        counters["threads_kept"] = strategy.threads_kept  # the worker's thread tuner's choice
    return statistics.median(times), counters


def rounds(configs: Mapping[str, MakeStrategy], fit: Callable[[Any], tuple[float, dict[str, Any]]],
           count: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """``count`` rounds of every configuration (``fit(strategy)`` -> seconds per step, counters), rotated; per
    configuration its step times and its ratios to ``plain`` of the same round, with their median and spread."""
    names = list(configs)
    per_round: list[dict[str, float]] = []
    counters: dict[str, dict[str, Any]] = {}
    for r in range(count):
        order = names[r % len(names):] + names[:r % len(names)]
        row: dict[str, float] = {}
        for name in order:
            seconds, stats = fit(configs[name]())
            row[name] = seconds
            counters[name] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
            log(f"[bench] round {r + 1}/{count} {name:28s} {seconds * 1e3:8.2f} ms per step")
        per_round.append(row)
    out: dict[str, Any] = {}
    for name in names:
        times = [row[name] for row in per_round]
        ratios = [row[name] / row["plain"] for row in per_round]
        out[name] = {"ms_per_step": [t * 1e3 for t in times], "ms_per_step_median": statistics.median(times) * 1e3,
                     "ratio_to_plain": ratios, "ratio_median": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "counters": counters.get(name, {})}
    return out


def quiet() -> None:
    """Lightning's banners and the warnings a benchmark's short fits raise (few batches, no validation) off."""
    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


class SquareLinears(pl.LightningModule):
    """``layers`` square ``nn.Linear`` of ``width`` (with bias), a regression loss: a model of many parameters and
    almost no compute, where the exchange's cost per parameter shows. Momentum SGD at its usual rate."""

    def __init__(self, width: int, layers: int = 4, lr: float = 0.05, momentum: float = 0.9) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.lr, self.momentum = lr, momentum

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
