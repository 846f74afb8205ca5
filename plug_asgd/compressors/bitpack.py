"""The bit layouts of the quantisers' streams: qsgd's levels of 1 to 16 bits, and what a tensor's frames hold."""

from __future__ import annotations

import numpy as np


def pack_levels(levels: np.ndarray, bits: int) -> np.ndarray:
    """Levels below ``2**bits``, ``bits`` each: the bytes of 8-bit levels and the words of 16-bit ones as they
    are, else packed least significant bit first (``ceil(n * bits / 8)`` bytes, the last padded with zeros).

    Args:
        levels: the levels, unsigned integers.
        bits: the bits of each level, 1 to 16.
    """
    if bits == 8:
        return levels.astype(np.uint8, copy=False)
    if bits == 16:
        return levels.astype(np.uint16, copy=False)
    return pack_bits(levels.astype(np.uint32), bits)


def unpack_levels(stream: np.ndarray, count: int, bits: int) -> np.ndarray:
    """The levels :func:`pack_levels` packed.

    Args:
        stream: what :func:`pack_levels` returned.
        count: how many levels it holds.
        bits: the bits of each level, 1 to 16.
    """
    if bits in (8, 16):
        return stream
    return unpack_bits(stream, count, bits)


def pack_bits(codes: np.ndarray, width: int) -> np.ndarray:
    """Unsigned ``codes`` (each below ``2**width``) as ``width`` bits each, least significant first.

    That is ``ceil(n * width / 8)`` bytes, the last one padded with zero bits.

    Args:
        codes: the codes, unsigned integers.
        width: the bits of each code.
    """
    bits = np.empty((codes.size, width), dtype=np.uint8)
    for j in range(width):
        bits[:, j] = (codes >> j) & 1
    return np.packbits(bits.reshape(-1), bitorder="little")


def unpack_bits(stream: np.ndarray, count: int, width: int) -> np.ndarray:
    """The uint32 codes :func:`pack_bits` packed.

    Args:
        stream: what :func:`pack_bits` returned (uint8).
        count: how many codes it holds.
        width: the bits of each code.
    """
    bits = np.unpackbits(stream, count=count * width, bitorder="little").reshape(count, width)
    codes = np.zeros(count, dtype=np.uint32)
    for j in range(width):
        codes |= bits[:, j].astype(np.uint32) << np.uint32(j)
    return codes


def qsgd_bytes(numel: int, bits: int) -> int:
    """The frame bytes of a tensor of ``numel`` values that :class:`QSGD` sends: its levels, then its sign bits.

    Args:
        numel: the tensor's values.
        bits: the bits of each level.
    """
    return -(-numel * bits // 8) + -(-numel // 8)
