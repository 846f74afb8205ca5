"""The strategy's PS as its users and callbacks see it (:class:`PSView`): where it is (its endpoints, its shards),
what a callback gets of it (:meth:`PSView.handle`), its counters and this rank's, and the client connected at the
first stage. An object the strategy holds and hands what only Lightning knows (the rank's placement, the trainer, the
model's shapes); the work is :mod:`plug_asgd.placement.connection`'s. Imports neither Lightning namespace.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from plug_asgd.placement.connection import Placement, PSConnection, PSHandle
from plug_asgd.placement.island import IslandGroup
from plug_asgd.placement.stage import Stage
from plug_asgd.sharding.client import ShardedClient
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.phase import Phase

if TYPE_CHECKING:
    from plug_asgd.compressors import Codec
    from plug_asgd.worker.exchange import Exchange


class PSView:
    """The PS of one strategy, as the strategy shows it.

    Args:
        connection: the strategy's PS connection, which does the work.
        exchange: the strategy's exchange (its counters; it lets the socket go before a request).
        stage: the stage that runs.
        mode: the mode's name, which the PS checks at hello.
        codec: the workers' codec.
        job: this worker's place in the job as the PS sees it (with islands: the island's number and count).
    """

    def __init__(self, connection: PSConnection, exchange: Exchange, stage: Stage, mode: str, codec: Codec,
                 job: Callable[[], Placement]) -> None:
        self.connection, self.exchange, self.stage = connection, exchange, stage
        self.mode, self.codec, self.job = mode, codec, job
        self.island: IslandGroup | None = None  # this rank's island (None: a worker of its own)
        self.follower_steps = 0  # an island's other ranks' local steps (a leader's are its exchange's)
        self.stats_at_exit: dict[str, Any] | None = None  # an island's other ranks: the PS's, as their leader left

    def endpoints(self) -> list[str]:
        """Every shard's address, in order (one: an unsharded PS's)."""
        return self.connection.endpoints(self.job())[0]

    def handle(self, comm_stats: Callable[..., dict[str, Any]], ps_stats: Callable[[], dict[str, Any]]) -> PSHandle:
        """What a callback needs of the PS (its addresses, keys and counters).

        Args:
            comm_stats: the strategy's ``comm_stats``.
            ps_stats: the strategy's ``ps_stats``.
        """
        return PSHandle(endpoints=self.endpoints(), mode=self.mode, codec=self.codec,
                        keys=self.connection.settings.ps_keys, comm_stats=comm_stats, ps_stats=ps_stats)

    def connect(self, shapes: Callable[[], Mapping[str, tuple[int, ...]]], trainer: Any) -> PSClient | ShardedClient:
        """This worker's client, connected (and the embedded PS started) at the first stage; shut down at exit, or
        when a later strategy of this process connects (``PSConnection.connect``).

        Args:
            shapes: the model's synced tensors' shapes, asked once.
            trainer: the Trainer (its callbacks may configure the embedded PS).
        """
        client = self.connection.client
        if client is None:
            client = self.connection.connect(self.job(), shapes, trainer, on_shutdown=self.exchange.close)
        return client

    def comm_stats(self, settle: bool = False) -> dict[str, Any]:
        """This rank's counters (``AsyncPSStrategy.comm_stats``); an island's other ranks: their steps and their
        traffic inside the island, the PS's being their leader's.

        Args:
            settle: take the reply of the push in flight first.
        """
        island = self.island
        if island is not None and not island.plan.leader:
            return {"local_steps": self.follower_steps, **island.counters()}
        if settle and self.stage.phase is not Phase.IDLE:
            self.exchange.finish()
        counters = self.connection.counters(self.exchange.stats)
        return {**counters, **island.counters()} if island is not None and counters else counters

    def ps_stats(self) -> dict[str, Any]:
        """The PS's counters (``AsyncPSStrategy.ps_stats``); on an island's other ranks, between stages, those its
        leader saw as it left the last one (the leader sends them to its island).

        Raises:
            RuntimeError: on an island's rank other than its leader during a stage, or before one ended: it has no
                connection to the PS.
        """
        island = self.island
        if island is not None and not island.plan.leader and self.stats_at_exit is not None and (
                self.stage.phase is Phase.IDLE):
            return dict(self.stats_at_exit)
        if island is not None and not island.plan.leader:
            plan = island.plan
            raise RuntimeError(f"rank {plan.rank} is not its island's leader (rank {plan.island * plan.size}): the "
                               "leader alone talks to the PS, so ask it (or the PS: plug-asgd status)")
        return self.connection.stats(self.stage.phase is not Phase.IDLE, settle=self.exchange.finish)
