"""Which remedies an asynchronous worker applies (:class:`StalenessCompensation`), and those a mode's workers
apply (:func:`resolve`, by the mode's ``compensate``); what each remedy does and why: docs/momentum.md, "What the
library does".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class StalenessCompensation:
    """Which remedies an asynchronous worker applies; ``window`` pushes make its staleness estimate.

    ``AsyncPSStrategy(staleness_compensation=False)`` turns all off (the seeds' plain fold).

    Args:
        scale: each update is pushed scaled by ``1 / (1 + s)``, ``s`` the worker's staleness estimate (left out
            for optimizers whose steps are normalized, as Adam's).
        lookahead: the model a reply brings is put ``s`` versions ahead, along the central model's last move.
        local_residual: what a sparse codec has not sent yet stays in the worker's model, not only in the codec.
        mask_momentum: the optimizer's momentum is zeroed at the coordinates a sparse update just sent.
        window: how many of the worker's last applied pushes its staleness estimate (their median) is made of.
        correct: the PS rescales a push for its own staleness where that is larger than the estimate, where an
            optimizer keeps momentum.
        nesterov: heavy-ball momentum SGD steps are taken in Nesterov's form while the updates are stale.

    Raises:
        ValueError: where ``window`` is not an int of at least 1.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, StalenessCompensation
        >>> compensation = StalenessCompensation(mask_momentum=False, window=8)
        >>> strategy = AsyncPSStrategy("asgd", staleness_compensation=compensation)  # connects to nothing yet
        >>> strategy.staleness_compensation == compensation
        True
        >>> StalenessCompensation(window=0)
        Traceback (most recent call last):
        ...
        ValueError: window must be an int >= 1, got 0

        The strategy then goes to a Trainer as usual: ``Trainer(strategy=strategy)``.
    """

    scale: bool = True
    lookahead: bool = True
    local_residual: bool = True
    mask_momentum: bool = True
    window: int = 16
    # the PS rescales each push for its own staleness where that is larger than the estimate (``scaled_for``);
    # only where an optimizer keeps momentum: without it a push staler than estimated is no risk, and the
    # correction only slowed training (docs/momentum.md)
    correct: bool = True
    # heavy-ball momentum SGD steps taken in Nesterov's form while the worker's updates are stale: the momentum's
    # own look-ahead, the dynamics of SGD(nesterov=True); beside the look-ahead only where the worker scales its
    # updates too (docs/momentum.md)
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")

    @property
    def active(self) -> bool:
        """Whether any remedy is on (``window`` and ``correct`` alone do nothing)."""
        return self.scale or self.lookahead or self.local_residual or self.mask_momentum or self.nesterov


OFF = StalenessCompensation(scale=False, lookahead=False, local_residual=False, mask_momentum=False, nesterov=False)


def resolve(value: StalenessCompensation | Mapping[str, Any] | bool | None, mode: str,
            kind: str) -> StalenessCompensation:
    """The compensation for ``mode``, by its ``Mode.compensate`` (``kind``: full, unscaled, step, round or none).

    None or True: the mode's default; False: off; an instance (or the dict of its fields, as a YAML
    file gives it): as given, refused for a mode that has no staleness to compensate.

    Args:
        value: what the strategy was given as ``staleness_compensation``.
        mode: the mode's name, for the error messages.
        kind: the mode's ``Mode.compensate``: which remedies its workers can apply.

    Raises:
        ValueError: where a dict holds a field the class lacks, or the remedies asked for do not go with the
            mode (a shared model takes only a scaled step in Nesterov's form; synchronous rounds only a scale;
            a mode without stale updates none).
        TypeError: where ``value`` is none of the accepted kinds.
    """
    if value is False:
        return OFF
    if isinstance(value, Mapping):
        try:
            value = StalenessCompensation(**value)
        except TypeError as exc:
            raise ValueError(f"staleness_compensation: {exc} (fields: scale, lookahead, local_residual, "
                             "mask_momentum, window, correct, nesterov)") from None
    if isinstance(value, StalenessCompensation):
        if kind == "step" and (value.lookahead or value.local_residual or value.mask_momentum):
            raise ValueError(f"mode={mode!r} shares one model and pushes nothing: only its step can be scaled and "
                             "taken in Nesterov's form (StalenessCompensation(scale=True, lookahead=False, "
                             "local_residual=False, mask_momentum=False, nesterov=True))")
        if kind == "round" and value.active and value != replace(OFF, scale=True, window=value.window,
                                                                 correct=value.correct):
            raise ValueError(f"mode={mode!r} averages synchronous rounds, each landing a round late: only its rounds "
                             "can be scaled (StalenessCompensation(scale=True, lookahead=False, local_residual=False, "
                             "mask_momentum=False, nesterov=False))")
        if kind == "none" and value.active:
            raise ValueError(f"staleness_compensation does not go with mode={mode!r}: its workers do not fold "
                             "stale updates into the central model (use staleness_compensation=False or leave it)")
        if kind == "round":  # a round's average is one version: nothing for the PS to correct
            return replace(value, correct=False)
        return value if kind in ("full", "step") else replace(value, scale=False)
    if value is None or value is True:
        if kind == "none":
            return OFF
        if kind == "step":
            return replace(OFF, scale=True, nesterov=True)
        if kind == "round":
            return replace(OFF, scale=True, correct=False)
        return StalenessCompensation(scale=kind == "full")
    raise TypeError(f"staleness_compensation must be a bool, None, a StalenessCompensation or a dict of its "
                    f"fields, got {value!r}")
