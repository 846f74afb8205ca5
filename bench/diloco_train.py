"""One worker host's process of ``bench.diloco``: the language-model recipe's ByteGPT trained under DDP or a PS mode.

``python -m bench.diloco_train --spec SPEC.json --out DIR``, one process per emulated host (``NODE_RANK``,
``MASTER_ADDR`` as ``bench.slowlink`` sets them), a 2-node Lightning job of one device each. The spec (written by
:mod:`bench.diloco_launch`) names the run: ``kind`` ``ddp`` (Lightning's DDP over gloo) or ``ps``
(``AsyncPSStrategy(mode=..., inner_steps=H)`` on the external ``plug-asgd serve-ps`` at ``ps_address``), the model's
and the data's sizes, the seed, the steps of each rank (``rank_max_steps`` where one trains more) and the
straggler: rank ``slow_rank`` sleeps ``slow_factor - 1`` x the median of its recent steps after each step
(:class:`bench.train.StepClock`'s proportional straggler).

Each rank writes ``rank{R}.json``: its steps, the wall-clock end of each step after the warm-up, its sleeps, the
wall-clock time its fit began and the strategy's own byte counts. Under DDP rank 0 also keeps its weights every
``snapshot_every_s`` seconds of training and at the end (``snapshots.pt``); under a PS mode the central model is
kept by ``bench.diloco_observe`` on the PS's host instead. Nothing is evaluated here: ``bench.diloco`` evaluates
every snapshot after the launch, on the same held-out windows for every run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    import pytorch_lightning as pl
    import torch

    from bench.train import StepClock
    from plug_asgd.recipes.lm import ByteGPT
    from plug_asgd.recipes.lm_data import FortunesDataModule


class BenchGPT(ByteGPT):
    """The recipe's ByteGPT with its learning rate constant after the warmup, whatever the run's length.

    The recipe decays the rate to a tenth over the fit's steps; the benchmark trains DDP for a fixed number of
    samples and the other schemes past it (until they reach DDP's loss), so a schedule tied to each fit's length
    would compare different rates at equal samples. Without a Trainer (hivemind's peers) the recipe's schedule is
    this one already.
    """

    def lr_factor(self, step: int, total: float) -> float:
        """The recipe's warmup, then 1.

        Args:
            step: the optimizer steps taken so far.
            total: the fit's steps (ignored: the rate stays at its peak after the warmup).
        """
        return super().lr_factor(step, math.inf)


class Clock(StepClock):
    """:class:`bench.train.StepClock` with the wall-clock time (``time.time()``) at which the fit began, the zero of
    every curve of the run (the observer on the PS's host and the link counters are read on the same clock).

    Args:
        run: StepClock's settings (``warmup``, ``slow_rank``, ``slow_factor``, ``snapshot_every_s``).
        rank: this process's global rank.
    """

    def __init__(self, run: dict[str, Any], rank: int) -> None:
        super().__init__(run, rank)
        self.wall_start = 0.0

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        """Note the wall clock, then start StepClock's (and its first snapshot, on rank 0 under DDP).

        Args:
            trainer: the trainer.
            module: the model.
        """
        self.wall_start = time.time()
        super().on_train_start(trainer, module)


def make_strategy(spec: dict[str, Any]) -> Any:
    """The run's strategy: Lightning's DDP over gloo, or AsyncPSStrategy on the external PS of ``ps_address``.

    Args:
        spec: the launch's spec.

    Raises:
        ValueError: a ``kind`` other than ``ddp`` or ``ps``.
    """
    if spec["kind"] == "ddp":
        from pytorch_lightning.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo")
    if spec["kind"] != "ps":
        raise ValueError(f"kind must be ddp or ps, got {spec['kind']!r}")
    from plug_asgd.recipes.common import mode_and_codec
    from plug_asgd.strategy import AsyncPSStrategy

    mode, codec = mode_and_codec(spec["mode"], spec.get("compressor", "none"), inner_steps=spec["inner_steps"],
                                 outer=spec.get("outer"), fragments=spec.get("fragments"),
                                 momentum_lookahead=spec.get("momentum_lookahead"), overlap=spec.get("overlap"))
    # no CURVE keys between emulated hosts (encryption would cost CPU no other scheme pays), no shared memory
    return AsyncPSStrategy(mode=mode, compressor=codec, ps_address=spec["ps_address"], ps_insecure=True,
                           shm_pushes=False)


def data_module(spec: dict[str, Any]) -> FortunesDataModule:
    """The corpus's windows of the run: training windows drawn with the run's seed, the held-out ones tiled.

    Args:
        spec: the launch's spec (its ``data``, ``batch_size`` and ``seed``).
    """
    data = spec["data"]
    return FortunesDataModule(data["data_dir"], context=data["context"], batch_size=spec["batch_size"],
                              val_windows=data["val_windows"], seed=spec["seed"])


def main(argv: list[str] | None = None) -> None:
    """Train this host's rank of the run in the spec; write its record and (rank 0 under DDP) its snapshots.

    Args:
        argv: ``--spec SPEC.json --out DIR``; None: the command line's.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("NODE_RANK", "0"))
    pl.seed_everything(spec["seed"], workers=True, verbose=False)
    model = BenchGPT(**spec["model"])
    strategy = make_strategy(spec)
    run = {"warmup": spec["warmup"], "slow_rank": spec.get("slow_rank"), "slow_factor": spec.get("slow_factor"),
           "snapshot_every_s": spec.get("snapshot_every_s")}
    clock = Clock(run, rank)
    max_steps = spec.get("rank_max_steps", {}).get(str(rank), spec["max_steps"])  # --async-until together
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=spec["nodes"], strategy=strategy, max_epochs=1000,
                         max_steps=max_steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                         callbacks=[clock])
    trainer.fit(model, datamodule=data_module(spec))
    comm = strategy.comm_stats() if hasattr(strategy, "comm_stats") else None
    record = {**clock.record(), "wall_start": clock.wall_start, "comm": comm}
    if clock.snapshots:
        # (StepClock's clock is the fit's time less the snapshots' own: on the wall clock, about the same)
        torch.save([(clock.wall_start + t, state) for t, state in clock.snapshots], args.out / "snapshots.pt")
    tmp = args.out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(args.out / f"rank{rank}.json")
    print(f"bench.diloco_train: rank {rank} done, {clock.steps} steps", flush=True)
    # DDP's default group, which Lightning leaves to the interpreter's exit: its gloo threads torn down there aborted
    # a rank after its record was written ("terminate called without an active exception", exit -6); ended here
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
