"""How a reply's differences travel (``--downlink-codec``): cast to float16, or levels of 8 or 4 bits with one scale
per tensor.

The PS sends the difference between the central model and its copy of a worker's, and both add what it decodes to
(:mod:`plug_asgd.ps.downlink`, :meth:`~plug_asgd.worker.held_model.HeldModel.patch`): :func:`decode_difference` is
the one decoding both call, with the same float operations, so that the two copies stay equal bit for bit. The
levels are rounded to the nearest (not stochastically): what they leave out is in the copy's next difference, so
it is sent later rather than averaged away. ``int8`` and ``int4`` scale each tensor by its largest difference
(``scale = max |d| / (2**(bits-1) - 1)``), so a coordinate is off by at most ``scale / 2`` after a reply; sent as
``Packed("qdiff", shape, {"bits", "scale"}, (codes,))``, the codes signed bytes at 8 bits, and at 4 bits two to a
byte (``code + 8``, the first in the low half). Not a push codec: a PS refuses a push that carries one.
"""

from __future__ import annotations

import numpy as np

from plug_asgd.protocol.wire import Packed, Sparse, Tensor

CODECS = ("fp16", "int8", "int4")  # --downlink-codec's choices
QDIFF = "qdiff"
_BITS = {"int8": 8, "int4": 4}


def encode_difference(codec: str, diff: np.ndarray) -> Tensor:
    """``diff`` as codec ``codec`` sends it; in ``diff``'s own type where the codec cannot hold it (beyond
    float16's range, or not finite).

    Args:
        codec: one of :data:`CODECS`.
        diff: the difference to send, float32 or float64.

    Raises:
        ValueError: where ``codec`` is not one of :data:`CODECS`.
    """
    if codec == "fp16":
        with np.errstate(over="ignore"):
            cast = diff.astype(np.float16)
        return cast if np.isfinite(cast).all() else diff
    if codec not in _BITS:
        raise ValueError(f"downlink codec must be one of {list(CODECS)}, got {codec!r}")
    bits = _BITS[codec]
    top = (1 << (bits - 1)) - 1
    largest = np.abs(diff).max() if diff.size else 0
    scale = np.float32(largest) / np.float32(top)
    if not np.isfinite(scale) or scale == 0:
        return diff
    codes = np.clip(np.rint(diff / scale), -top, top).astype(np.int8)
    if bits == 4:
        low = (codes.reshape(-1) + 8).astype(np.uint8)
        if low.size % 2:
            low = np.append(low, np.uint8(8))  # a code of 0
        codes = low[0::2] | (low[1::2] << 4)
    return Packed(QDIFF, diff.shape, {"bits": bits, "scale": float(scale)}, (codes,))


def decode_difference(part: Tensor, dtype: np.dtype) -> np.ndarray:
    """What ``part`` (from :func:`encode_difference`) adds to a copy of type ``dtype``.

    Args:
        part: a reply's difference: a dense array, or a ``qdiff`` :class:`Packed`.
        dtype: the copy's type.

    Raises:
        ValueError: where ``part`` is sparse, a Packed tensor of another codec, or its bits, scale or codes are
            not what :func:`encode_difference` makes.
    """
    if isinstance(part, Sparse):
        raise ValueError("a difference comes dense or coded, not sparse")
    if not isinstance(part, Packed):
        return np.asarray(part).astype(dtype, copy=False)
    bits, scale = part.meta.get("bits"), part.meta.get("scale")
    codes = part.arrays[0] if len(part.arrays) == 1 else None
    if part.codec != QDIFF or bits not in (4, 8) or not isinstance(scale, float) or codes is None:
        raise ValueError(f"not a difference this client reads: {part.codec!r} with {part.meta}")
    if bits == 8 and codes.dtype == np.int8 and codes.size == part.numel:
        levels = codes
    elif bits == 4 and codes.dtype == np.uint8 and codes.size == (part.numel + 1) // 2:
        levels = np.empty(codes.size * 2, np.int8)
        levels[0::2] = (codes & 15).astype(np.int8) - 8
        levels[1::2] = (codes >> 4).astype(np.int8) - 8
        levels = levels[:part.numel]
    else:
        raise ValueError(f"a {bits}-bit difference of {part.numel} values with codes {codes.dtype}[{codes.size}]")
    return (levels.astype(np.float32) * np.float32(scale)).reshape(part.shape).astype(dtype, copy=False)
