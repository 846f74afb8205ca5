"""What the parameter server decodes: a tensor a worker's codec sent, made into what it folds in, and a packed
tensor cut into a shard's slice.

:func:`decode` reads a ``Packed`` tensor with the registered codec of its name (:mod:`.registered`); a
worker's error feedback (:mod:`.error_feedback`) decodes what it sent with it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plug_asgd.compressors.checks import bad_payload
from plug_asgd.compressors.registered import packed_codecs
from plug_asgd.protocol.wire import FLOAT_DTYPES, Packed, Sparse, Tensor, dtype_name


@dataclass(frozen=True)
class Undecoded:
    """A packed tensor the PS folds as it is (:meth:`Codec.fold_packed`), its decoding never written whole into an
    array of the model's size and read again. :func:`decode` gives one where asked (``defer``); the fold decodes it
    (:meth:`decoded`) only where its codec's pass cannot be had.

    Attributes:
        packed: what the worker sent, its codec's name and shape checked.
        dtype: the central tensor's dtype.
    """

    packed: Packed
    dtype: np.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The decoded tensor's shape."""
        return tuple(self.packed.shape)

    def fold(self, central: np.ndarray, out: np.ndarray, scale: float) -> bool | None:
        """``out = decoded * scale + central`` and whether every value written is finite, without writing the
        decoding; None, with nothing written, where the codec's pass cannot be had (:meth:`Codec.fold_packed`).

        Args:
            central: the central tensor.
            out: where the new central tensor goes.
            scale: the update's factor.

        Raises:
            WireError: ``bad_payload``, where the tensor is not what its codec sends.
        """
        return packed_codecs()[self.packed.codec].fold_packed(self.packed, central, out, scale)

    def decoded(self) -> np.ndarray:
        """The tensor decoded, as :func:`decode` decodes it.

        Raises:
            WireError: ``bad_payload``, where the tensor is not what its codec sends.
        """
        return decode(self.packed, self.dtype)


def decode(tensor: Tensor, dtype: np.dtype | type, *, shape: tuple[int, ...] | None = None,
           defer: bool = False) -> np.ndarray | Sparse | Undecoded:
    """What the parameter server folds in for a tensor a compressor sent: a dense array or a Sparse of ``dtype``.

    Dense arrays are cast to ``dtype``, Sparse values are cast to ``dtype``, and a
    :class:`~plug_asgd.protocol.wire.Packed` is decoded by the registered codec of its name
    (:meth:`Codec.decode_packed`). Anything that cannot be what one of the codecs sent (an unknown
    codec, arrays of the wrong number, dtype or shape, out-of-range indices or parameters, a
    non-finite scale) raises ``WireError("bad_payload", ...)``; so does a tensor whose shape is
    not ``shape`` when one is given. Pass ``shape`` (the central tensor's) on the parameter
    server: it bounds the work before any decoding, which matters for codecs whose decoded size
    is not backed by frames (PowerSGD's ``P @ Q.T``). Values are not checked for NaN or Inf here:
    the caller checks the decoded result as it does for dense updates.

    Args:
        tensor: what a worker sent for the tensor (a dense array, a ``Sparse`` or a ``Packed``).
        dtype: the float dtype of the result (the central tensor's).
        shape: the shape the tensor must have; None: not checked.
        defer: a ``Packed`` of a float32 tensor comes back :class:`Undecoded` (its codec known, its shape
            checked), for a fold that decodes it in its own pass.

    Raises:
        ValueError: where ``dtype`` is not a float dtype (the caller's mistake, not the sender's).
        WireError: ``bad_payload``, where ``tensor`` cannot be what a codec sent, or is not of ``shape``.
    """
    dtype = np.dtype(dtype)
    if type(tensor) is np.ndarray and tensor.dtype == dtype and (shape is None or tensor.shape == tuple(shape)):
        return tensor  # a dense update as the central tensor holds it (the common case: nothing to decode)
    if dtype.kind != "f":
        raise ValueError(f"decode needs a float dtype, got {dtype}")
    if not isinstance(tensor, (np.ndarray, Sparse, Packed)):
        raise bad_payload(f"a payload must be an array, a Sparse or a Packed, got {type(tensor).__name__}")
    got = tuple(tensor.shape)
    if shape is not None and got != tuple(shape):
        raise bad_payload(f"payload of shape {list(got)} for a tensor of shape {list(shape)}")
    with np.errstate(over="ignore"):  # a float64 value beyond float32 becomes Inf; the caller refuses it
        if isinstance(tensor, np.ndarray):
            if dtype_name(tensor.dtype) not in FLOAT_DTYPES:
                raise bad_payload(f"a dense update must hold floats, got {tensor.dtype.name}")
            return tensor.astype(dtype, copy=False)
        if isinstance(tensor, Sparse):
            return _decode_sparse(tensor, dtype)
        packed = packed_codecs()
        codec = packed.get(tensor.codec)
        if codec is None:
            raise bad_payload(f"unknown codec {tensor.codec!r}; this side decodes {', '.join(sorted(packed))}")
        if defer and dtype == np.float32:
            return Undecoded(tensor, dtype)
        return codec.decode_packed(tensor, dtype)


def slice_packed(packed: Packed, start: int, stop: int) -> Packed:
    """Values ``start:stop`` of ``packed``'s flat tensor, in its codec's own form (:meth:`Codec.slice_packed`).

    Args:
        packed: a ``Packed`` tensor as its codec sent it, whole.
        start: the first flat index of the slice.
        stop: the flat index after its last.

    Raises:
        ValueError: where the codec is not registered, ``start:stop`` is empty or out of the tensor, or the
            codec cannot cut what it packs.
    """
    codec = packed_codecs().get(packed.codec)
    if codec is None:
        raise ValueError(f"unknown codec {packed.codec!r}")
    if not 0 <= start < stop <= packed.numel:
        raise ValueError(f"slice {start}:{stop} of a packed tensor of {packed.numel} values")
    return codec.slice_packed(packed, start, stop)


def _decode_sparse(tensor: Sparse, dtype: np.dtype) -> Sparse:
    indices, values = np.asarray(tensor.indices), np.asarray(tensor.values)
    if dtype_name(values.dtype) not in FLOAT_DTYPES:
        raise bad_payload(f"sparse values must be floats, got {values.dtype.name}")
    if indices.dtype.kind not in "iu" or indices.ndim != 1 or values.shape != indices.shape:
        raise bad_payload(f"a sparse update needs as many integer indices ({indices.shape}) as values "
                          f"({values.shape})")
    if indices.size and (int(indices[0]) < 0 or int(indices[-1]) >= tensor.numel
                         or not bool(np.all(indices[1:] > indices[:-1]))):
        raise bad_payload(f"sparse indices must be ascending, unique and in [0, {tensor.numel})")
    return Sparse(indices=indices.astype(np.int64, copy=False), values=values.astype(dtype, copy=False),
                  shape=tuple(tensor.shape))
