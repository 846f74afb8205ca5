"""Approximate replies to pushes: the coordinates where a worker's copy is furthest off, or every difference coded.

Where every update is dense (asgd, dynsgd, ssp without a sparse codec), the exact change since a
worker's version is the whole model, and a reply to a push costs the model's bytes on the link
down. With ``--downlink-fraction F`` the PS keeps, for each training worker, the copy it knows
the worker holds, and answers its pushes with, per tensor, the ``F`` share of coordinates where
``central - copy`` is largest in magnitude (and every coordinate off by more than
``--downlink-bound``), set to their central values. What is not sent stays in the difference
and is sent once it has grown enough: error feedback kept per worker on the PS, as in
DoubleSqueeze (Tang et al., 2019), without a separate residual. After each reply the PS knows
how far the worker's copy is from the central model (``gap``: the largest coordinate left out),
and counts the largest such gap (``downlink_gap_max``).

With ``--downlink-codec fp16`` (``int8``, ``int4``) a reply to a push carries instead, per tensor, the
whole difference ``central - copy`` cast to float16 (or in levels of 8 or 4 bits with one scale:
:mod:`plug_asgd.compressors.reply_codecs`), whose decoding the worker adds to its copy as the PS adds
it to its own (the same float operations: both copies stay equal, bit for bit). What the coding
rounds off stays in the next difference, so no copy drifts: it is within one rounding of the last
difference sent. A reply then costs a half (a quarter, an eighth) of float32's bytes where every
coordinate changes between two pushes, as a DiLoCo round's outer step changes them all. A reply
ahead (``AsyncDiLoCo``'s lookahead) goes the same way: the copy is then the model ahead, the
worker's next base; so does a reply with only the tensors its push carried (streaming's
fragments, ``overlap=True``): those of the copy are brought up to date.

Pulls stay exact: a worker pulls before validation, test, checkpoints and at the end of a fit,
so the model it evaluates or saves is the central one, bit for bit. An approximate copy is
named by ``held: [model_id, version]``, never by ``have``, so it can never be patched as if
it were exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from plug_asgd.compressors.reply_codecs import CODECS, decode_difference, encode_difference
from plug_asgd.protocol.wire import Packed, Sparse, sparse_wire_bytes


@dataclass
class _Copy:
    model_id: str
    version: int
    tensors: dict[str, np.ndarray]


class Downlink:
    """What each worker holds, for approximate replies to its pushes (top ``fraction`` per tensor, or every
    difference in ``codec``).

    Args:
        fraction: the share of each tensor's coordinates a reply carries (those furthest off), in (0, 1]; None:
            with ``codec``.
        bound: also send every coordinate off by more than this, so that no copy is further off; None: no bound.
        codec: a name in :data:`~plug_asgd.compressors.reply_codecs.CODECS`: a reply carries every difference so
            coded, which the worker adds; None: with ``fraction``.

    Raises:
        ValueError: where ``fraction`` is not in (0, 1], ``codec`` is not a downlink codec, or not exactly one of
            the two is given.
    """

    def __init__(self, fraction: float | None = None, bound: float | None = None, codec: str | None = None) -> None:
        if (fraction is None) == (codec is None):
            raise ValueError("a downlink takes a fraction or a codec, one of the two")
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"downlink fraction must be in (0, 1], got {fraction}")
        if codec is not None and codec not in CODECS:
            raise ValueError(f"downlink codec must be one of {list(CODECS)}, got {codec!r}")
        self.fraction = fraction
        self.bound = bound
        self.codec = codec
        self.copies: dict[int, _Copy] = {}
        self.gap_max = 0.0  # the largest coordinate left out of a reply, over all replies

    def holds(self, rank: int, model_id: str, version: int, tensors: dict[str, np.ndarray]) -> None:
        """Rank ``rank`` was sent the central model (``tensors``, copied) of ``version`` exactly.

        Args:
            rank: the worker's rank.
            model_id: the id of the central model it was sent (see :class:`~plug_asgd.ps.changes.ChangeLog`).
            version: the central version it was sent.
            tensors: the central tensors it was sent, by name.
        """
        self.copies[rank] = _Copy(model_id, version, {n: np.array(t, copy=True) for n, t in tensors.items()})

    @property
    def adds(self) -> bool:
        """Whether a reply to a push carries differences to add (a ``codec``), not values to set."""
        return self.codec is not None

    def reply(self, rank: int, held: tuple[str, int] | None, model_id: str, version: int,
              tensors: dict[str, np.ndarray], exact: bool = False) -> dict[str, Sparse | np.ndarray] | None:
        """What to set in ``rank``'s copy, which it says it holds (``held``): the largest differences, or
        (``exact``) all of them, a tensor whole where that is smaller; with a codec and not ``exact``, every
        difference coded, to add; None: the PS knows no such copy.

        Args:
            rank: the worker's rank.
            held: the ``[model_id, version]`` of the copy the worker says it holds, or None.
            model_id: the id of the central model now.
            version: the central version now (the copy's once it is answered).
            tensors: the central tensors now, by name.
            exact: whether to send every difference rather than the largest ``fraction``.
        """
        copy = self.copies.get(rank)
        if copy is None or held != (copy.model_id, copy.version) or model_id != copy.model_id:
            return None
        if not tensors.keys() <= copy.tensors.keys() or (self.codec is None and tensors.keys() != copy.tensors.keys()):
            return None  # (with a codec: some of the tensors, a fragment's, may be answered)
        if any(copy.tensors[n].shape != t.shape for n, t in tensors.items()):
            return None
        if self.codec is not None and not exact:
            out = self._differences(copy, tensors, self.codec)
            copy.version = version
            return out
        out: dict[str, Sparse | np.ndarray] = {}
        for name, central in tensors.items():
            mine = copy.tensors[name]
            diff = np.abs(central.reshape(-1) - mine.reshape(-1))
            k = max(1, int((self.fraction or 1.0) * diff.size))
            if exact or k >= diff.size:
                idx, left = np.flatnonzero(diff), 0.0
                if exact and sparse_wire_bytes(diff.size, idx.size, central.itemsize) >= central.nbytes:
                    np.copyto(mine, central)
                    out[name] = central
                    continue
            else:
                part = np.argpartition(diff, diff.size - k - 1)
                idx, left = part[diff.size - k:], float(diff[part[diff.size - k - 1]])
                if self.bound is not None and left > self.bound:
                    idx = np.union1d(idx, np.flatnonzero(diff > self.bound))
                    left = self.bound
                idx = np.sort(idx[diff[idx] > 0])
            values = central.reshape(-1)[idx]
            mine.reshape(-1)[idx] = values
            self.gap_max = max(self.gap_max, left)
            if idx.size:
                out[name] = Sparse(indices=idx.astype(np.int64), values=values, shape=central.shape)
        copy.version = version
        return out

    def _differences(self, copy: _Copy, tensors: dict[str, np.ndarray],
                     codec: str) -> dict[str, Sparse | Packed | np.ndarray]:
        """Every difference of ``tensors`` from ``copy`` as ``codec`` sends it
        (:func:`~plug_asgd.compressors.reply_codecs.encode_difference`), its decoding added to the copy as the
        worker adds it (:meth:`~plug_asgd.worker.held_model.HeldModel.patch`); a tensor that did not change is
        left out."""
        out: dict[str, Sparse | Packed | np.ndarray] = {}
        for name, central in tensors.items():
            mine = copy.tensors[name]
            diff = np.subtract(central, mine)
            if not diff.any():
                continue
            sent = encode_difference(codec, diff)
            np.add(mine, decode_difference(sent, mine.dtype), out=mine)
            spare = diff if sent is not diff else np.empty_like(diff)  # (diff's buffer, unless it is what is sent)
            left = np.abs(np.subtract(central, mine, out=spare), out=spare)
            self.gap_max = max(self.gap_max, float(left.max()))
            out[name] = sent
        return out


def make_downlink(fraction: float | None, bound: float | None, codec: str | None) -> Downlink | None:
    """The PS's downlink for its options (``--downlink-fraction``, ``--downlink-bound``, ``--downlink-codec``);
    None where replies are exact.

    Args:
        fraction: the share of each tensor a reply carries, or None.
        bound: with ``fraction``: every coordinate off by more than this is sent too, or None.
        codec: what every difference travels in, or None.

    Raises:
        ValueError: as :class:`Downlink`, for both a fraction and a codec.
    """
    if fraction is None and codec is None:
        return None
    return Downlink(fraction, bound, codec)
