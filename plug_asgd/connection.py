"""Where a worker's parameter server runs, and the worker's connection to it: the PS side of ``AsyncPSStrategy``.

:class:`PSConnection` holds the strategy's PS arguments (checked when the strategy is built) and, once a
stage connects, places the PS: one embedded PS, ``ps_shards=N`` embedded shards, one shard per node
(:mod:`plug_asgd.sharding.per_node`) or external addresses. It starts the embedded processes this rank owns
(:mod:`plug_asgd.ps_launcher`), connects one client (a :class:`~plug_asgd.worker.client.PSClient`, or a
:class:`~plug_asgd.sharding.client.ShardedClient` over the shards) that every later stage reuses, says goodbye at a
stage's end and shuts both down at exit. Kept apart from the strategy so that its Lightning life cycle does not
carry the PS's placement; the strategy hands in what only Lightning knows (itself as the :class:`Job`, the model's
shapes, the trainer). Imports neither Lightning namespace.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol

from plug_asgd.compressors import Codec
from plug_asgd.modes import Mode
from plug_asgd.ps_launcher import (
    EmbeddedPS,
    check_arguments,
    check_placement,
    check_placements,
    configurer,
    endpoint,
    endpoints,
    ps_config,
)
from plug_asgd.sharding.client import ShardedClient
from plug_asgd.sharding.config import connect, make_partition, sharded, shards
from plug_asgd.sharding.per_node import PER_NODE, gather_addresses, node_address, shard_endpoint
from plug_asgd.worker.client import PSClient, PSError, PSUnreachableError

log = logging.getLogger("plug_asgd.strategy")  # the strategy's warnings, under the name they always had

# how long a worker that failed (Ctrl-C, an error) waits on each of its goodbye requests
_FAILED_EXIT_S = 5.0

Shapes = Callable[[], Mapping[str, tuple[int, ...]]]  # the model's synced tensors' shapes, asked once it exists

# The connections of this process that hold a client or embedded PS processes. Weakly: a strategy its Trainer no longer
# uses is freed with its model and data (an atexit entry per strategy would keep each one, in a process that runs
# many fits), and its PS is stopped when the next strategy connects, or at exit.
_LIVE: weakref.WeakSet[PSConnection] = weakref.WeakSet()
# Each connection's run: the how-many-th strategy connected in this process, which every rank of a job counts alike.
# Its embedded PS refuses a hello for another run, so that a worker of the next Trainer never trains against the
# previous Trainer's PS on the same port while rank 0 has not yet stopped it.
_RUNS = itertools.count(1)


@atexit.register
def _shutdown_all() -> None:
    for connection in list(_LIVE):
        connection.shutdown()


def _release(embedded: EmbeddedPS, clients: list[PSClient | ShardedClient]) -> None:
    """A connection freed without a shutdown (its strategy collected): its client closed, its embedded PS stopped."""
    for client in clients:
        client.close()
    embedded.stop()


class Job(Protocol):
    """This worker's place in the job: what a Lightning ``ParallelStrategy`` knows (the strategy passes itself), read
    only where needed, as the ranks are known only once the workers are launched."""

    elastic_environment: Any  # torchrun's environment class, whose agent serves its store on the main port

    @property
    def cluster_environment(self) -> Any: ...  # the main address and port
    @property
    def num_nodes(self) -> int: ...
    @property
    def node_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...


def _elastic(job: Job) -> bool:
    return isinstance(job.cluster_environment, job.elastic_environment)


class PSConnection:
    """The strategy's PS: its arguments, its placement, the embedded processes this rank started, this worker's client.

    The arguments keep the strategy's names (those :func:`~plug_asgd.ps_launcher.ps_config` reads)."""

    def __init__(self, mode: Mode, codec: Codec, *, ps_address: str | list[str] | None, ps_port: int | None,
                 ps_shards: int | Literal["per_node"] | None, max_updates: int | None, connect_timeout: float,
                 request_timeout: float, lost_timeout: float, heartbeat_s: float | Literal["auto"] | None,
                 worker_timeout: float, resume_from: str | os.PathLike[str] | None,
                 ps_run_dir: str | os.PathLike[str] | None, ps_keys: str | os.PathLike[str] | None, ps_insecure: bool,
                 ps_threads: int, delta_replies: bool, downlink_fraction: float | None,
                 downlink_bound: float | None) -> None:
        self.heartbeat_s = check_arguments(max_updates=max_updates, heartbeat_s=heartbeat_s,
                                           worker_timeout=worker_timeout, ps_address=ps_address, ps_threads=ps_threads,
                                           downlink_fraction=downlink_fraction, downlink_bound=downlink_bound)
        self.mode, self.codec = mode, codec
        self.max_updates, self.ps_address, self.ps_port = max_updates, ps_address, ps_port
        self.shards = sharded(ps_address, ps_shards, mode, codec)  # a count, or "per_node"
        self.connect_timeout, self.request_timeout, self.lost_timeout = connect_timeout, request_timeout, lost_timeout
        self.worker_timeout, self.resume_from, self.ps_run_dir = worker_timeout, resume_from, ps_run_dir
        self.ps_keys, self.ps_insecure, self.ps_threads = ps_keys, ps_insecure, ps_threads
        self.delta_replies = delta_replies
        self.downlink = {"downlink_fraction": downlink_fraction, "downlink_bound": downlink_bound}
        self.client: PSClient | ShardedClient | None = None
        self.embedded = EmbeddedPS()
        self.stats_at_exit: dict[str, Any] | None = None  # the PS's counters as this worker last left a stage
        self._shard_addresses: list[str] | None = None  # per_node: every shard's, learned through shard 0
        self.run: int | None = None  # set when this connection first connects (see _RUNS)
        self.succeeded = False  # shut down because another strategy of this process connected
        self._on_shutdown: Callable[[], None] | None = None
        self._clients: list[PSClient | ShardedClient] = []  # what is closed if this connection is collected

    @property
    def per_node(self) -> bool:
        """Whether each node runs one shard (``ps_shards="per_node"``)."""
        return self.shards == PER_NODE

    def shard_count(self, num_nodes: int) -> int:
        """How many shards the PS has (1: one PS); with ``ps_shards="per_node"``, the job's ``num_nodes``."""
        return num_nodes if self.per_node else int(self.shards)

    def endpoints(self, job: Job) -> tuple[list[str], list[str] | None]:
        """The addresses workers connect to (one per shard), and those rank 0 binds (None: an external PS)."""
        if self.per_node and job.num_nodes > 1:
            if self._shard_addresses is None:
                raise RuntimeError("with ps_shards='per_node' the shards' addresses are known once the workers have "
                                   "connected (trainer.fit, validate or test)")
            return self._shard_addresses, None
        env = job.cluster_environment
        return endpoints(self.ps_address, self.ps_port, self.shard_count(job.num_nodes), env, _elastic(job))

    def connect(self, job: Job, shapes: Shapes, trainer: Any,
                on_shutdown: Callable[[], None] | None = None) -> PSClient | ShardedClient:
        """This worker's client (made once: later stages reuse it), after starting the embedded PS or shards this rank
        owns. A placement every rank would refuse (an embedded PS's options for an external one, a bind beyond
        loopback without keys) is refused before anything starts.

        One strategy at a time holds a PS in a process: the first connect of a new one (the next Trainer's) shuts the
        previous ones down, their embedded PS included, before its own starts on the same port. ``on_shutdown`` runs
        when this one is shut down."""
        if self.client is not None:
            return self.client
        if self.succeeded:
            raise RuntimeError("this AsyncPSStrategy's parameter server was stopped when another AsyncPSStrategy of "
                               "this process connected (a later Trainer's): a strategy's stages (fit, validate, test) "
                               "run before the next Trainer's; the model keeps the central weights its last stage "
                               "ended with")
        for other in list(_LIVE):
            if other is not self:
                log.info("plug_asgd: a new AsyncPSStrategy connects; closing the previous one's client and stopping "
                         "its embedded PS, if this rank started one")
                other.shutdown()
                other.succeeded = True
        self._on_shutdown = on_shutdown
        if self.run is None:
            self.run = next(_RUNS)
            weakref.finalize(self, _release, self.embedded, self._clients).atexit = False
        _LIVE.add(self)
        options = {"request_timeout": self.request_timeout, "lost_timeout": self.lost_timeout,
                   "heartbeat_s": self.heartbeat_s, "keys": self.ps_keys, "delta_replies": self.delta_replies,
                   "run": self.run}
        if self.per_node and job.num_nodes > 1:
            self._shard_addresses = addresses = self._start_per_node(job, shapes, trainer, options)
        else:
            addresses, binds = self.endpoints(job)
            embedded_options = self.resume_from is not None or configurer(trainer) is not None
            check_placements(addresses, binds, embedded_options=embedded_options, keys=self.ps_keys,
                             insecure=self.ps_insecure)
            if binds is not None and job.global_rank == 0:
                self.embedded.start(*(ps_config(self, bind, trainer, shard) for bind, shard in shards(binds)))
        self.client = connect(addresses, shapes(), self.codec, rank=job.global_rank, world_size=job.world_size,
                              mode=self.mode.name, **options)
        self._clients[:] = [self.client]
        return self.client

    def _start_per_node(self, job: Job, shapes: Shapes, trainer: Any, client_options: dict[str, Any]) -> list[str]:
        """``ps_shards="per_node"`` on several nodes: local rank 0 starts this node's shard; every rank learns every
        shard's address through shard 0 (:mod:`plug_asgd.sharding.per_node`). The shards' addresses, in order."""
        env = job.cluster_environment
        assert env is not None
        first, _ = endpoint(None, self.ps_port, env, _elastic(job))
        port = int(first.rpartition(":")[2])
        # node 0's: the address every node reaches it at, as one embedded PS's (first); another's: its own
        own = shard_endpoint(node_address(env.main_address, job.node_rank), port, job.node_rank)
        check_placement(own, own, embedded_options=False, keys=self.ps_keys, insecure=self.ps_insecure)
        part = make_partition(shapes(), job.num_nodes, self.codec)
        if job.local_rank == 0:
            self.embedded.start(ps_config(self, own, trainer, f"{job.node_rank}/{job.num_nodes}"))
        return gather_addresses(first, part, node_rank=job.node_rank, own=own if job.local_rank == 0 else None,
                        rank=job.global_rank, world_size=job.world_size, mode=self.mode.name,
                        timeout=self.connect_timeout, alive=self.embedded.gone, **client_options)

    def hello(self, stage: int, fitting: bool) -> dict[str, Any]:
        """Joins ``stage`` on the connected PS, waiting up to ``connect_timeout`` (less if the embedded PS exits)."""
        assert self.client is not None
        welcome = self.client.hello(stage, fitting, timeout=self.connect_timeout, alive=self.embedded.gone)
        process = self.embedded.process
        if process is not None and not self.per_node and welcome.get("pid") not in (None, process.pid):
            raise RuntimeError(f"another parameter server (pid {welcome.get('pid')}) answers on the embedded PS's "
                               f"port, not the one this rank started (pid {process.pid}; "
                               f"{self.embedded.gone() or 'still starting'}): is another job using this port? "
                               "pass ps_port=")
        return welcome

    def goodbye(self, stage: int, failed: bool, settle: Callable[[], None]) -> None:
        """Leaves ``stage``: ``settle`` (the exchange lets the socket go), then keeps the PS's counters and says bye.

        Rank 0 stops the embedded PS as soon as every worker has left, hence the counters kept now. After a failure
        (Ctrl-C stops the embedded PS too) this is a courtesy: a PS that went away must not hold the exit up for the
        client's lost_timeout."""
        assert self.client is not None
        try:
            settle()
            self.stats_at_exit = self.client.stats(timeout=_FAILED_EXIT_S if failed else None)
            self.client.bye(stage)
        except (PSError, PSUnreachableError) as exc:
            log.warning("could not say goodbye to the parameter server: %s", exc)

    def counters(self, exchange_stats: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """This worker's counters: the client's (bytes on the wire, waits, staleness), the exchange's
        (``exchange_stats``) and the reconnections; none before it connected."""
        if self.client is None:
            return {}
        return {**self.client.counters.as_dict(), **exchange_stats(), "reconnections": self.client.reconnections}

    def stats(self, in_stage: bool, settle: Callable[[], None]) -> dict[str, Any]:
        """The PS's counters: asked (after ``settle``: one request at a time on the socket) within a stage; between
        stages those kept as this worker left the last one, for the embedded PS may be gone."""
        if not in_stage and self.stats_at_exit is not None:
            return dict(self.stats_at_exit)
        if self.client is None:
            raise RuntimeError("not connected to a parameter server: run trainer.fit/test first")
        settle()
        return self.client.stats()

    def shutdown(self, wait_for_workers: float = 30.0) -> None:
        """At exit, or when a later strategy of this process connects: ``on_shutdown``, then let the other workers
        finish with the PS, then close the client and stop the embedded PS."""
        _LIVE.discard(self)
        on_shutdown, self._on_shutdown = self._on_shutdown, None
        if on_shutdown is not None:
            on_shutdown()
        client, self.client = self.client, None
        self._clients.clear()
        if client is not None:
            self.embedded.wait_for_workers(client, wait_for_workers)
            client.close()
        self.embedded.stop()
