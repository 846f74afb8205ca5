"""A packed update decoded and added to the central values in one C pass, its decoding never written whole.

numpy decodes a packed tensor (qsgd's levels, sign's bits, PowerSGD's factors) into a new array of the model's
size, which the fold then reads again beside the central values. Here the values are decoded a block at a time
(2,048 values, a row of ``P @ Q.T``) into a buffer that stays in L1 and added from there: the PS's fold out of
place, checked for NaN/Inf (:func:`qsgd_add_finite`, :func:`sign_add_finite`, :func:`low_rank_add_finite`; the
codecs' ``fold_packed``), and a worker's guess of an "own" reply, written to its weights and its next held model
(:func:`qsgd_add_twice`). Each block is decoded by the decoding's own loop and added by the fold's (one loop
that decoded and added each value ran slower than the two): the same bits as decoding, then adding
(``tests/test_fused.py``). Each returns False or None, with nothing written, where the C library is not at hand
or the arrays are not as it reads them; the caller then decodes and adds.
"""

from __future__ import annotations

import numpy as np

from plug_asgd.compressors import native
from plug_asgd.compressors.native import readable, usable


def contiguous(*arrays: np.ndarray) -> bool:
    """Whether each array is C-contiguous: its flat view (``reshape(-1)``) is itself, not a copy a pass would write.

    Args:
        arrays: the arrays a pass reads or writes.
    """
    return all(a.flags.c_contiguous for a in arrays)


def _folds(central: np.ndarray, out: np.ndarray) -> bool:
    """Whether a fused fold can read ``central`` and write ``out``: flat contiguous float32 of one size."""
    return usable(central, out) and central.size == out.size and out.flags.writeable


def _levels_readable(levels: np.ndarray, signs: np.ndarray, numel: int) -> bool:
    wide = levels.dtype == np.uint16
    return readable(levels, "uint16" if wide else "uint8", numel) and readable(signs, "uint8", -(-numel // 8))


def qsgd_add_twice(levels: np.ndarray, signs: np.ndarray, step: float, central: np.ndarray, out: np.ndarray,
                   again: np.ndarray) -> bool:
    """``out = again = decoded + central``, ``decoded`` being qsgd's values as
    :func:`plug_asgd.compressors.native.qsgd_decode` makes them and the sum the PS's fold's (the same bits as
    decoding, then :func:`plug_asgd.compressors.native.add_twice`); False, with nothing written, where the pass
    cannot be had.

    Args:
        levels: one level per coordinate, uint8 or uint16.
        signs: the sign bits, least significant first (set: negative).
        step: the value of one level.
        central: the central values, flat float32.
        out: one array the sums go to.
        again: another.
    """
    lib = native.library()
    if (lib is None or not _folds(central, out) or not _folds(central, again)
            or not _levels_readable(levels, signs, central.size)):
        return False
    lib.plug_asgd_qsgd_add_twice(levels.ctypes.data, int(levels.dtype == np.uint16), signs.ctypes.data, central.size,
                                 float(step), central.ctypes.data, out.ctypes.data, again.ctypes.data)
    return True


def qsgd_add_finite(levels: np.ndarray, signs: np.ndarray, step: float, central: np.ndarray, out: np.ndarray,
                    scale: float) -> bool | None:
    """``out = decoded * scale + central`` (``decoded + central`` where ``scale`` is 1), ``decoded`` qsgd's values,
    and whether every value written is finite: the bits of decoding, then
    :func:`plug_asgd.compressors.native.add_finite`; None, with nothing written, where the pass cannot be had.

    Args:
        levels: one level per coordinate, uint8 or uint16.
        signs: the sign bits, least significant first (set: negative).
        step: the value of one level.
        central: the central values, flat float32.
        out: where the sums go (may be ``central``).
        scale: the update's factor (a float32).
    """
    lib = native.library()
    if lib is None or not _folds(central, out) or not _levels_readable(levels, signs, central.size):
        return None
    return bool(lib.plug_asgd_qsgd_add_finite(levels.ctypes.data, int(levels.dtype == np.uint16), signs.ctypes.data,
                                              central.size, float(step), central.ctypes.data, out.ctypes.data,
                                              float(np.float32(scale))))


def sign_add_finite(bits: np.ndarray, value: float, central: np.ndarray, out: np.ndarray,
                    scale: float) -> bool | None:
    """``out = decoded * scale + central`` (``decoded + central`` where ``scale`` is 1), ``decoded`` sign's values
    (``-value`` where a bit is set, ``value`` elsewhere), and whether every value written is finite; None, with
    nothing written, where the pass cannot be had.

    Args:
        bits: the sign bits, least significant first.
        value: the magnitude every coordinate decodes to (a float32).
        central: the central values, flat float32.
        out: where the sums go (may be ``central``).
        scale: the update's factor (a float32).
    """
    lib = native.library()
    if lib is None or not _folds(central, out) or not readable(bits, "uint8", -(-central.size // 8)):
        return None
    return bool(lib.plug_asgd_sign_add_finite(bits.ctypes.data, central.size, float(np.float32(value)),
                                              central.ctypes.data, out.ctypes.data, float(np.float32(scale))))


def low_rank_add_finite(p: np.ndarray, qt: np.ndarray, central: np.ndarray, out: np.ndarray,
                        scale: float) -> bool | None:
    """``out = (p @ qt) * scale + central`` (without ``scale`` where it is 1), the product as
    :func:`plug_asgd.compressors.lowrank.low_rank_product` makes it, and whether every value written is finite;
    None, with nothing written, where the pass cannot be had (``p [n, r]``, ``qt [r, m]``, ``central`` and ``out``
    ``[n, m]``, all C-contiguous float32).

    Args:
        p: the left factor.
        qt: the right factor, transposed.
        central: the central values.
        out: where the sums go (not ``central``: each row of the product is made there first).
        scale: the update's factor (a float32).
    """
    lib = native.library()
    if (lib is None or p.ndim != 2 or qt.ndim != 2 or p.shape[1] != qt.shape[0] or p.shape[1] < 1
            or central.shape != (p.shape[0], qt.shape[1]) or out.shape != central.shape or not out.flags.writeable
            or np.shares_memory(out, central)
            or any(a.dtype != np.float32 or not a.flags.c_contiguous for a in (p, qt, central, out))):
        return None
    (n, r), m = p.shape, qt.shape[1]
    return bool(lib.plug_asgd_low_rank_add_finite(p.ctypes.data, qt.ctypes.data, n, m, r, central.ctypes.data,
                                                  out.ctypes.data, float(np.float32(scale))))
