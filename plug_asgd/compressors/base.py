"""The codec base class and its registry, error feedback, and what the parameter server decodes.

A :class:`Codec` subclass with a ``name`` registers itself in :data:`COMPRESSORS`: adding a codec
is writing that one class (its ``encode``, its ``wire_bytes``, and, for a ``Packed`` wire form, its
``decode_packed``); :func:`plug_asgd.compressors.decode`, :func:`plug_asgd.compressors.get`, the
codec table of docs/modes.md and the byte tests all read the registry.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import numpy as np
from typing_extensions import override

from plug_asgd.compressors.difference import accumulate, difference
from plug_asgd.protocol.wire import FLOAT_DTYPES, Packed, Sparse, Tensor, WireError, dtype_name


class Compressor(Protocol):
    """Turns a tensor's update into its wire form; may keep per-tensor state between calls."""

    name: str

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        """The wire form of ``update``, the update of the tensor called ``key``.

        Args:
            key: the tensor's name: per-tensor state (a residual, a warm-started factor) is kept under it.
            update: the tensor's update, a float array of the tensor's shape.
        """
        ...


COMPRESSORS: dict[str, type[Codec]] = {}
# a fit of fewer pushes per worker than this many of a codec's lag (Codec.lag_pushes) is warned about
SHORT_FIT_PERIODS = 5


class Codec(ABC):
    """A configured update codec: ``encode`` turns one tensor's update into its wire form.

    The instance a user configures (``TopK(0.01)``) is also the codec itself; a worker encodes with
    :meth:`encoder`, a fresh copy of it (no state from another fit) wrapped in :class:`ErrorFeedback`
    when ``error_feedback`` (by default: the class's ``error_feedback_by_default``).

    Args:
        error_feedback: whether a worker's encoder keeps what is not sent and adds it to the next update; None
            takes the class's ``error_feedback_by_default`` (on for the biased codecs).

    Example:
        >>> from plug_asgd import Codec
        >>> from plug_asgd.compressors import get
        >>> codec = get({"name": "topk", "fraction": 0.1})  # as a YAML file names it
        >>> codec, isinstance(codec, Codec)
        (TopK(fraction=0.1, error_feedback=True), True)
        >>> codec.wire_bytes((1000,))  # 100 float32 values with 2-byte indices, and a 4-byte header
        604
    """

    name: ClassVar[str]
    sends: ClassVar[str]  # what goes on the wire, for the codec table
    wire_formula: ClassVar[str]  # its frame bytes, for the codec table
    error_feedback_by_default: ClassVar[bool] = False
    # whether encoding one tensor touches nothing another tensor's encoding does (no shared random generator):
    # the tensors of a push may then be encoded by several threads, with the same result
    independent_keys: ClassVar[bool] = True
    # with error feedback, the staleness compensation may keep the residual in the worker's model
    residual_in_model: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is not None:
            if name in COMPRESSORS:
                raise TypeError(f"two codecs are called {name!r}: {COMPRESSORS[name].__name__} and {cls.__name__}")
            COMPRESSORS[name] = cls

    def __init__(self, *, error_feedback: bool | None = None) -> None:
        self.error_feedback = self.error_feedback_by_default if error_feedback is None else bool(error_feedback)
        self._differences: dict[str, np.ndarray] = {}  # encode_difference's arrays, one per tensor

    @abstractmethod
    def encode(self, key: str, update: np.ndarray) -> Tensor:
        """The wire form of ``update``, the update of the tensor called ``key``.

        Args:
            key: the tensor's name: per-tensor state (a residual, a warm-started factor) is kept under it.
            update: the tensor's update, a float array of the tensor's shape.
        """

    def encode_difference(self, key: str, w: np.ndarray, c: np.ndarray, scale: float = 1.0) -> Tensor:
        """``encode(key, scale * (w - c))``: the worker's update is its weights less the central model it holds.

        Here the difference is made in an array kept per key (the update must not change before it is sent);
        a codec that can encode it without making it whole overrides this (:mod:`.difference`).

        Args:
            key: the tensor's name, as for :meth:`encode`.
            w: the worker's weights of the tensor.
            c: the central model's values of the tensor that the worker holds (its base), of ``w``'s shape.
            scale: the factor the difference is multiplied by (a staleness compensation's scaling).
        """
        out = self._differences.get(key)
        if out is None or out.shape != w.shape or out.dtype != w.dtype:
            out = self._differences[key] = np.empty_like(w)
        return self.encode(key, difference(out, w, c, scale))

    @abstractmethod
    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        """The frame bytes ``encode`` sends for an update of ``shape`` (``nonzero`` coordinates not zero: all).

        Args:
            shape: the tensor's shape.
            itemsize: the bytes of one of the update's values (4 for float32).
            nonzero: how many of the update's coordinates are not zero; None: all of them.
        """

    @classmethod
    def decode_packed(cls, packed: Packed, dtype: np.dtype) -> np.ndarray:
        """The dense tensor a ``Packed`` of this codec stands for; only codecs that send one define it.

        Args:
            packed: what arrived, named by this codec; checked before it is decoded.
            dtype: the float dtype of the tensor returned (the central tensor's).

        Raises:
            WireError: here, always (``bad_payload``): this codec sends no ``Packed``.
        """
        raise bad_payload(f"codec {packed.codec!r} sends no Packed tensors")

    @classmethod
    def slice_packed(cls, packed: Packed, start: int, stop: int) -> Packed:
        """A ``Packed`` that decodes to values ``start:stop`` of ``packed``'s flat decoded tensor, bit for bit.

        What a sharded PS needs of a tensor cut over shards (:mod:`plug_asgd.protocol.partition`): each shard is
        sent its slice of the tensor as encoded whole, so the worker's codec state (residual, norm, scale)
        stays the one tensor's and every shard decodes what one PS would. Only codecs whose decoding is
        elementwise can; the others keep the tensors they pack whole (:meth:`keeps_whole`).

        Args:
            packed: a ``Packed`` this codec sent, whole.
            start: the first flat index of the slice.
            stop: the flat index after its last.

        Raises:
            ValueError: here, always: this codec packs a tensor as a whole.
        """
        raise ValueError(f"codec {packed.codec!r} packs a tensor as a whole, which cannot be cut into slices")

    def keeps_whole(self, shape: tuple[int, ...]) -> bool:
        """Whether a tensor of ``shape`` must stay whole on one shard of a sharded PS: True where this codec
        sends it in a form that :meth:`slice_packed` cannot cut (PowerSGD's factors of the whole matrix).

        Args:
            shape: the tensor's shape.
        """
        return False

    def lag_pushes(self) -> float | None:
        """About how many pushes a coordinate waits in the residual before it is sent, where that does not depend
        on the update (None: sent at once, or, as topk, once it has grown large).

        A fit of few such periods ends with the central model behind the workers' by what they hold back
        (:meth:`short_fit_warning`)."""
        return None

    def for_fit(self, pushes: float) -> Codec:
        """The codec a fit of about ``pushes`` pushes per worker encodes with: this one, unless a default of it
        depends on the fit's length (randomk's fraction).

        Args:
            pushes: about how many pushes each worker makes in the fit (not finite or negative where unknown).
        """
        return self

    def short_fit_warning(self, pushes: float) -> str | None:
        """What to tell a user whose fit makes ``pushes`` pushes per worker, too few for this codec's lag to
        wear off (fewer than ``SHORT_FIT_PERIODS`` of :meth:`lag_pushes`); None when enough.

        Args:
            pushes: about how many pushes each worker makes in the fit (NaN or negative where unknown: no warning).
        """
        lag = self.lag_pushes()
        if lag is None or not pushes >= 0 or pushes >= SHORT_FIT_PERIODS * lag:
            return None
        return (f"plug_asgd: {self!r} sends each coordinate about once in {lag:g} pushes; this fit makes about "
                f"{pushes:.0f} pushes per worker, fewer than {SHORT_FIT_PERIODS} times that, so its central model "
                "will end behind its workers' by what their residuals hold back (docs/momentum.md, \"randomk's lag "
                "and the length of a fit\"). Train longer, raise the fraction (left unset, it follows the fit's "
                "length), or use topk.")

    def config(self) -> dict[str, Any]:
        """The knobs this codec was built with, by name (what ``get({"name": ..., **knobs})`` takes)."""
        return {p: getattr(self, p) for p in inspect.signature(type(self)).parameters}

    def encoder(self, rank: int = 0) -> Compressor:
        """A fresh copy for a worker (its seed, if any, offset by ``rank``), in error feedback if configured.

        Args:
            rank: the worker's global rank: workers of a seeded codec draw different random numbers.
        """
        knobs = self.config()
        if "seed" in knobs:
            knobs["seed"] += rank
        codec = type(self)(**knobs)
        return ErrorFeedback(codec) if self.error_feedback else codec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.config().items())})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.config() == self.config()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), tuple(self.config().items())))


class NoCompression(Codec):
    """Sends the update as it is (dense): ``itemsize * numel`` bytes, 4 per float32 coordinate.

    Args:
        error_feedback: accepted as every codec's; nothing is lost, so there is nothing to feed back.

    Example:
        >>> import numpy as np
        >>> from plug_asgd import NoCompression
        >>> codec = NoCompression()
        >>> codec.encode("w", np.array([0.5, -2.0], dtype=np.float32))
        array([ 0.5, -2. ], dtype=float32)
        >>> codec.wire_bytes((1000,))
        4000
    """

    name = "none"
    sends = "the update, dense"
    wire_formula = "itemsize * numel"

    @override
    def encode(self, key: str, update: np.ndarray) -> Tensor:
        return update

    @override
    def wire_bytes(self, shape: tuple[int, ...], itemsize: int = 4, nonzero: int | None = None) -> int:
        return itemsize * math.prod(shape)


# -- error feedback ---------------------------------------------------------------------------------


class ErrorFeedback:
    """Error feedback around a codec: what it does not send now is added to the next update.

    Per key it encodes ``v = update + residual`` with ``inner`` and keeps ``residual = v -
    decode(sent)``, both computed in the update's float dtype (float32 at least), so that
    ``decode(sent) + residual`` is ``v``: exactly for codecs whose decoded values are either
    copied from ``v`` or zero (topk, randomk unscaled) or within a factor 2 of them (fp16, bf16,
    by Sterbenz's lemma), and to within the rounding of that one subtraction (``2**-24 *
    |residual|`` in float32) for the others. Nothing is lost, only delayed. The inner codec
    should be a contraction (``||v - decoded|| < ||v||``: topk, unscaled randomk, sign, powersgd,
    the casts); with an unbiased high-variance one (scaled randomk, qsgd with few bits on a large
    tensor) the residual can grow without bound. Wire sizes are the inner codec's.

    Args:
        inner: the codec that encodes ``update + residual``; a fresh one, whose state this wrapper then owns.
    """

    def __init__(self, inner: Codec) -> None:
        self.inner = inner
        self.name = inner.name
        self.independent_keys = inner.independent_keys
        # whether the staleness compensation keeps the residual in the worker's model (docs/momentum.md)
        self.local_residual = inner.residual_in_model
        self.residuals: dict[str, np.ndarray] = {}

    def encode(self, key: str, update: np.ndarray) -> Tensor:
        """The inner codec's wire form of ``update`` plus the residual of ``key``; what it leaves becomes the residual.

        Args:
            key: the tensor's name: its residual is kept under it.
            update: the tensor's update, a float array of the tensor's shape.
        """
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

    def encode_difference(self, key: str, w: np.ndarray, c: np.ndarray, scale: float = 1.0, *,
                          implicit_residual: bool = False) -> Tensor:
        """``encode(key, scale * (w - c))``, the sum with the residual made in the residual's own array.

        ``implicit_residual``: the residual is ``w - c`` itself, kept by the worker's model (its weights are the
        central model ``c`` plus what was not sent): the inner codec encodes that, and nothing is kept here.

        Args:
            key: the tensor's name: its residual is kept under it.
            w: the worker's weights of the tensor.
            c: the central model's values of the tensor that the worker holds (its base), of ``w``'s shape.
            scale: the factor the difference is multiplied by before the residual is added.
            implicit_residual: whether the residual is ``w - c`` itself, held by the worker's model.

        Raises:
            ValueError: where ``implicit_residual`` comes with a ``scale`` other than 1.
        """
        if implicit_residual:
            if scale != 1.0:
                raise ValueError("an implicit residual is w - c itself: it cannot be scaled")
            self.residuals.pop(key, None)
            return self.inner.encode_difference(key, w, c)
        ct = np.result_type(w.dtype, np.float32)
        v = self.residuals.get(key)
        if v is None or v.shape != w.shape or v.dtype != ct:
            v = np.zeros(w.shape, dtype=ct)
        accumulate(v.reshape(-1), w.reshape(-1), c.reshape(-1), scale)
        sent = self.inner.encode(key, v)
        if sent is v:  # sent as it is (dense): the residual's array is written below
            sent = v.copy()
        self._keep(key, v, sent)
        return sent

    def _keep(self, key: str, v: np.ndarray, sent: Tensor) -> None:
        """The residual: ``v`` less what ``sent`` decodes to, in ``v``'s own array."""
        decoded = decode(sent, v.dtype, shape=v.shape)
        if isinstance(decoded, Sparse):
            v.reshape(-1)[decoded.indices] -= decoded.values
        else:
            np.subtract(v, decoded, out=v)
        self.residuals[key] = v

    def set_pending(self, key: str, residual: np.ndarray) -> None:
        """Make ``residual`` (shaped as the tensor, or flat) what is kept of ``key``: the worker's model held it.

        Args:
            key: the tensor's name.
            residual: what is to be added to the tensor's next update; kept as it is, not copied.
        """
        self.residuals[key] = residual

    def pending(self, key: str) -> np.ndarray | None:
        """What is kept of ``key`` for a later push, or None before its first.

        Args:
            key: the tensor's name.
        """
        return self.residuals.get(key)


# -- decoding -------------------------------------------------------------------------------------------


def decode(tensor: Tensor, dtype: np.dtype | type, *, shape: tuple[int, ...] | None = None) -> np.ndarray | Sparse:
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


def packed_codecs() -> dict[str, type[Codec]]:
    """The registered codecs that send ``Packed`` tensors (those that define ``decode_packed``), by name."""
    return {n: c for n, c in COMPRESSORS.items() if c.decode_packed.__func__ is not Codec.decode_packed.__func__}


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


# -- checking what arrives (the decoders of the codecs) --------------------------------------------


def bad_payload(message: str) -> WireError:
    """The error a tensor that no codec could have sent is refused with (code ``bad_payload``), to be raised.

    Args:
        message: what is wrong with it, for the sender.
    """
    return WireError("bad_payload", message)


def check_meta(p: Packed, *keys: str) -> None:
    """Refuse ``p`` unless its meta holds exactly ``keys``.

    Args:
        p: the tensor as it arrived.
        *keys: the meta keys its codec sends.

    Raises:
        WireError: ``bad_payload``, where a key is missing or one more is there.
    """
    if set(p.meta) != set(keys):
        raise bad_payload(f"codec {p.codec!r} takes meta {sorted(keys)}, got {sorted(p.meta)}")


def meta_int(p: Packed, key: str, low: int, high: int) -> int:
    """``p.meta[key]``, refused unless an integer in ``low..high``.

    Args:
        p: the tensor as it arrived (its meta's keys checked already: :func:`check_meta`).
        key: the meta key.
        low: the least value allowed.
        high: the greatest value allowed.

    Raises:
        WireError: ``bad_payload``, where the value is no integer (a bool neither) or out of range.
    """
    value = p.meta[key]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise bad_payload(f"codec {p.codec!r}: {key} must be an integer in {low}..{high}, got {value!r}")
    return value


def meta_scale(p: Packed, key: str) -> float:
    """``p.meta[key]`` as a float, refused unless a finite number ``>= 0`` (a norm, a mean magnitude).

    Args:
        p: the tensor as it arrived (its meta's keys checked already: :func:`check_meta`).
        key: the meta key.

    Raises:
        WireError: ``bad_payload``, where the value is no number, not finite or negative.
    """
    value = p.meta[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise bad_payload(f"codec {p.codec!r}: {key} must be a finite number >= 0, got {value!r} (has the "
                          "worker's training diverged?)")
    return float(value)


def packed_arrays(p: Packed, count: int) -> tuple[np.ndarray, ...]:
    """``p``'s arrays as numpy arrays, refused unless there are ``count`` of them.

    Args:
        p: the tensor as it arrived.
        count: how many arrays its codec sends.

    Raises:
        WireError: ``bad_payload``, where there are more or fewer.
    """
    if len(p.arrays) != count:
        raise bad_payload(f"codec {p.codec!r} sends {count} array(s), got {len(p.arrays)}")
    return tuple(np.asarray(a) for a in p.arrays)


def expect(p: Packed, what: str, array: np.ndarray, dtypes: frozenset[str] | set[str], shape: tuple[int, ...]) -> None:
    """Refuse ``p`` unless ``array``, one of its arrays, has one of ``dtypes`` and the shape ``shape``.

    Args:
        p: the tensor as it arrived.
        what: what the array holds (``"the signs"``), for the message.
        array: the array checked.
        dtypes: the dtype names allowed.
        shape: the shape required.

    Raises:
        WireError: ``bad_payload``, where its dtype or shape is another.
    """
    if array.dtype.name not in dtypes or array.shape != shape:
        raise bad_payload(f"codec {p.codec!r}: {what} must be {'|'.join(sorted(dtypes))}{list(shape)}, got "
                          f"{array.dtype.name}{list(array.shape)}")


def check_int(what: str, value: int, low: int, high: int | None = None) -> int:
    """``value`` as an int, refused unless an integer in ``[low, high]``: a codec's knob, checked where it is built.

    Args:
        what: the knob's name, for the message.
        value: the value given.
        low: the least value allowed.
        high: the greatest value allowed; None: no bound.

    Raises:
        ValueError: where ``value`` is no integer (a bool neither) or out of range.
    """
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low or (
            high is not None and value > high):
        raise ValueError(f"{what} must be an integer in [{low}, {high if high is not None else 'inf'}], got {value!r}")
    return int(value)
