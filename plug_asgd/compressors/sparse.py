"""Sparse codecs: a few coordinates per tensor, sent as a :class:`~plug_asgd.wire.Sparse`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from plug_asgd.compressors.base import Codec
from plug_asgd.wire import Sparse, Tensor, sparse_wire_bytes

SPARSE_VALUES = ("float32", "float16")
FP16_MAX = float(np.finfo(np.float16).max)  # 65504


# a tensor of at least this many coordinates, of which at most 1/_FEW_ASKED are asked for, has its top k chosen
# among the coordinates above a threshold estimated from a strided sample of _SAMPLE of them (_top_k)
_SAMPLED_FROM = 65_536
_FEW_ASKED = 16
_SAMPLE = 8192


def largest_magnitudes(flat: np.ndarray, k: int, scratch: np.ndarray | None = None) -> np.ndarray:
    """Ascending int64 indices of the ``k`` largest ``|flat|`` (exact zeros left out: sending them changes nothing).

    ``scratch``, an array of ``flat``'s shape and dtype, takes ``|flat|`` in place of a new one."""
    if k >= flat.size:
        chosen = np.arange(flat.size)
    else:
        fits = scratch is not None and scratch.shape == flat.shape and scratch.dtype == flat.dtype
        chosen = _top_k(np.abs(flat, out=scratch) if fits else np.abs(flat), k)
    return np.sort(chosen[flat[chosen] != 0]).astype(np.int64)


def _top_k(mag: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest of ``mag`` (in no order), exactly the set ``np.argpartition`` gives, ties aside.

    A partition of a large tensor costs about 1.8 ms for the recipe CNN's 1.2M-coordinate layer, a fifth of
    an AdaComp push on the worker. So where few are asked for, a threshold is read off a strided sample
    (the sample's quantile that about 2k of the whole exceed) and only the coordinates at or above it
    (NaN included) are partitioned: exact whenever at least k are, which is checked; else, or when too many
    are (a tensor of many equal values), the whole is partitioned as before.
    """
    n = mag.size
    if n >= _SAMPLED_FROM and k * _FEW_ASKED <= n:
        sample = mag[:: n // _SAMPLE]
        above = min(sample.size - 1, math.ceil(2 * k * sample.size / n))
        threshold = np.partition(sample, sample.size - 1 - above)[sample.size - 1 - above]
        candidates = np.flatnonzero(np.logical_not(mag < threshold))  # not below: NaN is a candidate, as it
        # is the largest for argpartition
        if k <= candidates.size <= n // 4:
            among = mag[candidates]
            return candidates[np.argpartition(among, among.size - k)[among.size - k:]]
    return np.argpartition(mag, n - k)[n - k:]


def check_fraction(fraction: float) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be a fraction of the coordinates in (0, 1], got {fraction!r} "
                         "(0.01 sends 1% of each tensor)")
    return float(fraction)


def k_for(fraction: float, numel: int) -> int:
    return min(numel, max(1, math.ceil(fraction * numel)))


class TopKResidual:
    """Per tensor, the ``fraction`` of coordinates with the largest magnitude; the rest is kept.

    This is AdaComp's worker side (Hardy, Le Merrer, Sericola, NCA 2017): of ``v = update +
    residual`` it sends the ``k = ceil(fraction * numel)`` largest ``|v_i|`` (exact zeros among them
    are not sent: they would change nothing) and keeps the remainder as the residual that is
    added to the next update, so ``sent + residual == v`` exactly and nothing is lost, only
    delayed. On the wire a float32 tensor costs
    ``4 * ceil(numel / 65536) + 6 * nnz`` bytes (:func:`plug_asgd.wire.sparse_wire_bytes`).

    ``values="float16"`` sends the chosen values as IEEE halves (clipped to +-65504) and keeps
    what the rounding lost in the residual too: ``4 * ceil(numel / 65536) + 4 * nnz`` bytes, and
    ``sent + residual == v`` still holds exactly for ``|v| <= 131008`` (the difference of a value
    and its rounding is exact in float32 there).
    """

    name = "topk"
    # the staleness compensation keeps what it holds back in the worker's model (docs/momentum.md)
    local_residual = True

    def __init__(self, fraction: float, values: str = "float32") -> None:
        if values not in SPARSE_VALUES:
            raise ValueError(f"values must be one of {SPARSE_VALUES}, got {values!r}")
        self.fraction = check_fraction(fraction)
        self.values = values
        self.residuals: dict[str, np.ndarray] = {}
        self.magnitudes: dict[str, np.ndarray] = {}  # scratch for |v|, kept across pushes as the residuals are

    def k_for(self, numel: int) -> int:
        return k_for(self.fraction, numel)

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        # v = residual + update, made in the residual's array (which becomes the next residual), |v| in a kept
        # one: no array of the tensor's size is allocated, where two were (`python -m bench.push_cost`: the
        # update of a push of the recipe CNN at 0.33% took 2.1 to 2.3 ms where it took 4.0, on a Zen 4 core)
        flat = self.residuals.get(key)
        update_flat = update.reshape(-1)
        if flat is None or flat.shape != update_flat.shape or flat.dtype != update.dtype:
            flat = update_flat.astype(update.dtype, copy=True)
        else:
            flat += update_flat
        scratch = self.magnitudes.get(key)
        if scratch is None or scratch.shape != flat.shape or scratch.dtype != flat.dtype:
            scratch = self.magnitudes[key] = np.empty_like(flat)
        chosen = largest_magnitudes(flat, self.k_for(flat.size), scratch)
        values = flat[chosen]  # fancy indexing copies, so changing flat below keeps them intact
        if self.values == "float16" and values.dtype != np.float16:
            sent = np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16)
            flat[chosen] = values - sent.astype(flat.dtype)  # what the half could not carry waits
            values = sent
        else:
            flat[chosen] = 0
        self.residuals[key] = flat
        return Sparse(indices=chosen, values=values, shape=tuple(update.shape))

    def pending(self, key: str) -> np.ndarray | None:
        """What is kept of ``key`` for a later push (flat), or None before its first."""
        return self.residuals.get(key)


class TopK(Codec):
    """Per tensor, the exact top ``fraction`` of coordinates by magnitude, as a Sparse; no residual of its own.

    Sends the ``k = min(numel, max(1, ceil(fraction * numel)))`` largest ``|x_i|`` exactly, except
    exact zeros (they change nothing), so ``nnz = min(k, count_nonzero(x))``. On the wire:
    ``4 * max(1, ceil(numel / 65536)) + (2 + itemsize) * nnz`` bytes (6 per sent float32
    coordinate). Biased: error feedback is on by default, which makes it AdaComp's :class:`TopKResidual`.
    """

    name = "topk"
    sends = "Sparse: the `fraction` of coordinates of largest magnitude, per tensor"
    wire_formula = "4 * max(1, ceil(numel / 65536)) + (2 + itemsize) * nnz"
    error_feedback_by_default = True

    def __init__(self, fraction: float = 0.01, *, error_feedback: bool | None = None) -> None:
        super().__init__(error_feedback=error_feedback)
        self.fraction = check_fraction(fraction)

    def k_for(self, numel: int) -> int:
        return k_for(self.fraction, numel)

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        flat = np.asarray(update).reshape(-1)
        chosen = largest_magnitudes(flat, self.k_for(flat.size))
        return Sparse(indices=chosen, values=flat[chosen], shape=tuple(update.shape))

    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        numel = math.prod(shape)
        return sparse_wire_bytes(numel, min(self.k_for(numel), numel if nonzero is None else nonzero), itemsize)


class RandomK(Codec):
    """Per tensor, ``k = min(numel, max(1, ceil(fraction * numel)))`` coordinates drawn uniformly without replacement.

    Sent as a Sparse of exactly ``k`` values: ``4 * max(1, ceil(numel / 65536)) + (2 + itemsize)
    * k`` bytes. Unbiased (``unbiased``, by default where there is no error feedback), the values
    are scaled by ``numel / k``, so the expectation of the decoded tensor is the update; its
    variance is ``x_i**2 * (numel / k - 1)`` per coordinate. Error feedback (on by default) needs
    the unscaled values (a contraction: scaled ones make the residual grow by about ``numel / k -
    1`` in squared norm per step). The coordinates come from one generator seeded with ``seed``.

    ``fraction=None`` (the default): 1%, raised for a fit too short for it (:meth:`for_fit`). With error feedback a
    coordinate waits about ``1 / fraction`` pushes whatever it holds, and a fit of few such waits ends its central
    model behind the workers' (measured at 1%: up to 4.5 points below DDP in fits of 125 pushes per worker, above it
    in fits of 500; docs/momentum.md).
    """

    name = "randomk"
    sends = "Sparse: k random coordinates (scaled by numel / k when unbiased)"
    wire_formula = "4 * max(1, ceil(numel / 65536)) + (2 + itemsize) * k"
    error_feedback_by_default = True
    default_fraction = 0.01
    fit_periods = 10  # the default fraction gives a fit at least this many mean waits (for_fit)

    def __init__(self, fraction: float | None = None, seed: int = 0, *, unbiased: bool | None = None,
                 error_feedback: bool | None = None) -> None:
        super().__init__(error_feedback=error_feedback)
        self.auto = fraction is None  # the fraction follows the fit's length (for_fit)
        self.fraction = check_fraction(self.default_fraction if fraction is None else fraction)
        self.seed = seed
        self.unbiased = not self.error_feedback if unbiased is None else bool(unbiased)
        self.rng = np.random.default_rng(seed)

    def config(self) -> dict[str, Any]:
        return {**super().config(), "fraction": None} if self.auto else super().config()

    def k_for(self, numel: int) -> int:
        return k_for(self.fraction, numel)

    def lag_pushes(self) -> float | None:
        """With error feedback, ``1 / fraction``: each coordinate is drawn with that chance at every push, so the
        residual holds it for that many pushes on average, however large it grew (less in a tensor of fewer than
        ``1 / fraction`` coordinates, which sends one at every push). Unbiased, nothing waits."""
        return 1.0 / self.fraction if self.error_feedback and self.fraction < 1.0 else None

    def for_fit(self, pushes: float) -> Codec:
        """With the default fraction and error feedback: 1%, or ``fit_periods / pushes`` where that is more, so
        that a coordinate's mean wait is at most a tenth of the fit. Measured (one epoch of 16,000 images, seeds 0
        and 1, gap to DDP): at 4 workers, 125 pushes each, 1% -3.3 (SGD lr 0.05), 4% -1.0 (SGD) and -2.6
        (Nesterov), 8% -1.5 (Nesterov), 10% -0.4 (SGD) and -1.5 (Nesterov); at 2 workers, 250 pushes each, 1%
        -1.1 and -1.4, 2% +0.3 and +0.7 (SGD lr 0.05 and 0.01). A fraction the user gave stays as given."""
        if not self.auto or not self.error_feedback or not pushes > 0:
            return self
        fraction = min(1.0, max(self.default_fraction, self.fit_periods / pushes))
        if fraction == self.fraction:
            return self
        return type(self)(**{**self.config(), "fraction": fraction})  # rebuilt as encoder() does

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        flat = np.asarray(update).reshape(-1)
        k = self.k_for(flat.size)
        if k < flat.size:
            chosen = np.sort(self.rng.choice(flat.size, size=k, replace=False))
            values = flat[chosen] * (flat.size / k) if self.unbiased else flat[chosen]
        else:
            chosen, values = np.arange(flat.size), flat.copy()
        return Sparse(indices=chosen.astype(np.int64), values=values.astype(flat.dtype, copy=False),
                      shape=tuple(update.shape))

    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        numel = math.prod(shape)
        return sparse_wire_bytes(numel, self.k_for(numel), itemsize)
