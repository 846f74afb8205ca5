"""The strategy's PS as the strategy shows it (:class:`PSPlumbing`, a base of
:class:`~plug_asgd.strategy.AsyncPSStrategy`): where it is (its endpoints, its shards, this worker's placement), what
a callback gets of it (:meth:`PSPlumbing.ps_handle`), its counters and this worker's, and the client connected at the
first stage. The work is :mod:`plug_asgd.placement.connection`'s; Lightning's collectives through the PS are
:mod:`plug_asgd.strategy_collectives`'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from plug_asgd.placement.connection import Placement, PSConnection, PSHandle
from plug_asgd.placement.island import IslandGroup, IslandPlan
from plug_asgd.sharding.client import ShardedClient
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.phase import Phase
from plug_asgd.worker.tensors import synced_tensors

if TYPE_CHECKING:
    from plug_asgd.compressors import Codec
    from plug_asgd.modes import Mode
    from plug_asgd.worker.exchange import Exchange


class PSPlumbing:
    """The PS of :class:`~plug_asgd.strategy.AsyncPSStrategy`, as its users and callbacks see it (the strategy's
    ``connection`` does the work)."""

    # set by the strategy's __init__ and its stages; the ranks, the cluster environment and the module are Lightning's
    connection: PSConnection
    mode: Mode
    compressor: Codec
    _exchange: Exchange
    _phase: Phase
    _island: IslandGroup | None  # this rank's island's group (None: the rank is a worker of its own)
    island_ranks: int  # ranks per island
    _island_joined = False  # whether this stage's first model reached the island (every rank's view of ``joined``)
    _island_steps = 0  # an island's other ranks' local steps (the leader's are its exchange's)

    @property
    def per_node(self) -> bool:
        """Whether each node runs one shard (``ps_shards="per_node"``)."""
        return self.connection.per_node

    @property
    def ps_shards(self) -> int:
        """How many shards the PS has (1: one PS); with ``ps_shards="per_node"``, the job's node count."""
        return self.connection.shard_count(self.num_nodes)

    @property
    def ps_endpoint(self) -> str:
        """The PS's address, ``tcp://host:port``, that the workers connect to (the embedded PS's or ``ps_address``;
        shard 0's of a sharded PS, which serves the collectives)."""
        return self.ps_endpoints[0]

    @property
    def ps_endpoints(self) -> list[str]:
        """Every shard's address, in order (one: an unsharded PS's)."""
        return self.connection.endpoints(self.placement())[0]

    def placement(self) -> Placement:
        """This worker's place in the job (its ranks, the cluster's main address), as the PS's placement needs it:
        with islands, the PS's workers are the islands, so the ranks are the island's number and count."""
        env = self.cluster_environment
        plan = self.island_plan
        return Placement(main_address=env.main_address if env is not None else None,
                         main_port=env.main_port if env is not None else 0,
                         elastic=isinstance(env, self.elastic_environment), num_nodes=self.num_nodes,
                         node_rank=self.node_rank, local_rank=self.local_rank // plan.size, global_rank=plan.island,
                         world_size=plan.count)

    @property
    def island_plan(self) -> IslandPlan:
        """Where this rank stands among the job's islands (``island=``)."""
        return IslandPlan(self.island_ranks, self.global_rank, max(self.world_size, self.island_ranks))

    @property
    def island_leader(self) -> bool:
        """Whether this rank trades with the PS: an island's first rank, or any rank without islands."""
        return self.island_plan.leader

    def island_weights_agree(self) -> bool:
        """Whether every rank of this rank's island holds the same parameters and buffers, bit for bit: a check
        (a collective of the island, which every rank of it must call at the same point); True without islands."""
        if self._island is None:
            return True
        return self._island.digest_agrees(synced_tensors(self.lightning_module))

    def _island_group(self) -> IslandGroup:
        env = self.cluster_environment
        return IslandGroup(self.island_plan, node_rank=self.node_rank, local_rank=self.local_rank,
                           devices=self.num_processes, main_port=env.main_port if env is not None else 0,
                           device=self.root_device, timeout=self.connection.settings.request_timeout)

    def _island_sync(self) -> None:
        """The leader's weights on every rank of its island (all of them call it at the same point)."""
        if self._island is not None:
            self._island.send_weights(synced_tensors(self.lightning_module))

    def _island_closure(self, closure: Callable[..., Any], optimizer: Any) -> Callable[..., Any]:
        """``closure`` (the forward and backward), then the island's mean gradient in every rank's ``.grad``, as
        DDP's all-reduce leaves it: clipping and the step then act on it alike on every rank."""
        island = self._island
        assert island is not None

        def averaged(*args: Any, **kwargs: Any) -> Any:
            out = closure(*args, **kwargs)
            island.average_gradients(p for group in optimizer.param_groups for p in group["params"])
            return out

        return averaged

    def ps_handle(self) -> PSHandle:
        """What a callback needs of the PS this strategy trains against (its addresses, keys and counters)."""
        return PSHandle(endpoints=self.ps_endpoints, mode=self.mode.name, codec=self.compressor,
                        keys=self.connection.settings.ps_keys, comm_stats=self.comm_stats, ps_stats=self.ps_stats)

    def _connect(self) -> PSClient | ShardedClient:
        """This worker's client, connected (and the embedded PS started) at the first stage; shut down at exit, or
        when a later strategy of this process connects (``PSConnection.connect``)."""
        client = self.connection.client
        if client is None:
            client = self.connection.connect(self.placement(), self._shapes, self._trainer(),
                                             on_shutdown=self._exchange.close)
        return client

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in synced_tensors(self.lightning_module).items()}

    def _trainer(self) -> Any:
        return self.lightning_module.trainer if self.lightning_module is not None else None

    def _shutdown(self, wait_for_workers: float = 30.0) -> None:
        """Release the exchange (``on_shutdown``), let the other workers finish with the PS, then stop it (rank 0)
        and close: what happens at exit, or when a later strategy of this process connects."""
        self.connection.shutdown(wait_for_workers)

    def comm_stats(self, settle: bool = False) -> dict[str, Any]:
        """This worker's counters: local steps, bytes up and down (measured on the wire), time spent
        waiting for the PS, the staleness of its pushes (updates of others folded in between its
        base version and its own update), and its guesses of an "own" reply (CPU spent on them).

        Args:
            settle: take the reply of the push in flight first, so that its bytes down and its "own" are
                counted with it (once training is over: mid-training it would take the reply a step early).
        """
        island = self._island
        if island is not None and not island.plan.leader:  # no PS traffic of its own: the island's and its steps
            return {"local_steps": self._island_steps, **island.counters()}
        if settle and self._phase is not Phase.IDLE:
            self._exchange.finish()
        counters = self.connection.counters(self._exchange.stats)
        return {**counters, **island.counters()} if island is not None and counters else counters

    def ps_stats(self) -> dict[str, Any]:
        """The parameter server's global counters (version, pushes, bytes in and out, staleness).

        Between stages they are those this worker saw as it left the last one: the embedded PS
        stops once every worker has left, so asking it again could wait for a server that is gone.

        Raises:
            RuntimeError: on an island's rank other than its leader, which has no connection to the PS.
        """
        if not self.island_leader:
            plan = self.island_plan
            raise RuntimeError(f"rank {plan.rank} is not its island's leader (rank {plan.island * plan.size}): the "
                               "leader alone talks to the PS, so ask it (or the PS: plug-asgd status)")
        return self.connection.stats(self._phase is not Phase.IDLE, settle=self._exchange.finish)
