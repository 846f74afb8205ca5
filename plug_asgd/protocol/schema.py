"""The wire's schema: what travels between workers and the PS (:class:`Message`, :class:`Sparse`,
:class:`Packed`, :class:`Local`), the dtypes that may, and the limits a receiver enforces.

:mod:`plug_asgd.protocol.wire` encodes and decodes them (and re-exports every name here). Imports nothing of plug_asgd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROTOCOL_VERSION = 1
BLOCK_BITS = 16
BLOCK_SIZE = 1 << BLOCK_BITS

# Dtypes a tensor frame may carry. Central model tensors are restricted further (floats only)
# by the parameter server; the rest serve collectives (metric counts, flags).
DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "bool")
}
FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})
# numpy computes ``dtype.name`` in Python (microseconds a call, several calls a tensor); a dict
# lookup of the dtype itself is what the per-message hot paths use instead.
DTYPE_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}

# Bounds on a packed tensor's header entry (the frames are bounded by Limits like any other).
PACKED_MAX_ARRAYS = 16
PACKED_MAX_META = 32
PACKED_MAX_NAME = 32  # characters of the codec name and of each meta key
PACKED_MAX_STR = 256  # characters of a string meta value
# Broadcasts inside the training loop (notices, plug_asgd/worker/notices.py): calls per batch, bytes per value.
NOTICE_KEYS = 64  # Lightning's own code makes one a batch (the Timer's)
NOTICE_BYTES = 4096  # a decision, not a payload
# The local steps per second a push may say (``rate``, async_diloco's dynamic local steps): one a day to a million.
RATE_RANGE = (1 / 86400, 1e6)
CODEC_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.+")


class WireError(ValueError):
    """A message that does not follow the protocol. ``code`` is a short machine-readable tag.

    Args:
        code: the short machine-readable tag (``"bad_field"``, ...) a peer or a test can match on.
        message: the human-readable explanation, the exception's text.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Limits:
    """Upper bounds a receiver enforces before it trusts a message.

    Attributes:
        max_header_bytes: the most bytes the JSON header frame may hold.
        max_frames: the most frames one message may have (the header included).
        max_message_bytes: the most bytes of all its frames together.
        max_ndim: the most dimensions a tensor's shape may have.
    """

    max_header_bytes: int = 1 << 20
    max_frames: int = 1 << 16
    max_message_bytes: int = 1 << 31
    max_ndim: int = 8


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Sparse:
    """A sparse tensor: ascending unique flat ``indices`` into a tensor of ``shape``, and ``values``.

    Attributes:
        indices: the flat positions of the stored elements, ascending and unique.
        values: the stored elements, one per index.
        shape: the shape of the dense tensor it stands for.
    """

    indices: np.ndarray
    values: np.ndarray
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements of the dense tensor it stands for."""
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        """Elements it stores (the nonzeros)."""
        return int(self.indices.size)

    def to_dense(self) -> np.ndarray:
        """The dense tensor of ``shape``: ``values`` at ``indices``, zeros elsewhere."""
        out = np.zeros(self.numel, dtype=self.values.dtype)
        out[self.indices] = self.values
        return out.reshape(self.shape)


@dataclass(frozen=True)
class Packed:
    """A tensor in a codec's own form: the wire carries it, :func:`plug_asgd.compressors.decode` reads it.

    ``codec`` names the codec (``"qsgd"``, ``"powersgd"``, ...), ``shape`` is the shape of the
    tensor it decodes to, ``meta`` holds small scalars (int, float or str; they travel in the
    header) and ``arrays`` the codec's arrays (each travels as one raw frame, with its dtype and
    shape in the header; the dtypes allowed are those of dense tensors).

    Attributes:
        codec: the codec's name, which picks the decoder.
        shape: the shape of the tensor it decodes to.
        meta: the codec's small scalars by name.
        arrays: the codec's arrays, in the order its decoder reads them.
    """

    codec: str
    shape: tuple[int, ...]
    meta: dict[str, int | float | str] = field(default_factory=dict)
    arrays: tuple[np.ndarray, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "meta", dict(self.meta))
        object.__setattr__(self, "arrays", tuple(self.arrays))

    @property
    def numel(self) -> int:
        """Elements of the tensor it decodes to."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of its frames on the wire."""
        return sum(int(np.asarray(a).nbytes) for a in self.arrays)


@dataclass(frozen=True)
class Local:
    """A dense tensor the receiver reads from the sender's shared segment: where it is, not its bytes.

    Attributes:
        offset: where its bytes start in the segment, in bytes.
        dtype: the dtype of its elements.
        shape: its shape.
    """

    offset: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes it spans in the segment."""
        return math.prod(self.shape) * self.dtype.itemsize


Tensor = np.ndarray | Sparse | Packed
LOCAL_MAX_OFFSET = 1 << 48


@dataclass
class Message:
    """A decoded message: its type, its header fields, and its tensors by name (in wire order).

    Attributes:
        type: the message type (``"push"``, ``"pull"``, ...), which says what its fields mean.
        fields: the header's fields by name (JSON values).
        tensors: the tensors by name, in wire order.
        frames: the frame that holds each dense tensor's bytes, by tensor name.
    """

    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    # The frame that holds each dense tensor's bytes: a receiver that keeps a tensor as it came
    # can send it on as this frame (see ``encode``'s ``reuse``) instead of as a new buffer.
    frames: dict[str, Any] = field(default_factory=dict)

    def int_field(self, name: str, *, minimum: int | None = None, optional: bool = False) -> int | None:
        """A header integer, validated; a missing or mistyped one is a protocol error.

        Args:
            name: the field's name.
            minimum: the smallest value allowed; None allows any.
            optional: whether a missing field is allowed (it reads as None).

        Raises:
            WireError: where the field is missing (and not ``optional``), not an integer, or below ``minimum``.
        """
        value = self.fields.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise WireError("bad_field", f"message {self.type!r} needs an integer field {name!r}")
        if minimum is not None and value < minimum:
            raise WireError("bad_field", f"field {name!r} of message {self.type!r} must be >= {minimum}")
        return value

    def float_field(self, name: str, *, minimum: float, maximum: float, optional: bool = False) -> float | None:
        """A header number (an integer is taken too) in ``[minimum, maximum]``; NaN and Inf are refused.

        Args:
            name: the field's name.
            minimum: the smallest value allowed.
            maximum: the largest value allowed.
            optional: whether a missing field is allowed (it reads as None).

        Raises:
            WireError: where the field is missing (and not ``optional``), not a number, or out of range.
        """
        value = self.fields.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not minimum <= value <= maximum:
            raise WireError("bad_field", f"field {name!r} of message {self.type!r} must be a number from {minimum} "
                                         f"to {maximum}, got {value!r:.40}")
        return float(value)

    def str_field(self, name: str, *, optional: bool = False) -> str | None:
        """A header string; a missing or mistyped one is a protocol error.

        Args:
            name: the field's name.
            optional: whether a missing field is allowed (it reads as None).

        Raises:
            WireError: where the field is missing (and not ``optional``) or not a string.
        """
        value = self.fields.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise WireError("bad_field", f"message {self.type!r} needs a string field {name!r}")
        return value


def sparse_wire_bytes(numel: int, nnz: int, itemsize: int = 4) -> int:
    """Bytes of a sparse tensor's frames: block counts, 16-bit offsets and values.

    Args:
        numel: elements of the dense tensor.
        nnz: elements it stores.
        itemsize: bytes of one value.
    """
    return 4 * num_blocks(numel) + 2 * nnz + itemsize * nnz


def num_blocks(numel: int) -> int:
    """Blocks of ``BLOCK_SIZE`` elements a sparse tensor's indices are cut into (at least one).

    Args:
        numel: elements of the dense tensor.
    """
    return max(1, -(-numel // BLOCK_SIZE))


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, fast for the dtypes that travel (little-endian ones are looked up, not computed).

    Args:
        dtype: the dtype to name.
    """
    return DTYPE_NAMES.get(dtype) or dtype.name
