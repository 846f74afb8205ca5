"""The message format between workers and the parameter server.

A message is one msgpack *header* frame followed by raw tensor frames. The header names the
message type, the protocol version and, for each tensor, how its frames are laid out; the
frames are the tensors' bytes in little-endian order, so a receiver maps them with
``numpy.frombuffer`` without copying. Nothing is ever pickled: a header holds only msgpack
scalars, strings, lists and maps, and every size is checked against the header before a
byte is interpreted.

Sparse tensors (the top-k updates of AdaComp) travel as three frames: per-block counts
(uint32, one per block of 65536 coordinates), 16-bit offsets within the blocks (uint16, one
per coordinate, ascending) and the values. Their wire size is
``4 * ceil(numel / 65536) + 2 * nnz + itemsize * nnz`` bytes.

This module imports nothing else of plug_asgd.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
BLOCK_BITS = 16
BLOCK_SIZE = 1 << BLOCK_BITS

# Dtypes a tensor frame may carry. Central model tensors are restricted further (floats only)
# by the parameter server; the rest serve collectives (metric counts, flags).
_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
}
FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})


class WireError(ValueError):
    """A message that does not follow the protocol. ``code`` is a short machine-readable tag."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Limits:
    """Upper bounds a receiver enforces before it trusts a message."""

    max_header_bytes: int = 1 << 20
    max_frames: int = 1 << 16
    max_message_bytes: int = 1 << 31
    max_ndim: int = 8


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Sparse:
    """A sparse tensor: ascending unique flat ``indices`` into a tensor of ``shape``, and ``values``."""

    indices: np.ndarray
    values: np.ndarray
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nnz(self) -> int:
        return int(self.indices.size)

    def to_dense(self) -> np.ndarray:
        out = np.zeros(self.numel, dtype=self.values.dtype)
        out[self.indices] = self.values
        return out.reshape(self.shape)


Tensor = np.ndarray | Sparse


@dataclass
class Message:
    """A decoded message: its type, its header fields, and its tensors by name (in wire order)."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)

    def int_field(self, name: str, *, minimum: int | None = None, optional: bool = False) -> int | None:
        """A header integer, validated; a missing or mistyped one is a protocol error."""
        value = self.fields.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise WireError("bad_field", f"message {self.type!r} needs an integer field {name!r}")
        if minimum is not None and value < minimum:
            raise WireError("bad_field", f"field {name!r} of message {self.type!r} must be >= {minimum}")
        return value

    def str_field(self, name: str, *, optional: bool = False) -> str | None:
        value = self.fields.get(name)
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise WireError("bad_field", f"message {self.type!r} needs a string field {name!r}")
        return value


def sparse_wire_bytes(numel: int, nnz: int, itemsize: int = 4) -> int:
    """Bytes of a sparse tensor's frames: block counts, 16-bit offsets and values."""
    return 4 * _num_blocks(numel) + 2 * nnz + itemsize * nnz


def _num_blocks(numel: int) -> int:
    return max(1, -(-numel // BLOCK_SIZE))


def _dtype_name(array: np.ndarray) -> str:
    name = array.dtype.name
    if name not in _DTYPES:
        raise WireError("bad_dtype", f"dtype {name} cannot travel on the wire (allowed: {sorted(_DTYPES)})")
    return name


def _le(array: np.ndarray) -> np.ndarray:
    """A C-contiguous little-endian view or copy, so its buffer is the wire bytes."""
    out = np.asarray(array, dtype=_DTYPES[_dtype_name(array)])
    return out if out.flags.c_contiguous else out.copy(order="C")  # ascontiguousarray would make 0-d 1-d


def encode(
    msg_type: str,
    fields: Mapping[str, Any] | None = None,
    tensors: Mapping[str, Tensor] | None = None,
) -> list[Any]:
    """Frames of a message: the header, then each tensor's buffers (not copied where avoidable)."""
    specs: list[dict[str, Any]] = []
    frames: list[Any] = []
    for name, tensor in (tensors or {}).items():
        if isinstance(tensor, Sparse):
            values = _le(tensor.values.reshape(-1))
            indices = np.asarray(tensor.indices, dtype=np.int64).reshape(-1)
            if indices.size != values.size:
                raise WireError("bad_sparse", f"sparse tensor {name!r}: {indices.size} indices, {values.size} values")
            counts = np.bincount(indices >> BLOCK_BITS, minlength=_num_blocks(tensor.numel)).astype("<u4")
            offsets = (indices & (BLOCK_SIZE - 1)).astype("<u2")
            specs.append({"name": name, "enc": "sparse", "dtype": values.dtype.name,
                          "shape": list(tensor.shape), "nnz": int(indices.size)})
            frames += [counts.data, offsets.data, values.data]
        else:
            array = _le(np.asarray(tensor))
            specs.append({"name": name, "enc": "dense", "dtype": array.dtype.name, "shape": list(array.shape)})
            frames.append(array.reshape(-1).data if array.ndim else array.reshape(1).data)
    header = {"v": PROTOCOL_VERSION, "type": msg_type, "fields": dict(fields or {}), "tensors": specs}
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _buffer(frame: Any) -> memoryview:
    # zmq.Frame exposes .buffer; bytes and memoryview are taken as they are.
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    return memoryview(buf).cast("B")


def _shape(spec: Mapping[str, Any], name: str, limits: Limits) -> tuple[int, ...]:
    shape = spec.get("shape")
    if (not isinstance(shape, list) or len(shape) > limits.max_ndim
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in shape)):
        raise WireError("bad_shape", f"tensor {name!r}: shape must be a list of at most {limits.max_ndim} "
                                     "non-negative integers")
    return tuple(shape)


def _frame_array(frame: Any, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    buf = _buffer(frame)
    if len(buf) != count * dtype.itemsize:
        raise WireError("bad_frame_size", f"{what}: frame has {len(buf)} bytes, the header implies "
                                          f"{count * dtype.itemsize}")
    return np.frombuffer(buf, dtype=dtype, count=count)


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse and validate a message; any departure from the protocol raises :class:`WireError`."""
    if not frames:
        raise WireError("empty", "empty message")
    if len(frames) > limits.max_frames:
        raise WireError("too_many_frames", f"{len(frames)} frames, the limit is {limits.max_frames}")
    total = sum(len(_buffer(f)) for f in frames)
    if total > limits.max_message_bytes:
        raise WireError("too_large", f"message of {total} bytes, the limit is {limits.max_message_bytes}")
    raw = _buffer(frames[0])
    if len(raw) > limits.max_header_bytes:
        raise WireError("too_large", f"header of {len(raw)} bytes, the limit is {limits.max_header_bytes}")
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireError("bad_header", f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("bad_header", "header must be a msgpack map")
    if header.get("v") != PROTOCOL_VERSION:
        raise WireError("bad_version", f"protocol version {header.get('v')!r} is not supported; this side "
                                       f"speaks version {PROTOCOL_VERSION}: install the same plug-asgd "
                                       "version on workers and parameter server")
    msg_type, fields, specs = header.get("type"), header.get("fields", {}), header.get("tensors", [])
    if not isinstance(msg_type, str) or not isinstance(fields, dict) or not isinstance(specs, list):
        raise WireError("bad_header", "header needs 'type' (str), 'fields' (map) and 'tensors' (list)")
    tensors: dict[str, Tensor] = {}
    pos = 1
    for spec in specs:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise WireError("bad_tensor", "each tensor entry needs a string 'name'")
        name = spec["name"]
        if name in tensors:
            raise WireError("bad_tensor", f"tensor {name!r} appears twice")
        dtype_name = spec.get("dtype")
        if dtype_name not in _DTYPES:
            raise WireError("bad_dtype", f"tensor {name!r}: dtype {dtype_name!r} is not allowed")
        dtype = _DTYPES[dtype_name]
        shape = _shape(spec, name, limits)
        numel = math.prod(shape)
        enc = spec.get("enc")
        need = 1 if enc == "dense" else 3 if enc == "sparse" else None
        if need is None:
            raise WireError("bad_tensor", f"tensor {name!r}: unknown encoding {enc!r}")
        if pos + need > len(frames):
            raise WireError("frame_count", f"tensor {name!r} needs {need} frame(s), the message ends first")
        if enc == "dense":
            tensors[name] = _frame_array(frames[pos], dtype, numel, f"tensor {name!r}").reshape(shape)
        else:
            tensors[name] = _decode_sparse(name, spec, frames[pos:pos + 3], dtype, shape, numel)
        pos += need
    if pos != len(frames):
        raise WireError("frame_count", f"header describes {pos} frames, the message has {len(frames)}")
    return Message(type=msg_type, fields=fields, tensors=tensors)


def _decode_sparse(name: str, spec: Mapping[str, Any], frames: Sequence[Any], dtype: np.dtype,
                   shape: tuple[int, ...], numel: int) -> Sparse:
    nnz = spec.get("nnz")
    if not isinstance(nnz, int) or isinstance(nnz, bool) or not 0 <= nnz <= numel:
        raise WireError("bad_sparse", f"sparse tensor {name!r}: nnz must be an integer in [0, {numel}]")
    nblocks = _num_blocks(numel)
    counts = _frame_array(frames[0], np.dtype("<u4"), nblocks, f"sparse tensor {name!r} counts")
    offsets = _frame_array(frames[1], np.dtype("<u2"), nnz, f"sparse tensor {name!r} offsets")
    values = _frame_array(frames[2], dtype, nnz, f"sparse tensor {name!r} values")
    if int(counts.sum(dtype=np.int64)) != nnz:
        raise WireError("bad_sparse", f"sparse tensor {name!r}: block counts add up to {int(counts.sum())}, "
                                      f"not nnz={nnz}")
    blocks = np.repeat(np.arange(nblocks, dtype=np.int64), counts.astype(np.int64))
    indices = (blocks << BLOCK_BITS) | offsets.astype(np.int64)
    if nnz and (indices[-1] >= numel or (nnz > 1 and not bool(np.all(np.diff(indices) > 0)))):
        raise WireError("bad_sparse", f"sparse tensor {name!r}: indices must be ascending, unique and "
                                      f"below {numel}")
    return Sparse(indices=indices, values=values, shape=shape)


def message_bytes(frames: Sequence[Any]) -> int:
    """Bytes a message occupies on the wire (the sum of its frames), for the counters."""
    return sum(len(_buffer(f)) for f in frames)
