"""Low-rank codecs: a tensor seen as a matrix, sent as two thin factors."""

from __future__ import annotations

import math
import zlib

import numpy as np
from typing_extensions import override

from plug_asgd.compressors import fused, native
from plug_asgd.compressors.base import Codec
from plug_asgd.compressors.blas import one_thread
from plug_asgd.compressors.checks import bad_payload, check_int, check_meta, expect, packed_arrays
from plug_asgd.protocol.wire import FLOAT_DTYPES, Packed, Tensor


class PowerSGD(Codec):
    """Rank-``rank`` approximation by one warm-started power iteration (Vogels et al., NeurIPS 2019).

    The update is viewed as a matrix ``M`` of ``[n, m] = [shape[0], numel / shape[0]]``. Per key, a
    factor ``Q [m, r]`` (first drawn from a normal distribution seeded with ``seed`` and the key,
    then the previous step's) gives ``P = orthonormalise(M @ Q)`` (numpy's QR) and the new ``Q =
    M.T @ P``; ``Packed("powersgd", shape, {}, (P, Q))`` decodes to ``P @ Q.T``, the projection of
    ``M`` on the span of ``P``: exact (up to rounding) when ``M`` has rank ``<= r``, and
    converging to the best rank-``r`` approximation over the steps when ``M`` changes slowly.
    Factors are float32 (float64 for a float64 update): ``itemsize * r * (n + m)`` bytes. A
    tensor of fewer than 2 dimensions, or one where that would not be smaller than dense
    (``r * (n + m) >= n * m``, which includes ``r >= min(n, m)``), or holding NaN or Inf, is sent
    dense: ``itemsize * numel`` bytes. Biased: error feedback is on by default.

    Args:
        rank: the factors' columns ``r``, at least 1.
        seed: seeds the first ``Q`` of each tensor (with the tensor's name); a worker's encoder adds its rank.
        error_feedback: whether a worker keeps what the approximation leaves for its next push; None: on.

    Example:
        >>> import numpy as np
        >>> from plug_asgd import PowerSGD
        >>> from plug_asgd.compressors import decode
        >>> m = np.outer([1, 2, 3, 4], np.ones(6)).astype(np.float32)  # a [4, 6] matrix of rank 1
        >>> codec = PowerSGD(rank=1)
        >>> sent = codec.encode("w", m)
        >>> [a.shape for a in sent.arrays], codec.wire_bytes(m.shape), np.allclose(decode(sent, np.float32), m)
        ([(4, 1), (6, 1)], 40, True)
    """

    name = "powersgd"
    sends = ("Packed: factors P [n, rank] and Q [m, rank] of the tensor seen as n x m, one warm-started power "
             "iteration (Vogels et al. 2019)")
    wire_formula = "4 * rank * (n + m) (float32), else dense"
    error_feedback_by_default = True
    # with its residual in the model, workers drift along the directions outside its rank (docs/momentum.md)
    residual_in_model = False

    def __init__(self, rank: int = 4, seed: int = 0, *, error_feedback: bool | None = None) -> None:
        super().__init__(error_feedback=error_feedback)
        self.rank = check_int("rank", rank, 1)
        self.seed = seed
        self.q: dict[str, np.ndarray] = {}

    def _factored(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """``(n, m)`` where a tensor of ``shape`` is sent as factors, None where it is sent dense."""
        if len(shape) < 2:
            return None
        n = shape[0]
        m = math.prod(shape) // n if n else 0
        return (n, m) if self.rank * (n + m) < n * m else None

    @override
    def encode(self, key: str, update: np.ndarray) -> Tensor:
        x = np.asarray(update)
        factored = self._factored(x.shape)
        if factored is None:
            return x
        (n, m), r = factored, self.rank
        ct = np.result_type(x.dtype, np.float32)
        matrix = x.reshape(n, m).astype(ct, copy=False)
        q = self.q.get(key)
        if q is None or q.shape != (m, r) or q.dtype != ct:  # (a factor is kept only where finite)
            rng = np.random.default_rng([self.seed, zlib.crc32(key.encode())])
            q = rng.standard_normal((m, r)).astype(ct)
        with one_thread():
            # a NaN or Inf of the matrix reaches its row of M @ q (times a draw or last step's factor; NaN where
            # that is 0), and its column of M.T @ P: the small products are checked, not the matrix (a pass saved)
            product = matrix @ q
            if not np.isfinite(product).all():
                return x
            p, _ = np.linalg.qr(product)
            # (P.T @ M).T reads the matrix by rows: several times faster than M.T @ P's strided reads
            q = np.ascontiguousarray((p.T @ matrix).T)
        if not np.isfinite(q).all():
            return x
        self.q[key] = q
        return Packed("powersgd", tuple(x.shape), {}, (np.ascontiguousarray(p), q))

    @override
    def keeps_whole(self, shape: tuple[int, ...]) -> bool:
        """A factored tensor: ``P @ Q.T`` is the whole matrix's approximation, not one of its slices'."""
        return self._factored(tuple(shape)) is not None

    @override
    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        factored = self._factored(shape)
        if factored is None:
            return itemsize * math.prod(shape)
        return max(itemsize, 4) * self.rank * sum(factored)

    @classmethod
    def _factors(cls, packed: Packed) -> tuple[np.ndarray, np.ndarray]:
        """``P [n, r]`` and ``Q [m, r]`` of ``packed``, checked, in their common float dtype (float32 at least)."""
        check_meta(packed)
        if len(packed.shape) < 2:
            raise bad_payload(f"codec 'powersgd' needs a tensor of 2 or more dimensions, got shape "
                              f"{list(packed.shape)}")
        n = packed.shape[0]
        m = packed.numel // n if n else 0
        left, right = packed_arrays(packed, 2)
        if left.ndim != 2 or right.ndim != 2:
            raise bad_payload(f"codec 'powersgd': P and Q must be matrices, got {list(left.shape)} and "
                              f"{list(right.shape)}")
        rank = left.shape[1]
        if not 1 <= rank < min(n, m):
            raise bad_payload(f"codec 'powersgd': rank {rank} must be in [1, {min(n, m)}) for a [{n}, {m}] matrix")
        expect(packed, "P", left, FLOAT_DTYPES, (n, rank))
        expect(packed, "Q", right, FLOAT_DTYPES, (m, rank))
        ct = np.result_type(left.dtype, right.dtype, np.float32)
        return left.astype(ct, copy=False), right.astype(ct, copy=False)

    @classmethod
    @override
    def fold_packed(cls, packed: Packed, central: np.ndarray, out: np.ndarray, scale: float) -> bool | None:
        left, right = cls._factors(packed)
        if left.dtype != np.float32 or central.size != packed.numel or not fused.contiguous(central, out):
            return None
        n = packed.shape[0]
        return fused.low_rank_add_finite(np.ascontiguousarray(left), np.ascontiguousarray(right.T),
                                         central.reshape(n, -1), out.reshape(n, -1), scale)

    @classmethod
    @override
    def decode_packed(cls, packed: Packed, dtype: np.dtype) -> np.ndarray:
        left, right = cls._factors(packed)
        return low_rank_product(left, right).reshape(packed.shape).astype(dtype, copy=False)


ROWS = 256  # the rows of numpy's product made at a time: its temporaries stay in the cache


def low_rank_product(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``p @ q.T`` (``p [n, r]``, ``q [m, r]``, one float dtype), each value ``p[i, 0] * q[j, 0] + p[i, 1] * q[j,
    1] + ...`` added in ``k``'s order, each product and sum rounded to the dtype: the same bits in C
    (:func:`plug_asgd.compressors.native.low_rank_product`) and in numpy, on any machine. A worker answered "own"
    makes the PS's model itself from this decoding, so both must get its bits; a BLAS product's depend on the kernel
    its library picks for the CPU (fused multiply-adds or not, the order of the sums). In C about as fast as one
    BLAS thread; numpy's path, for a machine without a compiler, about 4 times slower.

    Args:
        p: the left factor ``[n, r]``.
        q: the right factor ``[m, r]``.
    """
    n, r = p.shape
    m = q.shape[0]
    out = np.empty((n, m), dtype=p.dtype)
    qt = np.ascontiguousarray(q.T)
    p = np.ascontiguousarray(p)
    if native.low_rank_product(p, qt, out):
        return out
    term = np.empty((min(ROWS, n), m), dtype=p.dtype)
    for start in range(0, n, ROWS):
        rows, part = p[start:start + ROWS], out[start:start + ROWS]
        np.multiply(rows[:, :1], qt[0], out=part)
        for k in range(1, r):
            np.multiply(rows[:, k:k + 1], qt[k], out=term[: len(rows)])
            np.add(part, term[: len(rows)], out=part)
    return out
