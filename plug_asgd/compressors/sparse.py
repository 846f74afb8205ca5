"""Sparse codecs: a few coordinates per tensor, sent as a :class:`~plug_asgd.protocol.wire.Sparse`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from typing_extensions import override

from plug_asgd.compressors.base import Codec
from plug_asgd.compressors.difference import largest_differences, top_k
from plug_asgd.protocol.wire import Sparse, Tensor, sparse_wire_bytes

SPARSE_VALUES = ("float32", "float16")
FP16_MAX = float(np.finfo(np.float16).max)  # 65504


def largest_magnitudes(flat: np.ndarray, k: int, scratch: np.ndarray | None = None) -> np.ndarray:
    """Ascending int64 indices of the ``k`` largest ``|flat|`` (exact zeros left out: sending them changes nothing;
    values tied with the k-th largest at the lowest indices, as every selection of the library takes them).

    ``scratch``, an array of ``flat``'s shape and dtype, takes ``|flat|`` in place of a new one.

    Args:
        flat: the values, a 1-d float array.
        k: how many to choose (all of them where ``k >= flat.size``).
        scratch: an array to write ``|flat|`` into (one of another shape or dtype is not used); None: a new one.
    """
    if k >= flat.size:
        chosen = np.arange(flat.size)
    else:
        fits = scratch is not None and scratch.shape == flat.shape and scratch.dtype == flat.dtype
        chosen = top_k(np.abs(flat, out=scratch) if fits else np.abs(flat), k)
    return chosen[flat[chosen] != 0].astype(np.int64)  # top_k's indices ascend already


def check_fraction(fraction: float) -> float:
    """``fraction`` as a float, refused unless a number in ``(0, 1]``: a sparse codec's share of coordinates.

    Args:
        fraction: the share of each tensor's coordinates sent.

    Raises:
        ValueError: where ``fraction`` is no number (a bool neither) or outside ``(0, 1]``.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be a fraction of the coordinates in (0, 1], got {fraction!r} "
                         "(0.01 sends 1% of each tensor)")
    return float(fraction)


def k_for(fraction: float, numel: int) -> int:
    """The coordinates sent of a tensor of ``numel``: ``ceil(fraction * numel)``, at least 1 and at most all.

    Args:
        fraction: the share of coordinates sent.
        numel: the tensor's values.
    """
    return min(numel, max(1, math.ceil(fraction * numel)))


class TopKResidual:
    """Per tensor, the ``fraction`` of coordinates with the largest magnitude; the rest is kept.

    This is AdaComp's worker side (Hardy, Le Merrer, Sericola, NCA 2017): of ``v = update +
    residual`` it sends the ``k = ceil(fraction * numel)`` largest ``|v_i|`` (exact zeros among them
    are not sent: they would change nothing) and keeps the remainder as the residual that is
    added to the next update, so ``sent + residual == v`` exactly and nothing is lost, only
    delayed. On the wire a float32 tensor costs
    ``4 * ceil(numel / 65536) + 6 * nnz`` bytes (:func:`plug_asgd.protocol.wire.sparse_wire_bytes`).

    ``values="float16"`` sends the chosen values as IEEE halves (clipped to +-65504) and keeps
    what the rounding lost in the residual too: ``4 * ceil(numel / 65536) + 4 * nnz`` bytes, and
    ``sent + residual == v`` still holds exactly for ``|v| <= 131008`` (the difference of a value
    and its rounding is exact in float32 there).

    Args:
        fraction: the share of each tensor's coordinates sent per push, in ``(0, 1]``.
        values: the dtype the chosen values are sent as, one of :data:`SPARSE_VALUES`.

    Raises:
        ValueError: where ``values`` is not one of :data:`SPARSE_VALUES` or ``fraction`` is not in ``(0, 1]``.
    """

    name = "topk"
    # the staleness compensation keeps what it holds back in the worker's model (docs/momentum.md)
    local_residual = True
    independent_keys = True  # each tensor's residual is its own: its tensors may be encoded by several threads

    def __init__(self, fraction: float, values: str = "float32") -> None:
        if values not in SPARSE_VALUES:
            raise ValueError(f"values must be one of {SPARSE_VALUES}, got {values!r}")
        self.fraction = check_fraction(fraction)
        self.values = values
        self.residuals: dict[str, np.ndarray] = {}
        self.magnitudes: dict[str, np.ndarray] = {}  # scratch for |v|, kept across pushes as the residuals are

    def k_for(self, numel: int) -> int:
        """The coordinates sent of a tensor of ``numel`` values.

        Args:
            numel: the tensor's values.
        """
        return k_for(self.fraction, numel)

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        """The top ``k`` of ``update`` plus the residual of ``key``, as a Sparse; the rest becomes the residual.

        Args:
            key: the tensor's name: its residual is kept under it.
            update: the tensor's update, a float array of the tensor's shape.
        """
        # v = residual + update, made in the residual's array (which becomes the next residual), |v| in a kept
        # one: no array of the tensor's size is allocated
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
        self.residuals[key] = flat
        return self._send(chosen, flat[chosen], flat, tuple(update.shape))

    def encode_difference(self, key: str, w: np.ndarray, c: np.ndarray, scale: float = 1.0, *,
                          implicit_residual: bool = False) -> Tensor:
        """``encode(key, scale * (w - c))`` without making the difference whole (:mod:`.difference`).

        ``implicit_residual``: the residual is ``w - c`` itself, kept by the worker's model (its weights are the
        central model ``c`` plus what was not sent): nothing is kept here, and ``scale`` must be 1.

        Args:
            key: the tensor's name: its residual is kept under it.
            w: the worker's weights of the tensor.
            c: the central model's values of the tensor that the worker holds (its base), of ``w``'s shape.
            scale: the factor ``w - c`` is multiplied by before the residual is added.
            implicit_residual: whether the residual is ``w - c`` itself, held by the worker's model.

        Raises:
            ValueError: where ``implicit_residual`` comes with a ``scale`` other than 1.
        """
        shape = tuple(w.shape)
        w, c = w.reshape(-1), c.reshape(-1)
        k = self.k_for(w.size)
        if implicit_residual:
            if scale != 1.0:
                raise ValueError("an implicit residual is w - c itself: it cannot be scaled")
            self.residuals.pop(key, None)
            chosen, values = largest_differences(w, c, k)
            return self._send(chosen, values, None, shape)
        flat = self.residuals.get(key)
        if flat is None or flat.shape != w.shape or flat.dtype != w.dtype:
            flat = self.residuals[key] = np.zeros_like(w)
        chosen, values = largest_differences(w, c, k, residual=flat, scale=scale)
        return self._send(chosen, values, flat, shape)

    def _send(self, chosen: np.ndarray, values: np.ndarray, flat: np.ndarray | None,
              shape: tuple[int, ...]) -> Sparse:
        """The Sparse of ``values`` at ``chosen``; what they leave of ``v`` stays in ``flat`` (the residual)."""
        if self.values == "float16" and values.dtype != np.float16:
            sent = np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16)
            if flat is not None:
                flat[chosen] = values - sent.astype(flat.dtype)  # what the half could not carry waits
            values = sent
        elif flat is not None:
            flat[chosen] = 0  # values were gathered (fancy indexing copies): they keep what was sent
        return Sparse(indices=chosen, values=values, shape=shape)

    def set_pending(self, key: str, residual: np.ndarray) -> None:
        """Make ``residual`` what is kept of ``key`` (stored flat): the worker's model held it.

        Args:
            key: the tensor's name.
            residual: what is to be added to the tensor's next update, of its shape or flat; not copied.
        """
        self.residuals[key] = residual.reshape(-1)

    def pending(self, key: str) -> np.ndarray | None:
        """What is kept of ``key`` for a later push (flat), or None before its first.

        Args:
            key: the tensor's name.
        """
        return self.residuals.get(key)


class TopK(Codec):
    """Per tensor, the exact top ``fraction`` of coordinates by magnitude, as a Sparse; no residual of its own.

    Sends the ``k = min(numel, max(1, ceil(fraction * numel)))`` largest ``|x_i|`` exactly, except
    exact zeros (they change nothing), so ``nnz = min(k, count_nonzero(x))``. On the wire:
    ``4 * max(1, ceil(numel / 65536)) + (2 + itemsize) * nnz`` bytes (6 per sent float32
    coordinate). Biased: error feedback is on by default, which makes it AdaComp's :class:`TopKResidual`.

    Args:
        fraction: the share of each tensor's coordinates sent per push, in ``(0, 1]``.
        error_feedback: whether a worker keeps the coordinates not sent for its next push; None: on.

    Example:
        >>> import numpy as np
        >>> from plug_asgd import TopK
        >>> sent = TopK(fraction=0.5).encode("w", np.array([0.5, -2.0, 0.25, 1.0], dtype=np.float32))
        >>> sent.indices, sent.values  # the 2 of 4 of largest magnitude
        (array([1, 3]), array([-2.,  1.], dtype=float32))
        >>> TopK(fraction=0.01).wire_bytes((100_000,))  # 1,000 float32 values with 2-byte indices, 8-byte header
        6008
    """

    name = "topk"
    sends = "Sparse: the `fraction` of coordinates of largest magnitude, per tensor"
    wire_formula = "4 * max(1, ceil(numel / 65536)) + (2 + itemsize) * nnz"
    error_feedback_by_default = True

    def __init__(self, fraction: float = 0.01, *, error_feedback: bool | None = None) -> None:
        super().__init__(error_feedback=error_feedback)
        self.fraction = check_fraction(fraction)

    def k_for(self, numel: int) -> int:
        """The coordinates sent of a tensor of ``numel`` values.

        Args:
            numel: the tensor's values.
        """
        return k_for(self.fraction, numel)

    @override
    def encode(self, key: str, update: np.ndarray) -> Tensor:
        flat = np.asarray(update).reshape(-1)
        chosen = largest_magnitudes(flat, self.k_for(flat.size))
        return Sparse(indices=chosen, values=flat[chosen], shape=tuple(update.shape))

    @override
    def encode_difference(self, key: str, w: np.ndarray, c: np.ndarray, scale: float = 1.0) -> Tensor:
        """The top k of ``scale * (w - c)``, chosen chunk by chunk (:func:`.difference.largest_differences`)."""
        if scale != 1.0:
            return super().encode_difference(key, w, c, scale)
        chosen, values = largest_differences(w.reshape(-1), c.reshape(-1), self.k_for(w.size))
        return Sparse(indices=chosen, values=values, shape=tuple(w.shape))

    @override
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
    model behind the workers' (docs/momentum.md, "randomk's lag and the length of a fit").

    Args:
        fraction: the share of each tensor's coordinates drawn per push, in ``(0, 1]``; None: 1%, raised for a
            short fit.
        seed: seeds the one generator that draws every tensor's coordinates, in order; a worker's encoder adds
            its rank.
        unbiased: whether the values sent are scaled by ``numel / k``; None: where there is no error feedback.
        error_feedback: whether a worker keeps the coordinates not drawn for its next push; None: on.

    Example:
        >>> import numpy as np
        >>> from plug_asgd import RandomK
        >>> x = np.arange(1.0, 9.0, dtype=np.float32)
        >>> sent = RandomK(fraction=0.25, unbiased=True).encode("w", x)
        >>> sent.indices.size, sent.values / x[sent.indices]  # 2 of 8 drawn, each scaled by 8 / 2
        (2, array([4., 4.], dtype=float32))
    """

    name = "randomk"
    sends = "Sparse: k random coordinates (scaled by numel / k when unbiased)"
    wire_formula = "4 * max(1, ceil(numel / 65536)) + (2 + itemsize) * k"
    error_feedback_by_default = True
    independent_keys = False  # one random generator draws every tensor's coordinates, in order
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

    @override
    def config(self) -> dict[str, Any]:
        return {**super().config(), "fraction": None} if self.auto else super().config()

    def k_for(self, numel: int) -> int:
        """The coordinates drawn of a tensor of ``numel`` values.

        Args:
            numel: the tensor's values.
        """
        return k_for(self.fraction, numel)

    @override
    def lag_pushes(self) -> float | None:
        """With error feedback, ``1 / fraction``: each coordinate is drawn with that chance at every push, so the
        residual holds it for that many pushes on average, however large it grew (less in a tensor of fewer than
        ``1 / fraction`` coordinates, which sends one at every push). Unbiased, nothing waits."""
        return 1.0 / self.fraction if self.error_feedback and self.fraction < 1.0 else None

    @override
    def for_fit(self, pushes: float) -> Codec:
        """With the default fraction and error feedback: 1%, or ``fit_periods / pushes`` where that is more, so
        that a coordinate's mean wait is at most a tenth of the fit (the gaps to DDP it was chosen by:
        docs/momentum.md). A fraction the user gave stays as given."""
        if not self.auto or not self.error_feedback or not pushes > 0:
            return self
        fraction = min(1.0, max(self.default_fraction, self.fit_periods / pushes))
        if fraction == self.fraction:
            return self
        return type(self)(**{**self.config(), "fraction": fraction})  # rebuilt as encoder() does

    @override
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

    @override
    def encode_difference(self, key: str, w: np.ndarray, c: np.ndarray, scale: float = 1.0) -> Tensor:
        """``scale * (w - c)`` at the drawn coordinates only: nothing else of the difference is needed."""
        k = self.k_for(w.size)
        if k >= w.size:
            return super().encode_difference(key, w, c, scale)
        chosen = np.sort(self.rng.choice(w.size, size=k, replace=False))
        values = np.subtract(w.reshape(-1)[chosen], c.reshape(-1)[chosen])
        if scale != 1.0:
            values *= values.dtype.type(scale)
        if self.unbiased:
            values = values * (w.size / k)
        return Sparse(indices=chosen.astype(np.int64), values=values.astype(w.dtype, copy=False),
                      shape=tuple(w.shape))

    @override
    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        numel = math.prod(shape)
        return sparse_wire_bytes(numel, self.k_for(numel), itemsize)
