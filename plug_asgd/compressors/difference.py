"""Encoding the difference of two arrays without making it whole: the worker's update is ``w - c``.

A worker whose base is the central model it holds (``c``) pushes ``w - c`` (plus what error feedback
keeps). Made whole, that difference costs a pass that writes the model's size, and a codec then reads
it again once or more: at ResNet size each pass over the model costs about as much as a training step
of a small batch. Here each tensor is walked in chunks small enough to stay in the core's cache
(:data:`CHUNK` values): the difference of a chunk is made, used and forgotten, so the model is read
once and written nowhere. The functions take flat float arrays; the results are those of the plain
computation on the whole difference, bit for bit (the same float operations on the same values).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import numpy as np

from plug_asgd.compressors import native

# values per chunk: four float32 arrays of it (the two read, two scratch) fit a core's 1 MiB L2 cache
CHUNK = 1 << 16

# a tensor of at least this many coordinates, of which at most 1/FEW_ASKED are asked for, has its top k chosen
# among the coordinates above a threshold estimated from a strided sample of SAMPLE of them (top_k)
SAMPLED_FROM = 65_536
FEW_ASKED = 16
SAMPLE = 8192


class Scratch:
    """Per-chunk work arrays, kept across calls (no allocation per push)."""

    def __init__(self) -> None:
        self.values = np.empty(0, dtype=np.float32)
        self.magnitudes = np.empty(0, dtype=np.float32)
        self.mask = np.empty(0, dtype=bool)

    def get(self, size: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Two float arrays of ``size`` values of ``dtype`` and a mask of ``size``.

        Args:
            size: the values each array holds (at most :data:`CHUNK` where the callers walk in chunks).
            dtype: the float arrays' dtype; another than the last call's replaces the kept arrays.
        """
        if self.values.size < size or self.values.dtype != dtype:
            self.values = np.empty(size, dtype=dtype)
            self.magnitudes = np.empty(size, dtype=dtype)
            self.mask = np.empty(size, dtype=bool)
        return self.values[:size], self.magnitudes[:size], self.mask[:size]


_scratch = threading.local()


def scratch() -> Scratch:
    """This thread's scratch: the encoders of several tensors may run at once, each in a thread of its own."""
    found = getattr(_scratch, "arrays", None)
    if found is None:
        found = _scratch.arrays = Scratch()
    return found


def chunks(size: int, chunk: int = CHUNK) -> Iterator[slice]:
    """Consecutive slices of ``chunk`` values covering ``range(size)``.

    Args:
        size: the values to cover.
        chunk: the values per slice (the last one may hold fewer).
    """
    for start in range(0, size, chunk):
        yield slice(start, min(size, start + chunk))


def difference(out: np.ndarray, w: np.ndarray, c: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """``out = scale * (w - c)``, whole (the codecs that need all of it at once).

    Args:
        out: the array written and returned, of ``w``'s shape.
        w: the worker's values.
        c: the central values it holds, of ``w``'s shape.
        scale: the factor the difference is multiplied by, in ``out``'s dtype (1: not multiplied).
    """
    np.subtract(w, c, out=out)
    if scale != 1.0:
        out *= out.dtype.type(scale)
    return out


def accumulate(residual: np.ndarray, w: np.ndarray, c: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """``residual += scale * (w - c)`` in chunks: the difference is never whole. Returns ``residual``. In one C
    pass where it can (:func:`.native.above` keeping nothing: the same float32 operations, the same bits).

    Args:
        residual: the flat array added into.
        w: the worker's values, flat, of ``residual``'s size.
        c: the central values it holds, flat, of ``residual``'s size.
        scale: the factor the difference is multiplied by before it is added.
    """
    if native.above(np.inf, w, c, residual, scale, native.ADDED, 0) is not None:
        return residual
    arrays = scratch()
    for part in chunks(residual.size):
        d, _, _ = arrays.get(part.stop - part.start, residual.dtype)
        difference(d, w[part], c[part], scale)
        residual[part] += d
    return residual


def top_k(mag: np.ndarray, k: int) -> np.ndarray:
    """Ascending indices of the ``k`` largest of ``mag`` (NaN ranking largest), ties at the k-th value going to the
    lowest indices (:func:`ascending_top`).

    Where few are asked for, a threshold is read off a strided sample (the sample's quantile that about
    ``FACTORS[0] * k`` of the whole exceed) and only the coordinates at or above it (NaN included) are
    partitioned: exact whenever at least k are, which is checked, else again lower (``FACTORS[1] * k``);
    where that lets too few or too many through (a tensor of many equal values), the whole is partitioned.

    Args:
        mag: the magnitudes, flat.
        k: how many to choose, at most ``mag.size``.
    """
    n = mag.size
    if sampled(n, k):
        sample = mag[:: n // SAMPLE]
        for factor in FACTORS:
            threshold = sample_threshold(sample, n, k, factor)
            candidates = np.flatnonzero(np.logical_not(mag < threshold))  # not below: NaN is a candidate, as it
            # is the largest for argpartition
            if k <= candidates.size <= n // 4:  # every value tied with the k-th is among them
                return candidates[ascending_top(mag[candidates], k)]
    return ascending_top(mag, k)


def lowest_on_ties(mag: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """``chosen``, positions of the ``k`` largest of ``mag`` (NaN ranking largest), made the set whose values tied
    with the k-th largest are those of the lowest positions: the rule the device's selection follows too
    (:func:`plug_asgd.worker.exchange.held_device.largest_differences`), where a partition or ``torch.topk`` may
    take any of them. One pass over ``mag`` to see whether a tie crosses the boundary; two more where one does.

    Args:
        mag: the magnitudes chosen among, flat.
        chosen: the positions of its ``k`` largest, in any order.
    """
    if chosen.size in (0, mag.size):
        return chosen
    picked = mag[chosen]
    nan = np.isnan(picked)
    if nan.all():  # the k-th largest is a NaN: the lowest NaNs
        return np.flatnonzero(np.isnan(mag))[: chosen.size]
    kth = picked[~nan].min()
    if np.count_nonzero(mag == kth) == np.count_nonzero(picked == kth):
        return chosen  # no value tied with the k-th left out
    above = np.flatnonzero((mag > kth) | np.isnan(mag))
    return np.concatenate([above, np.flatnonzero(mag == kth)[: chosen.size - above.size]])


def ascending_top(mag: np.ndarray, k: int) -> np.ndarray:
    """The positions :func:`lowest_on_ties` makes of the ``k`` largest of ``mag``, ascending: read off the k-th
    largest value (a partition of the values, not of their positions) in two comparisons, where a partition of
    positions, the tie check and a sort took three times as long. Where a NaN is among the values, the partition
    of positions (NaN ranking largest) decides.

    Args:
        mag: the magnitudes chosen among, flat.
        k: how many to choose (none where ``k <= 0``, all where ``k >= mag.size``).
    """
    if k <= 0:
        return np.zeros(0, dtype=np.intp)
    if k >= mag.size:
        return np.arange(mag.size)
    kth = np.partition(mag, mag.size - k)[mag.size - k]
    if np.isnan(kth) or np.isnan(mag).any():
        chosen = lowest_on_ties(mag, np.argpartition(mag, mag.size - k)[mag.size - k:])
        chosen.sort()
        return chosen
    keep = mag > kth
    ties = np.flatnonzero(mag == kth)[: k - np.count_nonzero(keep)]
    keep[ties] = True
    return np.flatnonzero(keep)


# The sampled threshold lets through about FACTORS[0] * k coordinates: few, since finding them (np.flatnonzero)
# costs about in proportion; a sample that misjudged it (fewer than k through) is read again for FACTORS[1] * k.
FACTORS = (1.25, 3.0)


def sampled(n: int, k: int) -> bool:
    """Whether the top ``k`` of ``n`` are chosen above a sampled threshold (few asked of many).

    Args:
        n: the values chosen among.
        k: how many are asked for.
    """
    return n >= SAMPLED_FROM and k * FEW_ASKED <= n


def sample_threshold(sample: np.ndarray, n: int, k: int, factor: float) -> np.floating:
    """The value about ``factor * k`` of ``n`` exceed, read off ``sample`` (magnitudes at a stride of
    ``n // SAMPLE``).

    Args:
        sample: the magnitudes at a stride of ``n // SAMPLE``.
        n: the values the sample was taken from.
        k: how many of them are asked for.
        factor: how many times ``k`` the threshold is to let through (one of :data:`FACTORS`).
    """
    above = min(sample.size - 1, math.ceil(factor * k * sample.size / n))
    return np.partition(sample, sample.size - 1 - above)[sample.size - 1 - above]


def largest_differences(w: np.ndarray, c: np.ndarray, k: int, residual: np.ndarray | None = None,
                        scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Ascending int64 indices of the ``k`` largest ``|v|`` and ``v`` there, exact zeros left out, where ``v`` is
    ``w - c`` (``residual`` None) or ``residual + scale * (w - c)``, written into ``residual``.

    The same indices as :func:`plug_asgd.compressors.sparse.largest_magnitudes` of ``v`` made whole, and
    the same values: the threshold is read off ``|v|`` at the same sample positions, computed there alone,
    and the candidates are gathered chunk by chunk.

    Args:
        w: the worker's values, flat.
        c: the central values it holds, flat, of ``w``'s size.
        k: how many coordinates to choose.
        residual: error feedback's residual, flat, which ``v`` is added into and left in; None: no residual.
        scale: the factor ``w - c`` is multiplied by.
    """
    n = w.size
    if k >= n or not sampled(n, k):
        return _whole(w, c, k, residual, scale)
    positions = slice(None, None, n // SAMPLE)
    sample = np.abs(_v(w[positions], c[positions], residual[positions] if residual is not None else None, scale))
    candidates, signed = _above(sample_threshold(sample, n, k, FACTORS[0]), w, c, residual, scale)
    if candidates is not None and candidates.size < k:  # the sample misjudged the threshold: again, lower (the
        # residual holds v by now)
        candidates, signed = _above(sample_threshold(sample, n, k, FACTORS[1]), w, c, residual, scale,
                                    made=residual is not None)
    if candidates is None or not k <= candidates.size <= n // 4:  # too few or too many above the threshold:
        # partition the whole
        if residual is not None:
            return _chosen(residual, ascending_top(np.abs(residual), k))
        return _whole(w, c, k, None, scale)
    # the top k of the candidates; positions in them ascend as their indices do
    pos = ascending_top(np.abs(signed), k)
    pos = pos[signed[pos] != 0]
    return candidates[pos].astype(np.int64, copy=False), signed[pos]


def _above(threshold: np.floating, w: np.ndarray, c: np.ndarray, residual: np.ndarray | None, scale: float,
           made: bool = False) -> tuple[np.ndarray, np.ndarray] | tuple[None, None]:
    """The indices where ``|v|`` is not below ``threshold`` (NaN too, as argpartition ranks it largest) and ``v``
    there, in one pass of C where it can be had (:mod:`.native`), else chunk by chunk; ``v`` as
    :func:`largest_differences`'s, added into ``residual`` unless ``made`` (the residual holds ``v`` already).
    ``(None, None)``: more than a quarter of the coordinates are (the C pass counts them without keeping them)."""
    mode = native.DIFFERENCE if residual is None else native.MADE if made else native.ADDED
    cap = w.size // 4
    got = native.above(threshold, w, c, residual, scale, mode, cap)
    if got is not None:
        count, idx, values = got
        return (idx, values) if count <= cap else (None, None)
    arrays = scratch()
    found: list[np.ndarray] = []
    values: list[np.ndarray] = []
    for part in chunks(w.size):
        d, mag, mask = arrays.get(part.stop - part.start, w.dtype)
        if residual is not None and made:
            d = residual[part]
        else:
            difference(d, w[part], c[part], scale)
            if residual is not None:
                r = residual[part]
                r += d
                d = r
        np.abs(d, out=mag)
        np.less(mag, threshold, out=mask)
        np.logical_not(mask, out=mask)
        idx = np.flatnonzero(mask)
        found.append(idx + part.start)
        values.append(d[idx])  # gathered while the chunk is in cache, signed
    return np.concatenate(found), np.concatenate(values)


def _v(w: np.ndarray, c: np.ndarray, residual: np.ndarray | None, scale: float) -> np.ndarray:
    """``residual + scale * (w - c)`` (``w - c`` scaled, where no residual), computed as the chunks compute it."""
    v = difference(np.empty_like(w), w, c, scale)
    if residual is not None:
        v = residual + v
    return v


def _whole(w: np.ndarray, c: np.ndarray, k: int, residual: np.ndarray | None,
           scale: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`largest_differences` with ``v`` made whole (small tensors, or most of a tensor asked for)."""
    if residual is not None:
        accumulate(residual, w, c, scale)
        v = residual
    else:
        v = difference(np.empty_like(w), w, c, scale)
    if k >= v.size:
        return _chosen(v, np.arange(v.size))
    return _chosen(v, top_k(np.abs(v), k))


def _chosen(v: np.ndarray, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``chosen`` (ascending) without the exact zeros of ``v``, as int64, and ``v`` there."""
    chosen = chosen[v[chosen] != 0].astype(np.int64, copy=False)
    return chosen, v[chosen]
