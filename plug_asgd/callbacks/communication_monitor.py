"""Per worker, what it computed and what it sent, recorded while training runs."""


from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor
from typing_extensions import override

from plug_asgd.callbacks.common import KeepsRecords, ps_handle, require_ps, run_dir
from plug_asgd.lightning_bridge.namespaces import LightningBound
from plug_asgd.placement.connection import PSHandle

if TYPE_CHECKING:  # either namespace's classes (lightning_bridge.namespaces); pytorch_lightning's names them here
    import pytorch_lightning as pl


COUNTED = ("wait_seconds", "bytes_up", "bytes_down", "push_bytes_up", "push_local_bytes_up", "requests", "pushes",
           "own_replies", "local_steps")  # what a record counts since training started
ISLAND_COUNTED = ("island_bytes_sent", "island_bytes_received")  # with islands: what the rank moved inside its island


class CommunicationMonitor(KeepsRecords, LightningBound):
    """Per worker: local steps, mean training loss, bytes up and down, compute vs communication time,
    and the staleness of its pushes, every ``every_n_steps`` local steps and at the end of training, once the last
    push is answered (after a record of the last step, where that reply changed the counts).

    Each worker appends its records to ``dirpath/worker{rank}.jsonl`` (default: ``comm/`` in the
    trainer's log dir), since workers do not wait for each other to merge them; rank 0 also logs
    its own to the trainer's loggers as ``comm/...``. Counts run from the start of training;
    bytes are counted on the wire; ``comm_s`` is time spent waiting for the PS's replies; ``replies`` counts the PS's
    replies by what they carried (own, whole, delta, approx, no_model, not_current, duplicate, pulled,
    pulled_delta: ``CommCounters.replies``), so that a count that does not add up names the reply. With islands
    (``AsyncPSStrategy(island=...)``) each rank records too: its island, whether it leads it, and the bytes it sent
    and received inside it (``island_bytes_sent``, ``island_bytes_received``); the PS's bytes are the leader's.

    Args:
        every_n_steps: record every this many local steps of each worker.
        dirpath: the folder of the ``worker{rank}.jsonl`` files (None: ``comm/`` in the trainer's log dir).

    Raises:
        ValueError: ``every_n_steps`` below 1.

    Example:
        >>> import pytorch_lightning as pl
        >>> from plug_asgd import AsyncPSStrategy, CommunicationMonitor, TopK
        >>> monitor = CommunicationMonitor(every_n_steps=20)
        >>> trainer = pl.Trainer(strategy=AsyncPSStrategy(compressor=TopK(0.01)), callbacks=[monitor], devices=2,
        ...                      accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False)
        >>> monitor.records  # after trainer.fit: this worker's records, as in its worker{rank}.jsonl
        []
    """

    def __init__(self, every_n_steps: int = 50, dirpath: str | os.PathLike[str] | None = None) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.dirpath = dirpath
        self.records: list[dict[str, Any]] = []
        # set up with the trainer, and at the start of training
        self._ps: PSHandle | None = None
        self._file: Path | None = None
        self._baseline: dict[str, Any] = {}
        self._start = 0.0
        self._losses: list[float] = []
        self._steps = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        require_ps(trainer, "CommunicationMonitor")
        self._file = run_dir(trainer, self.dirpath, "comm") / f"worker{trainer.global_rank}.jsonl"

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._file.parent.mkdir(parents=True, exist_ok=True)
        self._ps = ps_handle(trainer, "CommunicationMonitor")
        self._baseline = self._ps.comm_stats()  # counters since the client connected, setup included
        self._start = time.monotonic()
        self._losses: list[float] = []
        self._steps = 0

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, Tensor):
            self._losses.append(float(loss.detach()))
        self._steps += 1
        if self._steps % self.every_n_steps == 0:
            self._record(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._ps is not None
        # the last push's reply taken first (training is over), so that its bytes and its "own" are counted: a
        # record of the last step taken before that reply came is followed by this one
        stats = self._ps.comm_stats(settle=True)
        since, last = self._since(stats), self.records[-1] if self.records else None
        if self._steps % self.every_n_steps or last is None or any(
                since[k] != last[k] for k in ("bytes_down", "own_replies", "replies")):
            self._record(trainer, stats)

    def _since(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The counters since training started (the replies by kind among them)."""
        counted = COUNTED + ISLAND_COUNTED if "island" in stats else COUNTED
        since = {k: stats.get(k, 0) - self._baseline.get(k, 0) for k in counted}
        before = self._baseline.get("replies", {})
        since["replies"] = {k: n - before.get(k, 0) for k, n in stats.get("replies", {}).items()}
        return since

    def _record(self, trainer: pl.Trainer, stats: dict[str, Any] | None = None) -> None:
        assert self._ps is not None
        if stats is None:
            stats = self._ps.comm_stats()
        since = self._since(stats)
        wall = time.monotonic() - self._start
        comm = since["wait_seconds"]
        record = {
            "rank": trainer.global_rank, "local_steps": since["local_steps"],
            "train_loss_mean": sum(self._losses) / len(self._losses) if self._losses else None,
            "bytes_up": since["bytes_up"], "bytes_down": since["bytes_down"],
            "push_bytes_up": since["push_bytes_up"], "push_local_bytes_up": since["push_local_bytes_up"],
            "requests": since["requests"], "pushes": since["pushes"], "own_replies": since["own_replies"],
            "replies": since["replies"],
            "wall_s": round(wall, 3), "comm_s": round(comm, 3), "compute_s": round(max(0.0, wall - comm), 3),
            "staleness_mean": stats.get("staleness_mean", 0.0), "staleness_max": stats.get("staleness_max", 0),
            "version": stats.get("version", 0), "time": round(time.time(), 3),
        }
        if "island" in stats:  # a rank of an island: its PS traffic is its leader's (a leader's own; others' none)
            record.update(island=stats["island"], island_leader=stats["island_leader"],
                          **{k: since[k] for k in ISLAND_COUNTED})
        self._losses = []
        self.records.append(record)
        with open(self._file, "a") as f:
            f.write(json.dumps(record) + "\n")
        if trainer.is_global_zero:
            metrics = {f"comm/{k}": float(v) for k, v in record.items()
                       if k not in ("rank", "time", "replies") and v is not None}
            metrics.update({f"comm/replies/{k}": float(n) for k, n in record["replies"].items()})
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
