"""The base of the modes: :class:`Mode` and :class:`PushMode`, and the registry :data:`MODES` of their subclasses.

A :class:`Mode` is the worker half of a scheme (how often it pushes or pulls, which exchange it
uses, which codecs it takes, how its workers compensate staleness) and the factory of its server
half (:meth:`Mode.make_rule`). A subclass with a ``name`` registers itself in :data:`MODES`; the modes
themselves are in :mod:`plug_asgd.modes.asynchronous`, :mod:`plug_asgd.modes.rounds` and
:mod:`plug_asgd.modes.shared_and_elastic`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from typing_extensions import override

from plug_asgd.compressors import Codec, Compressor, NoCompression
from plug_asgd.modes.rules import AsgdRule, FoldRule

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
    ``"fragments"``, ``"elastic"`` or ``"shared"``. ``compensate`` says which staleness remedies its workers apply by
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
    derived_knobs: ClassVar[tuple[str, ...]] = ()  # fields set from other knobs, not given (DiLoCo's push_every)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is not None:
            if name in MODES:
                raise TypeError(f"two modes are called {name!r}: {MODES[name].__name__} and {cls.__name__}")
            MODES[name] = cls

    @property
    def exchange(self) -> str:
        """The worker's exchange with the PS: ``"push"``, ``"overlap"``, ``"fragments"``, ``"elastic"`` or
        ``"shared"``."""
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
