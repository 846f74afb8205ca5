"""Lightning's collectives of :class:`~plug_asgd.strategy.AsyncPSStrategy` through its PS (:class:`PSCollectives`,
a base of the strategy): barrier, broadcast, all_gather and reduce, each a gather of every worker's part
(:mod:`plug_asgd.worker.collectives`), but where the training loop's batches must not wait for the other workers: a
broadcast there is a notice (:mod:`plug_asgd.worker.notices`), a reduction the worker's own value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor
from typing_extensions import override

from plug_asgd.placement.island import IslandGroup, island_gather, island_notice
from plug_asgd.worker.collectives import Collectives
from plug_asgd.worker.phase import Phase

if TYPE_CHECKING:
    from plug_asgd.placement.connection import PSConnection
    from plug_asgd.worker.exchange import Exchange

_TRAINING = "train"  # RunningStage.TRAINING of either namespace (a str enum)


class PSCollectives:
    """Lightning's collectives of the strategy, through its PS; during the training loop's batches, answered without
    waiting for the other workers."""

    # set by the strategy's __init__ and its stages (the stage, its collectives so far, the training loop's batches)
    connection: PSConnection
    _exchange: Exchange
    _phase: Phase
    _stage: int
    _collective_seq: int
    _batches: int
    _island: IslandGroup | None  # this rank's island (None: a worker of its own)
    _trainer: Callable[[], Any]  # the strategy's trainer, None before it has one (PSPlumbing's)

    def _collectives(self) -> Collectives:
        connected = self.connection.client is not None or self._island is not None
        active = connected and self._phase is not Phase.IDLE and self.world_size > 1
        return Collectives(self._gather if active else None)

    def _gather(self, kind: str, obj: Any = None, tensors: dict[str, np.ndarray] | None = None) -> list[Any]:
        """Every rank's part of a collective: through the PS, or with islands, inside the island and through the PS
        among the leaders (:func:`~plug_asgd.placement.island.island_gather`)."""
        island = self._island
        if island is None:
            return self._ps_gather(kind, obj, tensors)
        across = self._ps_gather if island.plan.leader and island.plan.count > 1 else None
        return island_gather(island, kind, obj, tensors, across)

    def _ps_barrier(self, name: str) -> None:
        """A barrier of the PS's workers (with islands, of the leaders alone): what an exchange waits on."""
        if self.connection.client is not None and self._phase is not Phase.IDLE and (
                self.world_size // (self._island.plan.size if self._island is not None else 1)) > 1:
            self._ps_gather(f"barrier:{name}")

    def _ps_gather(self, kind: str, obj: Any = None, tensors: dict[str, np.ndarray] | None = None) -> list[Any]:
        self._exchange.finish()  # one request at a time on the socket
        assert self.connection.client is not None
        seq = self._collective_seq
        self._collective_seq += 1
        return self.connection.client.gather(self._stage, seq, obj, tensors, kind=kind)

    @override
    def barrier(self, name: str | None = None) -> None:
        self._collectives().barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Among the training loop's batches (the ``Timer``'s stop flag, every batch), answered without waiting for
        the other workers (:mod:`plug_asgd.worker.notices`); elsewhere a collective through the PS."""
        collectives = self._collectives()
        if collectives.gather is not None and self._phase is Phase.BATCHES:
            client, island = self.connection.client, self._island
            if island is None:
                assert client is not None
                return client.notices().broadcast(obj, src, self._stage, self._batches)
            board = None
            if client is not None and island.plan.count > 1:
                def board(value: Any, src_island: int) -> Any:
                    return client.notices().broadcast(value, src_island, self._stage, self._batches)
            return island_notice(island, obj, src, board)
        return collectives.broadcast(obj, src, self.global_rank)

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return self._collectives().all_gather(tensor, sync_grads)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce across workers during evaluation; during training the local value is returned."""
        trainer = self._trainer()
        training = trainer is not None and trainer.state.stage == _TRAINING
        return self._collectives().reduce(tensor, reduce_op, training)
