"""Update codecs: what of a worker's update goes on the wire.

A compressor turns one tensor's update into what is sent (a dense array or a
:class:`~plug_asgd.wire.Sparse`) and keeps, per tensor, whatever state it needs (the residual
of error feedback). The parameter server only ever sees the result, decoded by the wire.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from plug_asgd.wire import Sparse, Tensor


class Compressor(Protocol):
    """Turns a tensor's update into its wire form; may keep per-tensor state between calls."""

    name: str

    def encode(self, key: str, update: np.ndarray) -> Tensor: ...


class NoCompression:
    """Sends the update as it is (dense): 4 bytes per float32 coordinate."""

    name = "none"

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        return update


class TopKResidual:
    """Per tensor, the ``fraction`` of coordinates with the largest magnitude; the rest is kept.

    This is AdaComp's worker side (Hardy, Le Merrer, Sericola, NCA 2017): of ``v = update +
    residual`` it sends the ``k = ceil(fraction * numel)`` largest ``|v_i|`` (exact zeros among them
    are not sent: they would change nothing) and keeps the remainder as the residual that is
    added to the next update, so ``sent + residual == v`` exactly and nothing is lost, only
    delayed. On the wire a float32 tensor costs
    ``4 * ceil(numel / 65536) + 6 * nnz`` bytes (:func:`plug_asgd.wire.sparse_wire_bytes`).
    """

    name = "topk"

    def __init__(self, fraction: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"compression must be a fraction in (0, 1], got {fraction}")
        self.fraction = fraction
        self.residuals: dict[str, np.ndarray] = {}

    def k_for(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        residual = self.residuals.get(key)
        flat = update.reshape(-1).astype(update.dtype, copy=True)
        if residual is not None:
            flat += residual
        k = self.k_for(flat.size)
        if k < flat.size:
            chosen = np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]
        else:
            chosen = np.arange(flat.size)
        chosen = np.sort(chosen[flat[chosen] != 0])
        values = flat[chosen]  # fancy indexing copies, so zeroing below keeps them intact
        flat[chosen] = 0
        self.residuals[key] = flat
        return Sparse(indices=chosen.astype(np.int64), values=values, shape=tuple(update.shape))
