"""The modes as objects: each a configured training scheme whose knobs are checked where they are defined.

A :class:`Mode` is the worker half of a scheme (how often it pushes or pulls, which exchange it
uses, which codecs it takes, how its workers compensate staleness) and the factory of its server
half (:meth:`Mode.make_rule`). A subclass with a ``name`` registers itself in :data:`MODES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

from typing_extensions import override

from plug_asgd.compressors import Codec, Compressor, NoCompression, TopKResidual
from plug_asgd.modes.rules import AdaCompRule, AsgdRule, DynSGDRule, FoldRule, SSPRule, SyncRule

MODES: dict[str, type[Mode]] = {}


def _check_count(name: str, value: int | None, meaning: str = "local optimizer steps", *, low: int = 1,
                 none: str | None = None) -> None:
    """Refuse a knob that is not an integer >= ``low`` (``none``: what None means, where None is allowed)."""
    if none is not None and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        allowed = f" or None ({none})" if none is not None else ""
        raise ValueError(f"{name} must be an integer >= {low} ({meaning}){allowed}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Mode:
    """A training scheme. Class attributes say what it is; instance fields are its knobs.

    ``exchange`` names the worker's exchange (:mod:`plug_asgd.worker.exchange`): ``"push"``, ``"overlap"``,
    ``"elastic"`` or ``"shared"``. ``compensate`` says which staleness remedies its workers apply by
    default (:func:`plug_asgd.worker.compensation.resolve`): ``"full"``, ``"unscaled"``, ``"step"``, ``"round"``
    or ``"none"``.

    Example:
        >>> from plug_asgd import Mode
        >>> from plug_asgd.modes import get
        >>> mode = get({"name": "ssp", "staleness_bound": 3})  # as a YAML file names it
        >>> isinstance(mode, Mode), mode.config()
        (True, {'name': 'ssp', 'push_every': 1, 'pull_every': None, 'overlap': False, 'staleness_bound': 3})
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    rule: ClassVar[type[FoldRule]] = AsgdRule
    normalize: ClassVar[bool] = False  # the update is divided by the local steps it spans (agn, sagn)
    compensate: ClassVar[str] = "none"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is not None:
            if name in MODES:
                raise TypeError(f"two modes are called {name!r}: {MODES[name].__name__} and {cls.__name__}")
            MODES[name] = cls

    @property
    def exchange(self) -> str:
        """The worker's exchange with the PS: ``"push"``, ``"overlap"``, ``"elastic"`` or ``"shared"``."""
        return "push"

    @property
    def folds_into_update(self) -> bool:
        """Whether this mode's PS folds ``w += delta`` out of place: what "own" replies and pushes of weights need."""
        return self.rule.folds_into_update

    def make_rule(self, options: Mapping[str, Any] | None = None) -> FoldRule:
        """The PS's fold rule; ``options`` (the PS's own flags, None where unset) override this mode's knobs.

        Args:
            options: the PS's flags by name (``staleness_bound``, ``replicas_to_aggregate``), a value of None
                leaving this mode's; None: none given.
        """
        return self.rule()

    def server_options(self) -> dict[str, Any]:
        """The knobs the PS must be given (the embedded PS's flags), by name."""
        return {}

    def check_compressor(self, codec: Codec) -> None:
        """Raise a ValueError if this mode cannot send its updates through ``codec``.

        Args:
            codec: the codec the strategy was given.
        """

    def check_optimizers(self, optimizers: list[Any]) -> None:
        """Raise a ValueError if this mode's workers cannot train with these optimizers.

        Args:
            optimizers: the LightningModule's optimizers (``torch.optim.Optimizer`` instances).
        """

    def encoder(self, codec: Codec, rank: int) -> Compressor:
        """What worker ``rank`` encodes its updates with, fresh for a fit.

        Args:
            codec: the codec the strategy was given.
            rank: the worker's global rank.
        """
        return codec.encoder(rank)

    def for_workers(self, workers: int) -> Mode:
        """The mode a fit of ``workers`` training workers runs: this one, unless a default of it depends on their
        number (agn's ``push_every``).

        Args:
            workers: the workers that train in the fit.
        """
        return self

    def config(self) -> dict[str, Any]:
        """``{"name": ..., **knobs}``: what :func:`plug_asgd.modes.get` takes to rebuild this mode."""
        return {"name": self.name, **{f.name: getattr(self, f.name) for f in fields(self)}}

    def _refuse_codecs(self, codec: Codec, why: str) -> None:
        if not isinstance(codec, NoCompression):
            raise ValueError(f"compressor={codec.name!r} does not go with mode={self.name!r}: {why}")


@dataclass(frozen=True, kw_only=True)
class PushMode(Mode):
    """A mode whose workers push ``w - w_base`` every ``push_every`` local steps and take the central model.

    ``pull_every``: local steps between two pulls (default: with every push), a pull keeping the
    progress not yet pushed (DOWNPOUR's n_fetch). ``overlap``: send each push from a background
    thread while the next step computes, and merge the reply when the next push is due.

    Args:
        push_every: local steps between two pushes (None only where a mode says what it means).
        pull_every: local steps between two pulls of the central model; None: with every push.
        overlap: whether each push is sent from a background thread while the next step computes.

    Raises:
        ValueError: where a count is not a positive integer, or ``overlap`` comes with ``pull_every``.
    """

    push_every: int | None = 1
    pull_every: int | None = None
    overlap: bool = False
    push_every_none: ClassVar[str | None] = None  # what push_every=None means, where a mode allows it

    def __post_init__(self) -> None:
        _check_count("push_every", self.push_every, none=self.push_every_none)
        _check_count("pull_every", self.pull_every, none="with each push")
        if self.overlap and self.pull_every is not None:
            raise ValueError("overlap=True takes the model with every push's reply: it does not go with pull_every")

    @property
    @override
    def exchange(self) -> str:
        return "overlap" if self.overlap else "push"


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
