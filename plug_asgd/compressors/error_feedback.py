"""Error feedback: a worker's codec wrapped so that what it does not send now is added to the next update.

A codec's :meth:`~plug_asgd.compressors.base.Codec.encoder` wraps its fresh copy in :class:`ErrorFeedback` where the
codec's ``error_feedback`` is on. The residual is the update less what
:func:`~plug_asgd.compressors.decoding.decode` makes of what was sent; the decoding reads the registered codecs
(:mod:`.registered`), not the base class, which imports this module.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from plug_asgd.compressors.decoding import decode
from plug_asgd.compressors.difference import accumulate
from plug_asgd.protocol.wire import Sparse, Tensor


class _Encoding(Protocol):
    """What error feedback needs of the codec it wraps (a :class:`~plug_asgd.compressors.base.Codec` has it): named
    here, so that this module, which the base class imports, imports nothing of it."""

    name: str
    independent_keys: bool
    residual_in_model: bool

    def encode(self, key: str, update: np.ndarray) -> Tensor: ...

    def encode_difference(self, key: str, w: np.ndarray, c: np.ndarray, scale: float = 1.0) -> Tensor: ...


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

    def __init__(self, inner: _Encoding) -> None:
        self.inner = inner
        self.name = inner.name
        self.independent_keys = inner.independent_keys
        # whether the staleness compensation keeps the residual in the worker's model (docs/momentum.md)
        self.local_residual = inner.residual_in_model
        self.residuals: dict[str, np.ndarray] = {}
        self._decoded: dict[str, tuple[Tensor, np.ndarray]] = {}  # the last dense decoding of what each key sent

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
            self._decoded[key] = (sent, decoded)
        self.residuals[key] = v

    def decoded_of(self, key: str, sent: Tensor) -> np.ndarray | None:
        """What ``sent`` decodes to, where it is what :meth:`encode_difference` last sent for ``key`` and that
        decoded dense (``decode(sent, dtype, shape=...)`` of the tensor's own: what the PS folds), else None.
        Given once: a worker adding its push to its held model decodes it no second time (PowerSGD's product).

        Args:
            key: the tensor's name.
            sent: the encoded tensor pushed.
        """
        kept = self._decoded.pop(key, None)
        return kept[1] if kept is not None and kept[0] is sent else None

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
