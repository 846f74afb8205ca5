"""How a standby is elected: the votes of a majority of the run's live workers, and the proof its ``fenced`` carries.

The rule (docs/design.md, "Hot standby"). The **electorate** is the set of ranks training in the last state the
standby holds from its primary (the ``trainers`` of its last snapshot or ``trainers`` record; where none trains, the
ranks of the sessions it knows): the primary sends every change of that set before it makes it, so the standby's
electorate is the primary's as of the last record the standby acknowledged. A worker lost to its primary
(``worker_timeout``) leaves it by that record; one that dies with the primary stays in it, and counts as a vote
not cast. The standby leads only when the workers of **a majority** of the electorate (``len // 2 + 1``: 1 of 1,
2 of 2, 2 of 3, 3 of 4) have each asked it to (a ``lead`` request with the worker's session, token, the highest
version it saw and the epoch it knows), each within ``VOTE_TTL`` failovers of now and after the last word the
standby had from the primary, and no voter has seen a version above the standby's (it would lose the pushes
behind that version: ``standby_behind``, and it does not lead in this epoch).

A vote is kept as a **ballot**: an HMAC-SHA256 under the worker's token of the run, the epoch it elects, the session
and the version it saw. The primary issued each token and keeps it; a standby holds a worker's token only once that
worker sent it (a vote, or a hello after the failover). Leading, the standby answers every record of its old primary
with ``fenced``, which carries the epoch, the electorate it counted, the ballots, and a **seal**: an HMAC under the
link's token of all of them. The primary believes it only where the seal is the link's and the ballots that its own
tokens verify, of distinct ranks of the electorate it last had acknowledged, are a majority of that electorate
(:func:`check_proof`). So a peer that holds the link's credential but no majority's votes (a standby that lies, or
anyone who captured the link's token) cannot depose the primary: its ``fenced`` is refused (``bad_fenced``), and
the primary drops it as a standby and serves on.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from plug_asgd.protocol.wire import Message, WireError
from plug_asgd.ps.config import PSConfig
from plug_asgd.ps.fast_store import FastStore
from plug_asgd.ps.membership import Membership, proof

log = logging.getLogger("plug_asgd.ps")

VOTE_TTL = 2.0  # a vote counts for this many failover_timeouts after it was cast (a worker renews it as it asks)


def electorate(trainers: Iterable[int], owner_ranks: Iterable[int]) -> frozenset[int]:
    """The ranks whose votes elect a standby: those training, or where none does, those holding sessions.

    Args:
        trainers: the ranks training in the last state the standby holds (its primary's last ``trainers``).
        owner_ranks: the ranks of the sessions it knows.
    """
    ranks = frozenset(trainers)
    return ranks if ranks else frozenset(owner_ranks)


def needed(voters: frozenset[int]) -> int:
    """The votes that make a majority of ``voters`` (at least one).

    Args:
        voters: the electorate.
    """
    return len(voters) // 2 + 1


def ballot(token: str, run_id: str | None, epoch: int, session: str, version: int) -> str:
    """A worker's vote for the epoch ``epoch``, kept as an HMAC under its token (see the module doc).

    Args:
        token: the worker's membership token.
        run_id: the run's id (None: none known).
        epoch: the epoch the vote elects.
        session: the worker's session.
        version: the highest central version it saw.
    """
    signed = f"plug_asgd vote\x1f{run_id or ''}\x1f{epoch}\x1f{session}\x1f{version}"
    return hmac.new(token.encode(), signed.encode(), hashlib.sha256).hexdigest()


def seal(link: str, epoch: int, voters: list[int], votes: list[list[Any]]) -> str:
    """The link's seal over a ``fenced`` answer's proof: an HMAC under the link's token.

    Args:
        link: the link's token.
        epoch: the epoch the standby leads.
        voters: the electorate it counted.
        votes: its ballots, ``[session, version, ballot]`` each.
    """
    signed = json.dumps([epoch, voters, votes], separators=(",", ":"))
    return hmac.new(link.encode(), b"plug_asgd fenced\x1f" + signed.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Vote:
    """One worker's vote, as the standby keeps it.

    Attributes:
        session: the voter's session.
        version: the highest central version it saw.
        ballot: the vote's HMAC under its token (:func:`ballot`).
        at: when it was cast (``time.monotonic()``).
    """

    session: str
    version: int
    ballot: str
    at: float


class Tally:
    """A standby's votes for its next epoch, one per rank (the latest).

    Args:
        ttl: seconds a vote counts after it was cast.
    """

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.votes: dict[int, Vote] = {}

    def cast(self, rank: int, vote: Vote) -> None:
        """Count ``rank``'s vote (its latest replaces its earlier one).

        Args:
            rank: the voter's rank.
            vote: its vote.
        """
        self.votes[rank] = vote

    def highest(self, since: float) -> int:
        """The highest version a vote cast after ``since`` (the last word from the primary) names: the standby does
        not lead below it.

        Args:
            since: the last word from the primary (``time.monotonic()``).
        """
        return max((v.version for v in self.votes.values() if v.at > since), default=0)

    def live(self, voters: frozenset[int], since: float, now: float) -> dict[int, Vote]:
        """The votes that count now: of ranks of ``voters``, cast after ``since`` and within ``ttl`` of ``now``.

        Args:
            voters: the electorate.
            since: the last word from the primary: votes before it do not count.
            now: the time now (``time.monotonic()``).
        """
        return {r: v for r, v in self.votes.items() if r in voters and since < v.at and now - v.at <= self.ttl}

    def proof(self, link: str, epoch: int, voters: frozenset[int], votes: dict[int, Vote]) -> dict[str, Any]:
        """The fields of the ``fenced`` answer that prove a majority elected this standby.

        Args:
            link: the link's token.
            epoch: the epoch it leads.
            voters: the electorate it counted.
            votes: the votes that elected it.
        """
        ranks = sorted(voters)
        cast = [[v.session, v.version, v.ballot] for _, v in sorted(votes.items())]
        return {"voters": ranks, "votes": cast, "seal": seal(link, epoch, ranks, cast)}


def check_proof(fields: Mapping[str, Any], link: str, run_id: str | None, voters: frozenset[int],
                tokens: Mapping[str, tuple[int, str]]) -> str | None:
    """Why a ``fenced`` answer does not prove that a majority elected its sender (None: it does).

    Args:
        fields: the answer's fields (``epoch``, ``voters``, ``votes``, ``seal``).
        link: the token of the link it came on.
        run_id: the run's id.
        voters: the electorate the primary last had acknowledged by its standby.
        tokens: the primary's sessions: ``session -> (rank, token)``.
    """
    epoch, ranks, votes, sealed = (fields.get(k) for k in ("epoch", "voters", "votes", "seal"))
    if type(epoch) is not int or not isinstance(ranks, list) or not isinstance(votes, list):
        return "it carries no proof of a majority's votes"
    if not isinstance(sealed, str) or not sealed.isascii() or not link or not hmac.compare_digest(
            sealed, seal(link, epoch, ranks, votes)):
        return "its seal is not the link's"
    valid: set[int] = set()
    for vote in votes:
        if not (isinstance(vote, list) and len(vote) == 3 and isinstance(vote[0], str)
                and type(vote[1]) is int and isinstance(vote[2], str) and vote[2].isascii()):
            continue
        session, version, cast = vote
        owner = tokens.get(session)
        if owner is not None and owner[0] in voters and hmac.compare_digest(
                cast, ballot(owner[1], run_id, epoch, session, version)):
            valid.add(owner[0])
    if len(valid) < needed(voters):
        return (f"its ballots hold {len(valid)} valid vote(s) of the {len(voters)} live worker(s) this primary "
                f"knows, short of a majority ({needed(voters)})")
    return None


class Election:
    """A standby's count of the workers' votes (its ``lead`` requests), and a primary's check of the proof a
    ``fenced`` answer carries: a base of :class:`~plug_asgd.ps.failover.Failover` (see the module doc).

    It works on the server's config, store, membership and persistence (annotated here, set by the server).
    """

    config: PSConfig
    store: FastStore
    members: Membership
    persistence: Any
    role: str
    epoch: int
    primary_heard: float
    primary_version: int | None
    _link: str | None
    _send: Callable[..., None]
    _promote: Callable[[str], None]
    _not_serving: Callable[[], WireError]

    def _init_election(self) -> None:
        self.tally = Tally(VOTE_TTL * self.config.failover_timeout)
        self.fence_proof: dict[str, Any] = {}  # leading: what its ``fenced`` answers carry

    def voters(self) -> frozenset[int]:
        """The electorate now: the ranks training in the state this PS holds (a standby: its primary's last
        record; a primary: the last set its standby acknowledged, sent before its store took it)."""
        return electorate(self.store.rule.training_ranks, (o.rank for o in self.members.owners.values()))

    def _on_lead(self, identity: bytes, rid: Any, msg: Message) -> None:
        """A worker that could not reach the primary votes for this standby (the rule: module docstring); it is
        answered ``pending`` until a majority has voted, ``leading`` then. One that leads already says so to anyone
        of an earlier epoch (a bystander, a Supervisor's pulls, follows it too)."""
        known = msg.int_field("epoch", minimum=1)
        if self.role == "primary" and known < self.epoch:
            self._send(identity, rid, "leading", {"epoch": self.epoch, "version": self.store.version})
            return
        if self.role != "standby":
            raise self._not_serving() if self.role != "primary" else WireError(
                "bad_epoch", f"this parameter server leads epoch {self.epoch}: a worker of epoch {known} asks "
                             "nothing of it")
        session, token = msg.str_field("session"), msg.str_field("token")
        owner = self.members.owners.get(session)
        if owner is None or not hmac.compare_digest(owner.proof, proof(token)):
            raise WireError("bad_vote", "only a worker of this run (its session and token) may ask a standby to lead")
        if self._link is None or self.primary_version is None:
            raise WireError("not_ready", "this standby does not hold the primary's state yet")
        if known != self.epoch:
            raise WireError("bad_epoch", f"the worker knows epoch {known}, this standby follows epoch {self.epoch}")
        silent = time.monotonic() - self.primary_heard
        if silent < self.config.failover_timeout:
            raise WireError("primary_alive", f"this standby heard from the primary {silent:.1f} s ago: it is "
                                             "alive; the worker alone is cut off from it")
        voters = self.voters()
        if owner.rank not in voters:
            raise WireError("bad_vote", f"rank {owner.rank} is not a live worker of this run (those training at the "
                                        f"last record this standby holds: {sorted(voters)})")
        seen, now = msg.int_field("version", minimum=0, optional=True) or 0, time.monotonic()
        self.tally.cast(owner.rank, Vote(session, seen, ballot(token, self.persistence.run_id, self.epoch + 1,
                                                               session, seen), now))
        self._check_behind()
        votes = self.tally.live(voters, self.primary_heard, now)
        if len(votes) < needed(voters):
            self._send(identity, rid, "pending", {"epoch": self.epoch, "votes": len(votes),
                                                  "needed": needed(voters)})
            return
        self._window_loss()
        self.fence_proof = self.tally.proof(self._link, self.epoch + 1, voters, votes)
        self._promote(f"ranks {sorted(votes)} ({len(votes)} of the {len(voters)} live workers) could not reach it, "
                      f"nor could this standby for {silent:.1f} s")
        self._send(identity, rid, "leading", {"epoch": self.epoch, "version": self.store.version})

    def _check_behind(self) -> None:
        """No lead below the highest version a voter saw; with ``standby_window``, the window's loss is allowed."""
        highest = self.tally.highest(self.primary_heard)
        if highest > self.store.version and not self.config.standby_window:
            raise WireError("standby_behind", f"a worker saw version {highest}, this standby holds "
                                              f"{self.store.version}: the primary went on without it, and leading "
                                              "would lose the pushes it acknowledged since; this standby does not "
                                              "lead")

    def _window_loss(self) -> None:
        """Leading now with ``standby_window``, behind what a voter saw: the loss is said, and a base ahead of this
        version is folded in as fresh, as after a resume."""
        highest = self.tally.highest(self.primary_heard)
        if highest > self.store.version:
            log.warning("leading at version %d where a worker saw %d: the pushes folded after the last state this "
                        "standby holds are lost (standby_window %d)", self.store.version, highest,
                        self.config.standby_window)
            self.store.resumed = True

    def disproof(self, fields: Mapping[str, Any], link: str) -> str | None:
        """Why a ``fenced`` answer from this primary's standby does not prove that it leads (None: it does).

        Args:
            fields: the answer's fields.
            link: the token of the link it came on.
        """
        epoch = fields.get("epoch")
        if type(epoch) is not int or epoch <= self.epoch:
            return f"it names epoch {epoch!r:.20}, not one after this primary's {self.epoch}"
        tokens = {w.session: (w.rank, w.token) for w in (*self.members.lost.values(), *self.members.workers.values())}
        return check_proof(fields, link, self.persistence.run_id, self.voters(), tokens)
