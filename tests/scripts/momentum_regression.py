"""A small regression model trained with momentum SGD under several modes, in one Lightning launch.

Two linear layers with tanh, ``SGD(lr=0.05, momentum=0.9)`` (Nesterov's for eamsgd, which needs it),
batch 32, 3 epochs of 2,048 samples: the settings a user of one process or DDP would pick. Every
rank runs the same sequence of fits (Lightning launches the other ranks once, at the first
Trainer, by re-running this script); rank 0 writes ``OUT/on/MODE.json`` with the central model's
validation loss before and after (``--repeats``: the median of that many fits, each in ``runs``).
``--off-modes``, trained after ``--modes`` in the same launch with ``staleness_compensation=False``,
write ``OUT/off/MODE.json``.
"""

import argparse
import json
import os
import statistics
from pathlib import Path

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from plug_asgd import AsyncPSStrategy

SAMPLES = 2048
EPOCHS = 3


def dataset(seed: int, n: int) -> TensorDataset:
    """A fixed teacher (tanh features, a linear term) plus noise; its targets have a variance of about 20."""
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(8, 16, generator=g), torch.randn(16, 1, generator=g) * 1.6
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    noise = torch.randn(n, 1, generator=torch.Generator().manual_seed(seed + 1))
    y = torch.tanh(x @ w1) @ w2 + 0.9 * x[:, :1] + 0.1 * noise
    return TensorDataset(x, y)


class Regression(pl.LightningModule):
    def __init__(self, nesterov: bool = False) -> None:
        super().__init__()
        self.nesterov = nesterov
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=self.nesterov)


def val_loss(model: Regression) -> float:
    x, y = dataset(7, 1024).tensors
    with torch.no_grad():
        return F.mse_loss(model.net(x), y).item()


def one_process_loss() -> float:
    """The model trained by one process at the same batch, learning rate and samples (6.81): the reference that
    tests/test_momentum.py bounds the fits by."""
    pl.seed_everything(0, verbose=False)
    model = Regression()
    opt = model.configure_optimizers()
    for _ in range(EPOCHS):
        for x, y in DataLoader(dataset(0, SAMPLES), batch_size=32, shuffle=True):
            opt.zero_grad()
            F.mse_loss(model.net(x), y).backward()
            opt.step()
    return val_loss(model)


def threaded_fit(row: str, compensation=None, lockstep: bool = False) -> float:
    """The central model's validation loss after a fit of ``row`` ("mode" or "asgd+codec") whose 2 workers are
    threads of the calling process (``tests/threaded_fit.py``; the caller has the repository on its path): the
    quick tier's regression case. ``compensation``: as
    ``AsyncPSStrategy(staleness_compensation=...)``; ``lockstep``: the workers start each step together
    (``fit_in_threads``)."""
    from tests.threaded_fit import fit_in_threads

    mode, _, codec = row.partition("+")

    def make() -> Regression:
        torch.manual_seed(0)  # every rank starts from the same weights, as seeded ranks do
        return Regression(nesterov=mode == "eamsgd")

    model = fit_in_threads(make, dataset(0, SAMPLES), epochs=EPOCHS, batch_size=32, mode=mode,
                           compressor=codec or "none", staleness_compensation=compensation, lockstep=lockstep)
    return val_loss(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", required=True, help="comma-separated; MODE+CODEC for a compressor")
    parser.add_argument("--off-modes", default="", help="the same, trained with staleness_compensation=False")
    parser.add_argument("--repeats", type=int, default=1, help="fits of each of --modes; the median is 'after'")
    parser.add_argument("--off-repeats", type=int, default=1, help="fits of each of --off-modes")
    parser.add_argument("--compensation", type=json.loads, default=None,
                        help="staleness_compensation of --modes, as JSON: true/false or a dict of its fields")
    parser.add_argument("--once", default="",
                        help="comma-separated modes of --modes and --off-modes fitted once: deterministic ones")
    args = parser.parse_args()
    base_port = int(os.environ["MASTER_PORT"]) + 1
    once = set(args.once.split(","))
    runs = [(name, False) for name in args.modes.split(",") for _ in range(1 if name in once else args.repeats)]
    runs += [(name, True) for name in args.off_modes.split(",") if name
             for _ in range(1 if name in once else args.off_repeats)]
    afters: dict[tuple[str, bool], list[float]] = {}
    for i, (name, off) in enumerate(runs):
        mode, _, codec = name.partition("+")
        pl.seed_everything(0, verbose=False)
        model = Regression(nesterov=mode == "eamsgd")
        before = val_loss(model)
        options = {"staleness_compensation": False if off else args.compensation}
        strategy = AsyncPSStrategy(mode=mode, compressor=codec or "none", ps_port=base_port + i, **options)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS,
                             logger=False, enable_checkpointing=False, enable_model_summary=False,
                             enable_progress_bar=False, num_sanity_val_steps=0)
        loader = DataLoader(dataset(0, SAMPLES), batch_size=32, shuffle=True)
        trainer.fit(model, loader)  # the module ends holding the central model
        if trainer.is_global_zero:
            runs_after = afters.setdefault((name, off), [])
            runs_after.append(val_loss(model))
            out = args.out / ("off" if off else "on")
            out.mkdir(parents=True, exist_ok=True)
            (out / f"{name}.json").write_text(json.dumps({"mode": name, "before": before,
                                                          "after": statistics.median(runs_after),
                                                          "runs": runs_after,
                                                          "ps_version": strategy.ps_stats()["version"]}))


if __name__ == "__main__":
    main()
