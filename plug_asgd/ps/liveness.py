"""Liveness: the workers of a run, live and lost, and the rule that declares one lost or takes it back.

A worker whose hello announced heartbeats and that is silent for ``worker_timeout`` seconds is
declared lost: no sync round, staleness bound or collective waits for it any more. If it speaks
again it is taken back as it is (its late pushes meet the mode's rule like any stale push). A
heartbeat or a notice comes from another socket of the worker than the one that said hello: it counts
only where it carries the rank's session and token. Who may join, and under which rank, session and world
size, is :mod:`plug_asgd.ps.membership`'s.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from plug_asgd.protocol.wire import Message, WireError
from plug_asgd.ps import limits
from plug_asgd.ps.stats import Stats

log = logging.getLogger("plug_asgd.ps")


@dataclass
class WorkerInfo:
    """A worker that said hello: who it is, where it is, and what the PS knows of it.

    Attributes:
        rank: its rank in the run.
        identity: the ROUTER identity of the connection that said hello (replies go there).
        session: the session string of its process; a new one is a restarted process.
        stage: the stage (a fit, a validation...) it said hello for.
        training: whether it trains in that stage (pushes), so that sync rounds and ssp wait for it.
        last_seen: when it last spoke, in ``time.time()`` seconds.
        pushes: how many of its pushes were folded in.
        heartbeat_s: the heartbeat interval its hello announced, in seconds; None: never declared lost.
        token: the membership token the hello reply gave it: a hello that carries it may take the rank over.
        rate: the local steps per second its last push said it makes (async_diloco's ``dynamic_steps``); None: none
            said in this stage.
    """

    rank: int
    identity: bytes
    session: str
    stage: int
    training: bool
    last_seen: float
    pushes: int = 0
    heartbeat_s: float | None = None  # announced in hello; None: never declared lost
    token: str = ""  # given in the hello reply: a hello that carries it may take the rank over
    rate: float | None = None  # the local steps per second its last push said (async_diloco's dynamic steps)


class Liveness:
    """The workers of a run by rank, live and lost, and by the identity of their connection; who spoke when, and
    who is declared lost for its silence (:class:`~plug_asgd.ps.membership.Membership` adds who may join).

    Args:
        worker_timeout: seconds of silence after which a heartbeating worker is declared lost.
        stats: the counters it adds to (refused, lost, back).
    """

    def __init__(self, worker_timeout: float, stats: Stats) -> None:
        self.worker_timeout = worker_timeout
        self.stats = stats
        self._last_bye: float | None = None  # when a worker last left a stage: its world stays held a while
        self.workers: dict[int, WorkerInfo] = {}
        self.lost: dict[int, WorkerInfo] = {}  # declared dead; taken back if they speak again
        self.by_identity: dict[bytes, WorkerInfo] = {}
        # ranks that trained at the PS this one took over from, not yet back here: rounds wait for them (since when)
        self.awaited: dict[int, float] = {}

    def await_ranks(self, ranks: frozenset[int], now: float | None = None) -> None:
        """A standby that leads now waits for the ranks that trained at its primary, as if they trained here, until
        each says hello or ``worker_timeout`` passes: a sync round must not complete on the first worker to move.

        Args:
            ranks: the ranks that trained at the primary.
            now: the time the wait starts, in ``time.time()`` seconds; None: now.
        """
        now = time.time() if now is None else now
        self.awaited.update((r, now) for r in ranks if r not in self.workers)

    def seen(self, identity: bytes) -> bool:
        """A request came from ``identity``; True if that took a lost worker back.

        Args:
            identity: the ROUTER identity of the connection the request came on.
        """
        worker = self.by_identity.get(identity)
        if worker is not None:
            worker.last_seen = time.time()
            return False
        lost = next((w for w in self.lost.values() if w.identity == identity), None)
        if lost is not None:
            self._take_back(lost)
        return lost is not None

    def heartbeat(self, msg: Message) -> bool:
        """From a worker's heartbeat socket (another identity): keeps it alive if it carries the rank's session
        and token; True if it took a lost worker back. One for a rank held (live or lost) by another session or
        token is counted as ``not_member``, with no reply (that socket never reads); one for a rank nobody
        holds (a worker that said bye, a PS restarted before the hello) is ignored.

        Args:
            msg: the ``heartbeat`` message: ``rank``, ``session`` and ``token``.
        """
        rank = msg.int_field("rank", minimum=0)
        worker = self.workers.get(rank)
        if _proves(worker, msg):
            worker.last_seen = time.time()
            return False
        lost = self.lost.get(rank)
        if _proves(lost, msg):
            self._take_back(lost)
            return True
        if worker is not None or lost is not None:
            self.stats.refused["not_member"] += 1
        return False

    def sender(self, msg: Message) -> int:
        """The rank of a notice, which comes from a worker's other socket: it must carry the rank's session and
        token (as a heartbeat does), else ``not_member``.

        Args:
            msg: the ``notice`` request: ``rank``, ``session`` and ``token``.

        Raises:
            WireError: ``not_member``, where no worker of that rank, live or lost, has that session and token.
        """
        rank = msg.int_field("rank", minimum=0)
        worker = self.workers.get(rank) or self.lost.get(rank)
        if not _proves(worker, msg):
            raise WireError("not_member", f"no worker of rank {rank} with this session and token: say hello first")
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
        """Declare lost the heartbeating workers silent for ``worker_timeout`` s; returns their ranks.

        Args:
            now: the time to judge silence at, in ``time.time()`` seconds; None: now.
        """
        now = time.time() if now is None else now
        missing = [r for r, since in self.awaited.items() if now - since > self.worker_timeout]
        for r in missing:
            del self.awaited[r]
            self.stats.workers_lost += 1
            log.warning("rank %d trained at the previous leader but has not come here within %g s (worker_timeout): "
                        "declared lost; nothing waits for it now", r, self.worker_timeout)
        gone = [w for w in self.workers.values()
                if w.heartbeat_s is not None and now - w.last_seen > self.worker_timeout]
        for w in gone:
            del self.workers[w.rank]
            self.by_identity.pop(w.identity, None)
            self.lost[w.rank] = w
            self.stats.workers_lost += 1
            log.warning("rank %d silent for %.1f s (worker_timeout %g s): declared lost; nothing waits for it "
                        "now", w.rank, now - w.last_seen, self.worker_timeout)
        return missing + [w.rank for w in gone]

    def claimed(self, now: float | None = None) -> bool:
        """Whether a worker of the run's world can still be counted on: it holds a rank and heartbeats (it would be
        declared lost if it fell silent), or it spoke within ``worker_timeout`` (one whose hello announced no
        heartbeats, never declared lost), or a worker left a stage within ``worker_timeout`` (between two stages).

        Args:
            now: the time to judge silence at, in ``time.time()`` seconds; None: now.
        """
        now = time.time() if now is None else now
        if any(w.heartbeat_s is not None or now - w.last_seen <= self.worker_timeout for w in self.workers.values()):
            return True
        return self._last_bye is not None and now - self._last_bye <= self.worker_timeout


def _proves(worker: WorkerInfo | None, msg: Message) -> bool:
    """Whether ``msg``, from one of a worker's other sockets (heartbeat, notices), carries that worker's session and
    token: the only proof such a socket has, since its identity is not the one that said hello."""
    return worker is not None and worker.session == limits.session(msg) and worker.token == msg.fields.get("token")
