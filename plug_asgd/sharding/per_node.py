"""One shard per node: ``AsyncPSStrategy(ps_shards="per_node")`` under a multi-node job (num_nodes, torchrun, SLURM).

Each node's local rank 0 starts shard ``I = node_rank`` of ``N = num_nodes`` as an embedded PS (the machinery of
``ps_shards=N``: its checkpoints, resume and metrics in a folder ``shard-I``), listening on that node's address,
port ``ps_port + I`` (by default the cluster's main port, + 1 under torchrun, as for one embedded PS). With one
node it is the lone embedded PS of the default.

Where a node's shard listens (:func:`node_address`): node 0's at the cluster's main address (``MASTER_ADDR``),
where every node already reaches it; another node's at the address of its interface that routes to the main
address (a UDP socket connected to it, which sends nothing, then ``getsockname``), or at
``PLUG_ASGD_NODE_ADDRESS`` where that is set (a node with several interfaces whose route to the master is not the
one the others reach it by).

How every rank learns every shard's address (:func:`gather_addresses`): shard 0's is known to all (the main address);
before its first stage, every rank joins shard 0 for a stage of its own (stage 0, which the strategy's stages,
numbered from 1, never use), and a gather there carries each node's address from its local rank 0 to every rank.
Imports neither Lightning namespace.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from plug_asgd.protocol.partition import Partition
from plug_asgd.worker.client import PSClient

PER_NODE = "per_node"
ADDRESS_VARIABLE = "PLUG_ASGD_NODE_ADDRESS"
RENDEZVOUS_STAGE = 0  # the strategy's stages are numbered from 1
_KIND = "shard_addresses"


def routed_address(destination: str) -> str:
    """This machine's address on the interface that routes to ``destination`` (an IPv4 address): a UDP socket
    connected there (no packet is sent), asked for its own address.

    Args:
        destination: the IPv4 address to route to (the cluster's main address).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((destination, 9))
        return str(s.getsockname()[0])


def node_address(main_address: str, node_rank: int, environ: Mapping[str, str] | None = None,
                 route: Callable[[str], str] = routed_address) -> str:
    """Where node ``node_rank``'s shard listens, reachable by the other nodes (see the module's docstring).

    Args:
        main_address: the cluster's main address (``MASTER_ADDR``), a host name or an IP address.
        node_rank: this node's rank in the job.
        environ: the environment to read ``PLUG_ASGD_NODE_ADDRESS`` from; None: the process's.
        route: finds this machine's address on the interface that routes to an address.

    Raises:
        RuntimeError: where a node other than node 0 finds no route to the main address and is given none.
    """
    main = socket.gethostbyname(main_address)
    if node_rank == 0:
        return main
    given = (os.environ if environ is None else environ).get(ADDRESS_VARIABLE, "").strip()
    if given:
        return socket.gethostbyname(given)
    try:
        return route(main)
    except OSError as exc:
        raise RuntimeError(f"node {node_rank} found no route to the main address {main_address} ({exc}): set "
                           f"{ADDRESS_VARIABLE} to the address of this node the others reach it at") from None


def shard_endpoint(address: str, port: int, node_rank: int) -> str:
    """Shard ``node_rank``'s ``tcp://`` address on its node's ``address``: port ``port + node_rank`` (nodes that
    share a machine, or a test's, do not clash).

    Args:
        address: the node's address the shard listens on.
        port: the port of shard 0 (``ps_port``).
        node_rank: the node's rank, which is its shard's index.
    """
    return f"tcp://{address}:{port + node_rank}"


def shard_list(gathered: Sequence[tuple[int, Any, Any]], num_nodes: int) -> list[str]:
    """Every shard's address, by node, from the rendezvous gather's (rank, object, tensors); refuses a node that
    named none, or two, saying what to do.

    Args:
        gathered: every rank's (rank, object, tensors) of the rendezvous gather; a local rank 0's object is
            ``{"node": node_rank, "address": ...}``.
        num_nodes: the nodes of the job, which is the number of shards.

    Raises:
        RuntimeError: where a rank names a node out of range or a non-string address, a node's ranks name two
            addresses, or a node names none.
    """
    found: dict[int, str] = {}
    for rank, obj, _ in gathered:
        if not isinstance(obj, dict) or obj.get("address") is None:
            continue
        node, address = obj.get("node"), obj["address"]
        if not isinstance(node, int) or not 0 <= node < num_nodes or not isinstance(address, str):
            raise RuntimeError(f"rank {rank} named shard {node!r} at {address!r} in a job of {num_nodes} nodes")
        if found.setdefault(node, address) != address:
            raise RuntimeError(f"node {node}'s ranks disagree on where its shard listens ({found[node]}, {address}): "
                               "one local rank 0 per node starts it (check NODE_RANK / LOCAL_RANK)")
    missing = [n for n in range(num_nodes) if n not in found]
    if missing:
        raise RuntimeError(f"no local rank 0 of node(s) {missing} said where its shard listens: every node of a "
                           f"ps_shards='per_node' job (num_nodes={num_nodes}) must run a local rank 0")
    return [found[n] for n in range(num_nodes)]


def gather_addresses(shard0: str, partition: Partition, *, node_rank: int, own: str | None, rank: int, world_size: int,
             mode: str, timeout: float, alive: Callable[[], str | None] | None = None,
             **client_options: Any) -> list[str]:
    """Every shard's address, learned through shard 0 (at ``shard0``): ``own`` is this node's shard's address
    (local rank 0; None elsewhere). Every rank of the job calls it once, before its first stage.

    Args:
        shard0: shard 0's address (at the cluster's main address).
        partition: how the model is cut over the shards (as many as the job's nodes).
        node_rank: this rank's node.
        own: this node's shard's address on a local rank 0; None on the other ranks.
        rank: this rank, in the job.
        world_size: the job's ranks.
        mode: the strategy's mode, which the hello must name.
        timeout: seconds the hello keeps asking shard 0.
        alive: says why shard 0 cannot answer (its process died), or None while it may.
        **client_options: the options of the client made for the rendezvous.
    """
    client = PSClient(shard0, rank=rank, world_size=world_size, mode=mode, **client_options)
    client.partition = {**partition.describe(), "shard": 0}
    try:
        client.hello(RENDEZVOUS_STAGE, False, timeout=timeout, alive=alive)
        gathered = client.gather(RENDEZVOUS_STAGE, 0, {"node": node_rank, "address": own}, kind=_KIND)
        client.bye(RENDEZVOUS_STAGE)
    finally:
        client.close()
    return shard_list(gathered, partition.shards)
