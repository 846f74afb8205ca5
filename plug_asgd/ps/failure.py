"""A job whose rank failed: the PS tells the job's other ranks, so that none trains on alone.

Lightning ends every rank of a DDP job when one fails: the others fail in their next collective,
and the launcher kills its children. Workers of a PS share no collective while they train, so the
PS carries the news. A worker whose stage ends in an exception says so in its ``bye`` (``failed``:
what it raised, at most :data:`MAX_FAILURE_CHARS` characters), on its own connection and under its own
session (:meth:`~plug_asgd.ps.membership.Membership.bye` refuses any other). The PS then answers every later
request of the job's other workers (the sessions that held, or had lost, a rank at that moment)
with ``job_failed`` and that text, but for ``bye`` and ``stats``, which a failing worker sends on
its way out, and answers every gather waiting the same. A worker started afterwards (a new
session) is served as before.

An embedded PS whose parent (rank 0, which started it) is gone records the same and serves on for
at most :data:`FAILED_LINGER_S`, or until every worker has left, so that the others hear it at
their next request instead of waiting ``lost_timeout`` for a PS that went away.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from plug_asgd.protocol.wire import Message, WireError

MAX_FAILURE_CHARS = 2048  # a bye's ``failed`` text: every other rank's error reply quotes it
FAILED_SESSIONS_KEPT = 1 << 16  # sessions of failed jobs a long-lived PS remembers, the most recent
FAILED_LINGER_S = 3.0  # an embedded PS whose parent is gone serves this long at most, telling the workers
_ANSWERED = frozenset({"bye", "stats", "heartbeat"})  # what a worker of a failed job may still send


def reason(msg: Message) -> str | None:
    """The ``failed`` text of a ``bye``: what the leaving worker raised; None where its stage ended well.

    Args:
        msg: the ``bye`` request.

    Raises:
        WireError: ``limit``, where ``failed`` is not a string of at most :data:`MAX_FAILURE_CHARS` characters.
    """
    value = msg.fields.get("failed")
    if value is not None and (not isinstance(value, str) or len(value) > MAX_FAILURE_CHARS):
        raise WireError("limit", f"a bye's 'failed' must be a string of at most {MAX_FAILURE_CHARS} characters")
    return value


class JobFailure:
    """The sessions of failed jobs, each with the first failure its job reported (a PS may serve job after job)."""

    def __init__(self) -> None:
        self.failed: dict[str, str] = {}  # session -> what failed, the most recent last
        self.text: str | None = None  # the latest failure recorded
        self.linger_until: float | None = None  # set once the PS's parent is gone: when it stops

    def record(self, text: str, sessions: Iterable[str]) -> set[str]:
        """The job failed as ``text`` says: ``sessions`` are refused from now on (those of a job that failed
        already keep their first failure). The sessions newly failed.

        Args:
            text: what failed, in words (quoted to every other rank).
            sessions: the sessions of the job's workers at this moment.
        """
        new = {s for s in sessions if s not in self.failed}
        for session in new:
            self.failed[session] = text
        for session in list(self.failed)[:max(0, len(self.failed) - FAILED_SESSIONS_KEPT)]:
            del self.failed[session]
        self.text = text if new else self.text
        return new

    def check(self, session: Any, msg_type: str) -> None:
        """Refuse a request of the failed job (but its ``bye``, ``stats`` and heartbeats).

        Args:
            session: the sender's session (None: it holds none; a notice's is its field, whatever it is).
            msg_type: the request's type.

        Raises:
            WireError: ``job_failed``, with what failed, where ``session`` is one of the failed job's.
        """
        text = self.failed.get(session) if isinstance(session, str) else None  # (a sender's field: any type)
        if text is not None and msg_type not in _ANSWERED:
            raise WireError("job_failed", text)
