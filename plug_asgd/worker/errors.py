"""What a worker's requests to the PS end in besides a reply (:class:`PSError`, :class:`PSUnreachableError`), and
what they moved (:class:`CommCounters`): shared by the transport and everything above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# What each reply to a push or a pull carried (CommCounters.replies): every push is answered by one of the push kinds,
# every pull by one of the pull kinds.
REPLY_KINDS = ("own", "whole", "delta", "approx", "ahead", "part", "no_model", "not_current", "duplicate", "pulled",
               "pulled_delta")


class PSError(RuntimeError):
    """The parameter server refused a request; ``code`` says why (see the PS's error codes).

    Args:
        code: the PS's short name of the reason (``not_member``, ``too_large``, ``bad_reply``, ...).
        message: the explanation, for a person.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PSUnreachableError(ConnectionError):
    """No reply from the parameter server within the timeout."""


@dataclass
class CommCounters:
    """What this worker moved: bytes by direction, request counts and time spent waiting.

    Attributes:
        bytes_up: bytes of every frame sent to the PS (resends included).
        bytes_down: bytes of every frame received from the PS.
        push_bytes_up: the part of ``bytes_up`` that pushes sent.
        push_local_bytes_up: bytes of pushed tensors written to shared memory for the PS instead of sent.
        requests: requests sent (a resend not counted again).
        pushes: pushes sent.
        own_replies: pushes answered without the model: the PS's model is the worker's plus its update.
        delta_replies: model replies that carried only what changed since the model held.
        weights_not_current: pushes of weights the PS did not take (not counted in ``pushes``).
        partly_applied: on a sharded PS, pushes some shards folded in and others dropped (sync rounds).
        wait_seconds: seconds spent waiting for replies, not counting work done meanwhile.
        replies: the replies by what they carried (``REPLY_KINDS``), one kind a reply (a refusal, raised as
            :class:`PSError`, is none of them). To a push: ``own`` (folded; no model: the worker makes it, base plus
            update), ``whole`` (the whole model), ``delta`` (only what changed since the model held: nothing where it
            held the current one), ``approx`` (only the largest differences from the copy held: a downlink fraction),
            ``ahead`` (the model, or the tensors pushed where the push wanted those only, less the step the PS's rule
            anticipates: async_diloco's ``momentum_lookahead``), ``part`` (the tensors pushed only, as they are: a push
            that wanted those, streaming's fragment), ``no_model`` (none asked for), ``not_current`` (weights the PS did
            not take: nothing folded, no model; not in ``pushes``), ``duplicate`` (applied before a reconnection; the
            model then comes by a pull, counted as one). To a pull: ``pulled`` (the whole model) or ``pulled_delta``
            (what changed: nothing where the model held is current). On a sharded PS, each shard's reply.
    """

    bytes_up: int = 0
    bytes_down: int = 0
    push_bytes_up: int = 0
    push_local_bytes_up: int = 0  # written to shared memory for the PS instead of sent (see push_buffers)
    requests: int = 0
    pushes: int = 0
    own_replies: int = 0  # pushes answered without the model (see PSClient.push)
    delta_replies: int = 0  # model replies that carried only what changed since the model held (HeldModel)
    weights_not_current: int = 0  # pushes of weights the PS did not take: not counted in pushes
    partly_applied: int = 0  # on a sharded PS: pushes some shards folded in and others dropped (sync rounds)
    wait_seconds: float = 0.0
    replies: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REPLY_KINDS, 0))

    def as_dict(self) -> dict[str, Any]:
        """The counters by name, as the callbacks log and the benchmarks report them (seconds to the µs)."""
        return {"bytes_up": self.bytes_up, "bytes_down": self.bytes_down, "push_bytes_up": self.push_bytes_up,
                "push_local_bytes_up": self.push_local_bytes_up,
                "requests": self.requests, "pushes": self.pushes, "own_replies": self.own_replies,
                "delta_replies": self.delta_replies,
                "weights_not_current": self.weights_not_current, "partly_applied": self.partly_applied,
                "wait_seconds": round(self.wait_seconds, 6), "replies": dict(self.replies)}
