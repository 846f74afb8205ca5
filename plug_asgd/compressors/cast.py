"""Casts: every coordinate sent, rounded to a 16-bit float."""

from __future__ import annotations

import math

import numpy as np
from typing_extensions import override

from plug_asgd.compressors.base import Codec
from plug_asgd.compressors.checks import check_meta, expect, packed_arrays
from plug_asgd.compressors.sparse import FP16_MAX
from plug_asgd.protocol.wire import Packed, Tensor


class FP16(Codec):
    """Rounds each coordinate to an IEEE half and sends a dense float16 array: ``2 * numel`` bytes.

    The relative error is at most ``2**-11`` for magnitudes in half's normal range ``[2**-14,
    65504]``; smaller ones lose precision (subnormals, then zero) and finite larger ones saturate to
    +-65504 rather than becoming Inf (which the PS would refuse); NaN and Inf stay as they are.

    Args:
        error_feedback: whether a worker keeps what the rounding loses for its next push (off by default).

    Example:
        >>> import numpy as np
        >>> from plug_asgd import FP16
        >>> sent = FP16().encode("w", np.array([0.5, 1 / 3, 1e6], dtype=np.float32))
        >>> sent.dtype, sent.tolist()  # 1e6 saturates at half's largest finite value
        (dtype('float16'), [0.5, 0.333251953125, 65504.0])
    """

    name = "fp16"
    sends = "dense float16 (finite values saturate at +-65504)"
    wire_formula = "2 * numel"

    @override
    def encode(self, key: str, update: np.ndarray) -> Tensor:
        x = np.asarray(update)
        return np.where(np.isfinite(x), np.clip(x, -FP16_MAX, FP16_MAX), x).astype(np.float16)

    @override
    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        return 2 * math.prod(shape)


class BF16(Codec):
    """Rounds each coordinate to bfloat16: ``Packed("bf16", shape, {}, (bits,))``, ``2 * numel`` bytes.

    ``bits`` (uint16, ``numel``) are the upper 16 bits of each float32 value rounded to nearest,
    ties to even. bfloat16 keeps float32's range; the relative error is at most ``2**-8`` for float32
    normal magnitudes. NaN stays NaN (quiet), Inf stays Inf; a float64 update is first rounded to float32.

    Args:
        error_feedback: whether a worker keeps what the rounding loses for its next push (off by default).

    Example:
        >>> import numpy as np
        >>> from plug_asgd import BF16
        >>> from plug_asgd.compressors import decode
        >>> sent = BF16().encode("w", np.array([0.5, 1 / 3, 1e6], dtype=np.float32))
        >>> sent.arrays[0], decode(sent, np.float32).tolist()  # 8 significant bits, float32's range
        (array([16128, 16043, 18804], dtype=uint16), [0.5, 0.333984375, 999424.0])
    """

    name = "bf16"
    sends = "Packed: bfloat16, each float32 rounded to nearest even"
    wire_formula = "2 * numel"

    @override
    def encode(self, key: str, update: np.ndarray) -> Tensor:
        x = np.asarray(update)
        return Packed("bf16", tuple(x.shape), {}, (bf16_bits(x.reshape(-1)),))

    @override
    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        return 2 * math.prod(shape)

    @classmethod
    @override
    def decode_packed(cls, packed: Packed, dtype: np.dtype) -> np.ndarray:
        check_meta(packed)
        (bits,) = packed_arrays(packed, 1)
        expect(packed, "the bits", bits, {"uint16"}, (packed.numel,))
        return (bits.astype(np.uint32) << 16).view(np.float32).reshape(packed.shape).astype(dtype, copy=False)

    @classmethod
    @override
    def slice_packed(cls, packed: Packed, start: int, stop: int) -> Packed:
        """One bit pattern per value: the slice of the patterns."""
        return Packed("bf16", (stop - start,), {}, (np.asarray(packed.arrays[0])[start:stop],))


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns (uint16) of ``x`` rounded to float32, then to nearest even in 8 significant bits.

    Args:
        x: the values, of any float dtype and shape (NaN becomes a quiet NaN's pattern).
    """
    f = np.asarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(np.isnan(f), quiet_nan, rounded).astype(np.uint16)
