"""CIFAR-10 image classification recipe: the data module, the classifier and the entry point.

The python batches are read by :mod:`plug_asgd.recipes.cifar10_files` and the three 32x32 models
are in :mod:`plug_asgd.recipes.cifar10_models`; their names are re-exported here.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from typing_extensions import override

from plug_asgd.recipes.cifar10_files import (
    CIFAR10_CLASSES,
    CIFAR10_FOLDER,
    CIFAR10_MEAN,
    CIFAR10_STD,
    CIFAR10_URL,
    DEFAULT_DATA_DIR,
    TEST_BATCH,
    TRAIN_BATCHES,
    Cifar10FormatError,
    download_cifar10,
    ensure_cifar10,
    find_cifar10,
    load_cifar10,
    read_cifar10_batch,
    read_cifar10_meta,
)
from plug_asgd.recipes.cifar10_models import ARCHS, AlexNetCifar, ResNet18Cifar, SmallCNN, build_model
from plug_asgd.recipes.data import Arrays, ImageClassifier, SplitDataModule, add_common_data_arguments
from plug_asgd.recipes.idx import DatasetNotFoundError

__all__ = [
    "ARCHS",
    "CIFAR10_CLASSES",
    "CIFAR10_FOLDER",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR10_URL",
    "DEFAULT_DATA_DIR",
    "TEST_BATCH",
    "TRAIN_BATCHES",
    "AlexNetCifar",
    "Cifar10Classifier",
    "Cifar10DataModule",
    "Cifar10FormatError",
    "DatasetNotFoundError",
    "ResNet18Cifar",
    "SmallCNN",
    "add_data_arguments",
    "build_model",
    "download_cifar10",
    "ensure_cifar10",
    "find_cifar10",
    "load_cifar10",
    "normalize",
    "random_crop_flip",
    "read_cifar10_batch",
    "read_cifar10_meta",
]

# ------------------------------------------------------------------------------- transforms


def normalize(images: np.ndarray | Tensor) -> Tensor:
    """Turn uint8 images [N, 3, 32, 32] into float input normalised with :data:`CIFAR10_MEAN` / :data:`CIFAR10_STD`.

    Args:
        images: uint8 images [N, 3, 32, 32] (channels R, G, B), a numpy array or a tensor.
    """
    x = torch.as_tensor(images).float() / 255.0
    mean = torch.tensor(CIFAR10_MEAN, dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, dtype=x.dtype).view(1, 3, 1, 1)
    return (x - mean) / std


def random_crop_flip(images: Tensor, padding: int = 4, generator: torch.Generator | None = None) -> Tensor:
    """The standard CIFAR augmentation on a batch [B, C, H, W], in torch ops only.

    Each image is zero-padded by ``padding`` pixels on every side, cropped back to H x W at a random
    offset, and flipped left-right with probability 1/2 (torchvision's ``RandomCrop(32, padding=4)``
    followed by ``RandomHorizontalFlip()``, drawn per image).

    Args:
        images: the batch [B, C, H, W], of any dtype.
        padding: the zero pixels added on each side before the crop.
        generator: the random generator of the offsets and flips; None: torch's default one.
    """
    b, c, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    top = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    left = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    flip = torch.rand(b, generator=generator) < 0.5
    rows = top[:, None] + torch.arange(h)  # [B, H]
    cols = left[:, None] + torch.arange(w)  # [B, W]
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    return padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]


class _Collate:
    """Stack uint8 samples into a batch, augment it (training only) and normalise it."""

    def __init__(self, augment: bool) -> None:
        self.augment = augment

    def __call__(self, samples: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        x = torch.stack([s[0] for s in samples])
        y = torch.stack([s[1] for s in samples])
        if self.augment:
            x = random_crop_flip(x)
        return normalize(x), y


class Cifar10Classifier(ImageClassifier):
    """One of :data:`ARCHS` trained with cross-entropy, logging exactly as :class:`MnistCNN` does.

    Args:
        arch: the network, a key of :data:`ARCHS`.
        lr: the learning rate; None: the optimizer's default in :data:`plug_asgd.recipes.data.DEFAULT_LR`.
        momentum: SGD's momentum (unused by Adam).
        optimizer: ``"sgd"``, ``"nesterov"`` or ``"adam"``.
    """

    def __init__(self, arch: str = "cnn", lr: float | None = None, momentum: float = 0.9,
                 optimizer: str = "adam") -> None:
        super().__init__(lr, momentum, optimizer)
        self.save_hyperparameters()
        self.net = build_model(arch)


# ------------------------------------------------------------------------------------ data module


class Cifar10DataModule(SplitDataModule):
    """CIFAR-10 from the python batches, augmented for training, with optional deterministic subsets.

    Images stay uint8 in memory (150 MB for the training set per worker); each batch is augmented
    (training only) and normalised as it is collated.

    Args:
        data_dir: the folder holding ``cifar-10-batches-py/``, or that folder itself.
        batch_size: the images per batch, per worker.
        train_subset: train on this many images only (the same fixed-seed subset on every rank); None: all.
        test_subset: validate and test on this many images only; None: all.
        download: whether missing files may be downloaded.
        augment: whether training batches are randomly cropped and flipped.
        seed: seeds the choice of the subsets.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        batch_size: int = 32,
        train_subset: int | None = None,
        test_subset: int | None = None,
        download: bool = True,
        augment: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(data_dir, batch_size, train_subset, test_subset, download, seed)
        self.augment = augment

    @override
    def prepare_data(self) -> None:
        """Find (or download, on one process per node) the files; arrays are loaded in :meth:`setup`."""
        ensure_cifar10(self.data_dir, download=self.download)

    @override
    def load_arrays(self) -> Arrays:
        return load_cifar10(self.data_dir, download=self.download)

    @override
    def collate(self, train: bool) -> _Collate:
        return _Collate(train and self.augment)


# ------------------------------------------------------------------------------------ entry point


def add_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The recipe's data, model and optimiser flags: the MNIST recipe's, with ``--arch`` added.

    Args:
        parser: the parser the flags are added to, and which is returned.
    """
    default_dir = Path(os.environ.get("PLUG_ASGD_CIFAR10") or DEFAULT_DATA_DIR).expanduser()
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=default_dir,
        help=f"folder holding {CIFAR10_FOLDER}/, or that folder itself "
        "(default: $PLUG_ASGD_CIFAR10 or %(default)s)",
    )
    parser.add_argument(
        "--arch", choices=tuple(ARCHS), default="cnn",
        help="model: cnn (Keras cifar10_cnn), alexnet (AlexNet for 32x32) or resnet18 (CIFAR ResNet-18) "
        "(default: %(default)s)",
    )
    return add_common_data_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    """The recipe's command line: its data, model and optimiser flags and the strategy's."""
    from plug_asgd.recipes.common import add_strategy_arguments

    prog = "plug-asgd train cifar10" if Path(sys.argv[0]).name == "plug-asgd" else None
    parser = argparse.ArgumentParser(prog=prog, description="Train a CNN, AlexNet or ResNet-18 on CIFAR-10 under "
                                                            "AsyncPSStrategy and test the central model.")
    return add_strategy_arguments(add_data_arguments(parser))


def main(argv: list[str] | None = None) -> dict | None:
    """Entry point of ``recipes/cifar10.py`` and ``plug-asgd train cifar10``.

    Args:
        argv: the command line's arguments, without the program's name; None: ``sys.argv``'s.

    Returns:
        The run's summary (test accuracy, PS counters, bytes, times) on global rank 0; None on the other ranks.
    """
    from plug_asgd.recipes.common import seed_everything, train_and_test

    args = build_parser().parse_args(argv)
    seed_everything(args.seed)  # before the model is built: its initialization is the run's (rank 0's) start
    datamodule = Cifar10DataModule(args.data_dir, batch_size=args.batch_size, train_subset=args.train_subset,
                                   test_subset=args.test_subset, download=not args.no_download, seed=args.seed)
    model = Cifar10Classifier(arch=args.arch, lr=args.lr, optimizer=args.optimizer)
    return train_and_test("cifar10", model, datamodule, args)
