"""The asynchronous modes: each push folded into the central model as it arrives (asgd, adacomp, downpour, dynsgd,
ssp, agn); ssp holds back a worker too far ahead of the slowest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from typing_extensions import override

from plug_asgd.compressors import Codec, Compressor, TopKResidual
from plug_asgd.modes.base import Mode, PushMode, _check_count
from plug_asgd.modes.rules import AdaCompRule, DynSGDRule, FoldRule, SSPRule


@dataclass(frozen=True, kw_only=True)
class Asgd(PushMode):
    """Asynchronous SGD (Dean et al.'s): each push folded into the central model at once, whatever its staleness.

    Args:
        push_every: local steps between two pushes.
        pull_every: local steps between two pulls of the central model; None: with every push.
        overlap: whether each push is sent from a background thread while the next step computes.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, Asgd
        >>> strategy = AsyncPSStrategy(mode=Asgd(push_every=2))  # for Trainer(strategy=...); starts no process
        >>> strategy.mode, AsyncPSStrategy(mode="asgd").mode == Asgd()
        (Asgd(push_every=2, pull_every=None, overlap=False), True)
    """

    name = "asgd"
    summary = "push every step, folded in at once"
    compensate = "full"


@dataclass(frozen=True, kw_only=True)
class AdaComp(PushMode):
    """AdaComp: per tensor, the top ``fraction`` of ``|delta + residual|`` with its residual, sent as
    ``values`` (``"float16"``: 4 bytes per coordinate instead of 6); the PS scales by staleness.

    Args:
        fraction: the share of each tensor's coordinates sent per push, in ``(0, 1]``.
        values: the dtype the chosen values are sent as, ``"float32"`` or ``"float16"``.
        push_every: local steps between two pushes.
        pull_every: local steps between two pulls of the central model; None: with every push.
        overlap: whether each push is sent from a background thread while the next step computes.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, AdaComp
        >>> strategy = AsyncPSStrategy(mode=AdaComp(fraction=0.01, overlap=True))  # starts no process yet
        >>> strategy.mode.exchange  # each push sent while the next step computes
        'overlap'
    """

    name = "adacomp"
    summary = "per-layer top fraction with residual, staleness-scaled fold-in"
    rule = AdaCompRule
    compensate = "full"
    fraction: float = 0.01
    values: str = "float32"

    def __post_init__(self) -> None:
        super().__post_init__()
        TopKResidual(self.fraction, self.values)  # checks both

    @override
    def check_compressor(self, codec: Codec) -> None:
        self._refuse_codecs(codec, "adacomp is top-k selection paired with the PS's staleness scaling; for "
                                   "another codec use mode='asgd' with that compressor")

    @override
    def encoder(self, codec: Codec, rank: int) -> Compressor:
        return TopKResidual(self.fraction, self.values)


@dataclass(frozen=True, kw_only=True)
class Downpour(PushMode):
    """DOWNPOUR SGD (Dean et al., NIPS 2012): push the update of ``push_every`` local steps, pull every
    ``pull_every`` (its n_push and n_fetch); each push folded in at once.

    Args:
        push_every: local steps between two pushes.
        pull_every: local steps between two pulls of the central model; None: with every push.
        overlap: whether each push is sent from a background thread while the next step computes.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, Downpour
        >>> strategy = AsyncPSStrategy(mode=Downpour(push_every=4, pull_every=8))
        >>> strategy.mode
        Downpour(push_every=4, pull_every=8, overlap=False)
    """

    name = "downpour"
    summary = "push the update of push_every local steps, pull every pull_every steps"
    compensate = "full"
    push_every: int = 4


@dataclass(frozen=True, kw_only=True)
class DynSGD(PushMode):
    """DynSGD (Jiang et al., SIGMOD 2017): asgd whose PS scales each update by ``1 / (staleness + 1)``.

    Args:
        push_every: local steps between two pushes.
        pull_every: local steps between two pulls of the central model; None: with every push.
        overlap: whether each push is sent from a background thread while the next step computes.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, DynSGD
        >>> strategy = AsyncPSStrategy(mode=DynSGD())
        >>> type(strategy.mode.make_rule()).__name__  # the PS's half: the staleness scaling
        'DynSGDRule'
    """

    name = "dynsgd"
    summary = "asgd, each update scaled by 1/(staleness+1) at the PS"
    rule = DynSGDRule
    compensate = "full"


@dataclass(frozen=True, kw_only=True)
class SSP(PushMode):
    """Stale synchronous parallel: a worker more than ``staleness_bound`` pushes ahead of the slowest waits.

    Args:
        staleness_bound: how many pushes a worker may run ahead of the slowest before it waits (0: none).
        push_every: local steps between two pushes.
        pull_every: local steps between two pulls of the central model; None: with every push.
        overlap: whether each push is sent from a background thread while the next step computes.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, SSP
        >>> strategy = AsyncPSStrategy(mode=SSP(staleness_bound=3))
        >>> strategy.mode.server_options()  # what the embedded PS is started with
        {'staleness_bound': 3}
    """

    name = "ssp"
    summary = "asgd, but a worker staleness_bound pushes ahead of the slowest waits"
    rule = SSPRule
    compensate = "full"
    staleness_bound: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_count("staleness_bound", self.staleness_bound, "pushes ahead of the slowest worker", low=0)

    @override
    def make_rule(self, options: Mapping[str, Any] | None = None) -> FoldRule:
        bound = (options or {}).get("staleness_bound")
        return SSPRule(self.staleness_bound if bound is None else bound)

    @override
    def server_options(self) -> dict[str, Any]:
        return {"staleness_bound": self.staleness_bound}


@dataclass(frozen=True, kw_only=True)
class AGN(PushMode):
    """Accumulated gradient normalization (Hermans et al. 2017): each push is the update of ``push_every`` local
    steps divided by their number.

    ``push_every=None`` (the default): as many local steps as there are workers. The central model then takes one
    normalized step per N batches, N the workers, as DDP takes one step per N batches (one from each worker): DDP's
    pace per sample at DDP's learning rate, where a fixed 4 left 2 workers at half of it (1.0 to 1.3 points below
    DDP, docs/momentum.md).

    Args:
        push_every: local steps between two pushes; None: as many as there are workers.
        pull_every: local steps between two pulls of the central model; None: with every push.
        overlap: whether each push is sent from a background thread while the next step computes.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, AGN
        >>> strategy = AsyncPSStrategy(mode=AGN())
        >>> strategy.mode.for_workers(4).push_every  # a fit of 4 workers pushes every 4 local steps
        4
    """

    name = "agn"
    summary = "the update of push_every local steps divided by their number, folded in at once"
    normalize = True
    compensate = "unscaled"
    push_every: int | None = None
    push_every_none = "as many local steps as there are workers"

    @override
    def for_workers(self, workers: int) -> Mode:
        return replace(self, push_every=max(1, int(workers))) if self.push_every is None else self
