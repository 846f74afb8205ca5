"""Approximate replies to pushes: each carries the coordinates where its worker's copy is furthest off.

Where every update is dense (asgd, dynsgd, ssp without a sparse codec), the exact change since a
worker's version is the whole model, and a reply to a push costs the model's bytes on the link
down. With ``--downlink-fraction F`` the PS keeps, for each training worker, the copy it knows
the worker holds, and answers its pushes with, per tensor, the ``F`` share of coordinates where
``central - copy`` is largest in magnitude (and every coordinate off by more than
``--downlink-bound``), set to their central values. What is not sent stays in the difference
and is sent once it has grown enough: error feedback kept per worker on the PS, as in
DoubleSqueeze (Tang et al., 2019), without a separate residual. After each reply the PS knows
how far the worker's copy is from the central model (``gap``: the largest coordinate left out),
and counts the largest such gap (``downlink_gap_max``).

Pulls stay exact: a worker pulls before validation, test, checkpoints and at the end of a fit,
so the model it evaluates or saves is the central one, bit for bit. An approximate copy is
named by ``held: [model_id, version]``, never by ``have``, so it can never be patched as if
it were exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plug_asgd.protocol.wire import Sparse, sparse_wire_bytes


@dataclass
class _Copy:
    model_id: str
    version: int
    tensors: dict[str, np.ndarray]


class Downlink:
    """What each worker holds, for approximate replies to its pushes (top ``fraction`` per tensor).

    Args:
        fraction: the share of each tensor's coordinates a reply carries (those furthest off), in (0, 1].
        bound: also send every coordinate off by more than this, so that no copy is further off; None: no bound.

    Raises:
        ValueError: where ``fraction`` is not in (0, 1].
    """

    def __init__(self, fraction: float, bound: float | None = None) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"downlink fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction
        self.bound = bound
        self.copies: dict[int, _Copy] = {}
        self.gap_max = 0.0  # the largest coordinate left out of a reply, over all replies

    def holds(self, rank: int, model_id: str, version: int, tensors: dict[str, np.ndarray]) -> None:
        """Rank ``rank`` was sent the central model (``tensors``, copied) of ``version`` exactly.

        Args:
            rank: the worker's rank.
            model_id: the id of the central model it was sent (see :class:`~plug_asgd.ps.changes.ChangeLog`).
            version: the central version it was sent.
            tensors: the central tensors it was sent, by name.
        """
        self.copies[rank] = _Copy(model_id, version, {n: np.array(t, copy=True) for n, t in tensors.items()})

    def reply(self, rank: int, held: tuple[str, int] | None, model_id: str, version: int,
              tensors: dict[str, np.ndarray], exact: bool = False) -> dict[str, Sparse | np.ndarray] | None:
        """What to set in ``rank``'s copy, which it says it holds (``held``): the largest differences, or
        (``exact``) all of them, a tensor whole where that is smaller; None: the PS knows no such copy.

        Args:
            rank: the worker's rank.
            held: the ``[model_id, version]`` of the copy the worker says it holds, or None.
            model_id: the id of the central model now.
            version: the central version now (the copy's once it is answered).
            tensors: the central tensors now, by name.
            exact: whether to send every difference rather than the largest ``fraction``.
        """
        copy = self.copies.get(rank)
        if copy is None or held != (copy.model_id, copy.version) or model_id != copy.model_id:
            return None
        if copy.tensors.keys() != tensors.keys() or any(copy.tensors[n].shape != t.shape for n, t in tensors.items()):
            return None
        out: dict[str, Sparse | np.ndarray] = {}
        for name, central in tensors.items():
            mine = copy.tensors[name]
            diff = np.abs(central.reshape(-1) - mine.reshape(-1))
            k = max(1, int(self.fraction * diff.size))
            if exact or k >= diff.size:
                idx, left = np.flatnonzero(diff), 0.0
                if exact and sparse_wire_bytes(diff.size, idx.size, central.itemsize) >= central.nbytes:
                    np.copyto(mine, central)
                    out[name] = central
                    continue
            else:
                part = np.argpartition(diff, diff.size - k - 1)
                idx, left = part[diff.size - k:], float(diff[part[diff.size - k - 1]])
                if self.bound is not None and left > self.bound:
                    idx = np.union1d(idx, np.flatnonzero(diff > self.bound))
                    left = self.bound
                idx = np.sort(idx[diff[idx] > 0])
            values = central.reshape(-1)[idx]
            mine.reshape(-1)[idx] = values
            self.gap_max = max(self.gap_max, left)
            if idx.size:
                out[name] = Sparse(indices=idx.astype(np.int64), values=values, shape=central.shape)
        copy.version = version
        return out
