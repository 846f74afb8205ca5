"""The PS's model replies as a client reads them: what one carries (:class:`ModelReply`), what a delta reply changed
(:class:`Changes`), the model a request says it holds (:func:`with_have`), and a reply read into the client's held
model (:func:`model_reply`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from plug_asgd.protocol.wire import Message, Sparse
from plug_asgd.worker.errors import CommCounters, PSError
from plug_asgd.worker.held_model import HeldModel


@dataclass(frozen=True)
class Changes:
    """What a delta reply changed of the model its client held (version ``since``): per tensor, the ascending flat
    indices of the coordinates it set, or None where the tensor came whole; a tensor not named did not change.
    A worker that keeps its own arrays beside the central ones updates them at these coordinates only.

    Attributes:
        since: the central version the client held before the reply.
        indices: per tensor the reply changed, the flat indices it set (ascending), or None where it came whole.
    """

    since: int
    indices: dict[str, np.ndarray | None]


@dataclass
class ModelReply:
    """The PS's answer to a pull or a push: central version and tensors, and whether to stop.

    Attributes:
        version: the central model's version after the request.
        status: what the PS did with a push (``applied``, ``dropped``, ``not_current``, ``duplicate``, ...) or
            ``pulled`` for a pull.
        stop: whether the PS asks the workers to stop training.
        tensors: the central model by name (a delta reply's already patched in); empty where none came.
        own: no tensors: the central model is exactly the worker's base plus its update (or its weights).
        approx: the tensors are near the central model (or the model ahead), not it: the PS sent only the largest
            differences, or every difference coded (its downlink).
        ahead: the tensors are the central model less the step the PS's rule anticipates before the worker's next
            push (:meth:`~plug_asgd.modes.rules.FoldRule.ahead`), which the push asked for: a base, not the model.
        part: the tensors are those the push carried only (it wanted those: streaming's fragment).
        changed: a delta reply's changes; None where the whole model came, or none.
        pace: the worker's local steps per second over the fastest training worker's, where its push said its own
            (``PSClient.push``'s ``rate``); None: not said.
    """

    version: int
    status: str
    stop: bool
    tensors: dict[str, np.ndarray]
    own: bool = False  # no tensors: the central model is exactly the worker's base plus its update (or its weights)
    approx: bool = False  # near the central model, not it: the PS's downlink sent the largest differences, or coded
    ahead: bool = False  # the central model less the step the PS's rule anticipates (a push that asked for it)
    part: bool = False  # the tensors the push carried only (a push that wanted those)
    changed: Changes | None = None  # a delta reply's changes; None: the whole model came, or none
    pace: float | None = None  # its steps per second over the fastest worker's, where its push said its own



def with_have(fields: dict[str, Any], held: HeldModel | None) -> dict[str, Any]:
    """``fields`` with the model a client holds, if any: the PS may then send only what changed since.

    Args:
        fields: a request's header fields.
        held: the client's held model; None where it keeps none.
    """
    have = held.have if held is not None else None
    if have is None:
        return fields
    return {**fields, "have" if held.exact else "held": list(have)}  # type: ignore[union-attr]


def reply_kind(reply: Message, request: str) -> str:
    """What a ``model`` reply to ``request`` (``push`` or ``pull``) carried, as ``CommCounters.replies`` counts it.

    Args:
        reply: the PS's ``model`` reply.
        request: the request it answers: ``push`` or ``pull``.
    """
    delta = reply.fields.get("delta") is True
    if request == "pull":
        return "pulled_delta" if delta else "pulled"
    if reply.fields.get("own") is True:
        return "own"
    if reply.fields.get("status") == "not_current":
        return "not_current"
    if reply.fields.get("approx") is True:
        return "approx"
    if reply.fields.get("ahead") is True:
        return "ahead"
    if reply.fields.get("part") is True:
        return "part"
    if delta:
        return "delta"
    return "whole" if reply.tensors else "no_model"


def model_reply(reply: Message, held: HeldModel | None, counters: CommCounters, request: str) -> ModelReply:
    """The model a PS's reply to a pull or a push carries: a delta reply patched into the client's held model, a whole
    model kept as it.

    Args:
        reply: the PS's ``model`` reply.
        held: the client's held model (brought up to date here); None where it keeps none.
        counters: the client's counters, which count a delta reply and the reply's kind (``replies``).
        request: the request it answers: ``push`` or ``pull``.

    Raises:
        PSError: ``bad_reply``, where a delta reply comes to a client that keeps no model.
    """
    kind = reply_kind(reply, request)
    counters.replies[kind] = counters.replies.get(kind, 0) + 1
    version = int(reply.fields["version"])
    tensors: dict[str, np.ndarray] = dict(reply.tensors)  # type: ignore[arg-type]
    changed = None
    if reply.fields.get("delta") is True:
        if held is None:
            raise PSError("bad_reply", "the parameter server sent part of the model to a client that keeps none")
        changed = Changes(held.version, {n: t.indices if isinstance(t, Sparse) else None
                                         for n, t in tensors.items()})
        model = held.patch(tensors, version, exact=reply.fields.get("approx") is not True,
                           add=reply.fields.get("add") is True)
        tensors = {n: model[n] for n in tensors} if reply.fields.get("part") is True else model
        counters.delta_replies += 1
    elif tensors and held is not None and reply.fields.get("part") is not True:  # a part leaves the held model as it is
        # a model ahead is not the central one: what is held is dropped, unless the PS keeps it as this client's copy
        kept = reply.fields.get("ahead") is not True or reply.fields.get("approx") is True
        held.keep(reply.fields.get("model_id") if kept else None, version, tensors,
                  exact=reply.fields.get("approx") is not True)
    return ModelReply(version=version, status=str(reply.fields.get("status")),
                      stop=bool(reply.fields.get("stop")), tensors=tensors, own=reply.fields.get("own") is True,
                      approx=reply.fields.get("approx") is True, ahead=reply.fields.get("ahead") is True,
                      part=reply.fields.get("part") is True, changed=changed, pace=_pace(reply.fields.get("pace")))


def _pace(value: Any) -> float | None:
    """A reply's ``pace``: a number in (0, 1], or None (missing, or not one: the worker keeps its inner steps)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        return None
    return float(value)
