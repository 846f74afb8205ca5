"""The modes that push no update of their own steps: hogwild (one shared-memory model) and the elastic averaging
modes (easgd, eamsgd).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from plug_asgd.compressors import Codec
from plug_asgd.modes.base import Mode, _check_count


@dataclass(frozen=True, kw_only=True)
class Hogwild(Mode):
    """Hogwild: the workers of one machine step one shared-memory model without locks; nothing is pushed.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, Hogwild
        >>> AsyncPSStrategy(mode=Hogwild()).mode.exchange
        'shared'
        >>> AsyncPSStrategy(mode=Hogwild(), compressor="topk")
        Traceback (most recent call last):
        ValueError: compressor='topk' does not go with mode='hogwild': its workers share memory and send nothing
    """

    name = "hogwild"
    summary = "workers of one machine update one shared-memory model without locks"
    compensate = "step"

    @property
    @override
    def exchange(self) -> str:
        return "shared"

    @override
    def check_compressor(self, codec: Codec) -> None:
        self._refuse_codecs(codec, "its workers share memory and send nothing")


@dataclass(frozen=True, kw_only=True)
class EASGD(Mode):
    """Elastic averaging: every ``tau`` local steps worker and center move ``alpha * (w - center)`` towards
    each other (the worker pulls the center, steps, and pushes what the center must move).

    Args:
        tau: local steps between two elastic exchanges.
        alpha: the elastic step, in ``(0, 1)``: the share of ``w - center`` each side moves.

    Raises:
        ValueError: where ``tau`` is not a positive integer or ``alpha`` is not in ``(0, 1)``.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, EASGD
        >>> strategy = AsyncPSStrategy(mode=EASGD(tau=8, alpha=0.3))
        >>> strategy.mode.exchange
        'elastic'
    """

    name = "easgd"
    summary = "every tau steps worker and center move alpha*(w - center) towards each other"
    tau: int = 4
    alpha: float = 0.5

    def __post_init__(self) -> None:
        _check_count("tau", self.tau)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1) (the elastic step), got {self.alpha!r}")

    @property
    @override
    def exchange(self) -> str:
        return "elastic"

    @override
    def check_compressor(self, codec: Codec) -> None:
        self._refuse_codecs(codec, f"{self.name}'s elastic exchange moves the worker by exactly what the center "
                                   "receives, which a lossy codec would break")


@dataclass(frozen=True, kw_only=True)
class EAMSGD(EASGD):
    """Elastic averaging momentum SGD: easgd whose workers train with Nesterov momentum SGD (checked at fit).

    Args:
        tau: local steps between two elastic exchanges.
        alpha: the elastic step, in ``(0, 1)``.

    Example:
        >>> import torch
        >>> from plug_asgd import AsyncPSStrategy, EAMSGD
        >>> strategy = AsyncPSStrategy(mode=EAMSGD(tau=4))
        >>> sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1, momentum=0.9, nesterov=True)
        >>> strategy.mode.check_optimizers([sgd])  # any other optimizer is refused with a ValueError
    """

    name = "eamsgd"
    summary = "easgd with Nesterov momentum SGD on the workers"

    @override
    def check_optimizers(self, optimizers: list[Any]) -> None:
        for opt in optimizers:
            group = opt.param_groups[0] if opt.param_groups else {}
            sgd = any(c.__name__ == "SGD" and c.__module__.startswith("torch.optim") for c in type(opt).__mro__)
            if not (sgd and group.get("nesterov") and group.get("momentum", 0) > 0):
                raise ValueError("mode='eamsgd' is EASGD with Nesterov momentum on the workers: configure "
                                 "torch.optim.SGD(..., momentum=0.9, nesterov=True), or use mode='easgd'")
