"""A worker's own speed: the local steps per second it makes between two pushes, which async_diloco's dynamic
local steps compare with the fastest worker's (Liu et al. 2024: a worker at ``p`` times the fastest's speed makes
``p`` of the inner steps, so that every worker pushes about as often).

The PS compares the rates the workers' pushes say and answers each with its pace (``ModelReply.pace``): the
others' speeds come from their own clocks, not from counting their pushes between two of this worker's, which at
two workers is 1 or 2, and shortens a slower worker's rounds only rounds after it should have.

A worker's first round has no push before its end to say the rate: :class:`FirstPace` has it say the rate on its own
(a ``pace`` request) once the round's first steps are timed. Left at all its inner steps, a worker slowed 2x would
push its first round when the fastest pushes its second, and the delayed momentum's next cycle would pair one of
the fastest's pushes with that stale one.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from plug_asgd.protocol.wire import RATE_RANGE


class StepClock:
    """The wall time of each local step, from the end of the last step's exchange to the start of this one's: the
    data, the forward and backward and the optimizer's step, and anything else the loop does per step (a
    callback, a slowed host's sleep), but not the pushes. The median of a round's steps stands for them all, so
    that a validation run or a wait for an overlapped reply in one step does not count as slowness.
    """

    def __init__(self) -> None:
        self.steps: list[float] = []  # this round's steps' seconds
        self.last_end: float | None = None  # when the last step's exchange ended; None: no step yet

    def start(self) -> None:
        """A fit begins: no step is timed until one has ended."""
        self.steps, self.last_end = [], None

    def stepped(self) -> None:
        """A local step ended; its exchange, if any, begins now."""
        now = time.perf_counter()
        if self.last_end is not None:
            self.steps.append(now - self.last_end)

    def exchanged(self) -> None:
        """The step's exchange ended: the next step's time counts from now."""
        self.last_end = time.perf_counter()

    def rate(self) -> float | None:
        """The local steps per second since the last call (the median step's, within what a push may say), and the
        steps forgotten; None where no step was timed."""
        steps, self.steps = self.steps, []
        if not steps:
            return None
        median = statistics.median(steps)
        low, high = RATE_RANGE
        return high if median <= 1 / high else max(low, 1.0 / median)


FIRST_ASK = 8  # the local steps a worker's first round times before it says its rate (then twice as many more)


class FirstPace:
    """When a paced worker says its rate before its first push of a fit: after :data:`FIRST_ASK` steps, and again
    after twice as many more while the PS has no pace to say (a worker training has said no rate yet), as long as
    at least half the round is left to shorten. A push says the rate from then on: it stops asking.
    """

    def __init__(self) -> None:
        self.next_at: int | None = None  # the round's step at which to ask; None: not before the first push
        self.asked = 0  # the requests made

    def start(self, paced: bool) -> None:
        """A fit begins: ask at :data:`FIRST_ASK` steps where the worker is paced.

        Args:
            paced: whether the worker's inner steps follow its speed.
        """
        self.next_at = FIRST_ASK if paced else None

    def due(self, steps: int, round_steps: int) -> bool:
        """Whether to say the rate now.

        Args:
            steps: the local steps of the round so far (of the fit's, before its first push).
            round_steps: the round's length as it stands.
        """
        return self.next_at is not None and self.next_at <= steps and 2 * steps <= round_steps

    def ask(self, client: Any, rate: float | None, steps: int) -> float | None:
        """Say ``rate`` to the PS: returns the pace it answers, which ends the asking; where it has none yet (or
        no step was timed), None, and the worker asks again after twice the steps.

        Args:
            client: the worker's client (``PSClient.pace``; a sharded one asks every shard).
            rate: the worker's local steps per second since the fit began (``StepClock.rate``).
            steps: the round's steps so far.
        """
        pace = None if rate is None else client.pace(rate)
        self.asked += 1
        self.next_at = None if pace is not None else 3 * steps
        return pace

    def stop(self) -> None:
        """A push says the rate from now on."""
        self.next_at = None
