"""Where a worker's parameter server runs, and the worker's connection to it: the PS side of ``AsyncPSStrategy``.

:class:`PSConnection` holds the strategy's PS arguments (checked when the strategy is built) and, once a
stage connects, places the PS: one embedded PS, ``ps_shards=N`` embedded shards, one shard per node
(:mod:`plug_asgd.sharding.per_node`) or external addresses. It starts the embedded processes this rank owns
(:mod:`plug_asgd.placement.ps_launcher`), connects one client (a :class:`~plug_asgd.worker.client.PSClient`, or a
:class:`~plug_asgd.sharding.client.ShardedClient` over the shards) that every later stage reuses, says goodbye at a
stage's end and shuts both down at exit. Kept apart from the strategy so that its Lightning life cycle does not
carry the PS's placement; the strategy hands in what only Lightning knows (the worker's :class:`Placement`, the
model's shapes, the trainer). Imports neither Lightning namespace.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from plug_asgd.compressors import Codec
from plug_asgd.modes import Mode, chosen_knobs
from plug_asgd.placement.ps_launcher import (
    EmbeddedPS,
    check_placement,
    check_placements,
    configurer,
    endpoint,
    endpoints,
    ps_config,
)
from plug_asgd.placement.settings import PSSettings
from plug_asgd.placement.standby_launcher import STANDBY_NODE, check_nodes, standby_binds, standby_configs, wait_joined
from plug_asgd.protocol.wire import WireError
from plug_asgd.ps import PSConfig
from plug_asgd.ps.failure import MAX_FAILURE_CHARS
from plug_asgd.sharding.client import ShardedClient
from plug_asgd.sharding.config import connect, make_partition, sharded, shards
from plug_asgd.sharding.per_node import PER_NODE, gather_addresses, node_address, shard_endpoint
from plug_asgd.worker.client import PSClient, PSError, PSUnreachableError

log = logging.getLogger("plug_asgd.strategy")  # the strategy's warnings, under the name they always had

# how long a worker that failed (Ctrl-C, an error) waits on each of its goodbye requests
_FAILED_EXIT_S = 5.0
# after a failure, how long rank 0 waits for the other workers (told by the PS: ps/failure.py) to leave its PS
FAILED_WAIT_S = 2.0

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


def _release(embedded: tuple[EmbeddedPS, ...], clients: list[PSClient | ShardedClient]) -> None:
    """A connection freed without a shutdown (its strategy collected): its client closed, its embedded PS (and
    standby) stopped."""
    for client in clients:
        client.close()
    for processes in embedded:
        processes.stop()


@dataclass(frozen=True)
class Placement:
    """This worker's place in the job, as the strategy knows it once Lightning has launched the workers.

    Attributes:
        main_address: the cluster's main address (None: no cluster environment, so no embedded PS to place).
        main_port: the cluster's main port.
        elastic: whether torchrun launched the job (its agent serves its store on the main port).
        num_nodes: the job's node count.
        node_rank: this worker's node.
        local_rank: this worker's rank on its node.
        global_rank: this worker's rank in the job.
        world_size: the job's worker count.
    """

    main_address: str | None
    main_port: int
    elastic: bool
    num_nodes: int
    node_rank: int
    local_rank: int
    global_rank: int
    world_size: int


@dataclass(frozen=True)
class PSHandle:
    """What a callback is handed of the PS that a strategy trains against (``AsyncPSStrategy.ps_handle()``).

    Attributes:
        endpoints: every shard's address, in order (one: an unsharded PS).
        mode: the mode's name, which the PS checks at hello.
        codec: the workers' codec, which decides how a sharded PS cuts the model.
        keys: the CURVE keys the workers connect with (None: none).
        comm_stats: this worker's communication counters (``AsyncPSStrategy.comm_stats``; ``settle=True``: the push
            in flight answered first).
        ps_stats: the PS's counters (``AsyncPSStrategy.ps_stats``).
    """

    endpoints: list[str]
    mode: str
    codec: Codec
    keys: str | os.PathLike[str] | None
    comm_stats: Callable[..., dict[str, Any]]
    ps_stats: Callable[[], dict[str, Any]]


class PSConnection:
    """The strategy's PS: its settings, its placement, the embedded processes this rank started, this worker's client.

    Args:
        mode: the training scheme, whose name the PS checks and whose server options it takes.
        codec: the workers' codec (it decides how a sharded PS cuts the model).
        settings: the strategy's PS arguments.
    """

    def __init__(self, mode: Mode, codec: Codec, settings: PSSettings) -> None:
        self.mode, self.codec, self.settings = mode, codec, settings
        self.heartbeat_s = settings.heartbeat_seconds
        self.shards = sharded(settings.ps_address, settings.ps_shards, mode, codec)  # a count, or "per_node"
        self.client: PSClient | ShardedClient | None = None
        self.embedded = EmbeddedPS()
        self.standby = EmbeddedPS("standby (ps_standby=True)")  # node 1's local rank 0's
        self._connected_to: list[str] = []  # the addresses the client was made for
        self._standby_pending: tuple[list[PSConfig], list[str]] | None = None  # started once the PS answers
        self.stats_at_exit: dict[str, Any] | None = None  # the PS's counters as this worker last left a stage
        self._shard_addresses: list[str] | None = None  # per_node: every shard's, learned through shard 0
        self.run: int | None = None  # set when this connection first connects (see _RUNS)
        self.succeeded = False  # shut down because another strategy of this process connected
        self.failed = False  # a stage ended in an exception: the PS was told, and shutdown waits less
        self._on_shutdown: Callable[[], None] | None = None
        self._clients: list[PSClient | ShardedClient] = []  # what is closed if this connection is collected

    @property
    def per_node(self) -> bool:
        """Whether each node runs one shard (``ps_shards="per_node"``)."""
        return self.shards == PER_NODE

    def shard_count(self, num_nodes: int) -> int:
        """How many shards the PS has (1: one PS); with ``ps_shards="per_node"``, the job's ``num_nodes``.

        Args:
            num_nodes: the job's node count.
        """
        return num_nodes if self.per_node else int(self.shards)

    def endpoints(self, job: Placement) -> tuple[list[str], list[str] | None]:
        """The addresses workers connect to (one per shard), and those rank 0 binds (None: an external PS).

        Args:
            job: this worker's place in the job (its cluster's main address and port, the node count).

        Raises:
            RuntimeError: with ``ps_shards="per_node"`` on several nodes, before the workers connected (the shards'
                addresses are learned then).
        """
        if self.per_node and job.num_nodes > 1:
            if self._shard_addresses is None:
                raise RuntimeError("with ps_shards='per_node' the shards' addresses are known once the workers have "
                                   "connected (trainer.fit, validate or test)")
            return self._shard_addresses, None
        settings = self.settings
        return endpoints(settings.ps_address, settings.ps_port, self.shard_count(job.num_nodes), job.main_address,
                         job.main_port, job.elastic)

    def connect(self, job: Placement, shapes: Shapes, trainer: Any,
                on_shutdown: Callable[[], None] | None = None) -> PSClient | ShardedClient:
        """This worker's client (made once: later stages reuse it), after starting the embedded PS or shards this rank
        owns. A placement every rank would refuse (an embedded PS's options for an external one, a bind beyond
        loopback without keys) is refused before anything starts.

        One strategy at a time holds a PS in a process: the first connect of a new one (the next Trainer's) shuts the
        previous ones down, their embedded PS included, before its own starts on the same port.

        Args:
            job: this worker's place in the job: which rank starts which embedded PS, and where.
            shapes: the model's synced tensors' shapes, asked once (a sharded PS cuts the model by them).
            trainer: the Trainer, whose callbacks may configure the embedded PS (None: none).
            on_shutdown: run when this connection is shut down (the strategy's exchange releases its resources).

        Raises:
            RuntimeError: this connection was shut down because a later strategy of this process connected.
            ValueError: ``ps_standby`` in a job of one node; a placement every rank refuses.
        """
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
            weakref.finalize(self, _release, (self.embedded, self.standby), self._clients).atexit = False
        _LIVE.add(self)
        settings = self.settings
        options = {"request_timeout": settings.request_timeout, "lost_timeout": settings.lost_timeout,
                   "heartbeat_s": self.heartbeat_s, "keys": settings.ps_keys, "delta_replies": settings.delta_replies,
                   "run": self.run, "mode_options": chosen_knobs(self.mode)}
        if self.per_node and job.num_nodes > 1:
            self._shard_addresses = addresses = self._start_per_node(job, shapes, trainer, options)
        else:
            addresses, binds = self.endpoints(job)
            embedded_options = settings.resume_from is not None or configurer(trainer) is not None
            check_placements(addresses, binds, embedded_options=embedded_options, keys=settings.ps_keys,
                             insecure=settings.ps_insecure)
            if settings.ps_standby:  # checked (and node 1's configs made) before anything starts
                self._place_standby(job, addresses, binds, trainer)
            if binds is not None and job.global_rank == 0:
                self.embedded.start(*(self._config(bind, trainer, shard, job.world_size)
                                      for bind, shard in shards(binds)))
        self._connected_to = list(addresses)
        self.client = connect(addresses, shapes(), self.codec, rank=job.global_rank, world_size=job.world_size,
                              mode=self.mode.name, **options)
        self._clients[:] = [self.client]
        return self.client

    def _place_standby(self, job: Placement, addresses: list[str], binds: list[str] | None, trainer: Any) -> None:
        """``ps_standby=True``: refused on one node (every rank alike); node 1's local rank 0 makes its standbys'
        configs, started at its first hello (:mod:`plug_asgd.placement.standby_launcher`)."""
        check_nodes(job.num_nodes)
        if binds is None or job.node_rank != STANDBY_NODE or job.local_rank != 0:
            return
        assert job.main_address is not None
        own = standby_binds(job.main_address, addresses)
        settings = self.settings
        for bind in own:
            check_placement(bind, bind, embedded_options=False, keys=settings.ps_keys, insecure=settings.ps_insecure)
        primaries = [self._config(bind, trainer, shard, job.world_size) for bind, shard in shards(binds)]
        self._standby_pending = standby_configs(primaries, addresses, own), own

    def _start_per_node(self, job: Placement, shapes: Shapes, trainer: Any,
                        client_options: dict[str, Any]) -> list[str]:
        """``ps_shards="per_node"`` on several nodes: local rank 0 starts this node's shard; every rank learns every
        shard's address through shard 0 (:mod:`plug_asgd.sharding.per_node`). The shards' addresses, in order."""
        assert job.main_address is not None
        settings = self.settings
        first, _ = endpoint(None, settings.ps_port, job.main_address, job.main_port, job.elastic)
        port = int(first.rpartition(":")[2])
        # node 0's: the address every node reaches it at, as one embedded PS's (first); another's: its own
        own = shard_endpoint(node_address(job.main_address, job.node_rank), port, job.node_rank)
        check_placement(own, own, embedded_options=False, keys=settings.ps_keys, insecure=settings.ps_insecure)
        part = make_partition(shapes(), job.num_nodes, self.codec)
        if job.local_rank == 0:
            self.embedded.start(self._config(own, trainer, f"{job.node_rank}/{job.num_nodes}", job.world_size))
        return gather_addresses(first, part, node_rank=job.node_rank, own=own if job.local_rank == 0 else None,
                                rank=job.global_rank, world_size=job.world_size, mode=self.mode.name,
                                timeout=settings.connect_timeout, alive=self.embedded.gone, **client_options)

    def _config(self, bind: str, trainer: Any, shard: str | None, world_size: int) -> PSConfig:
        """The embedded PS's config: the strategy's settings, ``trainer``'s PS options, and the job's world size."""
        return ps_config(self.settings, self.mode, self.run, bind, trainer, shard, world_size)

    def hello(self, stage: int, fitting: bool) -> dict[str, Any]:
        """Joins ``stage`` on the connected PS, waiting up to ``connect_timeout`` (less if the embedded PS exits).

        Args:
            stage: this process's stage number (fit, validate, test...: one each, counted alike on every rank).
            fitting: whether the stage is a fit.

        Raises:
            RuntimeError: another PS than the one this rank started answers on the embedded PS's port; with
                ``ps_standby``, node 1's standby exited or was not taken (its first hello waits for it).
        """
        assert self.client is not None
        # where the client moved to a standby that leads, this rank's embedded PS is not the one that answers
        moved = [c.address for c in getattr(self.client, "clients", [self.client])] != self._connected_to
        welcome = self.client.hello(stage, fitting, timeout=self.settings.connect_timeout,
                                    alive=None if moved else self.embedded.gone)
        process = self.embedded.process
        if process is not None and not self.per_node and not moved and welcome.get("pid") not in (None, process.pid):
            raise RuntimeError(f"another parameter server (pid {welcome.get('pid')}) answers on the embedded PS's "
                               f"port, not the one this rank started (pid {process.pid}; "
                               f"{self.embedded.gone() or 'still starting'}): is another job using this port? "
                               "pass ps_port=")
        if self._standby_pending is not None:  # the PS answers: its standby can join it
            configs, binds = self._standby_pending
            self._standby_pending = None
            self.standby.start(*configs)
            wait_joined(self.client, binds, self.standby, self.settings.connect_timeout)
        return welcome

    def goodbye(self, stage: int, failed: bool, settle: Callable[[], None], failure: str | None = None) -> None:
        """Leaves ``stage``: ``settle`` (the exchange lets the socket go), then keeps the PS's counters and says bye.

        Rank 0 stops the embedded PS as soon as every worker has left, hence the counters kept now. After a failure
        (Ctrl-C stops the embedded PS too) this is a courtesy: a PS that went away must not hold the exit up for the
        client's lost_timeout.

        Args:
            stage: the stage being left.
            failed: whether it ended in an exception: each request then waits a few seconds at most.
            settle: lets the exchange finish with the socket (one request at a time on it).
            failure: what it ended on, where it failed: the bye says so, and the PS stops the job's other workers
                (:mod:`plug_asgd.ps.failure`).
        """
        assert self.client is not None
        self.failed = self.failed or failed
        try:
            settle()
            self.stats_at_exit = self.client.stats(timeout=_FAILED_EXIT_S if failed else None)
            self.client.bye(stage, failed=failure[:MAX_FAILURE_CHARS] if failed and failure else None)
        except (PSError, PSUnreachableError, WireError) as exc:  # the stage is over: said, not raised
            log.warning("could not say goodbye to the parameter server: %s", exc)

    def counters(self, exchange_stats: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """This worker's counters: the client's (bytes on the wire, waits, staleness), the exchange's
        (``exchange_stats``) and the reconnections; none before it connected.

        Args:
            exchange_stats: the exchange's counters (pushes, own replies, local steps...).
        """
        if self.client is None:
            return {}
        return {**self.client.counters.as_dict(), **exchange_stats(), "reconnections": self.client.reconnections}

    def stats(self, in_stage: bool, settle: Callable[[], None]) -> dict[str, Any]:
        """The PS's counters: asked (after ``settle``: one request at a time on the socket) within a stage; between
        stages those kept as this worker left the last one, for the embedded PS may be gone.

        Args:
            in_stage: whether a stage is running (the PS is then asked).
            settle: lets the exchange finish with the socket before the request.

        Raises:
            RuntimeError: never connected, so no PS to ask and no counters kept.
        """
        if not in_stage and self.stats_at_exit is not None:
            return dict(self.stats_at_exit)
        if self.client is None:
            raise RuntimeError("not connected to a parameter server: run trainer.fit/test first")
        settle()
        return self.client.stats()

    def shutdown(self, wait_for_workers: float = 30.0) -> None:
        """At exit, or when a later strategy of this process connects: ``on_shutdown``, then let the other workers
        finish with the PS, then close the client and stop the embedded PS.

        Args:
            wait_for_workers: seconds to wait for the other workers to leave the PS before stopping it.
        """
        _LIVE.discard(self)
        on_shutdown, self._on_shutdown = self._on_shutdown, None
        if on_shutdown is not None:
            on_shutdown()
        client, self.client = self.client, None
        self._clients.clear()
        if client is not None:  # after a failure the others were told, and some may be gone without a word
            for processes in (self.embedded, self.standby):  # a standby may lead, and serve the others
                processes.wait_for_workers(client, min(wait_for_workers, FAILED_WAIT_S) if self.failed
                                           else wait_for_workers)
            client.close()
        self.embedded.stop()
        self.standby.stop()
