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

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from typing_extensions import override

from plug_asgd.modes.fold import CentralState, Push, _add_into
from plug_asgd.modes.outer import F32, OuterOptimizer, check_saved_outer, saved_slots, slot_arrays
from plug_asgd.modes.rounds import Sync
from plug_asgd.modes.rules import FoldRule, SyncRule

_OUTER_FIELDS = ("outer", "outer_steps", "skipped", "changed_at", "floor")  # DiLoCoRule's, beside sync's


def inner_steps_knobs(mode: Any) -> None:
    """DiLoCo's and its asynchronous form's knobs checked: ``push_every`` is ``inner_steps``, the outer optimizer
    made from what was given, no pull of their own, ``overlap`` a bool, at most one fragment per inner step.

    Args:
        mode: the mode being built (its fields are set in place).

    Raises:
        ValueError: ``inner_steps`` or ``fragments`` not a whole number >= 1, more fragments than inner steps, a
            ``push_every`` other than ``inner_steps``, a pull of its own, an ``overlap`` not True or False.
    """
    if not isinstance(mode.inner_steps, int) or isinstance(mode.inner_steps, bool) or mode.inner_steps < 1:
        raise ValueError(f"inner_steps must be a whole number >= 1, got {mode.inner_steps!r}")
    if not isinstance(mode.fragments, int) or isinstance(mode.fragments, bool) or mode.fragments < 1:
        raise ValueError(f"fragments must be a whole number >= 1, got {mode.fragments!r}")
    if mode.fragments > mode.inner_steps:
        raise ValueError(f"fragments={mode.fragments} staggered over inner_steps={mode.inner_steps}: at most one "
                         "fragment is synced per step, so fragments <= inner_steps")
    if mode.push_every not in (None, mode.inner_steps):
        raise ValueError(f"{mode.name} pushes every inner_steps local steps: give inner_steps, not push_every")
    if mode.pull_every is not None:
        raise ValueError(f"{mode.name} takes the new model with every reply: pull_every stays unset")
    if not isinstance(mode.overlap, bool):
        raise ValueError(f"overlap must be True or False, got {mode.overlap!r}")
    object.__setattr__(mode, "push_every", mode.inner_steps)
    object.__setattr__(mode, "outer", OuterOptimizer.get(mode.outer))


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
        g = np.negative(mean, dtype=F32) if mean.dtype != F32 else -mean
        self.outer.step(self.outer_steps - self.skipped.get(name, 0), target, g, self.slots.setdefault(name, {}))

    @override
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The round's pushes held so far (sync's), the outer optimizer, its step count and its state by tensor, and
        by tensor the rounds that skipped it and the version that last changed it."""
        fields, arrays = super().state()
        fields = {**fields, "outer": asdict(self.outer), "outer_steps": self.outer_steps, "skipped": self.skipped,
                  "changed_at": self.changed_at, "floor": self.floor}
        return fields, {**arrays, **slot_arrays(self.slots)}

    @override
    def restore(self, fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Takes back what :meth:`state` kept; a checkpoint of another outer optimizer is refused.

        Args:
            fields: the header fields :meth:`state` returned.
            arrays: the arrays :meth:`state` returned, by name.

        Raises:
            ValueError: the checkpoint's outer optimizer is not this rule's (its state would mean something else).
        """
        check_saved_outer(fields, self.outer)
        super().restore({k: v for k, v in fields.items() if k not in _OUTER_FIELDS},
                        {k: v for k, v in arrays.items() if not k.startswith("outer/")})
        self.outer_steps = int(fields.get("outer_steps", 0))
        self.skipped = {k: int(v) for k, v in (fields.get("skipped") or {}).items()}
        self.changed_at = {k: int(v) for k, v in (fields.get("changed_at") or {}).items()}
        self.floor = None if fields.get("floor") is None else int(fields["floor"])
        self.slots = saved_slots(arrays)


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
            on and merged once its reply came (:class:`~plug_asgd.worker.exchange.fragments.FragmentExchange`);
            1: the whole model at once, as the paper of 2023.
        replicas_to_aggregate: the workers averaged per round; None: every worker training.
        push_every: set from ``inner_steps`` (give that).
        pull_every: must stay None: the new model comes with every round's reply.
        overlap: with ``fragments=1``, whether the whole model's push is sent while the inner steps go on and its
            reply merged once it came, keeping the steps made meanwhile (streaming's exchange with one fragment:
            the paper's overlap ``tau``); False: the worker waits for its round. Fragments always overlap.

    Raises:
        ValueError: ``inner_steps`` below 1, ``fragments`` below 1 or above ``inner_steps``, a ``push_every``
            other than ``inner_steps``, ``pull_every`` given, ``overlap`` not a bool, or an outer optimizer
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
        inner_steps_knobs(self)
        super().__post_init__()

    @property
    @override
    def exchange(self) -> str:
        return "fragments" if self.fragments > 1 or self.overlap else super().exchange

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
