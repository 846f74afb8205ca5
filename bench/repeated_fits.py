"""Many Trainers one after the other in one process, as a notebook or a sweep runs them: memory and PS processes.

    PYTHONPATH=. python -m bench.repeated_fits [--fits 5] [--mode asgd]

Each fit is a fresh ``Trainer(strategy=AsyncPSStrategy(...))`` and a fresh module of 2M parameters that holds
80 MB of data (as a module that loads its dataset would), 10 steps on one CPU device. After each fit the Trainer is
dropped and garbage collected; the line printed then gives the process's resident memory, its live child processes
(an embedded PS still up is one) and the central version the fit's PS reached (10: its own PS; more: it trained on
an earlier fit's). Flat memory, no live child and version 10 each time is the right answer (``docs/momentum.md``
has the figures before and after the fix). Diagnostic only: it prints, and keeps nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from plug_asgd import AsyncPSStrategy


class Heavy(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(1000, 2000), torch.nn.Linear(2000, 1))
        self.data = torch.randn(20000, 1000)  # 80 MB, held by the module

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data[:640], torch.randn(640, 1)), batch_size=32)


def rss_mb() -> int:
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmRSS")).split()[1]) // 1024


def live_children() -> int:
    """Child processes of this one that are not zombies (Linux /proc)."""
    me, count = str(os.getpid()), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        count += fields[1] == me and fields[0] != "Z"
    return count


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.repeated_fits", description=__doc__.splitlines()[0])
    ap.add_argument("--fits", type=int, default=5)
    ap.add_argument("--mode", default="asgd")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    for k in range(args.fits):
        strategy = AsyncPSStrategy(mode=args.mode)
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=10, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Heavy())
        version = strategy.ps_stats().get("version")
        del trainer, strategy
        gc.collect()
        print(json.dumps({"fit": k, "rss_mb": rss_mb(), "live_children": live_children(), "ps_version": version}),
              flush=True)


if __name__ == "__main__":
    main()
