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
import torch
from torch import Tensor, nn
from typing_extensions import override

from plug_asgd.recipes.data import Arrays, ImageClassifier, SplitDataModule, add_common_data_arguments
from plug_asgd.recipes.idx import ensure_mnist, load_mnist

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
    """Turn uint8 images [N, 28, 28] into the float [N, 1, 28, 28] input :class:`MnistCNN` expects.

    Args:
        images: uint8 images [N, 28, 28], a numpy array or a tensor.
    """
    x = torch.as_tensor(images)
    return ((x.float() / 255.0 - PIXEL_MEAN) / PIXEL_STD).unsqueeze(1)


class MnistCNN(ImageClassifier):
    """The Keras ``mnist_cnn`` example network (1,199,882 parameters), as a LightningModule.

    Chosen because it is the classic reference model for asynchronous SGD on MNIST, so results
    can be compared with published ones.

    Args:
        lr: the learning rate; None: the optimizer's default in :data:`plug_asgd.recipes.data.DEFAULT_LR`.
        momentum: SGD's momentum (unused by Adam).
        optimizer: ``"sgd"``, ``"nesterov"`` or ``"adam"``.
    """

    def __init__(self, lr: float | None = None, momentum: float = 0.9, optimizer: str = "adam") -> None:
        super().__init__(lr, momentum, optimizer)
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


class MnistDataModule(SplitDataModule):
    """MNIST / Fashion-MNIST from IDX files, with optional deterministic subsets for quick runs."""

    @override
    def prepare_data(self) -> None:
        """Find (or download, on one process per node) the files; arrays are loaded in :meth:`setup`."""
        ensure_mnist(self.data_dir, download=self.download)

    @override
    def load_arrays(self) -> Arrays:
        return load_mnist(self.data_dir, download=self.download)

    @override
    def inputs(self, x: np.ndarray) -> Tensor:
        return normalize(x)


def add_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the recipe's data and optimiser flags, so every entry point spells them the same way.

    Args:
        parser: the parser the flags are added to, and which is returned.
    """
    default_dir = Path(os.environ.get("PLUG_ASGD_DATA") or DEFAULT_DATA_DIR).expanduser()
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=default_dir,
        help="folder holding the four MNIST/Fashion-MNIST IDX files "
        "(default: $PLUG_ASGD_DATA or %(default)s)",
    )
    return add_common_data_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    """The recipe's command line: its data and optimiser flags and the strategy's."""
    from plug_asgd.recipes.common import add_strategy_arguments

    prog = "plug-asgd train mnist" if Path(sys.argv[0]).name == "plug-asgd" else None
    parser = argparse.ArgumentParser(prog=prog, description="Train the Keras mnist_cnn under AsyncPSStrategy and test "
                                                 "the central model.")
    return add_strategy_arguments(add_data_arguments(parser))


def main(argv: list[str] | None = None) -> dict | None:
    """Entry point of ``recipes/mnist.py`` and ``plug-asgd train mnist``.

    Args:
        argv: the command line's arguments, without the program's name; None: ``sys.argv``'s.

    Returns:
        The run's summary (test accuracy, PS counters, bytes, times) on global rank 0; None on the other ranks.
    """
    from plug_asgd.recipes.common import seed_everything, train_and_test

    args = build_parser().parse_args(argv)
    seed_everything(args.seed)  # before the model is built: its initialization is the run's (rank 0's) start
    datamodule = MnistDataModule(args.data_dir, batch_size=args.batch_size, train_subset=args.train_subset,
                                 test_subset=args.test_subset, download=not args.no_download, seed=args.seed)
    model = MnistCNN(lr=args.lr, optimizer=args.optimizer)
    return train_and_test("mnist", model, datamodule, args)
