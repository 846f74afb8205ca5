"""What the recipes' data modules share: arrays loaded once, subsets, and plain loaders."""

from __future__ import annotations

import argparse
import os
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class SplitDataModule(pl.LightningDataModule):
    """A dataset given as train and test arrays. Validation uses the test split (neither MNIST nor
    CIFAR-10 has another). Loaders are plain (no sampler): Lightning injects the distributed
    sampler itself, so each worker sees its own shard. A subset is the first ``n`` of a
    fixed-seed shuffle: class-balanced in expectation and the same on every rank.

    Args:
        data_dir: the folder the dataset's files are in (``~`` expanded).
        batch_size: the images per batch, per worker.
        train_subset: train on this many images only; None: all.
        test_subset: validate and test on this many images only; None: all.
        download: whether missing files may be downloaded.
        seed: seeds the choice of the subsets.
    """

    def __init__(self, data_dir: str | os.PathLike[str], batch_size: int = 32, train_subset: int | None = None,
                 test_subset: int | None = None, download: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.data_dir = Path(data_dir).expanduser()
        self.batch_size = batch_size
        self.train_subset = train_subset
        self.test_subset = test_subset
        self.download = download
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    @abstractmethod
    def load_arrays(self) -> Arrays:
        """``(train_x, train_y, test_x, test_y)``, downloading if allowed and needed."""

    def inputs(self, x: np.ndarray) -> Tensor:
        """What the dataset stores for images ``x`` (the raw array by default).

        Args:
            x: the images as loaded (uint8).
        """
        return torch.from_numpy(np.ascontiguousarray(x))

    def collate(self, train: bool) -> Callable[[list[Any]], Any] | None:
        """A batch builder (augmentation, normalisation), or None for the default one.

        Args:
            train: whether the batches are training ones (augmented, where a recipe augments).
        """
        return None

    def _subset(self, x: np.ndarray, y: np.ndarray, n: int | None, salt: int) -> TensorDataset:
        if n is not None:
            if n <= 0:
                raise ValueError(f"subset size must be positive, got {n}")
            idx = np.random.default_rng([self.seed, salt]).permutation(len(x))[:n]
            x, y = x[idx], y[idx]
        return TensorDataset(self.inputs(x), torch.as_tensor(y, dtype=torch.long))

    @override
    def setup(self, stage: str | None = None) -> None:
        """Load the arrays into TensorDatasets (once; later calls for other stages reuse them)."""
        if self.train_set is not None and self.test_set is not None:
            return
        train_x, train_y, test_x, test_y = self.load_arrays()
        self.train_set = self._subset(train_x, train_y, self.train_subset, salt=0)
        self.test_set = self._subset(test_x, test_y, self.test_subset, salt=1)

    def _loader(self, dataset: TensorDataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must be called before requesting a dataloader")
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=train, num_workers=0,
                          collate_fn=self.collate(train))

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, train=False)


OPTIMIZERS = ("sgd", "nesterov", "adam")
# the learning rates the recipes train with under every mode: momentum SGD's usual one, Adam's default
DEFAULT_LR = {"sgd": 0.05, "nesterov": 0.05, "adam": 1e-3}


def add_common_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The batch, subset, download and optimizer flags every recipe spells the same way.

    Args:
        parser: the parser the flags are added to, and which is returned.
    """
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch size (default: %(default)s)")
    parser.add_argument("--train-subset", type=int, default=None, help="use only this many training images")
    parser.add_argument("--test-subset", type=int, default=None, help="use only this many test images")
    parser.add_argument("--no-download", action="store_true", help="fail instead of downloading missing files")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: " + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_LR.items()) + ")")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="optimiser (default: %(default)s)")
    return parser


class ImageClassifier(pl.LightningModule):
    """Cross-entropy training of ``self.net`` (set by the subclass), logged as a DDP user writes it.

    ``sync_dist=True`` everywhere: under AsyncPSStrategy the training loss stays each worker's own,
    while validation and test reduce across workers through the PS. The optimizer is Adam (stable
    under every mode), SGD with momentum, or SGD with Nesterov momentum (what eamsgd needs).

    Args:
        lr: the learning rate; None: the optimizer's in :data:`DEFAULT_LR`.
        momentum: SGD's momentum (unused by Adam).
        optimizer: one of :data:`OPTIMIZERS`: ``"sgd"``, ``"nesterov"`` or ``"adam"``.

    Raises:
        ValueError: where ``optimizer`` is not one of :data:`OPTIMIZERS`.
    """

    net: torch.nn.Module

    def __init__(self, lr: float | None, momentum: float, optimizer: str) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")

    @override
    def forward(self, x: Tensor) -> Tensor:
        """Class logits for a batch of normalised images."""
        return self.net(x)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def _eval_step(self, batch: tuple[Tensor, Tensor], prefix: str) -> Tensor:
        x, y = batch
        logits = self(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        acc = (logits.argmax(dim=1) == y).float().mean()
        self.log(f"{prefix}_loss", loss, sync_dist=True, on_epoch=True, prog_bar=True)
        self.log(f"{prefix}_acc", acc, sync_dist=True, on_epoch=True, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "val")

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "test")

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam, or SGD with momentum (Nesterov's or not); ``lr=None`` takes :data:`DEFAULT_LR`."""
        hp = self.hparams
        lr = DEFAULT_LR[hp.optimizer] if hp.lr is None else hp.lr
        if hp.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=lr)
        return torch.optim.SGD(self.parameters(), lr=lr, momentum=hp.momentum, nesterov=hp.optimizer == "nesterov")
