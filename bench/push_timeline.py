"""Where a lone asgd worker's extra time per step goes: timers around its push, next to plain steps.

    OMP_NUM_THREADS=2 PYTHONPATH=. python -m bench.push_timeline [--steps 300] [--pairs 2] [--port 47600]

One process trains the recipe CNN on Fashion-MNIST (batch 32), alternating plain Lightning and
``AsyncPSStrategy(mode="asgd")`` with its embedded PS, and prints per run the median time per
step, and over the asgd runs the median time of each piece of a push: the whole
``PushExchange.send``, the push of weights (``PushExchange.push_weights``), the
delta (``PushExchange.update``) where one was pushed, and the client's request (send to reply); and per asgd
run, the time the PS's serving thread spent on each push, in all and on a core (its stats'
``push_busy_s`` and ``push_busy_cpu_s`` over ``push_messages``: the PS's part of the request,
and how much of that it waited for a core). The
benchmark's overhead figure says how much slower a step is; this says which piece of the push
that is. Diagnostic only: it wraps those methods, so it measures this code, not a protocol.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from typing import Any

import pytorch_lightning as pl

from bench.common import FASHION, ps_push_ms, time_calls
from plug_asgd.recipes.mnist import MnistCNN, MnistDataModule
from plug_asgd.strategy import AsyncPSStrategy
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.exchange import PushExchange

TIMES: dict[str, list[float]] = defaultdict(list)


class _StepEnds(pl.Callback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.ends.append(time.perf_counter())


def fit(kind: str, steps: int, port: int) -> tuple[float, dict[str, float] | None]:
    """Median time per step (ms) of one fit, after 10 warm-up steps; for asgd, the PS's time per push (ms)."""
    pl.seed_everything(0, verbose=False)
    dm = MnistDataModule(str(FASHION), batch_size=32, train_subset=max(8000, 32 * steps), download=False, seed=0)
    strategy: Any = AsyncPSStrategy(mode="asgd", ps_port=port) if kind == "asgd" else "auto"
    clock = _StepEnds()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         callbacks=[clock], limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(MnistCNN(), datamodule=dm)
    ends = clock.ends[10:]
    step = statistics.median(b - a for a, b in zip(ends, ends[1:], strict=False)) * 1000
    if kind != "asgd":
        return step, None
    return step, ps_push_ms(strategy.ps_stats())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--port", type=int, default=47600, help="first port of the embedded PSes (one per run)")
    args = parser.parse_args(argv)
    if not FASHION.is_dir():
        print(f"Fashion-MNIST is not at {FASHION}: install Debian's dataset-fashion-mnist (scripts/setup.sh)")
        return 2
    for owner, name, label in ((PushExchange, "send", "push"), (PushExchange, "push_weights", "weights"),
                               (PushExchange, "update", "delta"), (PSClient, "request", "request")):
        time_calls(owner, name, TIMES[label])
    steps: dict[str, list[float]] = defaultdict(list)
    ps_ms: list[dict[str, float] | None] = []
    for i in range(args.pairs):
        for kind in ("plain", "asgd") if i % 2 == 0 else ("asgd", "plain"):
            step, ps = fit(kind, args.steps, args.port + 2 * i)
            steps[kind].append(round(step, 2))
            if kind == "asgd":
                ps_ms.append(ps)
    pieces = {k: {"n": len(v), "median_ms": round(statistics.median(v) * 1000, 3)} for k, v in TIMES.items() if v}
    print(json.dumps({"step_ms": steps, "push_pieces": pieces, "ps_ms_per_push": ps_ms}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
