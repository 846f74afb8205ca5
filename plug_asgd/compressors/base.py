"""The codec base class and its registry, and the codec that sends the update as it is.

A :class:`Codec` subclass with a ``name`` registers itself in :data:`COMPRESSORS`: adding a codec
is writing that one class (its ``encode``, its ``wire_bytes``, and, for a ``Packed`` wire form, its
``decode_packed``); :func:`plug_asgd.compressors.decode`, :func:`plug_asgd.compressors.get`, the
codec table of docs/modes.md and the byte tests all read the registry. Error feedback is
:mod:`.error_feedback`'s, what the parameter server decodes :mod:`.decoding`'s, the checks of what
arrives :mod:`.checks`'.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import numpy as np
from typing_extensions import override

from plug_asgd.compressors.checks import bad_payload
from plug_asgd.compressors.difference import difference
from plug_asgd.compressors.error_feedback import ErrorFeedback
from plug_asgd.compressors.registered import COMPRESSORS
from plug_asgd.protocol.wire import Packed, Tensor


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
    sends_packed: ClassVar[bool] = False  # whether it defines its own decode_packed (set as a subclass is made)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is not None:
            if name in COMPRESSORS:
                raise TypeError(f"two codecs are called {name!r}: {COMPRESSORS[name].__name__} and {cls.__name__}")
            COMPRESSORS[name] = cls
        cls.sends_packed = cls.decode_packed.__func__ is not Codec.decode_packed.__func__  # type: ignore[attr-defined]

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
    def fold_packed(cls, packed: Packed, central: np.ndarray, out: np.ndarray, scale: float) -> bool | None:
        """``out = decode(packed) * scale + central`` (without the product where ``scale`` is 1), as the PS's fold
        adds a decoded update in float32, in one pass that never writes the decoding whole; and whether every value
        written is finite. None, with nothing written, where this codec has no such pass or cannot run it here
        (:mod:`.fused`): the PS then decodes and folds.

        Args:
            packed: what arrived, named by this codec; checked as :meth:`decode_packed` checks it.
            central: the central tensor, float32, of the packed tensor's values.
            out: where the sums go, like ``central``.
            scale: the update's factor.

        Raises:
            WireError: ``bad_payload``, where ``packed`` is not what this codec sends.
        """
        return None

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
