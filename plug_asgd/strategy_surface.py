"""What users, callbacks and Lightning call on :class:`~plug_asgd.strategy.AsyncPSStrategy` beside its life cycle
(:class:`PSSurface`, its base): the PS's addresses and counters, the island's plan and its check, Lightning's
collectives. Each is handed to the object that does it (the strategy's ``ps``, ``collectives`` and ``connection``:
:mod:`plug_asgd.placement`); this class holds no state of its own and reads none of the strategy's private
attributes, so the life cycle (``plug_asgd.strategy``) and this surface can be read apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor
from typing_extensions import override

from plug_asgd.placement.connection import Placement, PSHandle
from plug_asgd.placement.island import Island, IslandPlan, island_size
from plug_asgd.worker.tensors import synced_tensors

if TYPE_CHECKING:
    from plug_asgd.modes import Mode
    from plug_asgd.placement.collectives import StrategyCollectives
    from plug_asgd.placement.connection import PSConnection
    from plug_asgd.placement.ps_view import PSView

_TRAINING = "train"  # RunningStage.TRAINING of either namespace (a str enum)


class PSSurface:
    """The public surface of the strategy beside Lightning's life cycle: its PS, its island, its collectives."""

    # the strategy's parts (set by its __init__); the ranks, the cluster environment and the module are Lightning's
    connection: PSConnection
    ps: PSView
    collectives: StrategyCollectives
    mode: Mode
    island: Island

    # -- the PS as the strategy shows it (self.ps, plug_asgd.placement.ps_view) ------------------------------------

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
        return self.ps.endpoints()

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

    def ps_handle(self) -> PSHandle:
        """What a callback needs of the PS this strategy trains against (its addresses, keys and counters)."""
        return self.ps.handle(self.comm_stats, self.ps_stats)

    def comm_stats(self, settle: bool = False) -> dict[str, Any]:
        """This worker's counters: local steps, bytes up and down (measured on the wire), time spent
        waiting for the PS, the staleness of its pushes (updates of others folded in between its
        base version and its own update), and its guesses of an "own" reply (CPU spent on them). With islands, the
        rank's island and its bytes there too (an island's other ranks: those alone, with their steps).

        Args:
            settle: take the reply of the push in flight first, so that its bytes down and its "own" are
                counted with it (once training is over: mid-training it would take the reply a step early).
        """
        return self.ps.comm_stats(settle)

    def ps_stats(self) -> dict[str, Any]:
        """The parameter server's global counters (version, pushes, bytes in and out, staleness).

        Between stages they are those this worker saw as it left the last one: the embedded PS
        stops once every worker has left, so asking it again could wait for a server that is gone.
        """
        return self.ps.ps_stats()

    # -- islands (plug_asgd.placement.island) ---------------------------------------------------------------------

    @property
    def island_ranks(self) -> int:
        """How many ranks make one island, one worker of the PS (1: every rank a worker of its own)."""
        return island_size(self.island, max(1, self.num_processes), self.num_nodes, self.mode.name)

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
        island = self.ps.island
        return True if island is None else island.digest_agrees(synced_tensors(self.lightning_module))

    # -- Lightning's collectives (self.collectives, plug_asgd.placement.collectives) -----------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        self.collectives.active().barrier(name)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Among the training loop's batches (the ``Timer``'s stop flag, every batch), answered without waiting for
        the other workers (:mod:`plug_asgd.worker.notices`); elsewhere a collective through the PS."""
        return self.collectives.broadcast(obj, src)

    @override
    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return self.collectives.all_gather(tensor, sync_grads)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce across workers during evaluation; during training the local value is returned."""
        module = self.lightning_module
        trainer = module.trainer if module is not None else None
        return self.collectives.reduce(tensor, reduce_op, trainer is not None and trainer.state.stage == _TRAINING)
