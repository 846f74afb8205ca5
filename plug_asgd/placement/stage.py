"""The Lightning stage that runs, as the strategy's parts share it: one object the strategy hands each part, where
the parts once read each other's private attributes."""

from __future__ import annotations

from dataclasses import dataclass

from plug_asgd.worker.phase import Phase


@dataclass
class Stage:
    """This process's stage (a fit, a validation, a test, a prediction), counted alike on every rank.

    Attributes:
        number: this process's stages so far (the PS tells one stage's collectives from another's by it).
        collectives: the collectives through the PS this stage so far: the next one's number.
        phase: where the worker is in the stage.
        batches: the training loop's batches so far: a notice's number.
        fitting: whether the stage is a fit.
        failure: what the stage failed on, told to the other ranks through the PS (None: nothing, or nothing to
            tell: an island that lost a rank ends as a lost worker).
        joined: whether this stage's first model reached this rank (with islands, through its leader).
    """

    number: int = 0
    collectives: int = 0
    phase: Phase = Phase.IDLE
    batches: int = 0
    fitting: bool = False
    failure: str | None = None
    joined: bool = False

    def begin(self, fitting: bool) -> None:
        """A new stage starts: numbered, its collectives counted from 0 (its phase is set once it has begun).

        Args:
            fitting: whether it is a fit.
        """
        self.number += 1
        self.collectives = 0
        self.fitting = fitting

    def next_collective(self) -> int:
        """The number of the collective about to be sent (every rank counts its collectives alike)."""
        seq = self.collectives
        self.collectives += 1
        return seq
