"""The modes of synchronous rounds: ``replicas_to_aggregate`` updates based on the current version averaged (sync,
localsgd, sagn, osp, losp).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from plug_asgd.modes.base import PushMode, _check_count
from plug_asgd.modes.rules import FoldRule, SyncRule


@dataclass(frozen=True, kw_only=True)
class Sync(PushMode):
    """Synchronous rounds: ``replicas_to_aggregate`` updates based on the current version averaged
    (default: every training worker); older ones are dropped.

    Args:
        replicas_to_aggregate: the updates averaged per round; None: every worker training. Fewer than the
            workers make the slowest ones backup workers.
        push_every: local steps between two pushes.
        pull_every: local steps between two pulls of the central model; None: with every push.
        overlap: whether each push is sent from a background thread while the next step computes.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, Sync
        >>> strategy = AsyncPSStrategy(mode=Sync(replicas_to_aggregate=3))  # of 4 workers, one a backup
        >>> strategy.mode.server_options()
        {'replicas_to_aggregate': 3}
    """

    name = "sync"
    summary = "average of replicas_to_aggregate updates per version, stale ones dropped"
    rule = SyncRule
    replicas_to_aggregate: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_count("replicas_to_aggregate", self.replicas_to_aggregate, "updates averaged per round",
                     none="every training worker")

    @override
    def make_rule(self, options: Mapping[str, Any] | None = None) -> FoldRule:
        replicas = (options or {}).get("replicas_to_aggregate")
        return SyncRule(self.replicas_to_aggregate if replicas is None else replicas)

    @override
    def server_options(self) -> dict[str, Any]:
        return {"replicas_to_aggregate": self.replicas_to_aggregate}


@dataclass(frozen=True, kw_only=True)
class LocalSGD(Sync):
    """Local SGD: ``push_every`` local steps, then the workers' models are averaged in a synchronous round.

    Args:
        push_every: local steps between two rounds.
        replicas_to_aggregate: the updates averaged per round; None: every worker training.
        pull_every: local steps between two pulls of the central model; None: with every push.
        overlap: whether each push is sent from a background thread while the next step computes.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, LocalSGD
        >>> strategy = AsyncPSStrategy(mode=LocalSGD(push_every=16))
        >>> strategy.mode
        LocalSGD(push_every=16, pull_every=None, overlap=False, replicas_to_aggregate=None)
    """

    name = "localsgd"
    summary = "push_every local steps, then the models are averaged synchronously"
    push_every: int = 8


@dataclass(frozen=True, kw_only=True)
class SAGN(Sync):
    """Synchronous AGN: agn's updates (of ``push_every`` local steps, divided by their number), averaged in rounds.

    Args:
        push_every: local steps between two rounds.
        replicas_to_aggregate: the updates averaged per round; None: every worker training.
        pull_every: local steps between two pulls of the central model; None: with every push.
        overlap: whether each push is sent from a background thread while the next step computes.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, SAGN
        >>> strategy = AsyncPSStrategy(mode=SAGN(push_every=8))
        >>> strategy.mode.normalize, strategy.mode.config()["push_every"]
        (True, 8)
    """

    name = "sagn"
    summary = "agn's normalized updates, averaged synchronously"
    normalize = True
    push_every: int = 4


@dataclass(frozen=True, kw_only=True)
class OSP(Sync):
    """Overlapped synchronous parallel: sync's rounds, each push sent in the background while the next step computes.

    Args:
        overlap: must stay True (the mode is defined by it; ``sync`` is the same rounds without it).
        replicas_to_aggregate: the updates averaged per round; None: every worker training.
        push_every: local steps between two rounds.
        pull_every: must stay None: the model comes with every push's reply.

    Raises:
        ValueError: where ``overlap`` is False, or a knob :class:`Sync` refuses.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, OSP
        >>> strategy = AsyncPSStrategy(mode=OSP())
        >>> strategy.mode.exchange
        'overlap'
    """

    name = "osp"
    summary = "sync rounds, each sent in the background while the next step computes"
    overlap: bool = True

    def __post_init__(self) -> None:
        if not self.overlap:
            raise ValueError(f"mode={self.name!r} is defined by its overlap: for the same rounds without it, use "
                             f"mode={'sync' if self.name == 'osp' else 'localsgd'!r}")
        super().__post_init__()


@dataclass(frozen=True, kw_only=True)
class LOSP(OSP):
    """Local OSP: osp's rounds every ``push_every`` local steps; the progress made while a round is under way
    is kept (with momentum, its own share).

    Args:
        push_every: local steps between two rounds.
        replicas_to_aggregate: the updates averaged per round; None: every worker training.
        overlap: must stay True, as osp's.
        pull_every: must stay None, as osp's.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, LOSP
        >>> strategy = AsyncPSStrategy(mode=LOSP(push_every=8))
        >>> strategy.mode
        LOSP(push_every=8, pull_every=None, overlap=True, replicas_to_aggregate=None)
    """

    name = "losp"
    summary = "osp with push_every local steps; progress made during a round is kept (with momentum, its own share)"
    compensate = "round"
    push_every: int = 4
