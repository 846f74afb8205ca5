"""DiLoCo (Douillard et al. 2023): rounds of ``inner_steps`` local steps with the worker's own optimizer, then the
workers' pseudo-gradients averaged on the PS and applied by an outer optimizer whose state the PS keeps.

A worker's push at the end of its inner steps is ``w - w_base``, the negative of its pseudo-gradient; the PS
averages a round of them as sync does (in rank order) and steps the central model with the outer optimizer
(:class:`OuterOptimizer`: Nesterov SGD at lr 0.7 and momentum 0.9 by default, as the paper's), then answers every
worker of the round with the new model. The inner optimizers (their momentum, Adam's moments, their schedulers)
stay the workers' own from round to round, as in the paper. The outer optimizer's state (its momentum, or Adam's
moments and its step count) is part of the rule's state: checkpointed and resumed with the PS, and held by its
standby. Numpy only, as every rule.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np
from typing_extensions import override

from plug_asgd.modes.base import PushMode
from plug_asgd.modes.fold import APPLIED, CentralState, Push, _add_into
from plug_asgd.modes.rounds import Sync
from plug_asgd.modes.rules import FoldRule, SyncRule

_F32 = np.float32
_OUTER_FIELDS = ("outer", "outer_steps", "skipped", "changed_at", "floor")  # DiLoCoRule's, beside sync's


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
        >>> from plug_asgd.modes.diloco import OuterOptimizer
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
            b1, b2 = _F32(self.beta1), _F32(self.beta2)
            m = slots.setdefault("m", np.zeros_like(w))
            v = slots.setdefault("v", np.zeros_like(w))
            m *= b1
            m += (_F32(1) - b1) * g
            v *= b2
            v += (_F32(1) - b2) * g * g
            step = _F32(self.lr / (1 - self.beta1 ** t))
            denom = np.sqrt(v) / _F32(np.sqrt(1 - self.beta2 ** t)) + _F32(self.eps)
            w -= step * (m / denom)
            return
        mu = _F32(self.momentum)
        d = g
        if self.momentum:
            b = slots.get("b")
            if b is None:
                b = slots["b"] = g.copy()
            else:
                b *= mu
                b += g
            d = g + mu * b if self.name == "nesterov" else b
        w -= _F32(self.lr) * d


def _inner_steps(mode: Any) -> None:
    """DiLoCo's and its asynchronous form's knobs checked: ``push_every`` is ``inner_steps``, the outer optimizer
    made from what was given, no pull or overlap of their own, at most one fragment per inner step."""
    if not isinstance(mode.inner_steps, int) or isinstance(mode.inner_steps, bool) or mode.inner_steps < 1:
        raise ValueError(f"inner_steps must be a whole number >= 1, got {mode.inner_steps!r}")
    if not isinstance(mode.fragments, int) or isinstance(mode.fragments, bool) or mode.fragments < 1:
        raise ValueError(f"fragments must be a whole number >= 1, got {mode.fragments!r}")
    if mode.fragments > mode.inner_steps:
        raise ValueError(f"fragments={mode.fragments} staggered over inner_steps={mode.inner_steps}: at most one "
                         "fragment is synced per step, so fragments <= inner_steps")
    if mode.push_every not in (None, mode.inner_steps):
        raise ValueError(f"{mode.name} pushes every inner_steps local steps: give inner_steps, not push_every")
    if mode.pull_every is not None or mode.overlap:
        raise ValueError(f"{mode.name} takes the new model with every reply: pull_every and overlap stay unset")
    object.__setattr__(mode, "push_every", mode.inner_steps)
    object.__setattr__(mode, "outer", OuterOptimizer.get(mode.outer))


def _check_saved_outer(fields: dict[str, Any], outer: OuterOptimizer) -> None:
    """Refuses a checkpoint of another outer optimizer: its state would mean something else."""
    saved = fields.get("outer")
    if saved is not None and OuterOptimizer(**saved) != outer:
        raise ValueError(f"the checkpoint's outer optimizer {saved} is not this PS's {asdict(outer)}: resume with "
                         "the same --outer (or mode's outer=)")


def _saved_slots(arrays: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """The outer optimizer's state by tensor from a checkpoint's ``outer/SLOT/NAME`` arrays."""
    slots: dict[str, dict[str, np.ndarray]] = {}
    for key, array in arrays.items():
        if key.startswith("outer/"):
            _, slot, name = key.split("/", 2)
            slots.setdefault(name, {})[slot] = np.array(array, dtype=_F32)
    return slots


class DiLoCoRule(SyncRule):
    """Sync's rounds, each round's mean update taken as the negative pseudo-gradient of an outer optimizer step.

    With streaming fragments (the modes' ``fragments``) a round carries some of the tensors only: each tensor is
    stepped on the mean of the pushes that carry it, a tensor no push of the round carries is left as it is (no
    decay of its momentum), and each tensor counts its own outer steps (Adam's bias correction). A push is current
    where no round changed a tensor it carries since the version it is based on (its fragment's: rounds of the
    other fragments come between two of its own); with every tensor in every push that is sync's rule, the current
    version.

    Args:
        replicas_to_aggregate: the workers averaged per round; None: every worker training.
        outer: the outer optimizer.
    """

    def __init__(self, replicas_to_aggregate: int | None = None, outer: OuterOptimizer | None = None) -> None:
        super().__init__(replicas_to_aggregate)
        self.outer = outer or OuterOptimizer()
        self.outer_steps = 0  # rounds applied
        self.slots: dict[str, dict[str, np.ndarray]] = {}  # the outer optimizer's state, by tensor
        self.skipped: dict[str, int] = {}  # by tensor, the rounds that did not carry it: its steps are the rest
        self.changed_at: dict[str, int] = {}  # by tensor, the version of the last round that changed it
        self.floor: int | None = None  # the version from which changed_at knows every change (first seen)
        self.last_changed: frozenset[str] | None = None  # the last round's tensors, where it left some out

    @override
    def current(self, state: CentralState, push: Push) -> bool:
        """Based on the current version, or on a version since which no round changed a tensor it carries.

        Args:
            state: the central model.
            push: the worker's update.
        """
        if self.floor is None:
            self.floor = state.version
        if push.base_version == state.version:
            return True
        return push.base_version >= self.floor and all(
            self.changed_at.get(name, self.floor) <= push.base_version for name in push.update)

    @override
    def fold_round(self, state: CentralState, by_rank: list[Push]) -> None:
        """Each tensor a push of the round carries stepped on their mean (:meth:`apply_mean`); the others skipped.

        Args:
            state: the central model, changed in place.
            by_rank: the round's pushes, in the order of their ranks.
        """
        if self.floor is None:
            self.floor = state.version
        self.outer_steps += 1
        changed = []
        for name, target in state.tensors.items():
            carried = [p.update[name] for p in by_rank if name in p.update]
            if not carried:
                self.skipped[name] = self.skipped.get(name, 0) + 1
                continue
            total = np.zeros_like(target)
            for update in carried:
                _add_into(total, update)
            self.apply_mean(name, target, total / len(carried))
            self.changed_at[name] = state.version + 1
            changed.append(name)
        self.last_changed = frozenset(changed) if len(changed) < len(state.tensors) else None

    @override
    def changed(self) -> frozenset[str] | None:
        """The last round's tensors, where it carried only some (a fragment's); None: it may have changed any."""
        return self.last_changed

    @override
    def apply_mean(self, name: str, target: np.ndarray, mean: np.ndarray) -> None:
        """The outer optimizer's step of ``target`` on the pseudo-gradient ``-mean``.

        Args:
            name: the tensor's name.
            target: the central tensor, changed in place.
            mean: the round's mean update (``w - w_base``) of it.
        """
        g = np.negative(mean, dtype=_F32) if mean.dtype != _F32 else -mean
        self.outer.step(self.outer_steps - self.skipped.get(name, 0), target, g, self.slots.setdefault(name, {}))

    @override
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The round's pushes held so far (sync's), the outer optimizer, its step count and its state by tensor, and
        by tensor the rounds that skipped it and the version that last changed it."""
        fields, arrays = super().state()
        fields = {**fields, "outer": asdict(self.outer), "outer_steps": self.outer_steps, "skipped": self.skipped,
                  "changed_at": self.changed_at, "floor": self.floor}
        for name, slots in self.slots.items():
            for slot, array in slots.items():
                arrays[f"outer/{slot}/{name}"] = array
        return fields, arrays

    @override
    def restore(self, fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Takes back what :meth:`state` kept; a checkpoint of another outer optimizer is refused.

        Args:
            fields: the header fields :meth:`state` returned.
            arrays: the arrays :meth:`state` returned, by name.

        Raises:
            ValueError: the checkpoint's outer optimizer is not this rule's (its state would mean something else).
        """
        _check_saved_outer(fields, self.outer)
        super().restore({k: v for k, v in fields.items() if k not in _OUTER_FIELDS},
                        {k: v for k, v in arrays.items() if not k.startswith("outer/")})
        self.outer_steps = int(fields.get("outer_steps", 0))
        self.skipped = {k: int(v) for k, v in (fields.get("skipped") or {}).items()}
        self.changed_at = {k: int(v) for k, v in (fields.get("changed_at") or {}).items()}
        self.floor = None if fields.get("floor") is None else int(fields["floor"])
        self.slots = _saved_slots(arrays)


@dataclass(frozen=True, kw_only=True)
class DiLoCo(Sync):
    """DiLoCo: ``inner_steps`` local steps with the LightningModule's own optimizer, then a round in which the PS
    averages the workers' pseudo-gradients and applies the outer optimizer (``outer``) to the central model.

    Args:
        inner_steps: local steps between two rounds (the paper's H). The paper's 500 is for runs of tens of
            thousands of steps; 100 keeps a few dozen rounds in the recipes' runs of a few thousand.
        outer: the outer optimizer: an :class:`OuterOptimizer`, a name (``"nesterov"``, ``"sgd"``, ``"adam"``) or
            a dict of its fields.
        fragments: streaming DiLoCo (Douillard et al. 2025): the model split in this many fragments of about
            equal size (:func:`plug_asgd.worker.exchange.fragments.split`), fragment ``f`` synced every
            ``inner_steps`` steps at offset ``f * inner_steps // fragments``, each sent while the inner steps go
            on and merged when the next is due (:class:`~plug_asgd.worker.exchange.fragments.FragmentExchange`);
            1: the whole model at once, as the paper of 2023.
        replicas_to_aggregate: the workers averaged per round; None: every worker training.
        push_every: set from ``inner_steps`` (give that).
        pull_every: must stay None: the new model comes with every round's reply.
        overlap: must stay False.

    Raises:
        ValueError: ``inner_steps`` below 1, ``fragments`` below 1 or above ``inner_steps``, a ``push_every``
            other than ``inner_steps``, ``pull_every`` or ``overlap`` given, or an outer optimizer
            :class:`OuterOptimizer` refuses.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, DiLoCo
        >>> strategy = AsyncPSStrategy(mode=DiLoCo(inner_steps=50, outer={"name": "nesterov", "lr": 0.5}))
        >>> strategy.mode.push_every, strategy.mode.outer.lr
        (50, 0.5)
    """

    name = "diloco"
    summary = "inner_steps local steps, then the PS averages the pseudo-gradients and steps its outer optimizer"
    rule = DiLoCoRule
    derived_knobs = ("push_every",)
    inner_steps: int = 100
    outer: OuterOptimizer | str | dict[str, Any] = "nesterov"
    fragments: int = 1
    push_every: int | None = None

    def __post_init__(self) -> None:
        _inner_steps(self)
        super().__post_init__()

    @property
    @override
    def exchange(self) -> str:
        return "fragments" if self.fragments > 1 else super().exchange

    @override
    def make_rule(self, options: Mapping[str, Any] | None = None) -> FoldRule:
        options = options or {}
        replicas = options.get("replicas_to_aggregate")
        outer = options.get("outer")
        return DiLoCoRule(self.replicas_to_aggregate if replicas is None else replicas,
                          OuterOptimizer.get(self.outer if outer is None else outer))

    @override
    def server_options(self) -> dict[str, Any]:
        assert isinstance(self.outer, OuterOptimizer)
        return {**super().server_options(), "outer": self.outer.to_json()}


class AsyncDiLoCoRule(FoldRule):
    """Each worker's pseudo-gradient applied as it arrives, with the delayed Nesterov update of Liu et al. (2024):
    the outer momentum moves only every ``delay`` arrivals, on their mean, so that stale pseudo-gradients are not
    accelerated one by one; each arrival's own share (``lr / delay`` of it) is applied at once. Over ``delay``
    arrivals of the same pseudo-gradients the model moves as one synchronous outer step on their mean would
    (Nesterov's ``lr (mean + momentum b)``, SGD's ``lr b``), spread over the arrivals. A push is applied whatever its
    staleness, undiscounted: the delayed momentum is the remedy.

    With streaming fragments (the modes' ``fragments``) a push carries some of the tensors only: each tensor counts
    the arrivals that carry it (a fragment's momentum moves every ``delay`` arrivals of that fragment), and a tensor
    a push does not carry is left as it is.

    Args:
        outer: the outer optimizer: ``"nesterov"`` or ``"sgd"`` (Adam's per-coordinate scale has no delayed form).
        delay: arrivals between two moves of the momentum; None: the workers training.

    Raises:
        ValueError: an Adam outer optimizer, or a ``delay`` below 1.
    """

    def __init__(self, outer: OuterOptimizer | None = None, delay: int | None = None) -> None:
        super().__init__()
        self.outer = outer or OuterOptimizer()
        if self.outer.name == "adam":
            raise ValueError("async_diloco's delayed momentum is Nesterov's or SGD's: use outer='nesterov' or 'sgd'")
        if delay is not None and delay < 1:
            raise ValueError(f"delay must be >= 1 arrival, got {delay}")
        self.delay = delay
        self.arrivals = 0
        self.slots: dict[str, dict[str, np.ndarray]] = {}  # by tensor: "d", the arrivals' sum; "b", the momentum
        self.skipped: dict[str, int] = {}  # by tensor, the arrivals that did not carry it: its own are the rest
        self.last_changed: frozenset[str] | None = None  # the last arrival's tensors, where it left some out

    @property
    def period(self) -> int:
        """Arrivals between two moves of the momentum: ``delay``, or the workers training."""
        return self.delay or max(1, self.trainers)

    @override
    def push(self, state: Any, push: Any) -> list[Any]:
        n = self.period
        self.arrivals += 1
        lr, mu = _F32(self.outer.lr), _F32(self.outer.momentum)
        for name, target in state.tensors.items():
            if name not in push.update:  # another fragment's push: this tensor's arrivals are not counted
                self.skipped[name] = self.skipped.get(name, 0) + 1
                continue
            moves = (self.arrivals - self.skipped.get(name, 0)) % n == 0
            g = np.zeros_like(target)
            _add_into(g, push.update[name], -1.0)  # the pseudo-gradient, w_base - w
            slots = self.slots.setdefault(name, {})
            d = slots.setdefault("d", np.zeros_like(target))
            d += g
            target -= (lr / _F32(n)) * g
            if moves and self.outer.momentum:
                mean = d / _F32(n)
                b = slots.get("b")
                if self.outer.name == "sgd" and b is not None:
                    target -= lr * mu * b  # SGD's step on the mean is lr (mean + mu b_old): the mean is in already
                b = slots["b"] = mean.copy() if b is None else b * mu + mean
                if self.outer.name == "nesterov":
                    target -= lr * mu * b  # Nesterov's is lr (mean + mu b_new)
            if moves:
                d[...] = 0
        state.version += 1
        carried = push.update.keys() & state.tensors.keys()
        self.last_changed = frozenset(carried) if len(carried) < len(state.tensors) else None
        return [(push.token, APPLIED)]

    @override
    def changed(self) -> frozenset[str] | None:
        """The last arrival's tensors, where it carried only some (a fragment's); None: it may have changed any."""
        return self.last_changed

    @override
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The outer optimizer, the arrivals so far, and by tensor the arrivals' sum, the momentum and the arrivals
        that did not carry it."""
        arrays = {f"outer/{slot}/{name}": a for name, slots in self.slots.items() for slot, a in slots.items()}
        return {"outer": asdict(self.outer), "arrivals": self.arrivals, "skipped": self.skipped}, arrays

    @override
    def restore(self, fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Takes back what :meth:`state` kept.

        Args:
            fields: the header fields :meth:`state` returned.
            arrays: the arrays :meth:`state` returned, by name.

        Raises:
            ValueError: the checkpoint's outer optimizer is not this rule's.
        """
        _check_saved_outer(fields, self.outer)
        self.arrivals = int(fields.get("arrivals", 0))
        self.skipped = {k: int(v) for k, v in (fields.get("skipped") or {}).items()}
        self.slots = _saved_slots(arrays)


@dataclass(frozen=True, kw_only=True)
class AsyncDiLoCo(PushMode):
    """Asynchronous DiLoCo (Liu et al. 2024): each worker pushes its pseudo-gradient after its inner steps and the
    PS applies it as it arrives, with the delayed Nesterov update (:class:`AsyncDiLoCoRule`); no worker waits for
    another. With ``dynamic_steps`` a slower worker makes fewer inner steps, so that every worker pushes about as
    often: each reply says how many others arrived since the worker's last push, and a worker that sees more than
    ``workers - 1`` per push shortens its rounds to match (never above ``inner_steps``).

    Args:
        inner_steps: local steps between two pushes (a fast worker's; a slower one's are fewer).
        outer: the outer optimizer, ``"nesterov"`` (lr 0.7, momentum 0.9) or ``"sgd"``, as :class:`DiLoCo`'s.
        fragments: streaming fragments, as :class:`DiLoCo`'s: each fragment's pseudo-gradient a push of its own, at
            its staggered step (a slower worker's shortened rounds staggered alike).
        delay: arrivals between two moves of the outer momentum (of one fragment's); None: the number of workers.
        dynamic_steps: whether a slower worker shortens its rounds.
        push_every: set from ``inner_steps`` (give that).
        pull_every: must stay None: the new model comes with every reply.
        overlap: must stay False.

    Raises:
        ValueError: the knobs :class:`DiLoCo` refuses, an Adam outer optimizer, or a ``delay`` below 1.

    Example:
        >>> from plug_asgd import AsyncDiLoCo, AsyncPSStrategy
        >>> strategy = AsyncPSStrategy(mode=AsyncDiLoCo(inner_steps=50))
        >>> strategy.mode.push_every, strategy.mode.steps_for(0.5, workers=3)  # others arrive 0.5 a step: 4 steps
        (50, 4)
    """

    name = "async_diloco"
    summary = "inner_steps local steps, the pseudo-gradient applied as it arrives with a delayed Nesterov momentum"
    rule = AsyncDiLoCoRule  # (what the worker reads of its PS's rule: it folds no weights, scales no push)
    derived_knobs = ("push_every",)
    inner_steps: int = 100
    outer: OuterOptimizer | str | dict[str, Any] = "nesterov"
    fragments: int = 1
    delay: int | None = None
    dynamic_steps: bool = True
    push_every: int | None = None

    def __post_init__(self) -> None:
        _inner_steps(self)
        super().__post_init__()
        if self.delay is not None and (isinstance(self.delay, bool) or self.delay < 1):
            raise ValueError(f"delay must be a whole number >= 1 of arrivals, got {self.delay!r}")
        if self.outer.name == "adam":  # type: ignore[union-attr]
            raise ValueError("async_diloco's delayed momentum is Nesterov's or SGD's: use outer='nesterov' or 'sgd'")

    @property
    @override
    def exchange(self) -> str:
        return "fragments" if self.fragments > 1 else super().exchange

    @override
    def make_rule(self, options: Mapping[str, Any] | None = None) -> FoldRule:
        outer = (options or {}).get("outer")
        return AsyncDiLoCoRule(OuterOptimizer.get(self.outer if outer is None else outer), self.delay)

    @override
    def server_options(self) -> dict[str, Any]:
        assert isinstance(self.outer, OuterOptimizer)
        return {"outer": self.outer.to_json()}

    def steps_for(self, others_per_step: float, workers: int) -> int:
        """The inner steps of a worker that sees ``others_per_step`` pushes of the others per local step: as many
        as make ``workers - 1`` of them arrive per push of its own, at most ``inner_steps``.

        Args:
            others_per_step: the others' arrivals per local step of this worker, as measured.
            workers: the workers training.
        """
        if not self.dynamic_steps or workers <= 1 or others_per_step <= 0:
            return self.inner_steps
        return max(1, min(self.inner_steps, round((workers - 1) / others_per_step)))
