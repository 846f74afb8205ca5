"""What the callbacks share: the PS they are handed, where they write, and the records a checkpoint keeps.

The callbacks know the strategy only through what it hands them (:class:`~plug_asgd.placement.connection.PSHandle`), so
that they import no strategy and work with any strategy that trains against a PS and offers ``ps_handle()``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plug_asgd.placement.connection import PSHandle

if TYPE_CHECKING:  # either namespace's classes (lightning_bridge.namespaces); pytorch_lightning's names them here
    import pytorch_lightning as pl


def require_ps(trainer: pl.Trainer, who: str) -> None:
    """Refuses a trainer whose strategy trains against no PS (one without ``ps_handle()``).

    Args:
        trainer: the Trainer the callback is set up with.
        who: the callback's name, for the message.

    Raises:
        TypeError: the trainer's strategy is not a parameter-server strategy.
    """
    if not callable(getattr(trainer.strategy, "ps_handle", None)):
        raise TypeError(f"{who} needs Trainer(strategy=AsyncPSStrategy(...)), not {type(trainer.strategy).__name__}")


def ps_handle(trainer: pl.Trainer, who: str) -> PSHandle:
    """The PS that ``trainer``'s strategy trains against, once its workers have connected.

    Args:
        trainer: the Trainer the callback runs in.
        who: the callback's name, for the message.

    Raises:
        TypeError: the trainer's strategy is not a parameter-server strategy.
    """
    require_ps(trainer, who)
    return trainer.strategy.ps_handle()  # type: ignore[attr-defined]


def run_dir(trainer: pl.Trainer, dirpath: str | os.PathLike[str] | None, leaf: str) -> Path:
    """Where a callback writes. Call it on every rank (``setup``): ``trainer.log_dir`` is a broadcast,
    and a collective reached by one rank only would pair with another rank's next collective.

    Args:
        trainer: the Trainer the callback is set up with.
        dirpath: the folder the user chose; None: ``leaf`` in the trainer's log dir (or its root dir).
        leaf: the subfolder of the log dir the callback writes in by default.
    """
    if dirpath is not None:
        return Path(dirpath)
    log_dir = trainer.log_dir
    return Path(log_dir if trainer.loggers and log_dir is not None else trainer.default_root_dir) / leaf


class KeepsRecords:
    """A callback whose ``records`` (its evaluations, its measurements) a Lightning checkpoint keeps: what
    ``Callback.state_dict`` saves and ``load_state_dict`` gives back, so a resumed fit goes on with them."""

    records: list[dict[str, Any]]

    def state_dict(self) -> dict[str, Any]:
        """The records, for the Lightning checkpoint."""
        return {"records": list(self.records)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Takes the records back from a Lightning checkpoint.

        Args:
            state_dict: what :meth:`state_dict` saved.
        """
        self.records = list(state_dict.get("records", []))
