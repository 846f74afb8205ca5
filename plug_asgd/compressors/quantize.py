"""Quantisers: every coordinate sent in a few bits, with one scale per tensor."""

from __future__ import annotations

import math

import numpy as np
from typing_extensions import override

from plug_asgd.compressors import fused, native
from plug_asgd.compressors.base import Codec
from plug_asgd.compressors.bitpack import pack_levels, qsgd_bytes, unpack_levels
from plug_asgd.compressors.checks import check_int, check_meta, expect, meta_int, meta_scale, packed_arrays
from plug_asgd.compressors.difference import Scratch, chunks, difference, scratch
from plug_asgd.protocol.wire import Packed, Tensor


class QSGD(Codec):
    """Stochastic uniform quantisation (Alistarh et al., NeurIPS 2017), unbiased.

    With ``s = 2**bits - 1`` levels and ``norm = ||x||_2`` (the float32 squares summed in float64 by
    :func:`lane_sum`'s rule, rounded to float32, sent in meta), each coordinate becomes ``sign(x_i) * norm * l_i /
    s`` where ``l_i`` is ``floor(r_i)`` or ``floor(r_i) + 1`` for ``r_i = min(s * |x_i| / norm, s)`` (in float32),
    the latter where the coordinate's draw ``u_i`` (:func:`draws`) is below ``r_i - floor(r_i)``: so ``E[l_i] =
    r_i`` (to ``2**-24``) and the decoded tensor is the update in expectation, with a per-coordinate variance
    ``(norm / s)**2 * p_i * (1 - p_i) <= (norm / s)**2 / 4``. The draws are a hash of the coordinate's index
    and two keys the codec's generator draws per tensor: one pass of C computes them where it can (:mod:`.native`),
    numpy the same bits elsewhere. Sent as
    ``Packed("qsgd", shape, {"bits", "norm"}, (levels, signs))``: the levels at ``bits`` bits each (bytes
    as they are for 8 bits, 16-bit words for 16, least significant first otherwise), ``ceil(numel * bits /
    8)`` bytes, and one sign bit per coordinate (set for ``x_i < 0``), ``ceil(numel / 8)`` bytes. The decoder
    computes ``l_i * (norm / s)`` in float64. An update holding NaN or Inf is sent dense, for the PS to
    refuse as not finite.

    Args:
        bits: the bits of each level, 1 to 16 (``2**bits - 1`` levels above zero).
        seed: seeds the one generator that rounds every tensor, in order; a worker's encoder adds its rank.
        error_feedback: whether a worker keeps what the rounding leaves for its next push (off by default: the
            rounding is unbiased).

    Example:
        >>> import numpy as np
        >>> from plug_asgd import QSGD
        >>> from plug_asgd.compressors import decode
        >>> sent = QSGD(bits=4).encode("w", np.array([3.0, -4.0, 0.0, 0.0], dtype=np.float32))
        >>> sent.meta, decode(sent, np.float32)  # 3 and 4 are levels 9 and 12 of 15 of the norm 5: exact
        ({'bits': 4, 'norm': 5.0}, array([ 3., -4.,  0.,  0.], dtype=float32))
        >>> QSGD(bits=4).wire_bytes((4,))  # 4 levels of 4 bits, 4 sign bits
        3
    """

    name = "qsgd"
    sends = ("Packed: `bits`-bit stochastic levels and a sign bit each, the norm in the header "
             "(Alistarh et al. 2017); unbiased")
    wire_formula = "ceil(numel * bits / 8) + ceil(numel / 8)"
    independent_keys = False  # one random generator rounds every tensor, in order

    def __init__(self, bits: int = 8, seed: int = 0, *, error_feedback: bool | None = None) -> None:
        super().__init__(error_feedback=error_feedback)
        self.bits = check_int("bits", bits, 1, 16)
        self.seed = seed
        self.levels = (1 << self.bits) - 1
        self.rng = np.random.default_rng(seed)

    @override
    def encode(self, key: str, update: np.ndarray) -> Tensor:
        x = np.asarray(update)
        return self._encode(x.reshape(-1), None, 1.0, tuple(x.shape), x)

    @override
    def encode_difference(self, key: str, w: np.ndarray, c: np.ndarray, scale: float = 1.0) -> Tensor:
        """``encode(key, scale * (w - c))`` chunk by chunk: the difference is made twice (for the norm, then for
        the levels) and never whole."""
        return self._encode(w.reshape(-1), c.reshape(-1), scale, tuple(w.shape), None)

    def _encode(self, w: np.ndarray, c: np.ndarray | None, scale: float, shape: tuple[int, ...],
                whole: np.ndarray | None) -> Tensor:
        """The levels and signs of ``x = scale * (w - c)`` (``w`` itself where ``c`` is None)."""
        keys = (int(self.rng.integers(1 << 32, dtype=np.uint64)), int(self.rng.integers(1 << 32, dtype=np.uint64)))
        squares = native.square_sum(w, c, scale)
        if squares is None:
            squares = lane_sum(w, c, scale, np.square)
        with np.errstate(over="ignore"):
            norm = np.float32(math.sqrt(squares))
        if not np.isfinite(norm):
            if whole is not None:
                return whole
            return difference(np.empty(shape, dtype=w.dtype), w.reshape(shape), c.reshape(shape), scale)  # type: ignore[union-attr]
        ratio = np.float32(self.levels / float(norm)) if norm > 0 else np.float32(0)
        done = native.qsgd_encode(w, c, scale, float(ratio), self.levels, keys, self.bits > 8)
        if done is None:
            done = self.levels_of(w, c, scale, ratio, keys)
        levels, signs = done
        return Packed("qsgd", shape, {"bits": self.bits, "norm": float(norm)}, (pack_levels(levels, self.bits), signs))

    def levels_of(self, w: np.ndarray, c: np.ndarray | None, scale: float, ratio: np.float32,
                  keys: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The levels (bytes, or 16-bit words above 8 bits) and packed sign bits of ``x = scale * (w - c)``,
        chunk by chunk in numpy: the rule :func:`plug_asgd.compressors.native.qsgd_encode` follows in C.

        Args:
            w: the worker's values, flat.
            c: the central values it holds, flat, or None (``x`` is ``w``).
            scale: the factor of ``w - c``.
            ratio: the levels per unit of magnitude, ``2**bits - 1`` over the norm.
            keys: the tensor's two 32-bit keys of :func:`draws`.
        """
        arrays = scratch()
        levels = np.empty(w.size, dtype=np.uint8 if self.bits <= 8 else np.uint16)
        negative = np.empty(w.size, dtype=bool)
        for part in chunks(w.size):
            x = _chunk(arrays, w, c, part, scale)
            np.less(x, 0, out=negative[part])
            _, r, _ = arrays.get(x.size, np.float32)
            np.multiply(np.abs(x, out=r), ratio, out=r, casting="unsafe")
            np.minimum(r, np.float32(self.levels), out=r)
            low = np.floor(r)
            r -= low  # the chance of the upper level
            low += draws(part.start, part.stop, keys) < r
            levels[part] = low
        return levels, np.packbits(negative, bitorder="little")

    @override
    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        return qsgd_bytes(math.prod(shape), self.bits)

    @classmethod
    def _parts(cls, packed: Packed) -> tuple[int, float, np.ndarray, np.ndarray]:
        """The bits, the norm, the level stream and the sign bits of ``packed``, checked."""
        check_meta(packed, "bits", "norm")
        bits = meta_int(packed, "bits", 1, 16)
        norm = meta_scale(packed, "norm")
        stream, signs = packed_arrays(packed, 2)
        expect(packed, "the levels", stream, {"uint8"} if bits != 16 else {"uint16"},
               (-(-packed.numel * bits // 8) if bits != 16 else packed.numel,))
        expect(packed, "the signs", signs, {"uint8"}, (-(-packed.numel // 8),))
        return bits, norm, stream, signs

    @classmethod
    def add_decoded(cls, packed: Packed, central: np.ndarray, out: np.ndarray, again: np.ndarray) -> bool:
        """``out = again = decode(packed) + central`` with the PS's float32 addition, in one C pass that never
        writes the decoding whole (a worker's guess of an "own" reply); False, with nothing written, where that pass
        cannot be had (no C library, levels of other than 8 or 16 bits, arrays not flat contiguous float32).

        Args:
            packed: what qsgd sent for the tensor.
            central: the central values it is added to, flat.
            out: one array the sums go to, flat.
            again: another, flat.

        Raises:
            WireError: ``bad_payload``, where ``packed`` is not what qsgd sends.
        """
        bits, norm, stream, signs = cls._parts(packed)
        if bits not in (8, 16) or central.size != packed.numel:
            return False
        return fused.qsgd_add_twice(stream, signs, norm / ((1 << bits) - 1), central, out, again)

    @classmethod
    @override
    def fold_packed(cls, packed: Packed, central: np.ndarray, out: np.ndarray, scale: float) -> bool | None:
        bits, norm, stream, signs = cls._parts(packed)
        if bits not in (8, 16) or central.size != packed.numel or not fused.contiguous(central, out):
            return None
        return fused.qsgd_add_finite(stream, signs, norm / ((1 << bits) - 1), central.reshape(-1),
                                     out.reshape(-1), scale)

    @classmethod
    @override
    def decode_packed(cls, packed: Packed, dtype: np.dtype) -> np.ndarray:
        bits, norm, stream, signs = cls._parts(packed)
        # the level with its sign, in integers (exact), then scaled in float64: -(l * q) is (-l) * q, bit for bit,
        # without np.where's branch per coordinate; in one C loop where it can (the same operations)
        if dtype == np.float32 and bits in (8, 16):
            done = native.qsgd_decode(stream, signs, packed.numel, norm / ((1 << bits) - 1))
            if done is not None:
                return done.reshape(packed.shape)
        sign = 1 - 2 * np.unpackbits(signs, count=packed.numel, bitorder="little").view(np.int8)
        signed = np.multiply(unpack_levels(stream, packed.numel, bits), sign, dtype=np.int32)
        return (signed * (norm / ((1 << bits) - 1))).reshape(packed.shape).astype(dtype)

    @classmethod
    @override
    def slice_packed(cls, packed: Packed, start: int, stop: int) -> Packed:
        """The slice's levels and signs, packed again, with the whole tensor's norm: each decodes as it would whole."""
        bits = int(packed.meta["bits"])
        levels = unpack_levels(np.asarray(packed.arrays[0]), packed.numel, bits)[start:stop]
        negative = np.unpackbits(np.asarray(packed.arrays[1]), count=packed.numel, bitorder="little")[start:stop]
        return Packed("qsgd", (stop - start,), dict(packed.meta),
                      (pack_levels(levels, bits), np.packbits(negative, bitorder="little")))


class Sign(Codec):
    """One bit per coordinate and one scale (signSGD with error feedback, Karimireddy et al., ICML 2019).

    Sends ``Packed("sign", shape, {"scale": mean(|x|)}, (bits,))``: ``bits`` is
    ``np.packbits(x < 0, bitorder="little")``, ``ceil(numel / 8)`` bytes, and the scale (float32, in meta) is
    the mean magnitude (summed in float64 by :func:`lane_sum`'s rule, in one pass of C with the bits where it can),
    so each coordinate decodes to ``-scale`` where its bit is set and ``+scale`` otherwise (zero included).
    Biased: error feedback is on by default, where it is a contraction (``||x - decoded||**2 = ||x||**2 - numel *
    scale**2``). An update holding NaN or Inf is sent dense, for the PS to refuse as not finite.

    Args:
        error_feedback: whether a worker keeps what the signs leave for its next push; None: on.

    Example:
        >>> import numpy as np
        >>> from plug_asgd import Sign
        >>> from plug_asgd.compressors import decode
        >>> sent = Sign().encode("w", np.array([0.5, -2.0, 0.25, 1.0], dtype=np.float32))
        >>> sent.meta, decode(sent, np.float32)  # each value becomes +-mean(|x|)
        ({'scale': 0.9375}, array([ 0.9375, -0.9375,  0.9375,  0.9375], dtype=float32))
    """

    name = "sign"
    sends = "Packed: one sign bit per coordinate, the mean magnitude in the header"
    wire_formula = "ceil(numel / 8)"
    error_feedback_by_default = True

    @override
    def encode(self, key: str, update: np.ndarray) -> Tensor:
        x = np.asarray(update)
        return self._encode(x.reshape(-1), None, 1.0, tuple(x.shape), x)

    @override
    def encode_difference(self, key: str, w: np.ndarray, c: np.ndarray, scale: float = 1.0) -> Tensor:
        """``encode(key, scale * (w - c))`` in one pass of chunks: the difference is never whole."""
        return self._encode(w.reshape(-1), c.reshape(-1), scale, tuple(w.shape), None)

    def _encode(self, w: np.ndarray, c: np.ndarray | None, scale: float, shape: tuple[int, ...],
                whole: np.ndarray | None) -> Tensor:
        done = native.sign_encode(w, c, scale)
        if done is None:
            signs = np.empty(-(-w.size // 8), dtype=np.uint8)
            arrays = scratch()
            for part in chunks(w.size):  # a chunk is a multiple of 8 values: its bits fill whole bytes
                negative = np.less(_chunk(arrays, w, c, part, scale), 0, out=arrays.get(part.stop - part.start,
                                                                                         w.dtype)[2])
                signs[part.start // 8:-(-part.stop // 8)] = np.packbits(negative, bitorder="little")
            done = signs, lane_sum(w, c, scale, np.abs)
        signs, total = done
        with np.errstate(over="ignore"):
            scale_ = np.float32(total / w.size) if w.size else np.float32(0)
        if not np.isfinite(scale_):
            if whole is not None:
                return whole
            return difference(np.empty(shape, dtype=w.dtype), w.reshape(shape), c.reshape(shape), scale)  # type: ignore[union-attr]
        return Packed("sign", shape, {"scale": float(scale_)}, (signs,))

    @override
    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        return -(-math.prod(shape) // 8)

    @classmethod
    def _parts(cls, packed: Packed) -> tuple[float, np.ndarray]:
        """The scale and the sign bits of ``packed``, checked."""
        check_meta(packed, "scale")
        scale = meta_scale(packed, "scale")
        (bits,) = packed_arrays(packed, 1)
        expect(packed, "the signs", bits, {"uint8"}, (-(-packed.numel // 8),))
        return scale, bits

    @classmethod
    @override
    def fold_packed(cls, packed: Packed, central: np.ndarray, out: np.ndarray, scale: float) -> bool | None:
        value, bits = cls._parts(packed)
        if central.size != packed.numel or not fused.contiguous(central, out):
            return None
        return fused.sign_add_finite(bits, value, central.reshape(-1), out.reshape(-1), scale)

    @classmethod
    @override
    def decode_packed(cls, packed: Packed, dtype: np.dtype) -> np.ndarray:
        scale, bits = cls._parts(packed)
        if dtype == np.float32:
            done = native.sign_decode(bits, packed.numel, scale)
            if done is not None:
                return done.reshape(packed.shape)
        negative = np.unpackbits(bits, count=packed.numel, bitorder="little")
        value = dtype.type(scale)
        # value - 2 * value where negative: -value, exactly (doubling and the difference are exact), without
        # np.where's branch per coordinate
        return (value - negative * (value + value)).astype(dtype, copy=False).reshape(packed.shape)

    @classmethod
    @override
    def slice_packed(cls, packed: Packed, start: int, stop: int) -> Packed:
        """The slice's sign bits, packed again, with the whole tensor's scale: each decodes as it would whole."""
        negative = np.unpackbits(np.asarray(packed.arrays[0]), count=packed.numel, bitorder="little")[start:stop]
        return Packed("sign", (stop - start,), dict(packed.meta), (np.packbits(negative, bitorder="little"),))


def _chunk(arrays: Scratch, w: np.ndarray, c: np.ndarray | None, part: slice, scale: float) -> np.ndarray:
    """``scale * (w - c)`` over ``part`` (``w``'s values where ``c`` is None), in this thread's scratch."""
    if c is None:
        return w[part]
    d, _, _ = arrays.get(part.stop - part.start, w.dtype)
    return difference(d, w[part], c[part], scale)


LANES = 8


def lane_sum(w: np.ndarray, c: np.ndarray | None, scale: float, of: np.ufunc) -> float:
    """The sum of ``of(x)`` (``x = scale * (w - c)``, ``w`` where ``c`` is None) in float64, by the rule the C
    loops follow too: eight lanes, lane ``i % 8`` adding coordinate ``i``'s value in order, the lanes then added
    0 to 7.

    Args:
        w: the worker's values, flat.
        c: the central values it holds, flat, or None.
        scale: the factor of ``w - c``.
        of: the ufunc each value is taken through before it is summed (``np.abs``, ``np.square``), in ``x``'s
            dtype.
    """
    arrays = scratch()
    lanes = np.zeros(LANES)
    for part in chunks(w.size):  # a chunk's start is a multiple of the lanes
        x = _chunk(arrays, w, c, part, scale)
        values = of(x, out=arrays.get(x.size, x.dtype)[1]).astype(np.float64)
        rows = np.concatenate([values, np.zeros(-values.size % LANES)]).reshape(-1, LANES)
        rows[0] += lanes
        lanes = np.add.reduce(rows, axis=0)  # along the outer axis: row after row, in order
    total = 0.0
    for lane in lanes.tolist():
        total += lane
    return total


def _mix32(x: np.ndarray) -> np.ndarray:
    """Wellons' lowbias32 hash of uint32 values (wrapping products), as ``kernels/quantize.c`` computes it."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def draws(start: int, stop: int, keys: tuple[int, int]) -> np.ndarray:
    """qsgd's uniform draws of coordinates ``start:stop`` (float32 in ``[0, 1)``): ``u_i = (h_i >> 8) / 2**24``,
    ``h_i = mix32(mix32(lo_i ^ k1) ^ (hi_i + k2))`` for the low and high 32 bits of ``i``. A hash of the index,
    not a stream: any coordinate's draw is had alone, so a pass in C and one in numpy chunks agree.

    Args:
        start: the first coordinate.
        stop: the coordinate after the last.
        keys: ``(k1, k2)``, the tensor's 32-bit keys.
    """
    index = np.arange(start, stop, dtype=np.uint64)
    low, high = index.astype(np.uint32), (index >> np.uint64(32)).astype(np.uint32)
    hashed = _mix32(_mix32(low ^ np.uint32(keys[0])) ^ (high + np.uint32(keys[1])))
    return (hashed >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
