"""Lightning's collectives of :class:`~plug_asgd.strategy.AsyncPSStrategy` (barrier, broadcast, all_gather, reduce),
each a gather of every rank's part through the PS (:mod:`plug_asgd.worker.collectives`); with islands, in two levels
(:mod:`plug_asgd.placement.island`); among the training loop's batches a broadcast is a notice
(:mod:`plug_asgd.worker.notices`) and a reduction the rank's own value. An object the strategy holds, handed what it
reads: the connection, the exchange (which must let the socket go first), the stage, the rank's place. Imports
neither Lightning namespace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor

from plug_asgd.placement.island import IslandGroup
from plug_asgd.placement.island_collectives import island_gather, island_notice
from plug_asgd.placement.stage import Stage
from plug_asgd.worker.collectives import Collectives
from plug_asgd.worker.phase import Phase

if TYPE_CHECKING:
    from plug_asgd.placement.connection import PSConnection
    from plug_asgd.worker.exchange import Exchange


class StrategyCollectives:
    """A rank's collectives through the PS, and inside its island where it has one.

    Args:
        connection: the strategy's PS connection (its client: None on an island's other ranks).
        exchange: the strategy's exchange, which lets the socket go before a collective is sent.
        stage: the stage that runs (its number, its collectives so far, its phase and batches).
        ranks: this rank's global rank and the job's world size, once Lightning knows them.
    """

    def __init__(self, connection: PSConnection, exchange: Exchange, stage: Stage,
                 ranks: Callable[[], tuple[int, int]]) -> None:
        self.connection, self.exchange, self.stage, self.ranks = connection, exchange, stage, ranks
        self.island: IslandGroup | None = None  # this rank's island (None: a worker of its own)

    def active(self) -> Collectives:
        """The collectives of the stage: through the PS (or the island) where the rank is not alone, else local."""
        connected = self.connection.client is not None or self.island is not None
        live = connected and self.stage.phase is not Phase.IDLE and self.ranks()[1] > 1
        return Collectives(self.gather if live else None)

    def gather(self, kind: str, obj: Any = None, tensors: dict[str, np.ndarray] | None = None) -> list[Any]:
        """Every rank's ``(rank, obj, tensors)`` for one collective: through the PS, or with islands inside the island
        and through the PS among the leaders.

        Args:
            kind: what the collective is, which every rank must agree on.
            obj: this rank's msgpack data.
            tensors: this rank's arrays by name.
        """
        island = self.island
        if island is None:
            return self.ps_gather(kind, obj, tensors)
        across = self.ps_gather if island.plan.leader and island.plan.count > 1 else None
        return island_gather(island, kind, obj, tensors, across)

    def ps_gather(self, kind: str, obj: Any = None, tensors: dict[str, np.ndarray] | None = None) -> list[Any]:
        """A gather of the PS's workers (with islands, the leaders): after the exchange let the socket go.

        Args:
            kind: what the collective is.
            obj: this worker's msgpack data.
            tensors: this worker's arrays by name.
        """
        self.exchange.finish()  # one request at a time on the socket
        assert self.connection.client is not None
        return self.connection.client.gather(self.stage.number, self.stage.next_collective(), obj, tensors,
                                             kind=kind)

    def ps_barrier(self, name: str) -> None:
        """A barrier of the PS's workers (with islands, of the leaders alone): what an exchange waits on.

        Args:
            name: the barrier's name.
        """
        size = self.island.plan.size if self.island is not None else 1
        if self.connection.client is not None and self.stage.phase is not Phase.IDLE and self.ranks()[1] > size:
            self.ps_gather(f"barrier:{name}")

    def broadcast(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj``: among the training loop's batches (the ``Timer``'s stop flag, every batch) a
        notice that waits for no worker; elsewhere a collective.

        Args:
            obj: this rank's value (sent where it is ``src``).
            src: the rank whose value every rank takes.
        """
        collectives = self.active()
        if collectives.gather is None or self.stage.phase is not Phase.BATCHES:
            return collectives.broadcast(obj, src, self.ranks()[0])
        client, island, stage = self.connection.client, self.island, self.stage
        if island is None:
            assert client is not None
            return client.notices().broadcast(obj, src, stage.number, stage.batches)
        board = None
        if client is not None and island.plan.count > 1:
            def board(value: Any, src_island: int) -> Any:
                return client.notices().broadcast(value, src_island, stage.number, stage.batches)
        return island_notice(island, obj, src, board)

    def all_gather(self, tensor: Tensor, sync_grads: bool) -> Tensor:
        """Every rank's ``tensor``, stacked in rank order (:meth:`Collectives.all_gather`).

        Args:
            tensor: this rank's part.
            sync_grads: must be False (no autograd across processes).
        """
        return self.active().all_gather(tensor, sync_grads)

    def reduce(self, tensor: Any, reduce_op: Any, training: bool) -> Any:
        """Reduced across ranks during evaluation; during training the rank's own value.

        Args:
            tensor: this rank's value.
            reduce_op: the operation (:func:`~plug_asgd.worker.collectives.op_name`).
            training: whether the training loop's batches run.
        """
        return self.active().reduce(tensor, reduce_op, training)
