"""The embedded hot standby: ``AsyncPSStrategy(ps_standby=True)`` puts a standby of each embedded PS on node 1.

The embedded PS lives beside global rank 0, so it dies with node 0's machine. With ``ps_standby=True`` node 1's
local rank 0 starts, for each embedded PS (one, or one per shard of ``ps_shards=N``), a hot standby of it
(``serve-ps --standby-of``, docs/design.md "Hot standby"): on node 1's address (as ``ps_shards="per_node"`` finds
it: :func:`~plug_asgd.sharding.per_node.node_address`), port ``ps_port + N + I`` for shard I of N (nodes that share
a machine, or a test's, do not clash with the primaries' ports). It starts once node 1 has reached the primaries,
and node 1's workers begin only once each primary has taken its standby: a job that asked for one does not run
without it unnoticed. The workers learn the standbys from the primaries' replies, as any worker does. Each standby
proves itself to its primary (:mod:`plug_asgd.ps.standby_credential`): with ``ps_keys=DIR``, by the standby key
``DIR/standby`` (the primaries use ``DIR/server``); without keys, by the secret its primary wrote where their user
alone reads it (found from the primary's port: the nodes share a file system there, as emulated hosts do, or
``PLUG_ASGD_SECRET_DIR`` names a shared folder).

What it covers: the loss of node 0's machine, or of an embedded PS process. A rank 0 that fails with an exception
still ends the job, as without a standby (its PS tells the other workers: :mod:`plug_asgd.ps.failure`).

After a failover node 1's standby leads without one, so node 1 starts another (:class:`Renewal`, watching from
the moment the standbys joined): every ``failover_timeout`` it asks each of its standbys for its role, and where
one leads, it starts a new standby of it **beside it on node 1**, on the next port (the leader's plus the number of
shards), following node 1's local rank 0 as the first did; that one, once it leads, gets the next, and so on. It
covers a leader's crashed PS process, not the loss of node 1's machine (a standby on node 2 would: not yet).
Imports neither Lightning namespace.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from plug_asgd.placement.ps_launcher import EmbeddedPS
from plug_asgd.protocol.security import load_standby_keys
from plug_asgd.ps import PSConfig
from plug_asgd.ps.standby_join import ask_peer
from plug_asgd.sharding.client import ShardedClient
from plug_asgd.sharding.per_node import node_address
from plug_asgd.worker.client import PSClient, PSError, PSUnreachableError

log = logging.getLogger("plug_asgd.placement")

STANDBY_NODE = 1  # the node whose local rank 0 runs the standbys: the first that is not rank 0's


def standby_binds(main_address: str, primaries: Sequence[str], route: Callable[[str, int], str] | None = None
                  ) -> list[str]:
    """Where each primary's standby listens: node 1's address, ports after the primaries' own.

    Args:
        main_address: the cluster's main address (``MASTER_ADDR``), where the primaries listen.
        primaries: every embedded PS's address, in shard order (consecutive ports from the first's).
        route: node ``n``'s address as the other nodes reach it, from the main address (None:
            :func:`~plug_asgd.sharding.per_node.node_address`).
    """
    host = (route or node_address)(main_address, STANDBY_NODE)
    first = int(primaries[0].rpartition(":")[2])
    return [f"tcp://{host}:{first + len(primaries) + i}" for i in range(len(primaries))]


def check_nodes(num_nodes: int) -> None:
    """Refuses a standby in a job of one node, where it would die with the primary's machine.

    Args:
        num_nodes: the job's node count.

    Raises:
        ValueError: with one node.
    """
    if num_nodes < 2:
        raise ValueError("ps_standby=True puts the embedded PS's standby on node 1, and this job has one node "
                         "(num_nodes=1): a standby on the primary's machine dies with it. Run the job on 2 nodes or "
                         "more, or start a standby yourself on another machine with `plug-asgd serve-ps "
                         "--standby-of ADDR` beside an external PS (ps_address=)")


def standby_configs(primaries: Sequence[PSConfig], addresses: Sequence[str], binds: Sequence[str]) -> list[PSConfig]:
    """The standbys' configs: each primary's, bound on node 1, a standby of the address workers reach the primary at.

    A standby takes its primary's mode and options when it joins (:mod:`plug_asgd.ps.standby_join`); its metrics go
    to a folder ``standby`` of the primary's, and its checkpoints (once it leads) where the primary's go, on its
    own machine.

    Args:
        primaries: each embedded PS's config, as rank 0 starts it (this rank's own ``parent_pid``).
        addresses: the address workers reach each primary at, in the same order.
        binds: where each standby listens (:func:`standby_binds`).
    """
    return [dataclasses.replace(config, bind=bind, standby_of=address, resume=None,
                                run_dir=config.run_dir / "standby" if config.run_dir is not None else None)
            for config, address, bind in zip(primaries, addresses, binds, strict=True)]


def _standbys(stats: dict[str, Any]) -> list[Any]:
    return [s.get("standby") for s in stats.get("shards", [stats])]


def wait_joined(client: PSClient | ShardedClient, binds: Sequence[str], standby: EmbeddedPS, timeout: float) -> None:
    """Waits until each primary (asked through ``client``) names its standby at ``binds``; then node 1 watches them
    (:class:`Renewal`: a standby that leads gets a new one beside it).

    Args:
        client: this worker's client, connected to the primaries.
        binds: where each standby listens, in shard order.
        standby: the standby processes, watched: one that exits ends the wait.
        timeout: the longest wait, in seconds.

    Raises:
        RuntimeError: a standby exited, or was not taken within ``timeout``, saying what to check.
    """
    deadline = time.monotonic() + timeout
    named: list[Any] = []
    while True:
        gone = standby.gone()
        if gone is not None:
            raise RuntimeError(gone)
        try:
            named = _standbys(client.stats(timeout=5.0))
        except (PSError, PSUnreachableError):
            named = []
        if named == list(binds):
            Renewal(standby, binds).start()
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the parameter server did not take the standby at {list(binds)} within {timeout:g} "
                               f"s (it names {named}): can node 0 reach node 1 at that address? set "
                               "PLUG_ASGD_NODE_ADDRESS to one it can")
        time.sleep(0.1)


class Renewal:
    """Node 1's watch over its standbys (module doc): where one leads, a new standby of it beside it on node 1.

    A daemon thread; it ends once ``standby``'s processes are stopped (the job's end). Each new standby's process
    joins ``standby``'s, so that it is stopped with them and the workers' end waits for it as for the first.

    Args:
        standby: node 1's standby processes, as started (their configs are read from their command lines).
        binds: where each listens, in shard order.
    """

    def __init__(self, standby: EmbeddedPS, binds: Sequence[str]) -> None:
        self.standby = standby
        self.configs = [PSConfig.from_json(p.args[-1]) for p in standby.processes]
        self.watched = list(binds)  # the address of each shard's newest standby
        self.renewed = 0
        self.interval = min(c.failover_timeout for c in self.configs) if self.configs else 1.0
        self._keys = [load_standby_keys(c.keys) if c.keys is not None else None for c in self.configs]

    def start(self) -> None:
        """Watch from now on, in a daemon thread."""
        threading.Thread(target=self._run, name="plug_asgd-standby-renewal", daemon=True).start()

    def _run(self) -> None:
        context = zmq.Context.instance()
        while self.standby.processes:
            time.sleep(self.interval)
            for shard, address in enumerate(self.watched):
                stats = ask_peer(context, address, self.interval, self._keys[shard])
                if stats is not None and stats.get("role") == "primary" and self.standby.processes:
                    self.renew(shard, address)

    def renew(self, shard: int, leader: str) -> str:
        """Start a new standby of ``shard``'s standby that leads at ``leader``, beside it (the next port); returns
        where it listens.

        Args:
            shard: the shard's index.
            leader: the leader's address.
        """
        host, _, port = leader.rpartition(":")
        bind = f"{host}:{int(port) + len(self.watched)}"
        first = self.configs[shard]
        config = dataclasses.replace(first, bind=bind, standby_of=leader, run_dir=first.run_dir and (
            first.run_dir / f"renewed-{self.renewed + 1}"))  # its metrics beside the first standby's
        fresh = EmbeddedPS(self.standby.role)
        fresh.start(config)
        self.standby.processes.extend(fresh.processes)
        self.watched[shard] = bind
        self.renewed += 1
        log.warning("the standby at %s leads now: a new standby of it starts at %s (node %d)", leader, bind,
                    STANDBY_NODE)
        return bind
