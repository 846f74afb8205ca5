"""A node as one worker: the island of ranks that trains as DDP does inside and trades with the PS as one worker.

An island is ``size`` consecutive local ranks of one node (``AsyncPSStrategy(island=...)``). Its ranks all-reduce
their gradients every step over a process group of their own (NCCL on GPUs, gloo on CPUs) and step alike; its
leader, the first of them, alone talks to the PS, and after every step sends the island's weights to the others, so
that every rank's next forward reads the same bits. The PS sees one worker per island.

The group is a ``torch.distributed`` backend made directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over a
``TCPStore`` that the node's local rank 0 serves on loopback), not ``init_process_group``: a default process group
would make Lightning and torchmetrics synchronise over the island alone, and make the strategy warn that the workers
are put in lockstep. Imports neither Lightning namespace.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import msgpack
import torch
import torch.distributed as dist
from torch import Tensor

Island = int | Literal["node", "auto"]

# the node's store listens on 127.0.0.1, port main_port + ISLAND_PORT_OFFSET + node_rank (so that two nodes sharing a
# machine do not clash), or PLUG_ASGD_ISLAND_PORT + node_rank
ISLAND_PORT_OFFSET = 1000
ISLAND_PORT_ENV = "PLUG_ASGD_ISLAND_PORT"
# the modes that cannot take islands, and why
REFUSED = {"hogwild": "hogwild's workers write one model in shared memory without a PS exchange to make for an "
                      "island: there is no step of a leader to send to the others"}


# the node's store, served by its local rank 0 as long as the process lives; the groups made in this process, counted
# alike on every rank (one per strategy that trains with islands), so that a later strategy's group meets apart
_STORES: dict[int, Any] = {}
_GROUPS = itertools.count(1)


class IslandLost(RuntimeError):
    """A rank of this island is gone (its process ended, or its link inside the node broke): the island ends, and
    the PS goes on with the other islands, as for a lost worker."""


def check_island(island: Any, mode: str) -> Island:
    """``island`` as the strategy takes it: a size of 1 or more, ``"node"`` or ``"auto"``.

    Args:
        island: the strategy's ``island`` argument.
        mode: the mode's name (a mode that cannot take islands refuses any but 1 and ``"auto"``).

    Raises:
        ValueError: another value, or a size above 1 (or ``"node"``) with a mode that cannot take islands.
    """
    if island not in ("node", "auto") and (isinstance(island, bool) or not isinstance(island, int) or island < 1):
        raise ValueError(f"island={island!r}: give a number of consecutive local ranks (1: every device a worker of "
                         "its own), 'node' (each node one worker) or 'auto'")
    if mode in REFUSED and island not in (1, "auto"):
        raise ValueError(f"mode {mode!r} cannot train with island={island!r}: {REFUSED[mode]}. Use island=1")
    return island


def island_size(island: Island, devices: int, num_nodes: int, mode: str) -> int:
    """How many consecutive local ranks make one island.

    ``"auto"`` is the node on a job of several nodes (its links between nodes are the slow ones an island saves) and
    1 on one node, where nothing the workers send leaves the machine and per-device workers keep the asynchrony the
    mode was chosen for; 1 too for a mode that cannot take islands.

    Args:
        island: the strategy's ``island`` (checked by :func:`check_island`).
        devices: the devices (worker processes) of each node.
        num_nodes: the job's node count.
        mode: the mode's name.

    Raises:
        ValueError: an island larger than a node (it would span two), or a size that does not divide a node's devices.
    """
    if island == "auto":
        return devices if num_nodes > 1 and mode not in REFUSED else 1
    size = devices if island == "node" else int(island)
    if size > devices:
        raise ValueError(f"island={island} spans {size} ranks but a node has {devices} devices: an island would span "
                         "two nodes, whose link is the slow one it is meant to save. Use island='node' or a divisor "
                         f"of {devices}")
    if devices % size:
        raise ValueError(f"island={island} does not divide the {devices} devices of a node into islands of equal "
                         f"size: use a divisor of {devices} (or island='node')")
    return size


@dataclass(frozen=True)
class IslandPlan:
    """Where a rank stands among the islands: islands are ``size`` consecutive global ranks, inside one node.

    Attributes:
        size: ranks per island (1: every rank a worker of its own).
        rank: this rank's global rank.
        world_size: the job's rank count.
    """

    size: int
    rank: int
    world_size: int

    @property
    def island(self) -> int:
        """This rank's island: its rank as the PS knows it."""
        return self.rank // self.size

    @property
    def member(self) -> int:
        """This rank's place in its island (0: the leader)."""
        return self.rank % self.size

    @property
    def leader(self) -> bool:
        """Whether this rank talks to the PS for its island."""
        return self.member == 0

    @property
    def count(self) -> int:
        """How many islands the job has: the PS's workers."""
        return self.world_size // self.size

    def island_of(self, rank: int) -> int:
        """The island of global rank ``rank``.

        Args:
            rank: a global rank of the job.
        """
        return rank // self.size


class IslandGroup:
    """The process group of one island, with the few collectives the strategy needs of it.

    Args:
        plan: this rank's place among the islands.
        node_rank: this rank's node (which store to meet at).
        local_rank: this rank's place on its node (local rank 0 serves the node's store).
        devices: the node's devices: how many ranks meet at its store.
        main_port: the job's main port, from which the store's port is taken.
        device: this rank's device: NCCL for CUDA, gloo otherwise.
        timeout: seconds any collective of the island may wait for the others.

    Raises:
        RuntimeError: the node's store cannot be served or reached (a port in use: set ``PLUG_ASGD_ISLAND_PORT``).
    """

    def __init__(self, plan: IslandPlan, *, node_rank: int, local_rank: int, devices: int, main_port: int,
                 device: torch.device, timeout: float) -> None:
        self.plan, self.device = plan, device
        self.bytes_sent = self.bytes_received = 0  # what this rank moved inside its island, by the sizes it sent
        base = int(os.environ.get(ISLAND_PORT_ENV, main_port + ISLAND_PORT_OFFSET))
        port = base + node_rank
        try:
            store = _STORES.get(port)
            if store is None:  # one per process and port: every later strategy's group meets under its own prefix
                store = _STORES[port] = dist.TCPStore("127.0.0.1", port, devices, local_rank == 0,
                                                      timedelta(seconds=timeout), wait_for_workers=False)
        except (RuntimeError, OSError) as exc:
            role = "served" if local_rank == 0 else "reached"
            raise RuntimeError(f"the island's store on 127.0.0.1:{port} could not be {role} ({exc}): is the port in "
                               f"use? Set {ISLAND_PORT_ENV} to a free port") from exc
        prefixed = dist.PrefixStore(f"plug_asgd_island_{plan.island}_{next(_GROUPS)}", store)
        span = timedelta(seconds=timeout)
        if device.type == "cuda":
            nccl = dist.ProcessGroupNCCL.Options()
            nccl._timeout = span
            self.group: Any = dist.ProcessGroupNCCL(prefixed, plan.member, plan.size, nccl)
        else:  # over loopback, whatever GLOO_SOCKET_IFNAME says: an island never leaves its node
            options = dist.ProcessGroupGloo._Options()
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            options._timeout = span
            self.group = dist.ProcessGroupGloo(prefixed, plan.member, plan.size, options)

    def _wait(self, work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise IslandLost(f"island {self.plan.island} lost a rank ({exc}): rank {self.plan.rank} ends with it") \
                from exc

    # -- the step ----------------------------------------------------------------------------------

    def average_gradients(self, params: Iterable[Tensor]) -> None:
        """Every rank's gradients replaced by the island's mean, as DDP's all-reduce makes them (a parameter
        without a gradient on this rank counts as zeros, and keeps none).

        Args:
            params: the parameters that train, in the same order on every rank.
        """
        params = [p for p in params if p.requires_grad]
        by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for p in params:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        for group in by_kind.values():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group])
            self._wait(self.group.allreduce([flat]))
            self._count(flat, sent=True, received=True)
            flat.div_(self.plan.size)
            offset = 0
            for p in group:
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n

    def send_weights(self, tensors: Mapping[str, Tensor], stop: bool = False) -> bool:
        """The leader's tensors written into every rank's; returns whether any rank of the island asked to stop (its
        PS said so, or a callback on any rank did: the island stops at the same step, or one rank would wait in an
        all-reduce for another that left). Every rank calls it at the same point, with its own tensors of the same
        names.

        Args:
            tensors: the parameters and buffers the PS holds, by name (changed in place on the other ranks).
            stop: whether this rank would stop after this step.
        """
        header = torch.tensor([int(stop)], dtype=torch.int64, device=self._comm_device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self._wait(self.group.allreduce([header], options))
        by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for name in sorted(tensors):
            t = tensors[name]
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        leader = self.plan.leader
        for group in by_kind.values():
            with torch.no_grad():
                flat = torch.cat([t.detach().reshape(-1) for t in group]) if leader else torch.empty(
                    sum(t.numel() for t in group), dtype=group[0].dtype, device=group[0].device)
                self._wait(self.group.broadcast(flat, 0))
                self._count(flat, sent=leader, received=not leader)
                if not leader:
                    offset = 0
                    for t in group:
                        t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
        return bool(header.item())

    # -- bytes, for Lightning's collectives --------------------------------------------------------------

    @property
    def _comm_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in the island's order, on every rank.

        Args:
            data: this rank's bytes.
        """
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._comm_device)
        sizes = [torch.zeros_like(size) for _ in range(self.plan.size)]
        self._wait(self.group.allgather([sizes], [size]))
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8, device=self._comm_device)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.plan.size)]
        self._wait(self.group.allgather([parts], [mine]))
        self._count(mine, sent=True, received=False)
        self.bytes_received += longest * (self.plan.size - 1)
        return [bytes(p[:int(s.item())].cpu().numpy()) for p, s in zip(parts, sizes, strict=True)]

    def broadcast_bytes(self, data: bytes, root: int = 0) -> bytes:
        """Rank ``root``'s ``data`` (a place in the island) on every rank.

        Args:
            data: the bytes to send, on ``root`` (ignored elsewhere).
            root: the island member that sends.
        """
        mine = self.plan.member == root
        size = torch.tensor([len(data) if mine else 0], dtype=torch.int64, device=self._comm_device)
        self._wait(self.group.broadcast(size, root))
        n = int(size.item())
        buffer = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._comm_device) if mine and n
                  else torch.zeros(n, dtype=torch.uint8, device=self._comm_device))
        if n:
            self._wait(self.group.broadcast(buffer, root))
        self._count(buffer, sent=mine, received=not mine)
        return data if mine else bytes(buffer.cpu().numpy())

    def broadcast_obj(self, obj: Any, root: int = 0) -> Any:
        """Rank ``root``'s msgpack data on every rank of the island.

        Args:
            obj: the value, on ``root``.
            root: the island member that sends.
        """
        data = msgpack.packb(obj, use_bin_type=True) if self.plan.member == root else b""
        return msgpack.unpackb(self.broadcast_bytes(data, root),
                               raw=False, strict_map_key=False)

    def digest_agrees(self, tensors: Mapping[str, Tensor]) -> bool:
        """Whether every rank of the island holds ``tensors`` bit for bit (a check: every rank calls it).

        Args:
            tensors: this rank's tensors, by name.
        """
        h = hashlib.sha256()
        for name in sorted(tensors):
            t = tensors[name].detach().cpu().contiguous().reshape(-1)
            h.update(name.encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        return len(set(self.gather_bytes(h.digest()))) == 1

    def _count(self, t: Tensor, *, sent: bool, received: bool) -> None:
        n = t.numel() * t.element_size()
        self.bytes_sent += n if sent else 0
        self.bytes_received += n if received else 0

    def counters(self) -> dict[str, Any]:
        """This rank's place and traffic inside its island."""
        return {"island": self.plan.island, "island_size": self.plan.size, "island_leader": self.plan.leader,
                "island_bytes_sent": self.bytes_sent, "island_bytes_received": self.bytes_received}

    def close(self) -> None:
        """Lets the group and the store go (the node's rank 0 stops serving its store)."""
        self.group = None


def averaged_closure(group: IslandGroup, closure: Callable[..., Any], optimizer: Any) -> Callable[..., Any]:
    """``closure`` (the forward and backward), then the island's mean gradient in every rank's ``.grad``, as DDP's
    all-reduce leaves it: Lightning's clipping and the optimizer's step then act on it alike on every rank.

    Args:
        group: this rank's island.
        closure: Lightning's closure, which the optimizer calls.
        optimizer: the optimizer that steps (its parameters, in their order, are the ones averaged).
    """

    def averaged(*args: Any, **kwargs: Any) -> Any:
        out = closure(*args, **kwargs)
        group.average_gradients(p for g in optimizer.param_groups for p in g["params"])
        return out

    return averaged
