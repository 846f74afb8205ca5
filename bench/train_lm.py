"""The language model of a ``bench.train`` run with ``"model": "lm"``: the recipe's ByteGPT on Debian's fortunes.

A run's keys: ``lm`` (ByteGPT's keyword arguments: its size, ``warmup_steps``, ``optimizer``, ``lr``; the recipe's
own optimizer, AdamW with its warmup and cosine decay over the fit, where none is given), ``batch_size`` (windows
per batch, per worker), ``train_subset`` (training windows per epoch, shared out among the workers as the recipe
does), ``test_subset`` (held-out windows, tiled over the validation documents: the same for every run), ``seed``
and ``data_dir`` (default: ``$PLUG_ASGD_FORTUNES`` or the package's folder). ``trainer.test`` then logs
``test_loss`` (nats per byte) and ``test_acc`` (next-byte accuracy) of the model the strategy tests: the PS's
central model under AsyncPSStrategy, each rank's own (the same on all) under DDP.
"""

from __future__ import annotations

import os
from typing import Any

from plug_asgd.recipes.lm import ByteGPT, FortunesDataModule
from plug_asgd.recipes.lm_data import FORTUNES_DIR


def fortunes_dir() -> str:
    """The corpus's folder: ``$PLUG_ASGD_FORTUNES`` where set (a machine without the package), else Debian's."""
    return str(os.environ.get("PLUG_ASGD_FORTUNES") or FORTUNES_DIR)


def lm_model_and_data(run: dict[str, Any], seed: int) -> tuple[ByteGPT, FortunesDataModule]:
    """ByteGPT and the corpus's windows for ``run``.

    Args:
        run: the run's settings (``lm``, ``batch_size``, ``train_subset``, ``test_subset``, ``data_dir``).
        seed: draws the training windows (the model's initialization is drawn by the seed set before this call).

    Raises:
        ValueError: where ByteGPT refuses the size (``heads`` not dividing ``d_model``, say).
    """
    settings = dict(run["lm"])
    model = ByteGPT(**settings)
    data = FortunesDataModule(run.get("data_dir") or fortunes_dir(), context=model.max_context,
                              batch_size=run["batch_size"], train_windows=run.get("train_subset"),
                              val_windows=run.get("test_subset"), seed=seed)
    return model, data
