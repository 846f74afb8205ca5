"""Where a worker is in a Lightning stage, as the strategy keeps it: one state where four booleans stood."""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    """Where a worker is in a Lightning stage (a fit, a validation, a test, a prediction), as the strategy sees it."""

    IDLE = "idle"  # between stages: no collective goes through the PS
    STAGE = "stage"  # in a stage, outside the training loop's batches (setup, evaluation, their hooks)
    BATCHES = "batches"  # in the training loop's batches: a broadcast is a notice, answered without waiting
    FAILED = "failed"  # an exception ended the stage's work: teardown says goodbye without leaving the fit
