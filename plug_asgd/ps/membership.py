"""Who is in the run: hello and bye, the world size, and who owns each rank and session.

Which workers are live or lost, and when one is declared lost or taken back, is :mod:`plug_asgd.ps.liveness`'s
(:class:`Membership` is its :class:`~plug_asgd.ps.liveness.Liveness`, joined); a new session for the rank of a
lost worker (a restarted process) replaces the lost one.

A rank belongs to the connection (ZeroMQ identity) and session that said hello for it: bye,
push, pull, gather and attach from any other connection are refused (``not_member``: it never
said hello, or no longer holds a rank; ``not_owner``: it names a rank or session not its own), and
so are heartbeats (they come from the worker's heartbeat socket) that do not carry the rank's
session and token. The hello reply gives the worker a token; a live rank passes to another
connection only with that token (the same worker, reconnected), otherwise only once it is lost
(``rank_taken`` until then). A session belongs to the rank, and the token, of the hello that first named
it: a hello under it for another rank, or without its token from another connection, is refused
(``session_taken``), so nobody but its worker can push under its numbers (the dedupe table's key).

The world size is fixed by the config (``--workers``, or the world size an embedded PS is given);
else by the first accepted hello, and it is held while a worker of it can still be counted on (it
holds a rank and heartbeats, or spoke within ``worker_timeout``, or said bye within it): a hello
claiming another size is then refused (``world_held``), and once nobody holds it the next hello sets
it. A hello that is refused changes nothing: no world, no session, no rank.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from plug_asgd.protocol.wire import Message, WireError
from plug_asgd.ps import limits
from plug_asgd.ps.liveness import Liveness, WorkerInfo
from plug_asgd.ps.stats import Stats

log = logging.getLogger("plug_asgd.ps")


@dataclass(frozen=True)
class Owner:
    """The worker a session belongs to: the rank of the hello that first named it, and its proof.

    Attributes:
        rank: the rank the session said hello for.
        proof: the SHA-256 (hex) of the token its worker holds: what a checkpoint keeps of it, so that a resumed PS
            knows the session's worker by the token it sends again, and a checkpoint read by another user gives
            nobody the token itself.
    """

    rank: int
    proof: str


def proof(token: str) -> str:
    """The proof a checkpoint keeps of a token: its SHA-256, in hex.

    Args:
        token: a membership token.
    """
    return hashlib.sha256(token.encode()).hexdigest()


class Membership(Liveness):
    """The workers of a run by rank, and by the identity of their connection; the methods that change
    who trains return what the serving loop must then tell the store (``trainers``).

    Args:
        worker_timeout: seconds of silence after which a heartbeating worker is declared lost.
        stats: the counters it adds to (refused, lost, back).
        world_size: the run's world size when it is fixed from the start (``--workers``, an embedded PS's); None:
            the first hellos set it.
    """

    def __init__(self, worker_timeout: float, stats: Stats, world_size: int | None = None) -> None:
        super().__init__(worker_timeout, stats)
        self._world_size = world_size
        self.world_fixed = world_size is not None  # by the config: a hello of another size is refused for good
        self.ever_joined: set[int] = set()
        self.left: dict[int, set[int]] = defaultdict(set)
        self.late: dict[int, set[int]] = defaultdict(set)  # restarted mid-stage: outside its collectives
        self.sessions: dict[int, list[str]] = defaultdict(list)  # per rank, its latest sessions (oldest first)
        self.forgotten: list[str] = []  # sessions past limits.SESSIONS_PER_RANK: the store forgets their numbers
        self.owners: dict[str, Owner] = {}  # the rank and token proof of each session kept: only they use it
        self._empty_since: float | None = None

    @property
    def world_size(self) -> int | None:
        """The run's world size; None until a hello (or ``--workers``, or a resumed checkpoint) gives it."""
        return self._world_size

    @world_size.setter
    def world_size(self, value: int | None) -> None:
        """Set by a resumed checkpoint: kept unless the run fixed it (``--workers``).

        Args:
            value: the world size the checkpoint holds; None where it holds none.
        """
        if not self.world_fixed:
            self._world_size = value

    def trainers(self) -> frozenset[int]:
        """The ranks training now: those a sync round or ssp's bound waits for."""
        return frozenset(r for r, w in self.workers.items() if w.training) | frozenset(self.awaited)

    def pace(self, rank: int) -> float | None:
        """``rank``'s local steps per second over the fastest's of the workers training now, by the rates their
        last pushes said (async_diloco's dynamic local steps: a worker at pace ``p`` makes ``p`` of the inner steps,
        so that every worker pushes as often); None where ``rank`` said none.

        Args:
            rank: the worker asking, which has said a rate with a push of this stage.
        """
        own = self.workers[rank].rate if rank in self.workers else None
        return None if own is None else _share(own, self.fastest_rate())

    def fastest_rate(self) -> float | None:
        """The highest rate the workers training now have said; None where none has said one."""
        return max((w.rate for w in self.workers.values() if w.training and w.rate is not None), default=None)

    def absent(self, stage: int) -> set[int]:
        """Ranks a collective of ``stage`` does not wait for: those that left it and those lost.

        Args:
            stage: the stage of the collective.
        """
        return self.left.get(stage, set()) | self.late.get(stage, set()) | set(self.lost)

    def member(self, identity: bytes, msg: Message, *, session: bool = False) -> WorkerInfo:
        """The worker that said hello on this connection; the message's rank (and ``session``) must be its own.

        Args:
            identity: the ROUTER identity of the connection the request came on.
            msg: the request; its ``rank`` (optional in a pull) must be the connection's.
            session: whether its ``session`` must be the connection's too (a push's).

        Raises:
            WireError: ``not_member`` where the connection holds no rank; ``not_owner`` where the message names
                another rank or session.
        """
        worker = self.by_identity.get(identity)
        if worker is None:
            raise WireError("not_member", f"a {msg.type!r} from a connection that holds no rank (it has not said "
                                          "hello, left, or its rank passed to another connection): say hello first")
        rank = msg.int_field("rank", minimum=0, optional=msg.type == "pull")
        if rank is not None and rank != worker.rank:
            raise WireError("not_owner", f"this connection holds rank {worker.rank}, not rank {rank}")
        if session and limits.session(msg) != worker.session:
            raise WireError("not_owner", f"this connection's session for rank {worker.rank} is another one")
        return worker

    def _check_claim(self, identity: bytes, msg: Message) -> tuple[int, int, str, str | None]:
        """The hello's rank, world size, session and token, refused beyond the limits, against a world fixed or held,
        for a live rank held by another connection without its token, or under a session another worker owns."""
        rank = msg.int_field("rank", minimum=0)
        world_size = limits.world_size(msg)
        token = limits.token(msg)
        session = limits.session(msg)
        assert rank is not None
        if self._world_size is not None and world_size != self._world_size:
            if self.world_fixed:
                raise WireError("world_mismatch", f"worker says world_size={world_size}, this run's is "
                                                  f"{self._world_size}")
            if self.claimed():
                raise WireError("world_held", f"worker says world_size={world_size}; the {len(self.workers)} "
                                              f"worker(s) here said hello for {self._world_size}, which holds until "
                                              f"each is declared lost or has left (worker_timeout "
                                              f"{self.worker_timeout:g} s)")
        if rank >= world_size:
            raise WireError("bad_field", f"rank {rank} is not below world_size {world_size}")
        held = self.by_identity.get(identity)
        if held is not None and held.rank != rank:
            raise WireError("not_owner", f"this connection holds rank {held.rank}; it cannot say hello as {rank}")
        live = self.workers.get(rank)
        if live is not None and live.identity != identity and token != live.token:
            raise WireError("rank_taken", f"rank {rank} is held by a live worker; a restarted worker can take it "
                                          f"once the PS declares that one lost (worker_timeout "
                                          f"{self.worker_timeout:g} s)")
        owner = self.owners.get(session)
        if owner is not None and not (owner.rank == rank and (
                (held is not None and held.session == session) or (token is not None and proof(token) == owner.proof))):
            raise WireError("session_taken", "this session belongs to another worker (the rank and token of the "
                                             "hello that first named it): a process says hello under a session of "
                                             "its own")
        return rank, world_size, session, token

    def _set_world(self, world_size: int) -> None:
        """The world not held (or not yet known) takes the accepted hello's size; ranks beyond it are dropped."""
        if world_size == self._world_size:
            return
        for ranks in (self.workers, self.lost):
            for w in [w for w in ranks.values() if w.rank >= world_size]:
                log.warning("rank %d dropped: a hello says the world has %d ranks", w.rank, world_size)
                del ranks[w.rank]
                if self.by_identity.get(w.identity) is w:
                    del self.by_identity[w.identity]
        self._world_size = world_size

    def hello(self, identity: bytes, msg: Message, version: int) -> tuple[WorkerInfo, str | None]:
        """A worker (re)joins; the worker, and the session it replaces (a restarted process), if any.

        Args:
            identity: the ROUTER identity of the connection that said hello.
            msg: the ``hello`` request: rank, world size, stage, session, training, heartbeat and token.
            version: the central version now (logged where a lost rank restarts from it).
        """
        rank, world_size, session, token = self._check_claim(identity, msg)
        stage = msg.int_field("stage", minimum=0)
        heartbeat = _heartbeat(msg.fields.get("heartbeat_s"))
        assert stage is not None
        self._set_world(world_size)
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
        kept = previous.token if previous is not None and rank in self.workers else None
        worker = WorkerInfo(rank, identity, session, stage, bool(msg.fields.get("training")), time.time(),
                            previous.pushes if previous is not None else 0, heartbeat,
                            token or kept or secrets.token_hex(16))
        self.workers[rank] = worker
        self.by_identity[identity] = worker
        self.awaited.pop(rank, None)
        self.ever_joined.add(rank)
        if stage in self.left:
            self.left[stage].discard(rank)
        self._keep_session(rank, session)
        self.owners[session] = Owner(rank, proof(worker.token))
        return worker, replaced

    def _keep_session(self, rank: int, session: str) -> None:
        """``rank``'s latest sessions, at most limits.SESSIONS_PER_RANK; older ones go to ``forgotten``."""
        owned = self.sessions[rank]
        if session in owned:
            owned.remove(session)
        owned.append(session)
        while len(owned) > limits.SESSIONS_PER_RANK:
            self.forgotten.append(owned.pop(0))
            self.owners.pop(self.forgotten[-1], None)

    def owner_fields(self, sessions: Iterable[str]) -> dict[str, list[Any]]:
        """What a checkpoint keeps of the owners of ``sessions`` (those of its dedupe table): ``[rank, proof]`` each.

        Args:
            sessions: the sessions whose owners to keep.
        """
        return {s: [o.rank, o.proof] for s in sessions if (o := self.owners.get(s)) is not None}

    def restore_owners(self, fields: Any) -> None:
        """Take the session owners a checkpoint kept (:meth:`owner_fields`); entries of another shape are left out.

        Args:
            fields: the checkpoint's ``session_owners`` field; None where it has none (an older checkpoint: its
                sessions then belong to the first hello that names each, as before).
        """
        if not isinstance(fields, dict):
            return
        for session, entry in fields.items():
            if (isinstance(session, str) and isinstance(entry, list) and len(entry) == 2
                    and isinstance(entry[0], int) and not isinstance(entry[0], bool) and entry[0] >= 0
                    and isinstance(entry[1], str) and len(entry[1]) == 64):
                self.owners[session] = Owner(entry[0], entry[1])

    def bye(self, identity: bytes, msg: Message) -> int:
        """The connection's own rank leaves its stage (for good, or to begin the next one); returns the stage.

        A bye that says its rank failed (``failed``: the PS then ends the job's other workers) must name the
        connection's session too: only the rank's own connection, under its own session, says its rank failed.

        Args:
            identity: the ROUTER identity of the connection that said bye.
            msg: the ``bye`` request: its ``rank`` and ``stage`` (and, with ``failed``, its ``session``).

        Raises:
            WireError: ``not_member`` where the connection holds no rank, ``not_owner`` where it names another rank
                (or, saying its rank failed, another session); ``bad_field``, where the stage is not the one the
                rank is in.
        """
        worker = self.member(identity, msg, session=msg.fields.get("failed") is not None)
        stage = msg.int_field("stage", minimum=0)
        assert stage is not None
        if stage != worker.stage:
            raise WireError("bad_field", f"rank {worker.rank} is in stage {worker.stage}, not {stage}")
        del self.workers[worker.rank]
        self.by_identity.pop(identity, None)
        self.left[stage].add(worker.rank)
        self._last_bye = time.time()
        return stage

    def stage_done(self, stage: int) -> bool:
        """Whether every rank has left ``stage``; if so, forget who left it.

        Args:
            stage: the stage a rank just left.
        """
        if self.world_size is None or len(self.left[stage]) < self.world_size:
            return False
        del self.left[stage]
        self.late.pop(stage, None)
        return True

    def run_over(self, expected: int | None, linger: float) -> bool:
        """Whether ``expected`` workers have joined and all have left (or been lost) for ``linger`` seconds.

        Args:
            expected: the workers the run expects (``--workers``); None: the run is never over by itself.
            linger: seconds the PS stays with no worker before the run is over.
        """
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
        """Each worker, live or lost, as plain data (for ``stats``); one that paces its rounds (async_diloco's dynamic
        steps) with the local steps per second it said last (``rate``) and, while it trains, its :meth:`pace`."""
        now, out, fastest = time.time(), [], self.fastest_rate()  # (once: the dashboard asks on every tick)
        for w in sorted([*self.workers.values(), *self.lost.values()], key=lambda w: w.rank):
            row = {"rank": w.rank, "stage": w.stage, "training": w.training, "pushes": w.pushes,
                   "last_seen_s": round(now - w.last_seen, 3), "lost": w.rank in self.lost}
            if w.rate is not None:
                live = w.training and not row["lost"]
                row["rate"], row["pace"] = w.rate, _share(w.rate, fastest) if live else None
            out.append(row)
        return out


def _share(rate: float, fastest: float | None) -> float:
    """A pace: ``rate`` over the fastest rate said (itself where it is the fastest, or the only one)."""
    return rate / max(rate, fastest or rate)


def _heartbeat(value: Any) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 3600):
        raise WireError("bad_field", f"heartbeat_s must be a number of seconds in (0, 3600), got {value!r}")
    return float(value) if value is not None else None
