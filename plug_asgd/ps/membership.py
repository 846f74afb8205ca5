"""Who is in the run: hello and bye, heartbeats, and liveness (lost, and taken back).

A worker whose hello announced heartbeats and that is silent for ``worker_timeout`` seconds is
declared lost: no sync round, staleness bound or collective waits for it any more. If it speaks
again it is taken back as it is (its late pushes meet the mode's rule like any stale push); a
new session for the same rank (a restarted process) replaces the lost one.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from plug_asgd.ps.stats import Stats
from plug_asgd.wire import Message, WireError

log = logging.getLogger("plug_asgd.ps")


@dataclass
class WorkerInfo:
    rank: int
    identity: bytes
    session: str
    stage: int
    training: bool
    last_seen: float
    pushes: int = 0
    heartbeat_s: float | None = None  # announced in hello; None: never declared lost


class Membership:
    """The workers of a run by rank, and by the identity of their connection; the methods that change
    who trains return what the serving loop must then tell the store (``trainers``)."""

    def __init__(self, worker_timeout: float, stats: Stats) -> None:
        self.worker_timeout = worker_timeout
        self.stats = stats
        self.world_size: int | None = None
        self.workers: dict[int, WorkerInfo] = {}
        self.lost: dict[int, WorkerInfo] = {}  # declared dead; taken back if they speak again
        self.by_identity: dict[bytes, WorkerInfo] = {}
        self.ever_joined: set[int] = set()
        self.left: dict[int, set[int]] = defaultdict(set)
        self.late: dict[int, set[int]] = defaultdict(set)  # restarted mid-stage: outside its collectives
        self._empty_since: float | None = None

    def trainers(self) -> frozenset[int]:
        """The ranks training now: those a sync round or ssp's bound waits for."""
        return frozenset(r for r, w in self.workers.items() if w.training)

    def absent(self, stage: int) -> set[int]:
        """Ranks a collective of ``stage`` does not wait for: those that left it and those lost."""
        return self.left.get(stage, set()) | self.late.get(stage, set()) | set(self.lost)

    def seen(self, identity: bytes) -> bool:
        """A request came from ``identity``; True if that took a lost worker back."""
        worker = self.by_identity.get(identity)
        if worker is not None:
            worker.last_seen = time.time()
            return False
        lost = next((w for w in self.lost.values() if w.identity == identity), None)
        if lost is not None:
            self._take_back(lost)
        return lost is not None

    def heartbeat(self, msg: Message) -> bool:
        """From a worker's heartbeat socket (another identity): keeps it alive; True if taken back."""
        rank = msg.int_field("rank", minimum=0)
        session = msg.str_field("session")
        worker = self.workers.get(rank)
        if worker is not None and worker.session == session:
            worker.last_seen = time.time()
        elif rank in self.lost and self.lost[rank].session == session:
            self._take_back(self.lost[rank])
            return True
        return False

    def sender(self, msg: Message) -> int:
        """The rank of a message from one of a worker's other sockets (heartbeat, notices): its session's."""
        rank = msg.int_field("rank", minimum=0)
        worker = self.workers.get(rank) or self.lost.get(rank)
        if worker is None or worker.session != msg.str_field("session"):
            raise WireError("bad_field", f"no worker of rank {rank} with this session: say hello first")
        return rank

    def _take_back(self, worker: WorkerInfo) -> None:
        """A lost worker spoke again: it rejoins as it was."""
        del self.lost[worker.rank]
        silent = time.time() - worker.last_seen
        worker.last_seen = time.time()
        self.workers[worker.rank] = worker
        self.by_identity[worker.identity] = worker
        self.stats.workers_back += 1
        log.warning("rank %d is back after %.1f s of silence", worker.rank, silent)

    def check_liveness(self, now: float | None = None) -> list[int]:
        """Declare lost the heartbeating workers silent for ``worker_timeout`` s; returns their ranks."""
        now = time.time() if now is None else now
        gone = [w for w in self.workers.values()
                if w.heartbeat_s is not None and now - w.last_seen > self.worker_timeout]
        for w in gone:
            del self.workers[w.rank]
            self.by_identity.pop(w.identity, None)
            self.lost[w.rank] = w
            self.stats.workers_lost += 1
            log.warning("rank %d silent for %.1f s (worker_timeout %g s): declared lost; nothing waits for it "
                        "now", w.rank, now - w.last_seen, self.worker_timeout)
        return [w.rank for w in gone]

    def hello(self, identity: bytes, msg: Message, version: int) -> tuple[WorkerInfo, str | None]:
        """A worker (re)joins; the worker, and the session it replaces (a restarted process), if any."""
        rank = msg.int_field("rank", minimum=0)
        world_size = msg.int_field("world_size", minimum=1)
        stage = msg.int_field("stage", minimum=0)
        session = msg.str_field("session")
        if self.world_size is not None and world_size != self.world_size and self.workers:
            raise WireError("world_mismatch", f"worker says world_size={world_size}, the workers already "
                                              f"connected say {self.world_size}")
        if rank >= world_size:
            raise WireError("bad_field", f"rank {rank} is not below world_size {world_size}")
        heartbeat = _heartbeat(msg.fields.get("heartbeat_s"))
        self.world_size = world_size
        previous = self.workers.get(rank)
        if previous is not None:
            self.by_identity.pop(previous.identity, None)  # a reconnected worker has a new identity
        replaced = previous.session if previous is not None and previous.session != session else None
        if previous is None and rank in self.lost:
            previous = self.lost.pop(rank)  # restarted: the new process replaces the lost one
            log.warning("rank %d restarted (a new session) in stage %d: it starts from version %d", rank, stage,
                        version)
        if previous is not None and previous.session != session and previous.stage == stage:
            # a restarted process in a stage whose collectives the others have begun: it cannot take
            # part in them in step, so it trains alongside and its collectives are its own
            self.late[stage].add(rank)
        worker = WorkerInfo(rank, identity, session, stage, bool(msg.fields.get("training")), time.time(),
                            previous.pushes if previous is not None else 0, heartbeat)
        self.workers[rank] = worker
        self.by_identity[identity] = worker
        self.ever_joined.add(rank)
        self.left[stage].discard(rank)
        return worker, replaced

    def bye(self, rank: int, stage: int) -> None:
        """``rank`` has left ``stage`` (for good, or to begin the next one)."""
        worker = self.workers.get(rank)
        if worker is not None and worker.stage == stage:
            del self.workers[rank]
            self.by_identity.pop(worker.identity, None)
        self.lost.pop(rank, None)
        self.left[stage].add(rank)

    def stage_done(self, stage: int) -> bool:
        """Whether every rank has left ``stage``; if so, forget who left it."""
        if self.world_size is None or len(self.left[stage]) < self.world_size:
            return False
        del self.left[stage]
        self.late.pop(stage, None)
        return True

    def run_over(self, expected: int | None, linger: float) -> bool:
        """Whether ``expected`` workers have joined and all have left (or been lost) for ``linger`` seconds."""
        if expected is None or len(self.ever_joined) < expected:
            return False
        if self.workers:
            self._empty_since = None
            return False
        now = time.monotonic()
        if self._empty_since is None:
            self._empty_since = now
        if now - self._empty_since >= linger:
            log.info("all %d workers have left; stopping", len(self.ever_joined))
            return True
        return False

    def details(self) -> list[dict[str, Any]]:
        """Each worker, live or lost, as plain data (for ``stats``)."""
        now = time.time()
        return [{"rank": w.rank, "stage": w.stage, "training": w.training, "pushes": w.pushes,
                 "last_seen_s": round(now - w.last_seen, 3), "lost": w.rank in self.lost}
                for w in sorted([*self.workers.values(), *self.lost.values()], key=lambda w: w.rank)]


def _heartbeat(value: Any) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 3600):
        raise WireError("bad_field", f"heartbeat_s must be a number of seconds in (0, 3600), got {value!r}")
    return float(value) if value is not None else None
