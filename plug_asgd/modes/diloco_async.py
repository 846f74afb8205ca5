"""Asynchronous DiLoCo (Liu et al. 2024): each worker's pseudo-gradient applied on the PS as it arrives, with the
delayed Nesterov update of the outer optimizer, and a slower worker's rounds shortened. Numpy only, as every rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from typing_extensions import override

from plug_asgd.modes.base import PushMode
from plug_asgd.modes.diloco import inner_steps_knobs
from plug_asgd.modes.fold import APPLIED, _add_into
from plug_asgd.modes.outer import F32, OuterOptimizer, check_saved_outer, saved_slots, slot_arrays
from plug_asgd.modes.rules import FoldRule


class AsyncDiLoCoRule(FoldRule):
    """Each worker's pseudo-gradient applied as it arrives, with the delayed Nesterov update of Liu et al. (2024):
    the outer momentum moves only every ``delay`` arrivals, on their mean, so that stale pseudo-gradients are not
    accelerated one by one; each arrival's own share (``lr / delay`` of it) is applied at once. Over ``delay``
    arrivals of the same pseudo-gradients the model moves as one synchronous outer step on their mean would
    (Nesterov's ``lr (mean + momentum b)``, SGD's ``lr b``), spread over the arrivals. A push is applied whatever its
    staleness, undiscounted: the delayed momentum is the remedy.

    The period is fixed when a cycle of arrivals starts and kept until its last: a worker that stops training
    mid-cycle (its fit's end) would otherwise change ``N`` between the arrivals of one cycle, and its shares and
    mean would no longer add up to one outer step (2 workers, the first leaving before the second arrived: the
    second's pseudo-gradient applied at 1.33x, the first's at 0.98x, a fit's last step overshooting). Nor does a
    later cycle count fewer workers than have trained at once since training began (until none trains): the workers
    that go on after one ended its fit would otherwise have each arrival applied at ``N`` times its share, and
    their last arrivals overshoot (at 20 rounds beside a slowed host, the loss rose 0.1 nats over the last 3).

    With streaming fragments (the modes' ``fragments``) a push carries some of the tensors only: each tensor counts
    the arrivals that carry it (a fragment's momentum moves every ``delay`` arrivals of that fragment), and a tensor
    a push does not carry is left as it is.

    Args:
        outer: the outer optimizer: ``"nesterov"`` or ``"sgd"`` (Adam's per-coordinate scale has no delayed form).
        delay: arrivals between two moves of the momentum; None: the most workers training at once since training
            began (reset once none trains).

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
        self.cycles: dict[str, list[int]] = {}  # by tensor, the cycle under way: [its period, its arrivals so far]
        self._from_arrivals: set[str] = set()  # cycles left by a checkpoint that kept none: counted as it did
        self.last_changed: frozenset[str] | None = None  # the last arrival's tensors, where it left some out
        self.peak = 0  # the most workers training at once since training began (0 once none trains)

    @property
    def period(self) -> int:
        """Arrivals between two moves of the momentum: ``delay``, or the most workers training at once since
        training began."""
        return self.delay or max(1, self.peak)

    @override
    def set_trainers(self, state: Any, ranks: frozenset[int]) -> list[Any]:
        self.peak = max(self.peak, len(ranks)) if ranks else 0
        return super().set_trainers(state, ranks)

    @override
    def push(self, state: Any, push: Any) -> list[Any]:
        self.arrivals += 1
        lr, mu = F32(self.outer.lr), F32(self.outer.momentum)
        for name, target in state.tensors.items():
            if name not in push.update:  # another fragment's push: this tensor's arrivals are not counted
                self.skipped[name] = self.skipped.get(name, 0) + 1
                continue
            n, done = self._cycle(name)
            g = np.zeros_like(target)
            _add_into(g, push.update[name], -1.0)  # the pseudo-gradient, w_base - w
            slots = self.slots.setdefault(name, {})
            d = slots.setdefault("d", np.zeros_like(target))
            d += g
            target -= (lr / F32(n)) * g
            if done + 1 < n:
                self.cycles[name] = [n, done + 1]
                continue
            self.cycles.pop(name, None)
            if self.outer.momentum:
                mean = d / F32(n)
                b = slots.get("b")
                if self.outer.name == "sgd" and b is not None:
                    target -= lr * mu * b  # SGD's step on the mean is lr (mean + mu b_old): the mean is in already
                b = slots["b"] = mean.copy() if b is None else b * mu + mean
                if self.outer.name == "nesterov":
                    target -= lr * mu * b  # Nesterov's is lr (mean + mu b_new)
            d[...] = 0
        state.version += 1
        carried = push.update.keys() & state.tensors.keys()
        self.last_changed = frozenset(carried) if len(carried) < len(state.tensors) else None
        return [(push.token, APPLIED)]

    @override
    def ahead(self, names: frozenset[str] | None = None) -> dict[str, np.ndarray]:
        """By tensor whose cycle is under way, the step its momentum will take when the cycle closes: Nesterov's
        ``lr mu (mu b + mean)``, the cycle's arrivals so far standing for the mean of all of its arrivals; SGD's
        ``lr mu b``, known already. A worker whose push opened the cycle trains its next round from the central
        model less this step (``AsyncDiLoCo``'s ``momentum_lookahead``): without it, its next pseudo-gradient descends
        again the stretch the momentum step covers once the cycle closes, and the central model swings.

        Args:
            names: the tensors to anticipate (a fragment's push: its reply carries those only); None: every one.
        """
        lr, mu = F32(self.outer.lr), F32(self.outer.momentum)
        steps: dict[str, np.ndarray] = {}
        if not self.outer.momentum:
            return steps
        for name, (_, done) in self.cycles.items():
            if names is not None and name not in names:
                continue
            slots = self.slots.get(name, {})
            b, d = slots.get("b"), slots.get("d")
            if self.outer.name == "nesterov" and d is not None and done > 0:
                mean = d / F32(done)
                steps[name] = (lr * mu) * (mean if b is None else mu * b + mean)
            elif self.outer.name == "sgd" and b is not None:
                steps[name] = (lr * mu) * b
        return steps

    def _cycle(self, name: str) -> tuple[int, int]:
        """``name``'s cycle under way: its period and its arrivals before this one; a new one at the period now."""
        if name in self.cycles:
            n, done = self.cycles[name]
            return n, done
        n = self.period
        if name in self._from_arrivals:  # a checkpoint's sum of arrivals, counted as that checkpoint's rule did
            self._from_arrivals.discard(name)
            return n, (self.arrivals - 1 - self.skipped.get(name, 0)) % n
        return n, 0

    @override
    def changed(self) -> frozenset[str] | None:
        """The last arrival's tensors, where it carried only some (a fragment's); None: it may have changed any."""
        return self.last_changed

    @override
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The outer optimizer, the arrivals so far, the most workers training at once, and by tensor the
        arrivals' sum, the momentum, the arrivals that did not carry it and the cycle under way."""
        return ({"outer": asdict(self.outer), "arrivals": self.arrivals, "skipped": dict(self.skipped),
                 "cycles": {name: list(cycle) for name, cycle in self.cycles.items()}, "peak": self.peak},
                slot_arrays(self.slots))

    @override
    def restore(self, fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Takes back what :meth:`state` kept.

        Args:
            fields: the header fields :meth:`state` returned.
            arrays: the arrays :meth:`state` returned, by name.

        Raises:
            ValueError: the checkpoint's outer optimizer is not this rule's.
        """
        check_saved_outer(fields, self.outer)
        self.arrivals = int(fields.get("arrivals", 0))
        self.peak = int(fields.get("peak", 0))
        self.skipped = {k: int(v) for k, v in (fields.get("skipped") or {}).items()}
        self.cycles = {k: [int(n), int(done)] for k, (n, done) in (fields.get("cycles") or {}).items()}
        self.slots = saved_slots(arrays)
        self._from_arrivals = set() if "cycles" in fields else set(self.slots)


@dataclass(frozen=True, kw_only=True)
class AsyncDiLoCo(PushMode):
    """Asynchronous DiLoCo (Liu et al. 2024): each worker pushes its pseudo-gradient after its inner steps and the
    PS applies it as it arrives, with the delayed Nesterov update (:class:`AsyncDiLoCoRule`); no worker waits for
    another. With ``dynamic_steps`` a slower worker makes fewer inner steps, so that every worker pushes about as
    often (the paper's dynamic local updates): each push says the worker's local steps per second, each reply its
    pace, those over the fastest training worker's, and a worker at pace ``p`` makes ``p`` of ``inner_steps``
    (:meth:`steps_for`). With ``momentum_lookahead`` a
    worker whose push opened a cycle of the delayed momentum is answered with the central model less the momentum
    step that cycle is expected to take (:meth:`AsyncDiLoCoRule.ahead`), and trains its next round from there: it
    does not descend again what that step will cover, which at two workers swings the central model.

    Args:
        inner_steps: local steps between two pushes (a fast worker's; a slower one's are fewer).
        outer: the outer optimizer, ``"nesterov"`` (lr 0.7, momentum 0.9) or ``"sgd"``, as :class:`DiLoCo`'s. At
            two workers of equal speed and a handful of rounds, docs/modes.md gives the outer SGD at lr 1.0 without
            momentum.
        fragments: streaming fragments, as :class:`DiLoCo`'s: each fragment's pseudo-gradient a push of its own, at
            its staggered step (a slower worker's shortened rounds staggered alike).
        delay: arrivals between two moves of the outer momentum (of one fragment's); None: the number of workers
            (the most that have trained at once: one that ends its fit first leaves it as it was).
        dynamic_steps: whether a slower worker shortens its rounds to its speed over the fastest's.
        momentum_lookahead: whether a push asks for the central model less the momentum step its cycle is expected
            to take, to train the next round from.
        push_every: set from ``inner_steps`` (give that).
        pull_every: must stay None: the new model comes with every reply.
        overlap: with ``fragments=1``, whether the push is sent while the inner steps go on and its reply merged
            once it came, keeping the steps made meanwhile, as :class:`DiLoCo`'s; False: the worker waits for it.

    Raises:
        ValueError: the knobs :class:`DiLoCo` refuses, an Adam outer optimizer, or a ``delay`` below 1.

    Example:
        >>> from plug_asgd import AsyncDiLoCo, AsyncPSStrategy
        >>> strategy = AsyncPSStrategy(mode=AsyncDiLoCo(inner_steps=50))
        >>> strategy.mode.push_every, strategy.mode.steps_for(0.42)  # at 0.42x the fastest's speed: 21 steps
        (50, 21)
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
    momentum_lookahead: bool = True
    push_every: int | None = None

    def __post_init__(self) -> None:
        inner_steps_knobs(self)
        super().__post_init__()
        if self.delay is not None and (isinstance(self.delay, bool) or self.delay < 1):
            raise ValueError(f"delay must be a whole number >= 1 of arrivals, got {self.delay!r}")
        if not isinstance(self.momentum_lookahead, bool):
            raise ValueError(f"momentum_lookahead must be True or False, got {self.momentum_lookahead!r}")
        if self.outer.name == "adam":  # type: ignore[union-attr]
            raise ValueError("async_diloco's delayed momentum is Nesterov's or SGD's: use outer='nesterov' or 'sgd'")

    @property
    @override
    def exchange(self) -> str:
        return "fragments" if self.fragments > 1 or self.overlap else super().exchange

    @property
    def asks_ahead(self) -> bool:
        """Whether a push asks for the model ahead (:attr:`momentum_lookahead`, and an outer momentum to anticipate)."""
        return self.momentum_lookahead and bool(self.outer.momentum)  # type: ignore[union-attr]

    @override
    def make_rule(self, options: Mapping[str, Any] | None = None) -> FoldRule:
        outer = (options or {}).get("outer")
        return AsyncDiLoCoRule(OuterOptimizer.get(self.outer if outer is None else outer), self.delay)

    @override
    def server_options(self) -> dict[str, Any]:
        assert isinstance(self.outer, OuterOptimizer)
        return {"outer": self.outer.to_json()}

    def steps_for(self, pace: float) -> int:
        """The inner steps of a worker that makes ``pace`` times the fastest training worker's local steps per
        second (the PS's reply says it): ``pace`` of ``inner_steps``, rounded, at least 1, so that its rounds take
        the fastest's time.

        Args:
            pace: this worker's steps per second over the fastest's, in (0, 1].
        """
        if not self.dynamic_steps or not 0 < pace < 1:
            return self.inner_steps
        return max(1, min(self.inner_steps, round(self.inner_steps * pace)))
