"""The PS's counters: what the ``stats`` request, ``plug-asgd status``, the dashboard and the metrics file show."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Stats:
    """Global counters of one PS; the store counts its buffers' fates here, the serving loop the rest.

    Attributes:
        started: when the PS started, in ``time.time()`` seconds.
        messages_in: requests received.
        bytes_in: bytes received, every request's.
        bytes_out: bytes of the replies sent.
        push_bytes_in: bytes of the pushes received over the socket.
        push_local_bytes_in: bytes of pushes read from workers' shared memory.
        pushes_applied: pushes the mode's rule folded in.
        pushes_dropped: pushes the mode's rule resolved without folding them in (``dropped``).
        pushes_after_stop: pushes that came after the central model reached ``max_updates``.
        push_messages: pushes received, whatever became of them.
        busy_s: wall seconds the serving thread spent handling requests.
        busy_cpu_s: of ``busy_s``, the seconds it ran on a core.
        push_busy_s: wall seconds it spent handling pushes.
        push_busy_cpu_s: of ``push_busy_s``, the seconds on a core.
        copies_on_write: writes that copied the central arrays first, as a reply might still read them.
        own_replies: replies that told a worker its own push alone made the new model ("own").
        model_replies: replies that carried model tensors.
        delta_replies: of those, the ones with only what their worker lacked.
        approx_replies: of those, the ones with only the largest differences (``downlink_fraction``).
        ahead_replies: of those, the ones with the central model less the step its rule anticipates (a push's that
            asked, under async_diloco's ``momentum_lookahead``).
        part_replies: of those, the ones with only the tensors their push carried (streaming's fragments).
        model_bytes_out: the bytes of the replies that carried model tensors.
        weights_pushes: pushes of weights taken as the model.
        weights_not_current: pushes of weights answered ``not_current`` instead (nothing folded).
        weights_lent: pushes of weights kept as the model in the worker's own memory (``lend``).
        lent_copies: lent weights copied after all.
        workers_lost: workers declared lost for their silence.
        workers_back: lost workers taken back when they spoke again.
        refused: refused requests, by error code.
        replies_dropped: replies dropped, by why (``queue_full``, ``gone``, ``total``: past the bytes queued over all
            connections).
        staleness: folded pushes by staleness (central versions behind).
        pushes_by_rank: folded pushes by rank.
        bytes_out_by_rank: reply bytes by the rank of the connection they went to.
        io_errors: failed writes by what and errno name (``"checkpoint ENOSPC"``).
        io_last_error: the last failed write, as text; None while none failed.
    """

    started: float = field(default_factory=time.time)
    messages_in: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    push_bytes_in: int = 0
    push_local_bytes_in: int = 0  # read from workers' shared memory instead of the socket
    pushes_applied: int = 0
    pushes_dropped: int = 0
    pushes_after_stop: int = 0
    push_messages: int = 0  # every push received, whatever became of it
    busy_s: float = 0.0  # wall time the serving thread spent handling requests (taken to answered)
    busy_cpu_s: float = 0.0  # ... of which it ran on a core (less when it waited for one)
    push_busy_s: float = 0.0  # wall time handling pushes
    push_busy_cpu_s: float = 0.0  # ... of which on a core
    copies_on_write: int = 0
    own_replies: int = 0
    model_replies: int = 0  # replies that carried model tensors ...
    delta_replies: int = 0  # ... of which only what their worker lacked (plug_asgd.ps.changes)
    approx_replies: int = 0  # ... of which only the largest differences (plug_asgd.ps.downlink)
    ahead_replies: int = 0  # ... of which the central model less its rule's anticipated step (FoldRule.ahead)
    part_replies: int = 0  # ... of which only the tensors their push carried (``model: "pushed"``)
    model_bytes_out: int = 0  # ... their bytes
    weights_pushes: int = 0  # pushes of weights taken as the model (see PSClient.push)
    weights_not_current: int = 0  # ... answered "not_current" instead: nothing folded
    weights_lent: int = 0  # ... kept as the model in the worker's own memory, without a copy (``lend``)
    lent_copies: int = 0  # lent weights copied after all (a model reply, a write in place, a stop)
    workers_lost: int = 0
    workers_back: int = 0
    refused: Counter = field(default_factory=Counter)
    replies_dropped: Counter = field(default_factory=Counter)  # queue_full (a connection not reading), gone, total
    staleness: Counter = field(default_factory=Counter)
    pushes_by_rank: Counter = field(default_factory=Counter)
    bytes_out_by_rank: Counter = field(default_factory=Counter)  # every reply to a worker's connection
    io_errors: Counter = field(default_factory=Counter)  # failed writes, "checkpoint ENOSPC": n (ps/disk.py)
    io_last_error: str | None = None

    # the counters a checkpoint keeps (the others describe one process's life)
    SAVED = ("pushes_applied", "pushes_dropped", "push_bytes_in", "bytes_in", "bytes_out")

    def saved(self) -> dict[str, object]:
        """What a checkpoint keeps of these counters."""
        return {**{name: getattr(self, name) for name in self.SAVED},
                "staleness": {str(k): v for k, v in self.staleness.items()},
                "pushes_by_rank": {str(k): v for k, v in self.pushes_by_rank.items()}}

    def restore(self, saved: dict[str, object]) -> None:
        """Take back :meth:`saved` (from a checkpoint, or a standby's state, which may come again: it replaces).

        Args:
            saved: what :meth:`saved` returned, read back from a checkpoint's header.
        """
        for name in self.SAVED:
            setattr(self, name, int(saved.get(name, 0)))  # type: ignore[call-overload]
        self.staleness.clear()
        self.pushes_by_rank.clear()
        self.staleness.update({int(k): v for k, v in saved.get("staleness", {}).items()})  # type: ignore[union-attr]
        self.pushes_by_rank.update({int(k): v for k, v in saved.get("pushes_by_rank", {}).items()})  # type: ignore[union-attr]
