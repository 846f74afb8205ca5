"""What outlives a request: checkpoints (save, resume), the metrics file, and the counters as plain data.

A checkpoint holds the store's :class:`~plug_asgd.ps.store.Snapshot` (tensors, version, the
dedupe table, the rule's state), the world size and the counters worth keeping; stage
membership is not saved: it belongs to a run, and a resumed PS may serve a new one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from plug_asgd.checkpoint import CheckpointError, read_checkpoint, resolve_checkpoint
from plug_asgd.ps.config import PSConfig
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.stats import Stats
from plug_asgd.ps.store import Snapshot, Store
from plug_asgd.wire import FLOAT_DTYPES

log = logging.getLogger("plug_asgd.ps")


class Persistence:
    """Writes the checkpoints and the metrics lines of one PS when due; resumes it from a checkpoint."""

    def __init__(self, config: PSConfig, store: Store, members: Membership, stats: Stats) -> None:
        self.config = config
        self.policy = config.checkpoint_policy()
        self.store = store
        self.members = members
        self.stats = stats
        self.resumed_from: Path | None = None
        self._next_metrics = 0.0

    def housekeeping(self, final: bool = False) -> None:
        """Checkpoint and metrics line when due (and at exit); called between requests."""
        policy, version = self.policy, self.store.version
        if policy is not None and self.store.initialized and (policy.due(version)
                                                              or (final and policy.unsaved(version))):
            self.save_checkpoint()
        run_dir = self.config.run_dir
        if run_dir is not None and (final or time.monotonic() >= self._next_metrics):
            self._next_metrics = time.monotonic() + self.config.metrics_every
            run_dir.mkdir(parents=True, exist_ok=True)
            with open(run_dir / "ps_metrics.jsonl", "a") as f:
                f.write(json.dumps({"time": round(time.time(), 3), **self.counters()}) + "\n")

    def save_checkpoint(self) -> Path:
        """Write the central state now."""
        assert self.policy is not None
        snap = self.store.snapshot()
        fields = {"mode": self.config.mode, "version": snap.version, "world_size": self.members.world_size,
                  "last_seq": snap.last_seq, "rule": snap.rule_fields, "saved_at": time.time(),
                  "stats": self.stats.saved()}
        tensors = {f"model/{n}": t for n, t in snap.tensors.items()}
        tensors.update((f"rule/{n}", a) for n, a in snap.rule_arrays.items())
        path = self.policy.save(snap.version, fields, tensors)
        log.info("checkpoint %s written (version %d)", path, snap.version)
        return path

    def resume(self, where: str | os.PathLike[str]) -> None:
        """Start from the checkpoint ``where`` (a file, or the newest in a folder); CheckpointError if unusable."""
        path = resolve_checkpoint(where)
        msg = read_checkpoint(path)
        f = msg.fields
        mode = self.config.mode
        if f.get("mode") != mode:
            raise CheckpointError(f"{path} was written by a PS in mode {f.get('mode')!r}; this one runs "
                                  f"{mode!r}: resume with --mode {f.get('mode')}")
        tensors = {n[len("model/"):]: t for n, t in msg.tensors.items() if n.startswith("model/")}
        if not tensors or any(not isinstance(t, np.ndarray) or t.dtype.name not in FLOAT_DTYPES
                              for t in tensors.values()):
            raise CheckpointError(f"{path} holds no dense float central model")
        rule_arrays = {n[len("rule/"):]: t for n, t in msg.tensors.items() if n.startswith("rule/")}
        last_seq = {str(k): int(v) for k, v in f.get("last_seq", {}).items()}
        self.store.restore(Snapshot(int(f["version"]), tensors, last_seq, f.get("rule", {}), rule_arrays))
        self.members.world_size = f.get("world_size")
        self.stats.restore(f.get("stats", {}))
        if self.policy is not None:
            self.policy.saved_version(self.store.version)
        self.resumed_from = path
        log.info("resumed from %s at version %d", path, self.store.version)

    def counters(self) -> dict[str, Any]:
        """The counters, as plain data (what ``stats`` answers and ``plug-asgd status`` shows)."""
        s, store, members, config = self.stats, self.store, self.members, self.config
        elapsed = max(1e-9, time.time() - s.started)
        return {
            "mode": config.mode, "version": store.version, "initialized": store.initialized,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "max_updates": config.max_updates, "world_size": members.world_size,
            "workers": sorted(members.workers), "trainers": len(members.trainers()),
            "worker_details": members.details(),
            "uptime_s": round(elapsed, 3), "updates_per_s": round(store.version / elapsed, 3),
            "busy_s": round(s.busy_s, 6), "busy_cpu_s": round(s.busy_cpu_s, 6),
            "busy_fraction": round(min(1.0, s.busy_s / elapsed), 4), "push_messages": s.push_messages,
            "push_busy_s": round(s.push_busy_s, 6), "push_busy_cpu_s": round(s.push_busy_cpu_s, 6),
            "messages_in": s.messages_in, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
            "push_bytes_in": s.push_bytes_in, "push_local_bytes_in": s.push_local_bytes_in,
            "shm_segments": len(store.segments) if store.segments is not None else None,
            "pushes_applied": s.pushes_applied,
            "pushes_dropped": s.pushes_dropped, "pushes_after_stop": s.pushes_after_stop,
            "copies_on_write": s.copies_on_write, "own_replies": s.own_replies,
            "weights_pushes": s.weights_pushes, "weights_not_current": s.weights_not_current,
            "weights_lent": s.weights_lent, "lent_copies": s.lent_copies, "threads": config.threads,
            "worker_timeout_s": config.worker_timeout,
            "lost": sorted(members.lost), "workers_lost": s.workers_lost, "workers_back": s.workers_back,
            "refused": dict(s.refused), "staleness": {str(k): v for k, v in sorted(s.staleness.items())},
            "pushes_by_rank": {str(k): v for k, v in sorted(s.pushes_by_rank.items())},
        }
