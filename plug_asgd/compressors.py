"""Update codecs: what of a worker's update goes on the wire, and how the parameter server reads it.

A compressor turns one tensor's update into what is sent (a dense array, a
:class:`~plug_asgd.wire.Sparse` or a :class:`~plug_asgd.wire.Packed`) and keeps, per tensor,
whatever state it needs (the residual of error feedback, PowerSGD's warm-started factor). The
parameter server turns what arrives back into something it can fold in with :func:`decode`.

The family, by name (``numel`` coordinates, ``itemsize`` bytes per value, 4 for float32; sizes
are the bytes of the tensor's frames, the small header entry aside):

============  ==========================================  ===============================================
name          what is sent                                frame bytes
============  ==========================================  ===============================================
``none``      the update, dense                           ``itemsize * numel``
``fp16``      dense float16                               ``2 * numel``
``bf16``      Packed: upper 16 bits of each float32       ``2 * numel``
``topk``      Sparse: the top fraction by magnitude       ``4 * max(1, ceil(numel / 65536)) + (2 + itemsize) * nnz``
``randomk``   Sparse: k random coordinates                ``4 * max(1, ceil(numel / 65536)) + (2 + itemsize) * k``
``qsgd``      Packed: sign + level, ``bits + 1`` bits     ``ceil(numel * (bits + 1) / 8)``
``sign``      Packed: one sign bit per coordinate         ``ceil(numel / 8)``
``powersgd``  Packed: factors P [n, r] and Q [m, r]       ``4 * rank * (n + m)`` (float32), else dense
============  ==========================================  ===============================================

:func:`make_compressor` builds one by name and wraps the biased ones in :class:`ErrorFeedback`.
"""

from __future__ import annotations

import functools
import inspect
import math
import zlib
from collections.abc import Callable
from typing import Protocol

import numpy as np

from plug_asgd.wire import FLOAT_DTYPES, Packed, Sparse, Tensor, WireError, dtype_name


class Compressor(Protocol):
    """Turns a tensor's update into its wire form; may keep per-tensor state between calls."""

    name: str

    def encode(self, key: str, update: np.ndarray) -> Tensor: ...


class NoCompression:
    """Sends the update as it is (dense): ``itemsize * numel`` bytes, 4 per float32 coordinate."""

    name = "none"

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        return update


def largest_magnitudes(flat: np.ndarray, k: int) -> np.ndarray:
    """Ascending int64 indices of the ``k`` largest ``|flat|`` (exact zeros left out: sending them changes nothing)."""
    if k < flat.size:
        chosen = np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]
    else:
        chosen = np.arange(flat.size)
    return np.sort(chosen[flat[chosen] != 0]).astype(np.int64)


SPARSE_VALUES = ("float32", "float16")
_FP16_MAX = float(np.finfo(np.float16).max)  # 65504


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
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"compression must be a fraction in (0, 1], got {fraction}")
        if values not in SPARSE_VALUES:
            raise ValueError(f"values must be one of {SPARSE_VALUES}, got {values!r}")
        self.fraction = fraction
        self.values = values
        self.residuals: dict[str, np.ndarray] = {}

    def k_for(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        residual = self.residuals.get(key)
        flat = update.reshape(-1).astype(update.dtype, copy=True)
        if residual is not None:
            flat += residual
        chosen = largest_magnitudes(flat, self.k_for(flat.size))
        values = flat[chosen]  # fancy indexing copies, so changing flat below keeps them intact
        if self.values == "float16" and values.dtype != np.float16:
            sent = np.clip(values, -_FP16_MAX, _FP16_MAX).astype(np.float16)
            flat[chosen] = values - sent.astype(flat.dtype)  # what the half could not carry waits
            values = sent
        else:
            flat[chosen] = 0
        self.residuals[key] = flat
        return Sparse(indices=chosen, values=values, shape=tuple(update.shape))

    def pending(self, key: str) -> np.ndarray | None:
        """What is kept of ``key`` for a later push (flat), or None before its first."""
        return self.residuals.get(key)


# -- decoding --------------------------------------------------------------------------------------


def _bad(message: str) -> WireError:
    return WireError("bad_payload", message)


def decode(tensor: Tensor, dtype: np.dtype | type, *, shape: tuple[int, ...] | None = None) -> np.ndarray | Sparse:
    """What the parameter server folds in for a tensor a compressor sent: a dense array or a Sparse of ``dtype``.

    Dense arrays are cast to ``dtype``, Sparse values are cast to ``dtype``, and a
    :class:`~plug_asgd.wire.Packed` is decoded by its codec (``bf16``, ``qsgd``, ``sign``,
    ``powersgd``). Anything that cannot be what one of the compressors here sent (an unknown
    codec, arrays of the wrong number, dtype or shape, out-of-range indices or parameters, a
    non-finite scale) raises ``WireError("bad_payload", ...)``; so does a tensor whose shape is
    not ``shape`` when one is given. Pass ``shape`` (the central tensor's) on the parameter
    server: it bounds the work before any decoding, which matters for codecs whose decoded size
    is not backed by frames (PowerSGD's ``P @ Q.T``). Values are not checked for NaN or Inf here:
    the caller checks the decoded result as it does for dense updates.
    """
    dtype = np.dtype(dtype)
    if type(tensor) is np.ndarray and tensor.dtype == dtype and (shape is None or tensor.shape == tuple(shape)):
        return tensor  # a dense update as the central tensor holds it (the common case: nothing to decode)
    if dtype.kind != "f":
        raise ValueError(f"decode needs a float dtype, got {dtype}")
    if not isinstance(tensor, (np.ndarray, Sparse, Packed)):
        raise _bad(f"a payload must be an array, a Sparse or a Packed, got {type(tensor).__name__}")
    got = tuple(tensor.shape)
    if shape is not None and got != tuple(shape):
        raise _bad(f"payload of shape {list(got)} for a tensor of shape {list(shape)}")
    with np.errstate(over="ignore"):  # a float64 value beyond float32 becomes Inf; the caller refuses it
        if isinstance(tensor, np.ndarray):
            if dtype_name(tensor.dtype) not in FLOAT_DTYPES:
                raise _bad(f"a dense update must hold floats, got {tensor.dtype.name}")
            return tensor.astype(dtype, copy=False)
        if isinstance(tensor, Sparse):
            return _decode_sparse(tensor, dtype)
        decoder = _DECODERS.get(tensor.codec)
        if decoder is None:
            raise _bad(f"unknown codec {tensor.codec!r}; this side decodes {', '.join(sorted(_DECODERS))}")
        return decoder(tensor, dtype)


def _decode_sparse(tensor: Sparse, dtype: np.dtype) -> Sparse:
    indices, values = np.asarray(tensor.indices), np.asarray(tensor.values)
    if dtype_name(values.dtype) not in FLOAT_DTYPES:
        raise _bad(f"sparse values must be floats, got {values.dtype.name}")
    if indices.dtype.kind not in "iu" or indices.ndim != 1 or values.shape != indices.shape:
        raise _bad(f"a sparse update needs as many integer indices ({indices.shape}) as values ({values.shape})")
    if indices.size and (int(indices[0]) < 0 or int(indices[-1]) >= tensor.numel
                         or not bool(np.all(indices[1:] > indices[:-1]))):
        raise _bad(f"sparse indices must be ascending, unique and in [0, {tensor.numel})")
    return Sparse(indices=indices.astype(np.int64, copy=False), values=values.astype(dtype, copy=False),
                  shape=tuple(tensor.shape))


def _meta(p: Packed, *keys: str) -> None:
    if set(p.meta) != set(keys):
        raise _bad(f"codec {p.codec!r} takes meta {sorted(keys)}, got {sorted(p.meta)}")


def _meta_int(p: Packed, key: str, low: int, high: int) -> int:
    value = p.meta[key]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(f"codec {p.codec!r}: {key} must be an integer in {low}..{high}, got {value!r}")
    return value


def _meta_scale(p: Packed, key: str) -> float:
    value = p.meta[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise _bad(f"codec {p.codec!r}: {key} must be a finite number >= 0, got {value!r} (has the worker's "
                   "training diverged?)")
    return float(value)


def _arrays(p: Packed, count: int) -> tuple[np.ndarray, ...]:
    if len(p.arrays) != count:
        raise _bad(f"codec {p.codec!r} sends {count} array(s), got {len(p.arrays)}")
    return tuple(np.asarray(a) for a in p.arrays)


def _expect(p: Packed, what: str, array: np.ndarray, dtypes: frozenset[str] | set[str],
            shape: tuple[int, ...]) -> None:
    if array.dtype.name not in dtypes or array.shape != shape:
        raise _bad(f"codec {p.codec!r}: {what} must be {'|'.join(sorted(dtypes))}{list(shape)}, got "
                   f"{array.dtype.name}{list(array.shape)}")


def _decode_bf16(p: Packed, dtype: np.dtype) -> np.ndarray:
    _meta(p)
    (bits,) = _arrays(p, 1)
    _expect(p, "the bits", bits, {"uint16"}, (p.numel,))
    return (bits.astype(np.uint32) << 16).view(np.float32).reshape(p.shape).astype(dtype, copy=False)


def _decode_qsgd(p: Packed, dtype: np.dtype) -> np.ndarray:
    _meta(p, "bits", "norm")
    bits = _meta_int(p, "bits", 1, 16)
    norm = _meta_scale(p, "norm")
    (stream,) = _arrays(p, 1)
    _expect(p, "the codes", stream, {"uint8"}, (_qsgd_bytes(p.numel, bits),))
    codes = _unpack_bits(stream, p.numel, bits + 1)
    magnitude = (codes & ((1 << bits) - 1)) * (norm / ((1 << bits) - 1))
    return np.where(codes >> bits, -magnitude, magnitude).reshape(p.shape).astype(dtype)


def _decode_sign(p: Packed, dtype: np.dtype) -> np.ndarray:
    _meta(p, "scale")
    scale = _meta_scale(p, "scale")
    (packed,) = _arrays(p, 1)
    _expect(p, "the signs", packed, {"uint8"}, (-(-p.numel // 8),))
    negative = np.unpackbits(packed, count=p.numel, bitorder="little").astype(bool)
    value = dtype.type(scale)
    return np.where(negative, -value, value).astype(dtype, copy=False).reshape(p.shape)


def _decode_powersgd(p: Packed, dtype: np.dtype) -> np.ndarray:
    _meta(p)
    if len(p.shape) < 2:
        raise _bad(f"codec 'powersgd' needs a tensor of 2 or more dimensions, got shape {list(p.shape)}")
    n = p.shape[0]
    m = p.numel // n if n else 0
    left, right = _arrays(p, 2)
    if left.ndim != 2 or right.ndim != 2:
        raise _bad(f"codec 'powersgd': P and Q must be matrices, got {list(left.shape)} and {list(right.shape)}")
    rank = left.shape[1]
    if not 1 <= rank < min(n, m):
        raise _bad(f"codec 'powersgd': rank {rank} must be in [1, {min(n, m)}) for a [{n}, {m}] matrix")
    _expect(p, "P", left, FLOAT_DTYPES, (n, rank))
    _expect(p, "Q", right, FLOAT_DTYPES, (m, rank))
    ct = np.result_type(left.dtype, right.dtype, np.float32)
    return (left.astype(ct, copy=False) @ right.astype(ct, copy=False).T).reshape(p.shape).astype(dtype, copy=False)


_DECODERS: dict[str, Callable[[Packed, np.dtype], np.ndarray]] = {
    "bf16": _decode_bf16,
    "qsgd": _decode_qsgd,
    "sign": _decode_sign,
    "powersgd": _decode_powersgd,
}


# -- bit packing -----------------------------------------------------------------------------------


def _pack_bits(codes: np.ndarray, width: int) -> np.ndarray:
    """Unsigned ``codes`` (each below ``2**width``) as ``width`` bits each, least significant first.

    That is ``ceil(n * width / 8)`` bytes, the last one padded with zero bits.
    """
    bits = np.empty((codes.size, width), dtype=np.uint8)
    for j in range(width):
        bits[:, j] = (codes >> j) & 1
    return np.packbits(bits.reshape(-1), bitorder="little")


def _unpack_bits(stream: np.ndarray, count: int, width: int) -> np.ndarray:
    bits = np.unpackbits(stream, count=count * width, bitorder="little").reshape(count, width)
    codes = np.zeros(count, dtype=np.uint32)
    for j in range(width):
        codes |= bits[:, j].astype(np.uint32) << np.uint32(j)
    return codes


def _qsgd_bytes(numel: int, bits: int) -> int:
    return -(-numel * (bits + 1) // 8)


# -- the family ------------------------------------------------------------------------------------


def _k_for(fraction: float, numel: int) -> int:
    return min(numel, max(1, math.ceil(fraction * numel)))


def _check_fraction(fraction: float) -> float:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"compression must be a fraction in (0, 1], got {fraction}")
    return fraction


def _check_int(what: str, value: int, low: int, high: int | None = None) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low or (
            high is not None and value > high):
        raise ValueError(f"{what} must be an integer in [{low}, {high if high is not None else 'inf'}], got {value!r}")
    return int(value)




class Cast16:
    """Rounds each coordinate to a 16-bit float: ``fp16`` (IEEE half) or ``bf16`` (bfloat16).

    ``fp16`` sends a dense float16 array, ``2 * numel`` bytes. The relative error is at most
    ``2**-11`` for magnitudes in half's normal range ``[2**-14, 65504]``; smaller ones lose
    precision (subnormals, then zero) and finite larger ones saturate to +-65504 rather than
    becoming Inf (which the PS would refuse); NaN and Inf stay as they are.

    ``bf16`` sends ``Packed("bf16", shape, {}, (bits,))`` where ``bits`` (uint16, ``numel``) are
    the upper 16 bits of each float32 value rounded to nearest, ties to even: ``2 * numel``
    bytes. bfloat16 keeps float32's range; the relative error is at most ``2**-8`` for float32
    normal magnitudes. NaN stays NaN (quiet), Inf stays Inf; a float64 update is first rounded
    to float32.
    """

    name: str

    def __init__(self, kind: str = "fp16") -> None:
        if kind not in ("fp16", "bf16"):
            raise ValueError(f"Cast16 kind must be 'fp16' or 'bf16', got {kind!r}")
        self.name = kind

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        x = np.asarray(update)
        if self.name == "fp16":
            return np.where(np.isfinite(x), np.clip(x, -_FP16_MAX, _FP16_MAX), x).astype(np.float16)
        return Packed("bf16", tuple(x.shape), {}, (bf16_bits(x.reshape(-1)),))


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns (uint16) of ``x`` rounded to float32, then to nearest even in 8 significant bits."""
    f = np.asarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(np.isnan(f), quiet_nan, rounded).astype(np.uint16)


class TopK:
    """Per tensor, the exact top ``fraction`` of coordinates by magnitude, as a Sparse; no residual.

    Sends the ``k = min(numel, max(1, ceil(fraction * numel)))`` largest ``|x_i|`` exactly, except
    exact zeros (they change nothing), so ``nnz = min(k, count_nonzero(x))``. On the wire:
    ``4 * max(1, ceil(numel / 65536)) + (2 + itemsize) * nnz`` bytes (6 per sent float32
    coordinate). Biased; :func:`make_compressor` wraps it in :class:`ErrorFeedback` by default,
    which makes it AdaComp's :class:`TopKResidual`.
    """

    name = "topk"

    def __init__(self, fraction: float = 0.01) -> None:
        self.fraction = _check_fraction(fraction)

    def k_for(self, numel: int) -> int:
        return _k_for(self.fraction, numel)

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        flat = np.asarray(update).reshape(-1)
        chosen = largest_magnitudes(flat, self.k_for(flat.size))
        return Sparse(indices=chosen, values=flat[chosen], shape=tuple(update.shape))


class RandomK:
    """Per tensor, ``k = min(numel, max(1, ceil(fraction * numel)))`` coordinates drawn uniformly without replacement.

    Sent as a Sparse of exactly ``k`` values: ``4 * max(1, ceil(numel / 65536)) + (2 + itemsize)
    * k`` bytes. With ``unbiased=True`` (the default) the values are scaled by ``numel / k``, so
    the expectation of the decoded tensor is the update; its variance is ``x_i**2 * (numel / k -
    1)`` per coordinate. Error feedback needs the unscaled values (``unbiased=False``, a
    contraction: scaled ones make the residual grow by about ``numel / k - 1`` in squared norm
    per step), which is what :func:`make_compressor` builds when it adds error feedback. The
    coordinates come from one generator seeded with ``seed``, advanced at each call.
    """

    name = "randomk"

    def __init__(self, fraction: float = 0.01, seed: int = 0, *, unbiased: bool = True) -> None:
        self.fraction = _check_fraction(fraction)
        self.unbiased = unbiased
        self.rng = np.random.default_rng(seed)

    def k_for(self, numel: int) -> int:
        return _k_for(self.fraction, numel)

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


class QSGD:
    """Stochastic uniform quantisation (Alistarh et al., NeurIPS 2017), unbiased.

    With ``s = 2**bits - 1`` levels and ``norm = ||x||_2`` (rounded to float32, sent in meta),
    each coordinate becomes ``sign(x_i) * norm * l_i / s`` where ``l_i`` is ``floor(r_i)`` or
    ``floor(r_i) + 1`` for ``r_i = s * |x_i| / norm``, the latter with probability ``r_i -
    floor(r_i)``: so ``E[l_i] = r_i`` and the decoded tensor is the update in expectation, with a
    per-coordinate variance ``(norm / s)**2 * p_i * (1 - p_i) <= (norm / s)**2 / 4``. Each
    coordinate is ``bits + 1`` bits (the level, then the sign bit set for ``x_i < 0``), packed
    least significant bit first into ``Packed("qsgd", shape, {"bits", "norm"}, (uint8 codes,))``:
    ``ceil(numel * (bits + 1) / 8)`` bytes. The decoder computes ``l_i * (norm / s)`` in float64.
    An update holding NaN or Inf is sent dense, for the PS to refuse as not finite.
    """

    name = "qsgd"

    def __init__(self, bits: int = 8, seed: int = 0) -> None:
        self.bits = _check_int("bits", bits, 1, 16)
        self.levels = (1 << self.bits) - 1
        self.rng = np.random.default_rng(seed)

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        x = np.asarray(update)
        magnitude = np.abs(x.reshape(-1)).astype(np.float64)
        with np.errstate(over="ignore"):
            norm = np.float32(math.sqrt(float(np.dot(magnitude, magnitude))))
        if not np.isfinite(norm):
            return x
        uniform = self.rng.random(magnitude.size)
        if norm > 0:
            r = np.minimum(magnitude * (self.levels / float(norm)), self.levels)
            low = np.floor(r)
            level = (low + (uniform < r - low)).astype(np.uint32)
        else:
            level = np.zeros(magnitude.size, dtype=np.uint32)
        codes = level | ((x.reshape(-1) < 0).astype(np.uint32) << np.uint32(self.bits))
        return Packed("qsgd", tuple(x.shape), {"bits": self.bits, "norm": float(norm)},
                      (_pack_bits(codes, self.bits + 1),))


class Sign:
    """One bit per coordinate and one scale (signSGD with error feedback, Karimireddy et al., ICML 2019).

    Sends ``Packed("sign", shape, {"scale": mean(|x|)}, (bits,))``: ``bits`` is
    ``np.packbits(x < 0, bitorder="little")``, ``ceil(numel / 8)`` bytes, and the scale (float32,
    in meta) is the mean magnitude, so each coordinate decodes to ``-scale`` where its bit is set
    and ``+scale`` otherwise (zero included). Biased: meant for :class:`ErrorFeedback`, where it
    is a contraction (``||x - decoded||**2 = ||x||**2 - numel * scale**2``). An update holding NaN
    or Inf is sent dense, for the PS to refuse as not finite.
    """

    name = "sign"

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        x = np.asarray(update)
        flat = x.reshape(-1)
        with np.errstate(over="ignore"):
            scale = np.float32(np.mean(np.abs(flat), dtype=np.float64)) if flat.size else np.float32(0)
        if not np.isfinite(scale):
            return x
        return Packed("sign", tuple(x.shape), {"scale": float(scale)},
                      (np.packbits(flat < 0, bitorder="little"),))


class PowerSGD:
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
    dense: ``itemsize * numel`` bytes. Biased; meant for :class:`ErrorFeedback`.
    """

    name = "powersgd"

    def __init__(self, rank: int = 4, seed: int = 0) -> None:
        self.rank = _check_int("rank", rank, 1)
        self.seed = seed
        self.q: dict[str, np.ndarray] = {}

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        x = np.asarray(update)
        if x.ndim < 2:
            return x
        n = x.shape[0]
        m = x.size // n if n else 0
        r = self.rank
        if r * (n + m) >= n * m:
            return x
        ct = np.result_type(x.dtype, np.float32)
        matrix = x.reshape(n, m).astype(ct, copy=False)
        if not np.isfinite(matrix).all():
            return x
        q = self.q.get(key)
        if q is None or q.shape != (m, r) or q.dtype != ct or not np.isfinite(q).all():
            rng = np.random.default_rng([self.seed, zlib.crc32(key.encode())])
            q = rng.standard_normal((m, r)).astype(ct)
        p, _ = np.linalg.qr(matrix @ q)
        q = matrix.T @ p
        self.q[key] = q
        return Packed("powersgd", tuple(x.shape), {}, (np.ascontiguousarray(p), q))


class ErrorFeedback:
    """Error feedback around a compressor: what it does not send now is added to the next update.

    Per key it encodes ``v = update + residual`` with ``inner`` and keeps ``residual = v -
    decode(sent)``, both computed in the update's float dtype (float32 at least), so that
    ``decode(sent) + residual`` is ``v``: exactly for codecs whose decoded values are either
    copied from ``v`` or zero (topk, randomk unscaled) or within a factor 2 of them (fp16, bf16,
    by Sterbenz's lemma), and to within the rounding of that one subtraction (``2**-24 *
    |residual|`` in float32) for the others. Nothing is lost, only delayed. The inner compressor
    should be a contraction (``||v - decoded|| < ||v||``: topk, unscaled randomk, sign, powersgd,
    the casts); with an unbiased high-variance one (scaled randomk, qsgd with few bits on a large
    tensor) the residual can grow without bound. Wire sizes are the inner compressor's.
    """

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner
        self.name = inner.name
        # the staleness compensation keeps the residual in the worker's model, except powersgd's: measured, its
        # workers then drift along the directions outside its rank and the central model lags (docs/momentum.md)
        self.local_residual = not isinstance(inner, PowerSGD)
        self.residuals: dict[str, np.ndarray] = {}

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        update = np.asarray(update)
        v = update.astype(np.result_type(update.dtype, np.float32), copy=True)
        residual = self.residuals.get(key)
        if residual is not None and residual.shape == v.shape:
            v += residual
        sent = self.inner.encode(key, v)
        decoded = decode(sent, v.dtype, shape=v.shape)
        if isinstance(decoded, Sparse):
            left = v.reshape(-1).copy()
            left[decoded.indices] -= decoded.values
            self.residuals[key] = left.reshape(v.shape)
        else:
            self.residuals[key] = v - decoded
        return sent

    def pending(self, key: str) -> np.ndarray | None:
        """What is kept of ``key`` for a later push, or None before its first."""
        return self.residuals.get(key)


COMPRESSORS: dict[str, Callable[..., Compressor]] = {
    "none": NoCompression,
    "fp16": functools.partial(Cast16, "fp16"),
    "bf16": functools.partial(Cast16, "bf16"),
    "topk": TopK,
    "randomk": RandomK,
    "qsgd": QSGD,
    "sign": Sign,
    "powersgd": PowerSGD,
}
ERROR_FEEDBACK_BY_DEFAULT = frozenset({"sign", "topk", "randomk", "powersgd"})


def make_compressor(name: str, *, fraction: float = 0.01, bits: int = 8, rank: int = 4,
                    error_feedback: bool | None = None, seed: int = 0) -> Compressor:
    """The compressor called ``name`` (a key of :data:`COMPRESSORS`), with the parameters it takes.

    ``error_feedback`` wraps it in :class:`ErrorFeedback`; left at None it is on for the biased
    ones (sign, topk, randomk, powersgd) and off for the others (none, fp16, bf16, qsgd). With
    error feedback, randomk sends its values unscaled (see :class:`RandomK`).
    """
    factory = COMPRESSORS.get(name)
    if factory is None:
        raise ValueError(f"unknown compressor {name!r}; choose one of: {', '.join(COMPRESSORS)}")
    ef = name in ERROR_FEEDBACK_BY_DEFAULT if error_feedback is None else bool(error_feedback)
    offered = {"fraction": fraction, "bits": bits, "rank": rank, "seed": seed, "unbiased": not ef}
    accepted = inspect.signature(factory).parameters
    compressor = factory(**{k: v for k, v in offered.items() if k in accepted})
    return ErrorFeedback(compressor) if ef else compressor
