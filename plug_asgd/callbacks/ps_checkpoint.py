"""Checkpoints of the central model that the PS writes while training runs, and loading one into a module."""


from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from plug_asgd.callbacks.common import require_ps
from plug_asgd.lightning_bridge.namespaces import LightningBound
from plug_asgd.protocol.checkpoint import central_tensors, read_checkpoint, resolve_checkpoint
from plug_asgd.sharding.checkpoint import read_sharded, shard_folders
from plug_asgd.worker.tensors import assign, synced_tensors

if TYPE_CHECKING:  # either namespace's classes (lightning_bridge.namespaces); pytorch_lightning's names them here
    import pytorch_lightning as pl


def load_central_weights(module: torch.nn.Module, path: str | os.PathLike[str], strict: bool = True,
                         run_id: str | None = None) -> int:
    """Load a PS checkpoint (a file, or the newest in a folder: of run ``run_id`` if it holds several runs')
    into ``module``; returns its version.

    For inference from what :class:`PSCheckpoint` or ``plug-asgd serve-ps --checkpoint-dir`` wrote.
    The file is checked (magic, checksum, every frame) before a byte is used; nothing is unpickled.
    A folder of a sharded PS's checkpoints (``shard-0``, ``shard-1``...: ``PSCheckpoint`` with
    ``ps_shards=N``) is assembled from each shard's newest file (:mod:`plug_asgd.sharding.checkpoint`);
    the version returned is then the newest shard's.

    Args:
        module: the model to load into: its parameters and floating-point buffers, by name, take the central
            tensors in place.
        path: a checkpoint file, a folder of them, or a folder of a sharded PS's ``shard-I`` folders.
        strict: refuse a checkpoint whose tensor names are not exactly the module's; off, the names both hold
            are loaded and the others left.
        run_id: the run whose newest file to load from a folder that holds several runs' (None: its only run).

    Raises:
        KeyError: with ``strict``, the checkpoint's tensor names are not the module's.
        ValueError: a tensor's shape differs from the module's.

    Example:
        >>> import os, tempfile
        >>> import torch
        >>> from plug_asgd import load_central_weights
        >>> from plug_asgd.protocol.checkpoint import checkpoint_name, write_checkpoint
        >>> model = torch.nn.Linear(4, 2)
        >>> with tempfile.TemporaryDirectory() as folder:  # a folder as PSCheckpoint(folder) leaves it
        ...     central = {f"model/{n}": torch.full(t.shape, 0.5).numpy() for n, t in model.state_dict().items()}
        ...     _ = write_checkpoint(os.path.join(folder, checkpoint_name(40, "run1")), {"version": 40}, central)
        ...     load_central_weights(model, folder)
        40
        >>> model.bias.tolist()
        [0.5, 0.5]
    """
    targets = dict(module.named_parameters())
    targets.update((n, b) for n, b in module.named_buffers() if b.is_floating_point())
    if shard_folders(path):
        versions, central = read_sharded(path, {n: tuple(t.shape) for n, t in synced_tensors(module).items()},
                                         run_id)
        version = max(versions)
    else:
        msg = read_checkpoint(resolve_checkpoint(path, run_id))
        central, version = central_tensors(msg), int(msg.fields["version"])
    if strict:
        missing, unexpected = sorted(set(targets) - set(central)), sorted(set(central) - set(targets))
        if missing or unexpected:
            raise KeyError(f"checkpoint {path} does not match the module: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    for name, t in targets.items():
        if name in central:
            if tuple(central[name].shape) != tuple(t.shape):
                raise ValueError(f"{name}: checkpoint shape {central[name].shape}, module shape {tuple(t.shape)}")
            assign(t, central[name])
    return version


class PSCheckpoint(LightningBound):
    """Has the embedded PS write its central state to ``dirpath`` while training runs.

    What is written: the central tensors, the version, the PS's duplicate-push table, the mode's
    state (AdaComp's history) and its counters, every ``every_n_updates`` updates and/or
    ``every_n_seconds`` seconds (default: every 60 s) and when the PS stops; the newest ``keep``
    files are kept. Resume with ``AsyncPSStrategy(resume_from=dirpath)`` or
    ``plug-asgd serve-ps --resume dirpath``; :func:`load_central_weights` loads one for inference.
    A PS that dies loses at most the updates folded in after its last checkpoint.

    It is a plain ``Callback``, not a subclass of Lightning's ``Checkpoint``, on purpose: Lightning takes every
    ``Checkpoint`` in ``callbacks`` for one that writes the trainer's resumable checkpoints (with one there it adds
    no default ``ModelCheckpoint``, and ``trainer.checkpoint_callback`` and ``ckpt_path="best"`` read
    ``best_model_path`` from the first one), while this one has the PS write the central model in the PS's own
    format. It sits beside ``ModelCheckpoint``, which still saves each worker's Lightning checkpoint.

    Args:
        dirpath: the folder the PS writes its checkpoint files in (made if missing).
        every_n_updates: write every this many updates (None: by time only).
        every_n_seconds: write every this many seconds; with neither set, every 60 s.
        keep: how many of the run's newest files to keep (older ones are removed).

    Raises:
        ValueError: ``every_n_updates`` or ``keep`` below 1, or ``every_n_seconds`` not positive.

    Example:
        >>> import pytorch_lightning as pl
        >>> from plug_asgd import AsyncPSStrategy, PSCheckpoint
        >>> trainer = pl.Trainer(strategy=AsyncPSStrategy(), callbacks=[PSCheckpoint("ps_ckpt", every_n_updates=500)],
        ...                      devices=2, accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False)
        >>> type(trainer.checkpoint_callback).__name__  # Lightning's own, still there beside it
        'ModelCheckpoint'

        A later run resumes the PS from the newest file: ``AsyncPSStrategy(resume_from="ps_ckpt")``.
    """

    def __init__(self, dirpath: str | os.PathLike[str], every_n_updates: int | None = None,
                 every_n_seconds: float | None = None, keep: int = 3) -> None:
        if every_n_updates is not None and every_n_updates < 1:
            raise ValueError(f"every_n_updates must be >= 1, got {every_n_updates}")
        if every_n_seconds is not None and every_n_seconds <= 0:
            raise ValueError(f"every_n_seconds must be > 0, got {every_n_seconds}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dirpath = Path(dirpath)
        self.every_n_updates = every_n_updates
        self.every_n_seconds = every_n_seconds
        self.keep = keep

    def ps_options(self) -> dict[str, Any]:
        """The embedded PS's flags that carry this policy (the strategy passes them on)."""
        return {"checkpoint_dir": str(self.dirpath.resolve()), "checkpoint_every_updates": self.every_n_updates,
                "checkpoint_every_seconds": self.every_n_seconds, "keep": self.keep}

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_ps(trainer, "PSCheckpoint")
