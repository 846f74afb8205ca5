"""Lightning's Trainer features under each mode, 2 workers: ``feature_fit.py MODE[,MODE...] OUT PS_PORT``.

One launch (Lightning's own launcher, ``devices=2``) runs, in the same two processes, for each mode
in turn, one fit after another, each on its own embedded PS (``PS_PORT + 5 i + j``):

1. ``fit``: a LightningDataModule; SGD with momentum and two LR schedulers (StepLR per step,
   ReduceLROnPlateau per epoch on ``val_loss``); ``accumulate_grad_batches=2``,
   ``gradient_clip_val``, ``val_check_interval=0.5`` (validation mid-epoch), ``precision="bf16-mixed"``,
   CSV and TensorBoard loggers, ``ModelCheckpoint(monitor="val_loss", save_last=True)``, and an
   ``EarlyStopping`` that must stop the run after its third validation.
2. ``resume``: ``trainer.fit(ckpt_path=last.ckpt)`` one epoch further.
3. ``validate``, ``test`` and ``predict`` of the resumed model.
4. ``max_steps``: a fit stopped by ``max_steps=7``.
5. ``max_time``: a fit stopped by ``max_time`` (1 s), rank 1 slowed, no validation (a collective).
6. ``manual``: manual optimization with two optimizers.

Each rank writes what it saw to OUT/MODE/rank{r}.json; tests/test_features.py asserts on it.
"""

import json
import sys
import time
from pathlib import Path

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
    from torch.utils.data import DataLoader, TensorDataset

    from plug_asgd import AsyncPSStrategy

BATCH = 16
PORTS = 5  # embedded PS ports a mode's fits use
MAX_TIME = 1  # seconds of the max_time fit: rank 1 (30 ms a step) makes about 30 steps, rank 0 several times more
TRAIN, HELD_OUT = 512, 128


def blobs(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    return TensorDataset(torch.randn(n, 8, generator=g) + (2 * y[:, None] - 1), y)


class Blobs(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(blobs(TRAIN, 0), batch_size=BATCH, shuffle=True)

    def val_dataloader(self):
        return DataLoader(blobs(HELD_OUT, 1), batch_size=BATCH)

    def test_dataloader(self):
        return DataLoader(blobs(HELD_OUT, 2), batch_size=BATCH)

    def predict_dataloader(self):
        return DataLoader(blobs(HELD_OUT, 3), batch_size=BATCH)


class Net(pl.LightningModule):
    def __init__(self, lr: float = 0.05, slow_rank: int | None = None, plateau: bool = True,
                 nesterov: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        self.max_grad = 0.0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.hparams.slow_rank == self.global_rank:
            time.sleep(0.03)
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_start(self) -> None:
        self.started = {"global_step": self.trainer.global_step, "weights": weights(self),
                        "momentum_buffers": sum(1 for s in self.trainer.optimizers[0].state.values()
                                                if "momentum_buffer" in s)}
        if not self.trainer.optimizers[0]._optimizer_step_post_hooks:  # what clipping left of the gradients
            self.trainer.optimizers[0].register_step_post_hook(self._clipped)

    def _clipped(self, optimizer, args, kwargs) -> None:
        norm = torch.norm(torch.stack([p.grad.norm() for p in self.parameters() if p.grad is not None]))
        self.max_grad = max(self.max_grad, float(norm))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(1)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9, nesterov=self.hparams.nesterov)
        step = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return [opt], [{"scheduler": step, "interval": "step"}] + (
            [{"scheduler": plateau, "interval": "epoch", "monitor": "val_loss"}] if self.hparams.plateau else [])


class TwoOptimizers(Net):
    def __init__(self, nesterov: bool = False) -> None:
        super().__init__(nesterov=nesterov)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        for opt in (first, second):
            loss = F.cross_entropy(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("train_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        second = (torch.optim.SGD(self.net[2].parameters(), lr=0.05, momentum=0.9, nesterov=True)
                  if self.hparams.nesterov else torch.optim.Adam(self.net[2].parameters(), lr=1e-3))
        return torch.optim.SGD(self.net[0].parameters(), lr=0.05, momentum=0.9, nesterov=self.hparams.nesterov), second


def trainer(mode: str, port: int, out: Path, **kwargs) -> pl.Trainer:
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(accelerator="cpu", devices=2, strategy=AsyncPSStrategy(mode=mode, ps_port=port),
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(out), **kwargs)


def weights(module: torch.nn.Module) -> list[list[float]]:
    return [p.detach().float().flatten().tolist() for p in module.parameters()]


def features(mode: str, out: Path, port: int) -> None:
    """The fits of one mode, on the ports from ``port`` to ``port + 4``; each rank writes OUT/rank{r}.json."""
    nesterov = mode == "eamsgd"  # its workers run Nesterov momentum (EAMSGD), and it refuses other optimizers
    seen: dict = {}
    pl.seed_everything(0, verbose=False)
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_loss", save_top_k=1, save_last=True)
    stop = EarlyStopping(monitor="val_loss", min_delta=10.0, patience=2)  # no gain of 10: stops at the 3rd check
    t = trainer(mode, port, out, max_epochs=4, accumulate_grad_batches=2, gradient_clip_val=0.5,
                val_check_interval=0.5, precision="bf16-mixed", callbacks=[checkpoint, stop], enable_checkpointing=True,
                logger=[CSVLogger(out, name="csv"), TensorBoardLogger(out, name="tb")])
    model = Net(nesterov=nesterov)
    t.fit(model, datamodule=Blobs())
    opt = t.optimizers[0]
    seen["fit"] = {"global_step": t.global_step, "epoch": t.current_epoch, "stopped_epoch": stop.stopped_epoch,
                   "lr": opt.param_groups[0]["lr"], "max_grad": model.max_grad, "best": checkpoint.best_model_path,
                   "last": checkpoint.last_model_path, "weights": weights(model),
                   "best_score": float(checkpoint.best_model_score),
                   "batches": t.fit_loop.epoch_loop.total_batch_idx + 1,
                   "csv": t.loggers[0].log_dir, "tb": t.loggers[1].log_dir}
    last = Path(checkpoint.last_model_path)

    t = trainer(mode, port + 1, out, max_epochs=3)
    model = Net(nesterov=nesterov)
    t.fit(model, datamodule=Blobs(), ckpt_path=str(last))
    seen["resume"] = {"global_step": t.global_step, "epoch": t.current_epoch, "started": model.started}
    seen["validate"] = t.validate(model, datamodule=Blobs(), verbose=False)[0]
    seen["test"] = t.test(model, datamodule=Blobs(), verbose=False)[0]
    predictions = t.predict(model, datamodule=Blobs())
    seen["predict"] = sum(len(p) for p in predictions)
    seen["resumed_weights"] = weights(model)

    t = trainer(mode, port + 2, out, max_steps=7)
    t.fit(Net(nesterov=nesterov), datamodule=Blobs())
    seen["max_steps"] = t.global_step

    t = trainer(mode, port + 3, out, max_time={"seconds": MAX_TIME}, max_epochs=1000, limit_val_batches=0)
    began = time.monotonic()
    t.fit(Net(slow_rank=1, plateau=False, nesterov=nesterov), datamodule=Blobs())
    seen["max_time"] = {"global_step": t.global_step, "seconds": time.monotonic() - began}

    t = trainer(mode, port + 4, out, max_epochs=1)
    manual = TwoOptimizers(nesterov=nesterov)
    t.fit(manual, datamodule=Blobs())
    seen["manual"] = {"global_step": t.global_step, "weights": weights(manual)}
    (out / f"rank{t.global_rank}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    modes, root, first = sys.argv[1].split(","), Path(sys.argv[2]), int(sys.argv[3])
    for i, name in enumerate(modes):  # one launch for all: the processes start once (seconds each)
        (root / name).mkdir(parents=True, exist_ok=True)
        features(name, root / name, first + PORTS * i)
