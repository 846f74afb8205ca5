"""What the callbacks share: the strategy they need, and where they write."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from plug_asgd.strategy import AsyncPSStrategy

if TYPE_CHECKING:  # either namespace's classes (lightning_bridge.namespaces); pytorch_lightning's names them here
    import pytorch_lightning as pl


def require_strategy(trainer: pl.Trainer, who: str) -> AsyncPSStrategy:
    if not isinstance(trainer.strategy, AsyncPSStrategy):
        raise TypeError(f"{who} needs Trainer(strategy=AsyncPSStrategy(...)), not {type(trainer.strategy).__name__}")
    return trainer.strategy


def run_dir(trainer: pl.Trainer, dirpath: str | os.PathLike[str] | None, leaf: str) -> Path:
    """Where a callback writes. Call it on every rank (``setup``): ``trainer.log_dir`` is a broadcast,
    and a collective reached by one rank only would pair with another rank's next collective."""
    if dirpath is not None:
        return Path(dirpath)
    log_dir = trainer.log_dir
    return Path(log_dir if trainer.loggers and log_dir is not None else trainer.default_root_dir) / leaf


class KeepsRecords:
    """A callback whose ``records`` (its evaluations, its measurements) a Lightning checkpoint keeps: what
    ``Callback.state_dict`` saves and ``load_state_dict`` gives back, so a resumed fit goes on with them."""

    records: list[dict[str, Any]]

    def state_dict(self) -> dict[str, Any]:
        return {"records": list(self.records)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.records = list(state_dict.get("records", []))
