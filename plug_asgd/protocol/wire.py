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

A dense tensor may also travel as a *local* reference (:class:`Local`, no frame): its dtype,
shape and byte offset in the shared-memory segment the sender attached (see
:mod:`plug_asgd.protocol.push_memory`), so that the bytes of an update made on the PS's machine never
cross the socket. Only pushes carry them; the PS resolves them against the segment of the
sending session, and everything else refuses them.

Packed tensors (:class:`Packed`: quantised, bit-packed or low-rank updates) travel as one raw
frame per array. Their header entry names the codec, the shape of the tensor they decode to, a
small map of scalars (``meta``) and each array's dtype and shape; their wire size is the sum of
their arrays' ``nbytes``. The wire checks the layout (every frame's size against its dtype and
shape, the meta map, the codec name, the number of arrays) but never interprets a codec: that is
:func:`plug_asgd.compressors.decode`'s job.

The message's types, dtypes and limits are in :mod:`plug_asgd.protocol.schema` (its names are
re-exported here); this module encodes and decodes. Neither imports anything else of plug_asgd.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from plug_asgd.protocol.schema import (
    BLOCK_BITS,
    BLOCK_SIZE,
    CODEC_CHARS,
    DEFAULT_LIMITS,
    DTYPE_NAMES,
    DTYPES,
    FLOAT_DTYPES,
    LOCAL_MAX_OFFSET,
    PACKED_MAX_ARRAYS,
    PACKED_MAX_META,
    PACKED_MAX_NAME,
    PACKED_MAX_STR,
    PROTOCOL_VERSION,
    RATE_RANGE,
    Limits,
    Local,
    Message,
    Packed,
    Sparse,
    Tensor,
    WireError,
    dtype_name,
    num_blocks,
    sparse_wire_bytes,
)

__all__ = ["BLOCK_BITS", "BLOCK_SIZE", "CODEC_CHARS", "DEFAULT_LIMITS", "DTYPES", "DTYPE_NAMES", "FLOAT_DTYPES",
           "LOCAL_MAX_OFFSET", "Limits", "Local", "Message", "PACKED_MAX_ARRAYS", "PACKED_MAX_META",
           "PACKED_MAX_NAME", "PACKED_MAX_STR", "PROTOCOL_VERSION", "Packed", "RATE_RANGE", "Sparse", "Tensor",
           "WireError", "decode", "dtype_name", "encode", "frame_summary", "message_bytes", "num_blocks",
           "sparse_wire_bytes"]


def _dtype_name(array: np.ndarray) -> str:
    name = dtype_name(array.dtype)
    if name not in DTYPES:
        raise WireError("bad_dtype", f"dtype {name} cannot travel on the wire (allowed: {sorted(DTYPES)})")
    return name


def _le(array: np.ndarray) -> np.ndarray:
    """A C-contiguous little-endian view or copy, so its buffer is the wire bytes."""
    if array.dtype in DTYPE_NAMES and array.flags.c_contiguous:
        return array
    out = np.asarray(array, dtype=DTYPES[_dtype_name(array)])
    return out if out.flags.c_contiguous else out.copy(order="C")  # ascontiguousarray would make 0-d 1-d


def encode(
    msg_type: str,
    fields: Mapping[str, Any] | None = None,
    tensors: Mapping[str, Tensor] | None = None,
    reuse: Mapping[str, Any] | None = None,
    local: Mapping[str, int] | None = None,
) -> list[Any]:
    """Frames of a message: the header, then each tensor's buffers (not copied where avoidable).

    ``local`` maps a dense tensor's name to its byte offset in the sender's attached shared
    segment: it travels as a :class:`Local` reference, without a frame.

    ``reuse`` maps a dense tensor's name to a received frame that holds exactly its bytes
    (``Message.frames``); that frame is sent in place of the array's buffer. With pyzmq,
    resending a received frame shares its memory at no cost, whereas each new zero-copy buffer
    is released later through pyzmq's garbage-collection thread.

    Args:
        msg_type: the message type (``"push"``, ``"pull"``, ...).
        fields: the header fields, msgpack scalars, strings, lists and maps only; None for none.
        tensors: the tensors by name, sent in this order; None for none.
        reuse: received frames to send in place of dense tensors' buffers, by tensor name; None for none.
        local: byte offsets in the sender's attached segment of dense tensors that travel as
            :class:`Local` references, by tensor name; None for none.

    Raises:
        WireError: where a sparse tensor's indices and values differ in number, or a tensor's dtype cannot
            travel.
        ValueError: where a local tensor is not a C-contiguous little-endian array, or a frame to reuse
            differs in size from its tensor (the caller's mistake, not a peer's).
    """
    specs: list[dict[str, Any]] = []
    frames: list[Any] = []
    for name, tensor in (tensors or {}).items():
        if isinstance(tensor, Sparse):
            values = _le(tensor.values.reshape(-1))
            indices = np.asarray(tensor.indices, dtype=np.int64).reshape(-1)
            if indices.size != values.size:
                raise WireError("bad_sparse", f"sparse tensor {name!r}: {indices.size} indices, {values.size} values")
            counts = np.bincount(indices >> BLOCK_BITS, minlength=num_blocks(tensor.numel)).astype("<u4")
            offsets = (indices & (BLOCK_SIZE - 1)).astype("<u2")
            specs.append({"name": name, "enc": "sparse", "dtype": dtype_name(values.dtype),
                          "shape": list(tensor.shape), "nnz": int(indices.size)})
            frames += [counts.data, offsets.data, values.data]
        elif isinstance(tensor, Packed):
            spec, packed_frames = _encode_packed(name, tensor)
            specs.append(spec)
            frames += packed_frames
        elif local and name in local:
            array = np.asarray(tensor)
            if array.dtype not in DTYPE_NAMES or not array.flags.c_contiguous:
                raise ValueError(f"tensor {name!r}: a local tensor is a C-contiguous little-endian array")
            specs.append({"name": name, "enc": "local", "dtype": dtype_name(array.dtype), "shape": list(array.shape),
                          "offset": int(local[name])})
        else:
            array = _le(np.asarray(tensor))
            specs.append({"name": name, "enc": "dense", "dtype": dtype_name(array.dtype), "shape": list(array.shape)})
            frame = reuse.get(name) if reuse else None
            if frame is not None and _nbytes(frame) != array.nbytes:
                raise ValueError(f"tensor {name!r}: the frame to reuse has {_nbytes(frame)} bytes, "
                                 f"the tensor {array.nbytes}")
            frames.append(frame if frame is not None else array.reshape(-1).data if array.ndim
                          else array.reshape(1).data)
    header = {"v": PROTOCOL_VERSION, "type": msg_type, "fields": dict(fields or {}), "tensors": specs}
    return [msgpack.packb(header, use_bin_type=True), *frames]


def _check_codec(name: str, codec: Any) -> str:
    if not (isinstance(codec, str) and 0 < len(codec) <= PACKED_MAX_NAME and set(codec) <= CODEC_CHARS):
        raise WireError("bad_packed", f"packed tensor {name!r}: the codec must be a name of 1 to {PACKED_MAX_NAME} "
                                      f"letters, digits or '_-.+', got {codec!r:.60}")
    return codec


def _check_meta(name: str, meta: Any) -> dict[str, int | float | str]:
    """A packed tensor's meta: a map of at most PACKED_MAX_META short names to int, float or str."""
    if not isinstance(meta, dict) or len(meta) > PACKED_MAX_META:
        raise WireError("bad_packed", f"packed tensor {name!r}: meta must be a map of at most {PACKED_MAX_META} "
                                      "entries")
    out: dict[str, int | float | str] = {}
    for key, value in meta.items():
        if not isinstance(key, str) or not 0 < len(key) <= PACKED_MAX_NAME:
            raise WireError("bad_packed", f"packed tensor {name!r}: meta keys must be strings of 1 to "
                                          f"{PACKED_MAX_NAME} characters, got {key!r:.60}")
        if isinstance(value, (np.integer, np.floating)):  # numpy scalars travel as their Python value
            value = value.item()
        ok = (isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < 1 << 64
              or isinstance(value, float)
              or isinstance(value, str) and len(value) <= PACKED_MAX_STR)
        if not ok:
            raise WireError("bad_packed", f"packed tensor {name!r}: meta {key!r} must be an int (64-bit), a float "
                                          f"or a string of at most {PACKED_MAX_STR} characters, got "
                                          f"{type(value).__name__}")
        out[key] = value
    return out


def _encode_packed(name: str, tensor: Packed) -> tuple[dict[str, Any], list[Any]]:
    codec = _check_codec(name, tensor.codec)
    meta = _check_meta(name, tensor.meta)
    if len(tensor.arrays) > PACKED_MAX_ARRAYS:
        raise WireError("bad_packed", f"packed tensor {name!r}: {len(tensor.arrays)} arrays, at most "
                                      f"{PACKED_MAX_ARRAYS} may travel")
    if len(tensor.shape) > DEFAULT_LIMITS.max_ndim or not all(0 <= d < 1 << 40 for d in tensor.shape):
        raise WireError("bad_shape", f"packed tensor {name!r}: shape {list(tensor.shape)} cannot travel")
    arrays = [_le(np.asarray(a)) for a in tensor.arrays]
    spec = {"name": name, "enc": "packed", "codec": codec, "shape": list(tensor.shape), "meta": meta,
            "arrays": [{"dtype": dtype_name(a.dtype), "shape": list(a.shape)} for a in arrays]}
    return spec, [a.reshape(-1).data if a.ndim else a.reshape(1).data for a in arrays]


def _buffer(frame: Any) -> memoryview:
    # zmq.Frame exposes .buffer; bytes and memoryview are taken as they are.
    buf = getattr(frame, "buffer", frame)
    view = buf if type(buf) is memoryview else memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _nbytes(frame: Any) -> int:
    """A frame's size in bytes, without a cast where the type tells it (a memoryview's len is its first dimension)."""
    kind = type(frame)
    if kind is memoryview:
        return frame.nbytes
    return len(frame) if kind in _LEN_IS_SIZE else _buffer(frame).nbytes


# Frame types whose len() is their size in bytes (a received ZeroMQ frame's is, cheaply).
_LEN_IS_SIZE = frozenset({bytes, bytearray, zmq.Frame})
_MAX_DIM = 1 << 40


def _shape(spec: Mapping[str, Any], name: str, limits: Limits, what: str | None = None) -> tuple[int, ...]:
    shape = spec.get("shape")
    if (type(shape) is not list or len(shape) > limits.max_ndim
            or not all(type(d) is int and 0 <= d < _MAX_DIM for d in shape)):  # int, not bool
        raise WireError("bad_shape", f"{what or f'tensor {name!r}'}: shape must be a list of at most "
                                     f"{limits.max_ndim} non-negative integers below 2**40")
    return tuple(shape)


def _frame_array(frame: Any, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    buf = _buffer(frame)
    if len(buf) != count * dtype.itemsize:
        raise WireError("bad_frame_size", f"{what}: frame has {len(buf)} bytes, the header implies "
                                          f"{count * dtype.itemsize}")
    return np.frombuffer(buf, dtype=dtype, count=count)


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Parse and validate a message; any departure from the protocol raises :class:`WireError`.

    Args:
        frames: the message's frames as received (``zmq.Frame``, bytes or memoryview), header first.
        limits: the bounds checked before a byte is interpreted.

    Raises:
        WireError: where the message departs from the protocol in any way (its ``code`` says how).
    """
    msg_type, fields, specs = _header(frames, limits)
    tensors: dict[str, Tensor] = {}
    dense_frames: dict[str, Any] = {}
    pos = 1
    for spec in specs:
        name = spec.get("name") if type(spec) is dict else None
        if type(name) is not str:
            raise WireError("bad_tensor", "each tensor entry needs a string 'name'")
        if name in tensors:
            raise WireError("bad_tensor", f"tensor {name!r} appears twice")
        enc = spec.get("enc")
        if enc == "packed":
            tensors[name], pos = _decode_packed(name, spec, frames, pos, limits)
            continue
        tensors[name], after = _decode_plain(name, enc, spec, frames, pos, limits)
        if enc == "dense":
            dense_frames[name] = frames[pos]
        pos = after
    if pos != len(frames):
        raise WireError("frame_count", f"header describes {pos} frames, the message has {len(frames)}")
    return Message(type=msg_type, fields=fields, tensors=tensors, frames=dense_frames)


def _header(frames: Sequence[Any], limits: Limits) -> tuple[str, dict[str, Any], list[Any]]:
    """A message's type, fields and tensor entries, from its header frame, once its sizes are within ``limits``."""
    if not frames:
        raise WireError("empty", "empty message")
    if len(frames) > limits.max_frames:
        raise WireError("too_many_frames", f"{len(frames)} frames, the limit is {limits.max_frames}")
    total = message_bytes(frames)
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
    return msg_type, fields, specs


def _decode_plain(name: str, enc: Any, spec: Mapping[str, Any], frames: Sequence[Any], pos: int,
                  limits: Limits) -> tuple[Tensor | Local, int]:
    """A dense, sparse or local tensor's entry and its frames from ``pos``; returns it and the position after it."""
    dtype_spec = spec.get("dtype")
    dtype = DTYPES.get(dtype_spec) if type(dtype_spec) is str else None
    if dtype is None:
        raise WireError("bad_dtype", f"tensor {name!r}: dtype {dtype_spec!r} is not allowed")
    shape = _shape(spec, name, limits)
    numel = math.prod(shape)
    if enc == "local":
        offset = spec.get("offset")
        if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < LOCAL_MAX_OFFSET:
            raise WireError("bad_local", f"local tensor {name!r}: offset must be an integer in "
                                         f"[0, {LOCAL_MAX_OFFSET})")
        return Local(offset, dtype, shape), pos
    need = 1 if enc == "dense" else 3 if enc == "sparse" else None
    if need is None:
        raise WireError("bad_tensor", f"tensor {name!r}: unknown encoding {enc!r}")
    if pos + need > len(frames):
        raise WireError("frame_count", f"tensor {name!r} needs {need} frame(s), the message ends first")
    if enc == "dense":
        return _frame_array(frames[pos], dtype, numel, f"tensor {name!r}").reshape(shape), pos + 1
    return _decode_sparse(name, spec, frames[pos:pos + 3], dtype, shape, numel), pos + 3


def _decode_sparse(name: str, spec: Mapping[str, Any], frames: Sequence[Any], dtype: np.dtype,
                   shape: tuple[int, ...], numel: int) -> Sparse:
    nnz = spec.get("nnz")
    if not isinstance(nnz, int) or isinstance(nnz, bool) or not 0 <= nnz <= numel:
        raise WireError("bad_sparse", f"sparse tensor {name!r}: nnz must be an integer in [0, {numel}]")
    nblocks = num_blocks(numel)
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


def _decode_packed(name: str, spec: Mapping[str, Any], frames: Sequence[Any], pos: int,
                   limits: Limits) -> tuple[Packed, int]:
    """A packed tensor's entry and its frames from ``pos``; returns it and the position after it."""
    codec = _check_codec(name, spec.get("codec"))
    shape = _shape(spec, name, limits)
    meta = _check_meta(name, spec.get("meta"))
    entries = spec.get("arrays")
    if not isinstance(entries, list) or len(entries) > PACKED_MAX_ARRAYS:
        raise WireError("bad_packed", f"packed tensor {name!r}: 'arrays' must be a list of at most "
                                      f"{PACKED_MAX_ARRAYS} entries")
    if pos + len(entries) > len(frames):
        raise WireError("frame_count", f"packed tensor {name!r} needs {len(entries)} frame(s), the message "
                                       "ends first")
    arrays = []
    for i, entry in enumerate(entries):
        what = f"packed tensor {name!r} array {i}"
        if not isinstance(entry, dict):
            raise WireError("bad_packed", f"{what}: each array entry must be a map with 'dtype' and 'shape'")
        if not isinstance(entry.get("dtype"), str) or entry["dtype"] not in DTYPES:
            raise WireError("bad_dtype", f"{what}: dtype {entry.get('dtype')!r} is not allowed")
        array_shape = _shape(entry, name, limits, what)
        count = math.prod(array_shape)
        arrays.append(_frame_array(frames[pos + i], DTYPES[entry["dtype"]], count, what).reshape(array_shape))
    return Packed(codec=codec, shape=shape, meta=meta, arrays=tuple(arrays)), pos + len(entries)


def message_bytes(frames: Sequence[Any]) -> int:
    """Bytes a message occupies on the wire (the sum of its frames), for the counters.

    Args:
        frames: the message's frames (``zmq.Frame``, bytes, memoryview or any buffer).
    """
    total = 0
    for frame in frames:
        total += _nbytes(frame)
    return total


def frame_summary(frames: Sequence[Any], shown: int = 8) -> str:
    """What a message that would not decode held, for its error: the frames' sizes and the first one's opening bytes.

    Args:
        frames: the message's frames as received.
        shown: the sizes listed before the rest are counted.
    """
    sizes = [_nbytes(f) for f in frames]
    listed = ", ".join(map(str, sizes[:shown])) + (f" and {len(sizes) - shown} more" if len(sizes) > shown else "")
    head = bytes(_buffer(frames[0])[:16]).hex(" ") if frames else ""
    return f"{len(sizes)} frames of {listed} bytes, the first opening {head or 'empty'}"
