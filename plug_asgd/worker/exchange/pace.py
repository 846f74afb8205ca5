"""A worker's own speed: the local steps per second it makes between two pushes, which async_diloco's dynamic
local steps compare with the fastest worker's (Liu et al. 2024: a worker at ``p`` times the fastest's speed makes
``p`` of the inner steps, so that every worker pushes about as often).

The PS compares the rates the workers' pushes say and answers each with its pace (``ModelReply.pace``): the
others' speeds come from their own clocks, not from counting their pushes between two of this worker's, which at
two workers is 1 or 2, and shortens a slower worker's rounds only rounds after it should have.
"""

from __future__ import annotations

import statistics
import time

from plug_asgd.protocol.wire import RATE_RANGE


class StepClock:
    """The wall time of each local step, from the end of the last step's exchange to the end of this step (the start
    of its exchange): the data, the forward and backward and the optimizer's step, and anything else the loop does
    per step (a callback, a slowed host's sleep), but not the pushes. The median of a round's steps stands for them
    all, so that a validation run or a wait for an overlapped reply in one step does not count as slowness.
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
