"""Lightning's collectives for islands (:mod:`plug_asgd.placement.island`): a rank's part as bytes for its island
(msgpack: nothing is unpickled), a gather of every rank of the job in two levels (the island, then the leaders through
the PS), and the training loop's notice. Imports neither Lightning namespace."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import numpy as np

from plug_asgd.placement.island import IslandGroup


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def encode_part(rank: int, obj: Any, tensors: Mapping[str, np.ndarray] | None) -> bytes:
    """One rank's part of a collective as bytes for its island (msgpack: nothing is unpickled).

    Args:
        rank: the rank's global rank.
        obj: its msgpack data.
        tensors: its arrays by name (None: none).
    """
    arrays = {k: [v.dtype.str, list(v.shape), np.ascontiguousarray(v).tobytes()] for k, v in (tensors or {}).items()}
    return _pack([rank, obj, arrays])


def decode_part(data: bytes) -> tuple[int, Any, dict[str, np.ndarray]]:
    """What :func:`encode_part` made: ``(rank, obj, tensors)``.

    Args:
        data: the bytes of one rank's part.
    """
    rank, obj, arrays = msgpack.unpackb(data, raw=False, strict_map_key=False)
    return rank, obj, {k: np.frombuffer(b, dtype=np.dtype(d)).reshape(s).copy() for k, (d, s, b) in arrays.items()}


Gather = Callable[..., list[tuple[int, Any, dict[str, np.ndarray]]]]  # (kind, obj, tensors) -> every worker's part


def island_gather(group: IslandGroup, kind: str, obj: Any, tensors: Mapping[str, np.ndarray] | None,
                  ps_gather: Gather | None) -> list[tuple[int, Any, dict[str, np.ndarray]]]:
    """A collective of every rank of the job in two levels: the island's parts gathered on its leader, the leaders'
    gathered through the PS (``ps_gather``, None where the job is one island), the whole sent back to the island.
    Returns every rank's ``(global rank, obj, tensors)`` in rank order, as the PS's gather does for lone workers.

    Args:
        group: this rank's island.
        kind: what the collective is (the PS checks that every leader agrees).
        obj: this rank's msgpack data.
        tensors: this rank's arrays by name (None: none).
        ps_gather: the leaders' gather through the PS (only the leader calls it).
    """
    parts = group.gather_bytes(encode_part(group.plan.rank, obj, tensors))
    data = b""
    if group.plan.leader:
        members = [decode_part(p) for p in parts]
        everyone = members
        if ps_gather is not None:
            arrays = {f"{r}:{k}": v for r, _, t in members for k, v in t.items()}
            everyone = []
            for _, objs, leader_arrays in ps_gather(kind, [[r, o] for r, o, _ in members], arrays):
                for r, o in objs:
                    prefix = f"{r}:"
                    everyone.append((r, o, {k[len(prefix):]: v for k, v in leader_arrays.items()
                                            if k.startswith(prefix)}))
        data = _pack([encode_part(r, o, t) for r, o, t in sorted(everyone, key=lambda part: part[0])])
    unpacked = msgpack.unpackb(group.broadcast_bytes(data), raw=False, strict_map_key=False)
    return [decode_part(p) for p in unpacked]


def island_notice(group: IslandGroup, obj: Any, src: int, board: Callable[[Any, int], Any] | None) -> Any:
    """A broadcast among the training loop's batches (the ``Timer``'s stop flag) for islands: rank ``src``'s value
    within its island, the leaders' notice board of the PS across islands (``board(value, src_island)``, the
    leader's only; None where the job is one island), then the leader's value to its whole island, so that the
    ranks of an island decide alike at the same batch.

    Args:
        group: this rank's island.
        obj: this rank's value.
        src: the global rank whose value every rank takes once it has arrived.
        board: the leader's notice through the PS (:mod:`plug_asgd.worker.notices`).
    """
    plan = group.plan
    value = obj
    if plan.island_of(src) == plan.island:
        value = group.broadcast_obj(obj, root=src % plan.size)
    if plan.leader and board is not None:
        value = board(value, plan.island_of(src))
    return group.broadcast_obj(value, 0)
