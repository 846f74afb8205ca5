"""The outer optimizer of DiLoCo's modes (:class:`OuterOptimizer`), which the PS applies to a pseudo-gradient, and
what a checkpoint keeps of its state. Numpy only, as every rule."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np

F32 = np.float32


@dataclass(frozen=True)
class OuterOptimizer:
    """The optimizer the PS applies to a round's pseudo-gradient ``g`` (the workers' mean of ``w_base - w``), with
    torch's update rules in float32 (Nesterov's and SGD's in torch's order of operations too):

    - ``"nesterov"``: ``b = momentum * b + g`` (``b = g`` at the first round); ``w -= lr * (g + momentum * b)``;
    - ``"sgd"``: ``b`` as above (none where ``momentum`` is 0); ``w -= lr * b``;
    - ``"adam"``: ``m = beta1 * m + (1 - beta1) * g``, ``v = beta2 * v + (1 - beta2) * g * g``,
      ``w -= lr / (1 - beta1 ** t) * m / (sqrt(v) / sqrt(1 - beta2 ** t) + eps)``.

    Args:
        name: ``"nesterov"``, ``"sgd"`` or ``"adam"``.
        lr: the outer learning rate (0.7: the paper's, with Nesterov's momentum 0.9; 1.0 with ``"sgd"`` and no
            momentum is the workers' plain average, local SGD's).
        momentum: ``"nesterov"`` and ``"sgd"``'s momentum.
        beta1: Adam's first moment's decay.
        beta2: Adam's second moment's decay.
        eps: Adam's epsilon.

    Raises:
        ValueError: an unknown ``name``, a learning rate not above 0, a momentum or a beta outside [0, 1).

    Example:
        >>> from plug_asgd.modes.outer import OuterOptimizer
        >>> OuterOptimizer()
        OuterOptimizer(name='nesterov', lr=0.7, momentum=0.9, beta1=0.9, beta2=0.999, eps=1e-08)
    """

    name: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    KINDS: ClassVar[tuple[str, ...]] = ("nesterov", "sgd", "adam")

    def __post_init__(self) -> None:
        if self.name not in self.KINDS:
            raise ValueError(f"outer optimizer {self.name!r}: choose one of {', '.join(self.KINDS)}")
        for knob in ("lr", "momentum", "beta1", "beta2", "eps"):  # floats: lr=1 and lr=1.0 are one optimizer, one JSON
            value = getattr(self, knob)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"the outer optimizer's {knob} must be a number, got {value!r}")
            object.__setattr__(self, knob, float(value))
        if not self.lr > 0:
            raise ValueError(f"the outer optimizer's lr must be > 0, got {self.lr}")
        for knob in ("momentum", "beta1", "beta2"):
            if not 0 <= getattr(self, knob) < 1:
                raise ValueError(f"the outer optimizer's {knob} must be in [0, 1), got {getattr(self, knob)}")

    @classmethod
    def get(cls, outer: OuterOptimizer | str | Mapping[str, Any] | None) -> OuterOptimizer:
        """``outer`` as an optimizer: itself, a name at its defaults, a dict of its fields, or its JSON.

        Args:
            outer: what the mode or the PS's flag was given (None: the default).
        """
        if outer is None:
            return cls()
        if isinstance(outer, OuterOptimizer):
            return outer
        if isinstance(outer, str):
            return cls(**json.loads(outer)) if outer.lstrip().startswith("{") else cls(name=outer)
        return cls(**dict(outer))

    def to_json(self) -> str:
        """The optimizer as the PS's ``--outer`` flag takes it."""
        return json.dumps(asdict(self), sort_keys=True)

    def step(self, t: int, w: np.ndarray, g: np.ndarray, slots: dict[str, np.ndarray]) -> None:
        """One outer step of tensor ``w`` (in place) on the pseudo-gradient ``g``, the ``t``-th (from 1).

        Args:
            t: the outer step's number (Adam's bias correction).
            w: the central tensor, float32, changed in place.
            g: its pseudo-gradient, float32.
            slots: this tensor's state (``b``; or ``m``, ``v``), filled at the first step.
        """
        if self.name == "adam":
            b1, b2 = F32(self.beta1), F32(self.beta2)
            m = slots.setdefault("m", np.zeros_like(w))
            v = slots.setdefault("v", np.zeros_like(w))
            m *= b1
            m += (F32(1) - b1) * g
            v *= b2
            v += (F32(1) - b2) * g * g
            step = F32(self.lr / (1 - self.beta1 ** t))
            denom = np.sqrt(v) / F32(np.sqrt(1 - self.beta2 ** t)) + F32(self.eps)
            w -= step * (m / denom)
            return
        mu = F32(self.momentum)
        d = g
        if self.momentum:
            b = slots.get("b")
            if b is None:
                b = slots["b"] = g.copy()
            else:
                b *= mu
                b += g
            d = g + mu * b if self.name == "nesterov" else b
        w -= F32(self.lr) * d


def check_saved_outer(fields: dict[str, Any], outer: OuterOptimizer) -> None:
    """Refuses a checkpoint of another outer optimizer: its state would mean something else.

    Args:
        fields: the checkpoint's header fields of the rule.
        outer: this PS's outer optimizer.

    Raises:
        ValueError: the checkpoint's outer optimizer is another.
    """
    saved = fields.get("outer")
    if saved is not None and OuterOptimizer(**saved) != outer:
        raise ValueError(f"the checkpoint's outer optimizer {saved} is not this PS's {asdict(outer)}: resume with "
                         "the same --outer (or mode's outer=)")


def slot_arrays(slots: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The outer optimizer's state by tensor as a checkpoint's ``outer/SLOT/NAME`` arrays (:func:`saved_slots`
    reads them back).

    Args:
        slots: by tensor name, its slots (``"b"``, ``"m"``, ...) and their arrays.
    """
    return {f"outer/{slot}/{name}": array for name, by_slot in slots.items() for slot, array in by_slot.items()}


def saved_slots(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """The outer optimizer's state by tensor from a checkpoint's ``outer/SLOT/NAME`` arrays.

    Args:
        arrays: the rule's arrays from a checkpoint (others than ``outer/...`` are passed over).
    """
    slots: dict[str, dict[str, np.ndarray]] = {}
    for key, array in arrays.items():
        if key.startswith("outer/"):
            _, slot, name = key.split("/", 2)
            slots.setdefault(name, {})[slot] = np.array(array, dtype=F32)
    return slots
