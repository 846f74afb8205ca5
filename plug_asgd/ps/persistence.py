"""What outlives a request: checkpoints (save, resume), the metrics file, and the counters as plain data.

A checkpoint holds the store's :class:`~plug_asgd.ps.store_records.Snapshot` (tensors, version, the
dedupe table, the rule's state), the owner of each session of the dedupe table (its rank and a
hash of its worker's token: a resumed PS lets only that worker push under it again), the world
size, the run id, the counters worth keeping and its lineage: the epoch its writer leads (which names
the file past the first), the writer's address and its standby's (what a resumed PS asks whether a
later epoch leads, :mod:`plug_asgd.ps.failover`). A PS that was replaced writes no checkpoint, not
even at its stop, and a standby that leads writes one at once; stage membership is not saved: it belongs to a
run, and a resumed PS may serve a new one. The files are readable by their owner only (0600).

A checkpoint folder belongs to runs: a fresh PS takes a new run id (or ``--run-id``), a resumed
one its checkpoint's, and it lists, prunes and resumes only that run's files. Housekeeping never
stops the PS: a failed write is counted and retried (:mod:`plug_asgd.ps.disk`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from plug_asgd.protocol.checkpoint import (
    CheckpointError,
    HeaderTooLarge,
    checkpoint_candidates,
    epoch_of,
    read_checkpoint,
    run_of,
    runs_in,
)
from plug_asgd.protocol.wire import FLOAT_DTYPES
from plug_asgd.ps.config import PSConfig
from plug_asgd.ps.disk import Retry, append_line
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.shard_guard import ShardGuard
from plug_asgd.ps.stats import Stats
from plug_asgd.ps.store import Store
from plug_asgd.ps.store_records import Snapshot

log = logging.getLogger("plug_asgd.ps")


def new_run_id() -> str:
    """A fresh run's id: when it started, and 8 random hex digits (``YYYYMMDD-HHMMSS-`` and the digits). Two ids made
    in one second are the same about once in 3.5 million pairs of runs of 50 (with 6 digits, once in 13,000), and
    two PSs started in the same second into one folder would then write each other's files."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


def check_folder(dirpath: Path, run_id: str, *, named: bool, continued: bool) -> None:
    """Refuse a checkpoint folder that holds another run's files, unless this run was ``named`` (--run-id: the
    runs' files are kept apart) or ``continued`` from this folder; and a fresh named run whose files are there.

    Args:
        dirpath: the checkpoint folder.
        run_id: this run's id.
        named: whether the run was given its id (``--run-id``), so that its files are kept apart from others'.
        continued: whether this run continues one resumed from this very folder.

    Raises:
        CheckpointError: where the folder holds files of this run id and the run does not continue it, or
            holds another run's files and this run is neither named nor continued.
    """
    runs = runs_in(dirpath)
    if run_id in runs and not continued:
        raise CheckpointError(f"{dirpath} already holds checkpoints of run {run_id} (newest {runs[run_id][-1].name}): "
                              f"continue it with --resume {dirpath} --run-id {run_id}, or name this run otherwise")
    others = {r: files for r, files in runs.items() if r != run_id}
    if others and not named and not continued:
        listed = "; ".join(f"run {r or '(older plug_asgd, no run id)'}: newest {files[-1].name}"
                           for r, files in others.items())
        raise CheckpointError(
            f"{dirpath} holds checkpoints of another run ({listed}). Continue that run with --resume {dirpath} "
            "(AsyncPSStrategy(resume_from=...)); or give this run a --checkpoint-dir of its own; or, to keep both "
            "runs' files in this folder, name this one with --run-id NAME")


class Persistence:
    """Writes the checkpoints and the metrics lines of one PS when due; resumes it from a checkpoint.

    Args:
        config: the server's options (checkpoint policy, run id and folder, metrics interval, retries).
        store: the central model it saves and restores.
        members: the membership whose world size a checkpoint keeps.
        stats: the counters a checkpoint keeps and the metrics lines show.
        clock: what tells the time for the intervals and backoffs, in seconds.
        shard: this PS's place in a sharded PS, recorded in its checkpoints and checked on resume; None: the
            one ``config.shard`` names.
    """

    def __init__(self, config: PSConfig, store: Store, members: Membership, stats: Stats,
                 clock: Callable[[], float] = time.monotonic, shard: ShardGuard | None = None) -> None:
        self.config = config
        self.shard = shard if shard is not None else ShardGuard(config.shard)
        self.policy = config.checkpoint_policy()
        self.store = store
        self.members = members
        self.stats = stats
        self.clock = clock
        self.resumed_from: Path | None = None
        self.resume_skipped: list[str] = []  # corrupt newer files a resume fell back past
        self.last_checkpoint: Path | None = None
        self.sessions_left_out = 0  # dedupe entries a checkpoint left out to stay readable
        self.checkpoint_retry = Retry("checkpoint", stats, config.io_retry_seconds, clock)
        self.metrics_retry = Retry("metrics", stats, config.io_retry_seconds, clock)
        self._next_metrics = 0.0
        self.run_id = config.run_id or new_run_id()
        self.following = config.standby_of is not None  # a standby: nothing written until it leads
        self.replaced = False  # a primary whose standby leads a later epoch: no checkpoint of it ever again
        self.lineage: Callable[[], dict[str, Any]] = lambda: {"epoch": 1}  # the server's, once it listens
        self.resumed_lineage: dict[str, Any] | None = None  # what the checkpoint resumed says of its writer
        self._checkpoint_now = False
        if config.resume is None and not self.following:
            self._start_run(self.run_id, continued=False)

    def lead(self) -> None:
        """A standby leads: its run (the primary's, from its state) is continued from now on, checkpoints and all,
        the first at once (the folder then says which epoch leads)."""
        self.following = False
        self._checkpoint_now = True
        self._start_run(self.run_id, continued=True)

    def _start_run(self, run_id: str, continued: bool) -> None:
        self.run_id = run_id
        if self.policy is not None:
            self.policy.run_id = run_id
            check_folder(self.policy.dirpath, run_id, named=self.config.run_id is not None, continued=continued)

    def housekeeping(self, final: bool = False) -> int:
        """Checkpoint and metrics line when due (and at exit); called between requests. A failed write is
        counted and retried, never raised; returns 1 if the checkpoint at exit failed (its updates are lost).

        Args:
            final: whether this is the last call, at exit: write what is unsaved, with no retry after.
        """
        if self.following:
            return 0
        policy, version, retry = self.policy, self.store.version, self.checkpoint_retry
        code = 0
        if policy is not None and self.store.initialized and not self.replaced and (
                policy.due(version) or (retry.failing and not retry.waiting()) or self._checkpoint_now
                or (final and policy.unsaved(version))):
            self._checkpoint_now = False
            try:
                self.save_checkpoint()
                retry.succeeded()
            except Exception as exc:  # a full disk, or anything else: the state in memory is worth more
                policy.failed(version)
                retry.failed(exc, final)
                code = 1
        run_dir, now = self.config.run_dir, self.clock()
        if run_dir is not None and (final or (now >= self._next_metrics and not self.metrics_retry.waiting())):
            self._next_metrics = now + self.config.metrics_every
            try:
                append_line(run_dir / "ps_metrics.jsonl", json.dumps({"time": round(time.time(), 3),
                                                                      **self.counters()}) + "\n")
                self.metrics_retry.succeeded()
            except Exception as exc:
                self.metrics_retry.failed(exc, final)
        return code if final else 0

    def save_checkpoint(self) -> Path:
        """Write the central state now (OSError, HeaderTooLarge: nothing written, the files there untouched)."""
        assert self.policy is not None
        snap = self.store.snapshot()
        fields = {"mode": self.config.mode, "version": snap.version, "world_size": self.members.world_size,
                  "run_id": self.run_id, "last_seq": snap.last_seq, "rule": snap.rule_fields,
                  "session_owners": self.members.owner_fields(snap.last_seq),
                  "saved_at": time.time(), "stats": self.stats.saved(), **self.shard.checkpoint_fields(),
                  **self.lineage()}
        tensors = {f"model/{n}": t for n, t in snap.tensors.items()}
        tensors.update((f"rule/{n}", a) for n, a in snap.rule_arrays.items())
        try:
            path = self.policy.save(snap.version, fields, tensors, fields["epoch"])
        except HeaderTooLarge as exc:  # the dedupe table grew past what a checkpoint may hold
            fields["last_seq"] = self._trim(snap.last_seq, exc.excess)
            fields["session_owners"] = self.members.owner_fields(fields["last_seq"])
            path = self.policy.save(snap.version, fields, tensors, fields["epoch"])
        self.last_checkpoint = path
        log.info("checkpoint %s written (version %d)", path, snap.version)
        return path

    def _trim(self, last_seq: dict[str, int], excess: int) -> dict[str, int]:
        """The dedupe table less its longest session names, at least ``excess`` bytes of it (each entry's
        msgpack bytes: the header shrinks by at least their sum). A push of a session left out, resent after
        a resume from this checkpoint, could be applied twice: logged, and counted in the counters."""
        kept, dropped = dict(last_seq), 0
        for session in sorted(last_seq, key=len, reverse=True):
            if excess <= 0:
                break
            excess -= len(msgpack.packb(session)) + len(msgpack.packb(kept.pop(session)))
            dropped += 1
        self.sessions_left_out += dropped
        log.warning("a checkpoint would exceed the header size a checkpoint may have: %d of %d sessions (the "
                    "longest names) left out of its duplicate-push table", dropped, len(last_seq))
        return kept

    def resume(self, where: str | os.PathLike[str]) -> None:
        """Start from the checkpoint ``where`` (a file; in a folder, the newest readable one of its run, a corrupt
        newer one skipped with a warning); CheckpointError if unusable.

        Args:
            where: a checkpoint file, or a folder of checkpoints.

        Raises:
            CheckpointError: where the checkpoint was written in another mode, or holds no dense float model
                (and where none is readable, or it belongs to another shard).
        """
        path, msg = self._read_newest(where)
        f = msg.fields
        mode = self.config.mode
        if f.get("mode") != mode:
            raise CheckpointError(f"{path} was written by a PS in mode {f.get('mode')!r}; this one runs "
                                  f"{mode!r}: resume with --mode {f.get('mode')}")
        self.shard.restore(f, path)
        tensors = {n[len("model/"):]: t for n, t in msg.tensors.items() if n.startswith("model/")}
        if not tensors or any(not isinstance(t, np.ndarray) or t.dtype.name not in FLOAT_DTYPES
                              for t in tensors.values()):
            raise CheckpointError(f"{path} holds no dense float central model")
        rule_arrays = {n[len("rule/"):]: t for n, t in msg.tensors.items() if n.startswith("rule/")}
        last_seq = {str(k): int(v) for k, v in f.get("last_seq", {}).items()}
        self.store.restore(Snapshot(int(f["version"]), tensors, last_seq, f.get("rule", {}), rule_arrays))
        self.members.restore_owners(f.get("session_owners"))
        self.members.world_size = f.get("world_size")
        self.stats.restore(f.get("stats", {}))
        if self.policy is not None:
            self.policy.saved_version(self.store.version)
        self.resumed_from = path
        epoch = f.get("epoch")
        self.resumed_lineage = {"epoch": epoch if type(epoch) is int and epoch >= 1 else epoch_of(path),
                                **{k: v for k in ("leader", "standby") if isinstance(v := f.get(k), str)}}
        file_run = f.get("run_id") if isinstance(f.get("run_id"), str) else run_of(path)
        folder = Path(where) if Path(where).is_dir() else path.parent  # continued there: its runs' files are known
        continued = self.policy is not None and folder.resolve() == self.policy.dirpath.resolve()
        self._start_run(self.config.run_id or file_run or new_run_id(), continued=continued)
        log.info("resumed from %s at version %d (run %s)", path, self.store.version, self.run_id)

    def _read_newest(self, where: str | os.PathLike[str]) -> tuple[Path, Any]:
        candidates = checkpoint_candidates(where, self.config.run_id)
        errors = []
        for path in candidates:
            try:
                return path, read_checkpoint(path)
            except CheckpointError as exc:
                if len(candidates) == 1:
                    raise
                errors.append(str(exc))
                self.resume_skipped.append(path.name)
                log.warning("%s: falling back to the next newest checkpoint of its run", exc)
        raise CheckpointError(f"no readable checkpoint of the run in {where}: " + "; ".join(errors))

    def counters(self) -> dict[str, Any]:
        """The counters, as plain data (what ``stats`` answers and ``plug-asgd status`` shows)."""
        s, store, members, config = self.stats, self.store, self.members, self.config
        elapsed = max(1e-9, time.time() - s.started)
        return {
            "mode": config.mode, "version": store.version, "initialized": store.initialized,
            "shard": self.shard.spec, "partition_digest": self.shard.digest,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "max_updates": config.max_updates, "world_size": members.world_size,
            "world_held": members.world_fixed or (members.world_size is not None and members.claimed()),
            "sessions_owned": len(members.owners),
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
            "model_replies": s.model_replies, "delta_replies": s.delta_replies, "model_bytes_out": s.model_bytes_out,
            "approx_replies": s.approx_replies, "ahead_replies": s.ahead_replies,
            "part_replies": s.part_replies,
            "downlink_gap_max": store.downlink.gap_max if store.downlink is not None else None,
            "bytes_out_by_rank": {str(k): v for k, v in sorted(s.bytes_out_by_rank.items())},
            "weights_pushes": s.weights_pushes, "weights_not_current": s.weights_not_current,
            "weights_lent": s.weights_lent, "lent_copies": s.lent_copies, "threads": config.threads,
            "worker_timeout_s": config.worker_timeout,
            "lost": sorted(members.lost), "workers_lost": s.workers_lost, "workers_back": s.workers_back,
            "refused": dict(s.refused), "staleness": {str(k): v for k, v in sorted(s.staleness.items())},
            "pushes_by_rank": {str(k): v for k, v in sorted(s.pushes_by_rank.items())},
            **self.disk_counters(),
        }

    def disk_counters(self) -> dict[str, Any]:
        """The run and its writes: failed ones by kind (``"checkpoint ENOSPC": 2``), the last error, the
        newest checkpoint written, what a resume skipped, dedupe entries a checkpoint left out."""
        return {"run_id": self.run_id, "io_errors": dict(self.stats.io_errors),
                "io_last_error": self.stats.io_last_error,
                "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
                "resume_skipped": list(self.resume_skipped), "checkpoint_sessions_left_out": self.sessions_left_out}
