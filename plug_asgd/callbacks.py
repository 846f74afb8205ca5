"""Keras-style callbacks for parameter-server training: watch, keep and measure the central model.

- :class:`Supervisor` evaluates the *central* model while the workers train, in a thread of
  rank 0 with its own connection to the PS, so no training loop waits for it.
- :class:`PSCheckpoint` has the PS write its whole state (not a worker's copy) atomically.
- :class:`CommunicationMonitor` records, per worker, what it computed and what it sent.

They work with :class:`~plug_asgd.strategy.AsyncPSStrategy` only. Written once for both Lightning
namespaces, as the strategy (``plug_asgd.namespaces``): each is a ``Callback`` of the namespace in use.
"""

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
from torch import Tensor

from plug_asgd.checkpoint import central_tensors, read_checkpoint, resolve_checkpoint
from plug_asgd.client import PSClient, PSError, PSUnreachableError
from plug_asgd.namespaces import LightningBound
from plug_asgd.shard_checkpoint import read_sharded, shard_folders
from plug_asgd.sharding import connect
from plug_asgd.strategy import AsyncPSStrategy, synced_tensors
from plug_asgd.tensors import assign

if TYPE_CHECKING:  # either namespace's classes (plug_asgd.namespaces); pytorch_lightning's names them here
    import pytorch_lightning as pl

log = logging.getLogger("plug_asgd.callbacks")

EvaluateFn = Callable[[torch.nn.Module, Any], Mapping[str, float]]


def _strategy(trainer: pl.Trainer, who: str) -> AsyncPSStrategy:
    if not isinstance(trainer.strategy, AsyncPSStrategy):
        raise TypeError(f"{who} needs Trainer(strategy=AsyncPSStrategy(...)), not {type(trainer.strategy).__name__}")
    return trainer.strategy


def _run_dir(trainer: pl.Trainer, dirpath: str | os.PathLike[str] | None, leaf: str) -> Path:
    """Where a callback writes. Call it on every rank (``setup``): ``trainer.log_dir`` is a broadcast,
    and a collective reached by one rank only would pair with another rank's next collective."""
    if dirpath is not None:
        return Path(dirpath)
    log_dir = trainer.log_dir
    return Path(log_dir if trainer.loggers and log_dir is not None else trainer.default_root_dir) / leaf


def load_central_weights(module: torch.nn.Module, path: str | os.PathLike[str], strict: bool = True,
                         run_id: str | None = None) -> int:
    """Load a PS checkpoint (a file, or the newest in a folder: of run ``run_id`` if it holds several runs')
    into ``module``; returns its version.

    For inference from what :class:`PSCheckpoint` or ``plug-asgd serve-ps --checkpoint-dir`` wrote.
    The file is checked (magic, checksum, every frame) before a byte is used; nothing is unpickled.
    A folder of a sharded PS's checkpoints (``shard-0``, ``shard-1``...: ``PSCheckpoint`` with
    ``ps_shards=N``) is assembled from each shard's newest file (:mod:`plug_asgd.shard_checkpoint`);
    the version returned is then the newest shard's.
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

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _strategy(trainer, "PSCheckpoint")


def classification_metrics(module: torch.nn.Module, batch: Any) -> dict[str, float]:
    """Sums over a batch ``(x, y)`` of a classifier: cross-entropy and correct predictions."""
    x, y = batch[0], batch[1]
    logits = module(x)
    return {"loss": float(F.cross_entropy(logits, y, reduction="sum")),
            "correct": float((logits.argmax(dim=1) == y).sum()), "count": float(y.numel())}


class Supervisor(LightningBound):
    """Evaluates the central model on ``dataloader`` while training runs, as the seeds' Supervisor node.

    On global rank 0, a thread with its own connection to the PS pulls the central model every
    ``every_n_updates`` updates or ``every_n_seconds`` seconds (default 10 s), loads it into a
    copy of the module and evaluates it; the training loop never waits for it. Each evaluation
    is logged to the trainer's loggers (``central/test_acc``, ``central/test_loss``,
    ``central/version``, ``central/wall_s``, ``central/bytes_pushed``: the update bytes pushed so
    far, over the socket or through shared memory, step = PS version) and
    appended to ``dirpath/supervisor.jsonl`` (default: the trainer's log dir), which
    ``plug-asgd plot`` draws.

    ``evaluate(module, batch)`` returns sums over the batch; the default
    (:func:`classification_metrics`) gives ``loss``, ``correct`` and ``count`` of a classifier
    whose batches are ``(x, y)``. The thread shares rank 0's cores and torch threads, so rank 0
    trains a little slower while an evaluation runs; the other workers are not affected.
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
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        _strategy(trainer, "Supervisor")
        self._file = _run_dir(trainer, self.dirpath, "") / "supervisor.jsonl"

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = _strategy(trainer, "Supervisor")
        if not trainer.is_global_zero:
            return
        self._file.parent.mkdir(parents=True, exist_ok=True)
        model = copy.deepcopy(pl_module).cpu().eval()
        address = strategy.ps_endpoints if strategy.ps_shards > 1 else strategy.ps_endpoint
        self._start = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, args=(model, address, strategy.mode.name,
                                                                  strategy.connection.ps_keys, strategy.compressor),
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
            while not self._stop.wait(0.2):
                stats = client.stats()
                version = stats["version"]
                due_updates = self.every_n_updates is not None and (
                    last_version is None or version - last_version >= self.every_n_updates)
                due_time = self.every_n_seconds is not None and time.monotonic() - last_time >= self.every_n_seconds
                if version == last_version or not (due_updates or due_time):
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

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._thread is not None:
            self._flush(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(60)
            self._thread = None
            self._flush(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop.set()


class CommunicationMonitor(LightningBound):
    """Per worker: local steps, mean training loss, bytes up and down, compute vs communication time,
    and the staleness of its pushes, every ``every_n_steps`` local steps and at the end of training.

    Each worker appends its records to ``dirpath/worker{rank}.jsonl`` (default: ``comm/`` in the
    trainer's log dir), since workers do not wait for each other to merge them; rank 0 also logs
    its own to the trainer's loggers as ``comm/...``. Counts run from the start of training;
    bytes are counted on the wire; ``comm_s`` is time spent waiting for the PS's replies.
    """

    def __init__(self, every_n_steps: int = 50, dirpath: str | os.PathLike[str] | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.dirpath = dirpath
        self.records: list[dict[str, Any]] = []

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._strategy = _strategy(trainer, "CommunicationMonitor")
        self._file = _run_dir(trainer, self.dirpath, "comm") / f"worker{trainer.global_rank}.jsonl"

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._file.parent.mkdir(parents=True, exist_ok=True)
        self._baseline = self._strategy.comm_stats()  # counters since the client connected, setup included
        self._start = time.monotonic()
        self._losses: list[float] = []
        self._steps = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, Tensor):
            self._losses.append(float(loss.detach()))
        self._steps += 1
        if self._steps % self.every_n_steps == 0:
            self._record(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._steps % self.every_n_steps:
            self._record(trainer)

    def _record(self, trainer: pl.Trainer) -> None:
        stats = self._strategy.comm_stats()
        since = {k: stats.get(k, 0) - self._baseline.get(k, 0)
                 for k in ("wait_seconds", "bytes_up", "bytes_down", "push_bytes_up", "push_local_bytes_up", "pushes",
                           "own_replies", "local_steps")}
        wall = time.monotonic() - self._start
        comm = since["wait_seconds"]
        record = {
            "rank": trainer.global_rank, "local_steps": since["local_steps"],
            "train_loss_mean": sum(self._losses) / len(self._losses) if self._losses else None,
            "bytes_up": since["bytes_up"], "bytes_down": since["bytes_down"],
            "push_bytes_up": since["push_bytes_up"], "push_local_bytes_up": since["push_local_bytes_up"],
            "pushes": since["pushes"], "own_replies": since["own_replies"],
            "wall_s": round(wall, 3), "comm_s": round(comm, 3), "compute_s": round(max(0.0, wall - comm), 3),
            "staleness_mean": stats.get("staleness_mean", 0.0), "staleness_max": stats.get("staleness_max", 0),
            "version": stats.get("version", 0), "time": round(time.time(), 3),
        }
        self._losses = []
        self.records.append(record)
        with open(self._file, "a") as f:
            f.write(json.dumps(record) + "\n")
        if trainer.is_global_zero:
            metrics = {f"comm/{k}": float(v) for k, v in record.items()
                       if k not in ("rank", "time") and v is not None}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
