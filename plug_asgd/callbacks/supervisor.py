"""Evaluating the central model while the workers train, from a thread of rank 0 with a connection of its own."""


from __future__ import annotations

import copy
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from typing_extensions import override

from plug_asgd.callbacks.common import KeepsRecords, ps_handle, require_ps, run_dir
from plug_asgd.lightning_bridge.namespaces import LightningBound
from plug_asgd.sharding.config import connect
from plug_asgd.worker.client import PSClient, PSError, PSUnreachableError
from plug_asgd.worker.tensors import assign, synced_tensors

if TYPE_CHECKING:  # either namespace's classes (lightning_bridge.namespaces); pytorch_lightning's names them here
    import pytorch_lightning as pl


log = logging.getLogger("plug_asgd.callbacks")

EvaluateFn = Callable[[torch.nn.Module, Any], Mapping[str, float]]


def classification_metrics(module: torch.nn.Module, batch: Any) -> dict[str, float]:
    """Sums over a batch ``(x, y)`` of a classifier: cross-entropy and correct predictions.

    Args:
        module: the classifier, holding the central weights; it returns logits.
        batch: ``(x, y)`` (anything further is ignored), ``y`` the class indices.
    """
    x, y = batch[0], batch[1]
    logits = module(x)
    return {"loss": float(F.cross_entropy(logits, y, reduction="sum")),
            "correct": float((logits.argmax(dim=1) == y).sum()), "count": float(y.numel())}


class Supervisor(KeepsRecords, LightningBound):
    """Evaluates the central model on ``dataloader`` while training runs, as the seeds' Supervisor node.

    On global rank 0, a thread with its own connection to the PS pulls the central model every
    ``every_n_updates`` updates or ``every_n_seconds`` seconds (default 10 s), loads it into a
    copy of the module and evaluates it; the training loop never waits for it. At the fit's end it
    evaluates once more the model the fit ended with, where that moved since its last evaluation. Each evaluation
    is logged to the trainer's loggers (``central/test_acc``, ``central/test_loss``,
    ``central/version``, ``central/wall_s``, ``central/bytes_pushed``: the update bytes pushed so
    far, over the socket or through shared memory, step = PS version) and
    appended to ``dirpath/supervisor.jsonl`` (default: the trainer's log dir), which
    ``plug-asgd plot`` draws.

    ``evaluate(module, batch)`` returns sums over the batch; the default
    (:func:`classification_metrics`) gives ``loss``, ``correct`` and ``count`` of a classifier
    whose batches are ``(x, y)``. The thread shares rank 0's cores and torch threads, so rank 0
    trains a little slower while an evaluation runs; the other workers are not affected.

    Args:
        dataloader: the batches the central model is evaluated on, each time in full.
        every_n_updates: evaluate once the PS has folded in this many updates since the last evaluation.
        every_n_seconds: evaluate once this many seconds have passed since the last one; with neither set, 10.
        dirpath: the folder of ``supervisor.jsonl`` (None: the trainer's log dir).
        evaluate: ``evaluate(module, batch)``, the sums over one batch (a ``count`` key makes them means).

    Example:
        >>> import pytorch_lightning as pl
        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> from plug_asgd import AsyncPSStrategy, Supervisor
        >>> held_out = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,))), batch_size=32)
        >>> supervisor = Supervisor(held_out, every_n_seconds=5)
        >>> trainer = pl.Trainer(strategy=AsyncPSStrategy(), callbacks=[supervisor], devices=2, accelerator="cpu",
        ...                      max_epochs=1, logger=False, enable_progress_bar=False)
        >>> with torch.no_grad():  # as the Supervisor's thread evaluates: the sums over one batch
        ...     sorted(supervisor.evaluate(torch.nn.Linear(8, 3), next(iter(held_out))))
        ['correct', 'count', 'loss']
    """

    def __init__(self, dataloader: Iterable[Any], every_n_updates: int | None = None,
                 every_n_seconds: float | None = None, dirpath: str | os.PathLike[str] | None = None,
                 evaluate: EvaluateFn = classification_metrics) -> None:
        if every_n_updates is None and every_n_seconds is None:
            every_n_seconds = 10.0
        self.dataloader = dataloader
        self.every_n_updates = every_n_updates
        self.every_n_seconds = every_n_seconds
        self.dirpath = dirpath
        self.evaluate = evaluate
        self.records: list[dict[str, Any]] = []
        self._pending: queue.Queue[dict[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._final = False  # the stop is the fit's end: the thread evaluates the model it ended with first
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._file: Path | None = None  # set up with the trainer (its log dir)
        self._start = 0.0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_ps(trainer, "Supervisor")
        self._file = run_dir(trainer, self.dirpath, "") / "supervisor.jsonl"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        handle = ps_handle(trainer, "Supervisor")
        if not trainer.is_global_zero:
            return
        self._file.parent.mkdir(parents=True, exist_ok=True)
        model = copy.deepcopy(pl_module).cpu().eval()
        address = handle.endpoints if len(handle.endpoints) > 1 else handle.endpoints[0]
        self._start = time.monotonic()
        self._stop.clear()
        self._final = False
        self._thread = threading.Thread(target=self._watch, args=(model, address, handle.mode, handle.keys,
                                                                  handle.codec),
                                        name="plug_asgd-supervisor", daemon=True)
        self._thread.start()

    def _watch(self, model: torch.nn.Module, address: str | list[str], mode: str, keys: Any = None,
               codec: Any = None) -> None:
        options = {"rank": 0, "world_size": 1, "mode": mode, "request_timeout": 30, "keys": keys}
        # a sharded PS's (every shard's address): the model assembled from the shards' pieces, cut as the workers
        # cut it (their codec decides which tensors stay whole)
        client = PSClient(address, **options) if isinstance(address, str) else connect(
            address, {n: tuple(t.shape) for n, t in synced_tensors(model).items()}, codec, **options)
        last_version, last_time = None, 0.0
        try:
            while True:
                # the fit's end (on_train_end sets _final) evaluates once more: the model it ended with, which a
                # fit shorter than a poll, or ending between two evaluations, would otherwise never have recorded
                final = self._stop.wait(0.2)
                if final and not self._final:
                    break
                stats = client.stats()
                version = stats["version"]
                due_updates = self.every_n_updates is not None and (
                    last_version is None or version - last_version >= self.every_n_updates)
                due_time = self.every_n_seconds is not None and time.monotonic() - last_time >= self.every_n_seconds
                if version == last_version or not (due_updates or due_time or final):
                    if final:
                        break
                    continue
                reply = client.pull()
                record = self._evaluate(model, reply.tensors)
                record.update(version=reply.version, wall_s=round(time.monotonic() - self._start, 3),
                              bytes_pushed=stats["push_bytes_in"] + stats.get("push_local_bytes_in", 0),
                              bytes_total=stats["bytes_in"] + stats["bytes_out"],
                              time=round(time.time(), 3))
                last_version, last_time = reply.version, time.monotonic()
                with open(self._file, "a") as f:
                    f.write(json.dumps(record) + "\n")
                self.records.append(record)
                self._pending.put(record)
                if final:
                    break
        except (PSError, PSUnreachableError) as exc:
            # the PS went away: training is over or failed, and the trainer reports the failure itself
            log.info("Supervisor stopped: %s", exc)
        except BaseException as exc:  # surfaced in the main thread at the next batch
            self._error = exc
        finally:
            client.close()

    @torch.no_grad()
    def _evaluate(self, model: torch.nn.Module, tensors: Mapping[str, Any]) -> dict[str, Any]:
        for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                          if b.is_floating_point()]:
            assign(t, tensors[name])
        sums: dict[str, float] = {}
        for batch in self.dataloader:
            for key, value in self.evaluate(model, batch).items():
                sums[key] = sums.get(key, 0.0) + value
        count = sums.pop("count", 0.0)
        if count and "correct" in sums and "loss" in sums:
            return {"test_acc": sums["correct"] / count, "test_loss": sums["loss"] / count}
        return {k: (v / count if count else v) for k, v in sums.items()}

    def _flush(self, trainer: pl.Trainer) -> None:
        if self._error is not None:
            raise RuntimeError("the Supervisor's evaluation failed") from self._error
        while not self._pending.empty():
            record = self._pending.get_nowait()
            metrics = {f"central/{k}": float(record[k]) for k in ("test_acc", "test_loss", "version", "wall_s",
                                                                 "bytes_pushed") if k in record}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=int(record["version"]))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._thread is not None:
            self._flush(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._thread is not None:
            self._final = True
            self._stop.set()
            self._thread.join(60)
            self._thread = None
            self._flush(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop.set()
