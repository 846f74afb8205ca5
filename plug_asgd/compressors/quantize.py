"""Quantisers: every coordinate sent in a few bits, with one scale per tensor."""

from __future__ import annotations

import math

import numpy as np

from plug_asgd.compressors.base import (
    Codec,
    check_int,
    check_meta,
    expect,
    meta_int,
    meta_scale,
    packed_arrays,
)
from plug_asgd.wire import Packed, Tensor


class QSGD(Codec):
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
    sends = "Packed: `bits`-bit stochastic levels and signs, the norm in the header (Alistarh et al. 2017); unbiased"
    wire_formula = "ceil(numel * (bits + 1) / 8)"
    independent_keys = False  # one random generator rounds every tensor, in order

    def __init__(self, bits: int = 8, seed: int = 0, *, error_feedback: bool | None = None) -> None:
        super().__init__(error_feedback=error_feedback)
        self.bits = check_int("bits", bits, 1, 16)
        self.seed = seed
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
                      (pack_bits(codes, self.bits + 1),))

    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        return qsgd_bytes(math.prod(shape), self.bits)

    @classmethod
    def decode_packed(cls, packed: Packed, dtype: np.dtype) -> np.ndarray:
        check_meta(packed, "bits", "norm")
        bits = meta_int(packed, "bits", 1, 16)
        norm = meta_scale(packed, "norm")
        (stream,) = packed_arrays(packed, 1)
        expect(packed, "the codes", stream, {"uint8"}, (qsgd_bytes(packed.numel, bits),))
        codes = unpack_bits(stream, packed.numel, bits + 1)
        magnitude = (codes & ((1 << bits) - 1)) * (norm / ((1 << bits) - 1))
        return np.where(codes >> bits, -magnitude, magnitude).reshape(packed.shape).astype(dtype)

    @classmethod
    def slice_packed(cls, packed: Packed, start: int, stop: int) -> Packed:
        """The slice's codes, packed again, with the whole tensor's norm: each decodes as it would whole."""
        width = int(packed.meta["bits"]) + 1
        codes = unpack_bits(np.asarray(packed.arrays[0]), packed.numel, width)[start:stop]
        return Packed("qsgd", (stop - start,), dict(packed.meta), (pack_bits(codes, width),))


class Sign(Codec):
    """One bit per coordinate and one scale (signSGD with error feedback, Karimireddy et al., ICML 2019).

    Sends ``Packed("sign", shape, {"scale": mean(|x|)}, (bits,))``: ``bits`` is
    ``np.packbits(x < 0, bitorder="little")``, ``ceil(numel / 8)`` bytes, and the scale (float32,
    in meta) is the mean magnitude, so each coordinate decodes to ``-scale`` where its bit is set
    and ``+scale`` otherwise (zero included). Biased: error feedback is on by default, where it is a
    contraction (``||x - decoded||**2 = ||x||**2 - numel * scale**2``). An update holding NaN or Inf
    is sent dense, for the PS to refuse as not finite.
    """

    name = "sign"
    sends = "Packed: one sign bit per coordinate, the mean magnitude in the header"
    wire_formula = "ceil(numel / 8)"
    error_feedback_by_default = True

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        x = np.asarray(update)
        flat = x.reshape(-1)
        with np.errstate(over="ignore"):
            scale = np.float32(np.mean(np.abs(flat), dtype=np.float64)) if flat.size else np.float32(0)
        if not np.isfinite(scale):
            return x
        return Packed("sign", tuple(x.shape), {"scale": float(scale)},
                      (np.packbits(flat < 0, bitorder="little"),))

    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        return -(-math.prod(shape) // 8)

    @classmethod
    def decode_packed(cls, packed: Packed, dtype: np.dtype) -> np.ndarray:
        check_meta(packed, "scale")
        scale = meta_scale(packed, "scale")
        (bits,) = packed_arrays(packed, 1)
        expect(packed, "the signs", bits, {"uint8"}, (-(-packed.numel // 8),))
        negative = np.unpackbits(bits, count=packed.numel, bitorder="little").astype(bool)
        value = dtype.type(scale)
        return np.where(negative, -value, value).astype(dtype, copy=False).reshape(packed.shape)

    @classmethod
    def slice_packed(cls, packed: Packed, start: int, stop: int) -> Packed:
        """The slice's sign bits, packed again, with the whole tensor's scale: each decodes as it would whole."""
        negative = np.unpackbits(np.asarray(packed.arrays[0]), count=packed.numel, bitorder="little")[start:stop]
        return Packed("sign", (stop - start,), dict(packed.meta), (np.packbits(negative, bitorder="little"),))


def pack_bits(codes: np.ndarray, width: int) -> np.ndarray:
    """Unsigned ``codes`` (each below ``2**width``) as ``width`` bits each, least significant first.

    That is ``ceil(n * width / 8)`` bytes, the last one padded with zero bits.
    """
    bits = np.empty((codes.size, width), dtype=np.uint8)
    for j in range(width):
        bits[:, j] = (codes >> j) & 1
    return np.packbits(bits.reshape(-1), bitorder="little")


def unpack_bits(stream: np.ndarray, count: int, width: int) -> np.ndarray:
    bits = np.unpackbits(stream, count=count * width, bitorder="little").reshape(count, width)
    codes = np.zeros(count, dtype=np.uint32)
    for j in range(width):
        codes |= bits[:, j].astype(np.uint32) << np.uint32(j)
    return codes


def qsgd_bytes(numel: int, bits: int) -> int:
    return -(-numel * (bits + 1) // 8)
