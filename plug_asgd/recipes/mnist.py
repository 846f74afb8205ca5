"""MNIST-style image classification recipe: the Keras ``mnist_cnn`` model and a matching data module.

Serves as the standard workload for the asynchronous strategy: it is small enough to train on CPU,
yet has a 1.2M-parameter dense layer, so parameter traffic dominates like in the original
parameter-server experiments.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from plug_asgd.recipes.idx import load_mnist

__all__ = [
    "DEFAULT_DATA_DIR",
    "PIXEL_MEAN",
    "PIXEL_STD",
    "MnistCNN",
    "MnistDataModule",
    "add_data_arguments",
    "normalize",
]

# Mean / std of the pixel values (scaled to [0, 1]) over the Fashion-MNIST training set.
# MNIST's own are 0.1307 / 0.3081; the difference is only an affine shift of the input, which the
# first convolution's weights and bias absorb, so these constants are close enough for MNIST too.
PIXEL_MEAN: float = 0.2860
PIXEL_STD: float = 0.3530

DEFAULT_DATA_DIR = "~/.cache/plug_asgd/mnist"


def normalize(images: np.ndarray | Tensor) -> Tensor:
    """Turn uint8 images [N, 28, 28] into the float [N, 1, 28, 28] input :class:`MnistCNN` expects."""
    x = torch.as_tensor(images)
    return ((x.float() / 255.0 - PIXEL_MEAN) / PIXEL_STD).unsqueeze(1)


class MnistCNN(pl.LightningModule):
    """The Keras ``mnist_cnn`` example network (1,199,882 parameters), as a LightningModule.

    Chosen because it is the classic reference model for asynchronous SGD on MNIST, so results
    can be compared with published ones.
    """

    def __init__(self, lr: float = 1e-3, momentum: float = 0.9, optimizer: str = "adam") -> None:
        super().__init__()
        if optimizer not in ("sgd", "nesterov", "adam"):
            raise ValueError(f"optimizer must be 'sgd', 'nesterov' or 'adam', got {optimizer!r}")
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(0.25),
            nn.Flatten(),
            nn.Linear(9216, 128),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(128, 10),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Return class logits [B, 10] for normalised images [B, 1, 28, 28]."""
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Cross-entropy on one batch (``sync_dist`` as a DDP user writes it; under AsyncPSStrategy it stays local)."""
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def _eval_step(self, batch: tuple[Tensor, Tensor], prefix: str) -> Tensor:
        """Shared body of validation and test: log epoch-averaged loss and accuracy across workers."""
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        acc = (logits.argmax(dim=1) == y).float().mean()
        self.log(f"{prefix}_loss", loss, sync_dist=True, on_epoch=True, prog_bar=True)
        self.log(f"{prefix}_acc", acc, sync_dist=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Evaluate one held-out batch."""
        return self._eval_step(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Evaluate one test batch."""
        return self._eval_step(batch, "test")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam (default: stable under every mode) or SGD with momentum, by the ``optimizer`` hyperparameter.

        SGD with momentum 0.9 needs lr <= 0.01 under adacomp: the momentum keeps growing while the
        worker is reset to the central model after every push, and lr=0.05 diverges.
        """
        if self.hparams.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum,
                               nesterov=self.hparams.optimizer == "nesterov")


class MnistDataModule(pl.LightningDataModule):
    """MNIST / Fashion-MNIST from IDX files, with optional deterministic subsets for quick runs.

    Uses plain DataLoaders (no sampler): Lightning injects the distributed sampler itself, so each
    worker sees its own shard.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        batch_size: int = 32,
        train_subset: int | None = None,
        test_subset: int | None = None,
        download: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir).expanduser()
        self.batch_size = batch_size
        self.train_subset = train_subset
        self.test_subset = test_subset
        self.download = download
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    def prepare_data(self) -> None:
        """Find (or download, on one process per node) the files; arrays are loaded in :meth:`setup`."""
        load_mnist(self.data_dir, download=self.download)

    def _subset(self, x: np.ndarray, y: np.ndarray, n: int | None, salt: int) -> TensorDataset:
        """Take the first ``n`` of a fixed-seed shuffle: class-balanced in expectation, same on every rank."""
        if n is not None:
            if n <= 0:
                raise ValueError(f"subset size must be positive, got {n}")
            idx = np.random.default_rng([self.seed, salt]).permutation(len(x))[:n]
            x, y = x[idx], y[idx]
        return TensorDataset(normalize(x), torch.as_tensor(y, dtype=torch.long))

    def setup(self, stage: str | None = None) -> None:
        """Load the arrays into TensorDatasets (once; later calls for other stages reuse them)."""
        if self.train_set is not None and self.test_set is not None:
            return
        train_x, train_y, test_x, test_y = load_mnist(self.data_dir, download=self.download)
        self.train_set = self._subset(train_x, train_y, self.train_subset, salt=0)
        self.test_set = self._subset(test_x, test_y, self.test_subset, salt=1)

    def _loader(self, dataset: TensorDataset | None, shuffle: bool) -> DataLoader:
        """Build a plain single-process loader; fails clearly if :meth:`setup` was not run."""
        if dataset is None:
            raise RuntimeError("MnistDataModule.setup() must be called before requesting a dataloader")
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=0)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches."""
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        """Validation uses the test split (MNIST has no separate validation set)."""
        return self._loader(self.test_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """Test batches, in file order."""
        return self._loader(self.test_set, shuffle=False)


def add_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the recipe's data and optimiser flags, so every entry point spells them the same way."""
    default_dir = Path(os.environ.get("PLUG_ASGD_DATA") or DEFAULT_DATA_DIR).expanduser()
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=default_dir,
        help="folder holding the four MNIST/Fashion-MNIST IDX files "
        "(default: $PLUG_ASGD_DATA or %(default)s)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="per-worker batch size (default: %(default)s)"
    )
    parser.add_argument("--train-subset", type=int, default=None, help="use only this many training images")
    parser.add_argument("--test-subset", type=int, default=None, help="use only this many test images")
    parser.add_argument(
        "--no-download", action="store_true", help="fail instead of downloading missing files"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default: %(default)s)")
    parser.add_argument(
        "--optimizer", choices=("sgd", "nesterov", "adam"), default="adam", help="optimiser (default: %(default)s)"
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    from plug_asgd.recipes.common import add_strategy_arguments

    prog = "plug-asgd train mnist" if Path(sys.argv[0]).name == "plug-asgd" else None
    parser = argparse.ArgumentParser(prog=prog, description="Train the Keras mnist_cnn under AsyncPSStrategy and test "
                                                 "the central model.")
    return add_strategy_arguments(add_data_arguments(parser))


def main(argv: list[str] | None = None) -> dict | None:
    """Entry point of ``recipes/mnist.py`` and ``plug-asgd train mnist``."""
    from plug_asgd.recipes.common import train_and_test

    args = build_parser().parse_args(argv)
    datamodule = MnistDataModule(args.data_dir, batch_size=args.batch_size, train_subset=args.train_subset,
                                 test_subset=args.test_subset, download=not args.no_download, seed=args.seed)
    model = MnistCNN(lr=args.lr, optimizer=args.optimizer)
    return train_and_test("mnist", model, datamodule, args)
