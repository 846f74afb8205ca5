"""What goes into a store and what comes out of it: a push as received (:class:`PushIn`), what became of it
(:class:`Folded` and its statuses), the state a checkpoint keeps (:class:`Snapshot`), and the bounds on a push's
fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plug_asgd.modes import Resolution
from plug_asgd.protocol.wire import Local, Tensor

NOT_CURRENT = "not_current"  # weights based on an older model: nothing folded (see PSClient.push)
STOPPED = "stopped"  # the PS reached max_updates: nothing folded
FOLDED = "folded"  # handed to the mode's rule, which resolved it now or will later


# The largest staleness estimate a push may say it was scaled for: far beyond any a worker measures, small enough
# that the correction stays a finite float32 factor.
MAX_SCALED_FOR = 1e6
# How far a push's number may lie past its session's last one. A worker numbers its pushes 1, 2, 3...; the gap
# it leaves is the pushes the PS never recorded (refused, or folded after the checkpoint a PS resumed from), far
# below this. One push cannot set its session's number beyond what its worker will reach.
MAX_SEQ_STEP = 1 << 32


@dataclass
class PushIn:
    """One push as received.

    Attributes:
        token: what the mode's rule hands back when it resolves the push (where its answer goes).
        rank: the pushing worker's rank.
        session: the session of the worker's process.
        seq: its number in ``session``: each is folded at most once.
        base_version: the central version the update was computed from.
        tensors: the update, by name; a tensor may name a worker's shared memory (:class:`Local`).
        frames: the received frames of its dense tensors, by name.
        weights: whether it carries weights to take as the model rather than an update.
        lend: whether the store may keep those weights where they lie, in the worker's memory.
        request: the number of the request it came in.
        scaled_for: the staleness its worker scaled it for (staleness compensation's estimate), corrected here
            to the staleness it lands with; None: not scaled.
    """

    token: Any
    rank: int
    session: str
    seq: int
    base_version: int
    tensors: dict[str, Tensor | Local]
    frames: dict[str, Any] = field(default_factory=dict)
    weights: bool = False
    lend: bool = False
    request: int = 0
    scaled_for: float | None = None


@dataclass
class Folded:
    """What became of a push.

    Attributes:
        status: ``folded``, ``stopped`` or ``not_current``.
        resolutions: the pushes the rule resolved now, this one or others (a completed sync round).
        own_version: the version this push alone made, where its worker can make that model itself (the base
            plus the update as folded here, bit for bit); None otherwise.
        staleness: central versions between the push's base and the model it was folded into.
        local_bytes: the bytes read from the worker's shared memory.
    """

    status: str
    resolutions: list[Resolution] = field(default_factory=list)
    own_version: int | None = None
    staleness: int = 0
    local_bytes: int = 0


@dataclass
class Snapshot:
    """The state a checkpoint keeps: the tensors (read them before the store serves another request).

    Attributes:
        version: the central version.
        tensors: the central tensors, by name (the store's own arrays, not copies).
        last_seq: the last push number of each session, so that a push sent again after a resume is refused.
        rule_fields: the mode's rule's state, as plain data.
        rule_arrays: the mode's rule's state, as arrays by name.
    """

    version: int
    tensors: dict[str, np.ndarray]
    last_seq: dict[str, int]
    rule_fields: dict[str, Any]
    rule_arrays: dict[str, np.ndarray]
