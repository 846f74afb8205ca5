"""Whether a worker's torch steps faster with one thread fewer, leaving a core to the push's encoding: measured.

A codec encodes each push on a thread of its own while the next step's forward and backward compute. Where a step
is mostly memory traffic (many parameters, little compute on each), torch's threads and that one contend for the
cores, an OpenMP team spinning at its barrier while one of its threads waits for the core the encoding holds, and
torch on one thread fewer steps faster; where the step is compute, every thread counts (both measured:
bench/results/README.md, "The exchange at ResNet size"). Which one a model is, the steps tell: the tuner times some
at torch's threads, some at one fewer, and keeps the faster, once per fit.
"""

from __future__ import annotations

import logging
import os
import statistics
from collections.abc import Callable

log = logging.getLogger("plug_asgd.strategy")

# set where a strategy was made before anyone set OMP_NUM_THREADS: Lightning then chooses torch's threads (and exports
# the variable to the workers it launches, which inherit this too), so the thread tuner may change them
THREADS_CHOSEN = "PLUG_ASGD_THREADS_CHOSEN"


def threads_chosen() -> bool:
    """Whether torch's threads in this process are Lightning's choice, not the user's own (``OMP_NUM_THREADS``)."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ[THREADS_CHOSEN] = "1"
    return os.environ.get(THREADS_CHOSEN) == "1"


class ThreadTuner:
    """Times ``window`` steps at ``threads`` (after ``warmup``), then ``window`` at ``threads - 1`` (after ``settle``),
    and keeps one fewer where its median step is shorter by more than ``margin``; else goes back.

    Args:
        threads: torch's threads to start from (at least 2).
        set_threads: sets torch's threads (``torch.set_num_threads``).
        warmup: steps left untimed at the start (the first ones are slower).
        window: steps timed at each count.
        settle: steps left untimed after the switch.
        margin: how much shorter (a fraction) one fewer's median step must be to be kept.

    Raises:
        ValueError: where ``threads`` is below 2 or a count is below 1.
    """

    def __init__(self, threads: int, set_threads: Callable[[int], None], warmup: int = 10, window: int = 30,
                 settle: int = 3, margin: float = 0.05) -> None:
        if threads < 2 or min(warmup, window, settle) < 1:
            raise ValueError(f"a tuner needs 2 threads or more and counts of 1 or more, got threads={threads}, "
                             f"warmup={warmup}, window={window}, settle={settle}")
        self.threads, self.set_threads = threads, set_threads
        self.warmup, self.window, self.settle, self.margin = warmup, window, settle, margin
        self.marks: list[float] = []
        self.medians: list[float] = []  # the median step at threads, then at threads - 1
        self.kept: int | None = None  # the count kept, once decided

    @property
    def done(self) -> bool:
        """Whether the count is decided."""
        return self.kept is not None

    def batch_start(self, now: float) -> None:
        """A training batch starts at ``now`` (seconds): the step before it ended.

        Args:
            now: a monotonic clock's reading.
        """
        if self.done:
            return
        self.marks.append(now)
        skip = self.warmup if not self.medians else self.settle
        if len(self.marks) < skip + self.window + 1:
            return
        timed = self.marks[skip:]
        self.medians.append(statistics.median(b - a for a, b in zip(timed, timed[1:], strict=False)))
        self.marks = [now]  # the step starting now is the first at the next count
        if len(self.medians) == 1:
            self.set_threads(self.threads - 1)
            return
        at_all, at_fewer = self.medians
        self.kept = self.threads - 1 if at_fewer < at_all * (1 - self.margin) else self.threads
        if self.kept == self.threads:
            self.set_threads(self.threads)
        log.info("torch steps on %d threads: a step took %.1f ms on %d, %.1f ms on %d (a core left to the push's "
                 "encoding)", self.kept, at_all * 1e3, self.threads, at_fewer * 1e3, self.threads - 1)

    def stop(self) -> None:
        """The fit is over: torch's threads as they were before it."""
        if self.medians:  # (the threads were changed, or may have been)
            self.set_threads(self.threads)
