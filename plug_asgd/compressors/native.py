"""Loops in C, where a C compiler is at hand: the sparse codecs' selection pass, a sparse fold, the quantisers.

The sparse codecs' selection (:func:`plug_asgd.compressors.difference.largest_differences`) reads the worker's
weights and the central model once, keeping the coordinates above a sampled threshold. In numpy that pass is six
calls per chunk (difference, magnitude, comparison, negation, indices, gather): at ResNet size it runs at a fifth
of the memory's speed, and each call takes the interpreter's lock back, which the training thread needs. Here the
same float32 operations run in one C loop, called through :mod:`ctypes` (which lets go of the interpreter's lock
for the whole call): the same indices and values, bit for bit (``tests/test_native.py``), since the difference,
the scaling and the residual's sum are the same IEEE operations, in the same order, compiled without contraction
into fused multiply-adds.

A sparse update's fold (``target.flat[indices] += values``: the PS folding a sparse push, a worker adding what it
sent to its held model) is one loop too, :func:`scatter_add`, where numpy's fancy indexing reads, adds and writes
in three passes: the same float32 additions, so the same bits. So is a dense one's out of place with the check
that every result is finite (:func:`add_finite`, ``kernels/fold.c``), where numpy adds, then reads the result
again to check it.

The quantisers' passes (``kernels/quantize.c``): sign's encoding (the sign bits and the sum of magnitudes in one
pass), qsgd's (the sum of squares, then the levels with their random draws and the sign bits), and both decodings,
where numpy makes each in several passes over the tensor and a temporary per pass. Their sums and draws follow rules
numpy's path follows too (:mod:`.quantize`), and qsgd's decoding computes ``±level * step`` in float64 as numpy
does: the same bits either way (``tests/test_native_quantize.py``).

The sources (``kernels/*.c``) are built once per machine and compiler (:mod:`.native_build`), and loaded after.
Where there is no compiler, or the compilation fails, or on a big-endian machine, or with ``PLUG_ASGD_NATIVE=0``,
:func:`library` is None and numpy does it all: the same results, slower (``docs/limits.md``). Where the loops cannot
be built (no compiler, a failed build, no cache folder) the process logs a warning, once, saying what to install;
``PLUG_ASGD_NATIVE=0`` chooses numpy and says nothing.

A worker's guess of an "own" reply writes the PS's sum ``c + decoded`` to its weights and to its next held model in
one pass (:func:`add_twice`). The passes that decode a packed update and add it in the same loop are
:mod:`.fused`'s.

PowerSGD's decoding, ``P @ Q.T`` (:func:`low_rank_product`, ``kernels/lowrank.c``), adds each value's ``r``
products in order, as :func:`plug_asgd.compressors.lowrank.low_rank_product`'s numpy path does: the PS and a worker
on another kind of CPU decode the same bits, which a BLAS product (its kernel chosen per CPU) does not promise.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys
import threading

import numpy as np

from plug_asgd.compressors.native_build import (
    NoCompiler,
    build,
    cache_dir,
    cached_path,
    compiler_identity,
    find_compiler,
    sources,
)

log = logging.getLogger(__name__)


DIFFERENCE, ADDED, MADE = 0, 1, 2  # the modes: v = w - c, r += s * (w - c), v = r

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # [the library], or [None] where it cannot be had


_P, _I64, _F32, _F64, _INT, _U32 = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_int,
                                    ctypes.c_uint32)
SIGNATURES: dict[str, tuple[object, list[object]]] = {  # each loop's return and argument types
    "plug_asgd_above": (_I64, [_P, _P, _P, _I64, _F32, _F32, _INT, _P, _P, _I64]),
    "plug_asgd_scatter_add": (_I64, [_P, _I64, _P, _P, _I64]),
    "plug_asgd_qsgd_decode": (None, [_P, _INT, _P, _I64, _F64, _P]),
    "plug_asgd_sign_encode": (_F64, [_P, _P, _I64, _F32, _P]),
    "plug_asgd_square_sum": (_F64, [_P, _P, _I64, _F32]),
    "plug_asgd_qsgd_encode": (None, [_P, _P, _I64, _F32, _F32, _F32, _U32, _U32, _INT, _P, _P]),
    "plug_asgd_sign_decode": (None, [_P, _I64, _F32, _P]),
    "plug_asgd_add_finite": (_INT, [_P, _P, _P, _I64, _F32]),
    "plug_asgd_low_rank_product": (None, [_P, _P, _I64, _I64, _I64, _P]),
    "plug_asgd_add_twice": (None, [_P, _P, _P, _P, _I64]),
    "plug_asgd_qsgd_add_twice": (None, [_P, _INT, _P, _I64, _F64, _P, _P, _P]),
    "plug_asgd_qsgd_add_finite": (_INT, [_P, _INT, _P, _I64, _F64, _P, _P, _F32]),
    "plug_asgd_sign_add_finite": (_INT, [_P, _I64, _F32, _P, _P, _F32]),
    "plug_asgd_low_rank_add_finite": (_INT, [_P, _P, _I64, _I64, _I64, _P, _P, _F32]),
}


def _load() -> ctypes.CDLL:
    """Build the loops where this compiler has not yet, and load them; raises where they cannot be had."""
    texts = sources()
    folder = cache_dir()  # (no home folder: RuntimeError)
    compiler = find_compiler()
    if compiler is None:
        raise NoCompiler(f"no C compiler found ({'$CC=' + os.environ['CC'] if os.environ.get('CC') else 'cc, gcc'})")
    target = cached_path(folder, texts, compiler_identity(compiler))
    if not target.exists():
        build(target, texts, compiler)
    lib = ctypes.CDLL(str(target))
    for name, (restype, argtypes) in SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled loops (built at the first call on this machine with this compiler, loaded after), or None where
    they cannot be had (no compiler, a failed build, no cache folder: a warning, once a process;
    ``PLUG_ASGD_NATIVE=0`` or a big-endian machine: no warning): the callers then use numpy."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if _loaded:
            return _loaded[0]
        found = None
        chosen_numpy = os.environ.get("PLUG_ASGD_NATIVE", "1") == "0"  # no warning: numpy was asked for
        if chosen_numpy:
            log.info("plug_asgd: PLUG_ASGD_NATIVE=0: numpy's loops are used")
        elif sys.byteorder != "little":  # (kernels/quantize.c): nothing to install would change it
            log.info("plug_asgd: the C loops are little-endian only; numpy's are used")
        else:
            try:
                found = _load()
            except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as exc:
                hint = ("install a C compiler (apt-get install gcc, or set CC to one)" if isinstance(exc, NoCompiler)
                        else "fix its cause (PLUG_ASGD_CACHE sets the folder they are built in)")
                log.warning("plug_asgd: the C loops cannot be built here (%s): the codecs' passes run in numpy, "
                            "the same results but slower (docs/limits.md). To have them, %s; to choose numpy and "
                            "silence this, set PLUG_ASGD_NATIVE=0", exc, hint)
        _loaded.append(found)
        return found


def _ptr(array: np.ndarray | None) -> int | None:
    return None if array is None else array.ctypes.data


def usable(*arrays: np.ndarray | None) -> bool:
    """Whether the pass can read these arrays as they are: float32, contiguous, one dimension (None: not passed).

    Args:
        arrays: the arrays the pass would read or write.
    """
    return all(a is None or (a.dtype == np.float32 and a.ndim == 1 and a.flags.c_contiguous) for a in arrays)


def above(threshold: float, w: np.ndarray | None, c: np.ndarray | None, residual: np.ndarray | None, scale: float,
          mode: int, cap: int) -> tuple[int, np.ndarray, np.ndarray] | None:
    """How many coordinates have ``|v|`` not below ``threshold`` (NaN included), and of them the first ``cap``:
    their ascending indices and ``v`` there, ``v`` as ``mode`` makes it (:data:`DIFFERENCE`, :data:`ADDED` into
    ``residual``, which holds ``v`` after, or :data:`MADE`: ``residual`` itself). None where the library is not
    available or the arrays are not as it reads them (:func:`usable`, of one size): the caller's numpy pass then
    does it.

    Args:
        threshold: the magnitude a coordinate must not be below (a float32 value).
        w: the worker's values (float32, flat, contiguous); None for ``MADE``.
        c: the central values it holds, of ``w``'s size; None for ``MADE``.
        residual: the residual added into (``ADDED``) or read (``MADE``); None for ``DIFFERENCE``.
        scale: the factor ``w - c`` is multiplied by (as a float32).
        mode: one of :data:`DIFFERENCE`, :data:`ADDED`, :data:`MADE`.
        cap: the most coordinates to return.
    """
    lib = library()
    read = (residual,) if mode == MADE else (w, c) if mode == DIFFERENCE else (w, c, residual)
    if lib is None or any(a is None for a in read) or not usable(*read):
        return None
    n = read[0].size  # type: ignore[union-attr]
    if any(a.size != n for a in read):  # type: ignore[union-attr]  # (numpy's pass says what is wrong)
        return None
    idx = np.empty(cap, dtype=np.int64)
    val = np.empty(cap, dtype=np.float32)
    found = lib.plug_asgd_above(_ptr(w), _ptr(c), _ptr(residual), n, float(np.float32(threshold)),
                                float(np.float32(scale)), mode, idx.ctypes.data, val.ctypes.data, cap)
    kept = min(found, cap)
    return found, idx[:kept], val[:kept]


def scatter_add(target: np.ndarray, indices: np.ndarray, values: np.ndarray) -> bool:
    """``target.flat[indices] += values`` in one C loop; False, with nothing written, where the library is not
    available, the arrays are not as it reads them (``target`` float32, contiguous and writeable; ``indices``
    int64 and ``values`` float32, flat, contiguous, of one size), or the indices do not ascend strictly within
    ``target``: the caller's numpy then does it.

    Args:
        target: the array added into, of any shape.
        indices: the flat indices, ascending.
        values: what is added at them.
    """
    lib = library()
    if (lib is None or target.dtype != np.float32 or not target.flags.c_contiguous or not target.flags.writeable
            or indices.dtype != np.int64 or values.dtype != np.float32 or indices.ndim != 1
            or values.shape != indices.shape or not indices.flags.c_contiguous or not values.flags.c_contiguous):
        return False
    done = lib.plug_asgd_scatter_add(target.ctypes.data, target.size, indices.ctypes.data, values.ctypes.data,
                                     indices.size)
    return done >= 0


def readable(array: np.ndarray, dtype: str, size: int) -> bool:
    """Whether a pass can read ``size`` values of ``dtype`` from ``array`` as it is (flat, contiguous).

    Args:
        array: what the pass would read.
        dtype: the dtype it reads.
        size: the values it reads.
    """
    return array.dtype == np.dtype(dtype) and array.ndim == 1 and array.size >= size and array.flags.c_contiguous


def qsgd_decode(levels: np.ndarray, signs: np.ndarray, numel: int, step: float) -> np.ndarray | None:
    """qsgd's ``numel`` float32 values from 8- or 16-bit levels and sign bits (``QSGD.decode_packed``'s: ``±level *
    step`` in float64, rounded), in one C loop; None where the library is not available or the arrays are not
    flat contiguous uint8 or uint16 levels and uint8 signs of enough values.

    Args:
        levels: one level per coordinate, uint8 or uint16.
        signs: the sign bits, least significant first (set: negative).
        numel: the coordinates decoded.
        step: the value of one level, ``norm / (2**bits - 1)``.
    """
    lib = library()
    wide = levels.dtype == np.uint16
    if (lib is None or not readable(levels, "uint16" if wide else "uint8", numel)
            or not readable(signs, "uint8", -(-numel // 8))):
        return None
    out = np.empty(numel, dtype=np.float32)
    lib.plug_asgd_qsgd_decode(levels.ctypes.data, int(wide), signs.ctypes.data, numel, float(step), out.ctypes.data)
    return out


def _reading(w: np.ndarray, c: np.ndarray | None) -> ctypes.CDLL | None:
    """The library, where it can read ``w`` and ``c`` (flat contiguous float32 of one size, ``c`` possibly None)."""
    lib = library()
    return lib if lib is not None and usable(w, c) and (c is None or c.size == w.size) else None


def sign_encode(w: np.ndarray, c: np.ndarray | None, scale: float) -> tuple[np.ndarray, float] | None:
    """Sign's bits of ``x = scale * (w - c)`` (``w`` where ``c`` is None) and the sum of ``|x|`` in float64 (the
    eight lanes' rule, :func:`plug_asgd.compressors.quantize.lane_sum`), in one C pass; None where the library is
    not available or the arrays are not flat contiguous float32 of one size.

    Args:
        w: the worker's values.
        c: the central values it holds, or None.
        scale: the factor of ``w - c`` (a float32).
    """
    lib = _reading(w, c)
    if lib is None:
        return None
    bits = np.empty(-(-w.size // 8), dtype=np.uint8)
    total = lib.plug_asgd_sign_encode(w.ctypes.data, _ptr(c), w.size, float(np.float32(scale)), bits.ctypes.data)
    return bits, float(total)


def square_sum(w: np.ndarray, c: np.ndarray | None, scale: float) -> float | None:
    """The sum of ``x * x`` (float32 squares, summed in float64 by the eight lanes' rule) of ``x = scale * (w -
    c)``; None where :func:`sign_encode` would be.

    Args:
        w: the values squared, less ``c``'s.
        c: what is taken from them first, or None.
        scale: the factor applied before squaring (a float32).
    """
    if (lib := _reading(w, c)) is None:
        return None
    return float(lib.plug_asgd_square_sum(w.ctypes.data, _ptr(c), w.size, float(np.float32(scale))))


def qsgd_encode(w: np.ndarray, c: np.ndarray | None, scale: float, ratio: float, top: int, keys: tuple[int, int],
                wide: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """qsgd's levels and sign bits of ``x = scale * (w - c)`` in one C pass (the rule of
    :meth:`plug_asgd.compressors.quantize.QSGD.levels_of`); None where :func:`sign_encode` would be.

    Args:
        w: the worker's values.
        c: the central values it holds, or None.
        scale: the factor of ``w - c`` (a float32).
        ratio: the levels per unit of magnitude, ``top / norm`` (a float32).
        top: the highest level, ``2**bits - 1``.
        keys: the two 32-bit keys of this tensor's draws.
        wide: 16-bit levels (else bytes).
    """
    lib = _reading(w, c)
    if lib is None:
        return None
    levels = np.empty(w.size, dtype=np.uint16 if wide else np.uint8)
    bits = np.empty(-(-w.size // 8), dtype=np.uint8)
    lib.plug_asgd_qsgd_encode(w.ctypes.data, _ptr(c), w.size, float(np.float32(scale)), float(np.float32(ratio)),
                              float(top), keys[0], keys[1], int(wide), levels.ctypes.data, bits.ctypes.data)
    return levels, bits


def sign_decode(bits: np.ndarray, numel: int, value: float) -> np.ndarray | None:
    """``numel`` float32 values, ``-value`` where a bit is set and ``value`` elsewhere, in one C loop; None where the
    library is not available or ``bits`` is not flat contiguous uint8 of enough bytes.

    Args:
        bits: the sign bits, least significant first.
        numel: the coordinates decoded.
        value: the magnitude every coordinate decodes to (a float32).
    """
    lib = library()
    if lib is None or not readable(bits, "uint8", -(-numel // 8)):
        return None
    out = np.empty(numel, dtype=np.float32)
    lib.plug_asgd_sign_decode(bits.ctypes.data, numel, float(np.float32(value)), out.ctypes.data)
    return out


def add_finite(update: np.ndarray, central: np.ndarray, out: np.ndarray, scale: float) -> bool | None:
    """``out = update + central`` (``update * scale + central`` where ``scale`` is not 1: numpy's float32
    operations) in one C pass, and whether every value written is finite; None, with nothing written, where the
    library is not available or the arrays are not flat contiguous float32 of one size (``out`` writeable).

    Args:
        update: the update folded in.
        central: the central values it is added to.
        out: where the sums go (may be ``central`` itself).
        scale: the update's factor (a float32).
    """
    lib = library()
    if (lib is None or not usable(update, central, out) or not update.size == central.size == out.size
            or not out.flags.writeable):
        return None
    return bool(lib.plug_asgd_add_finite(update.ctypes.data, central.ctypes.data, out.ctypes.data, out.size,
                                         float(np.float32(scale))))


def add_twice(update: np.ndarray, central: np.ndarray, out: np.ndarray, again: np.ndarray) -> None:
    """``out = again = update + central`` (numpy's float32 addition, so the PS's fold's bits), reading the two once;
    numpy's add and copy where the library is not available or the arrays are not flat contiguous float32 of one
    size (``out`` and ``again`` writeable, neither one of the others).

    Args:
        update: the decoded update.
        central: the central values it is added to.
        out: one array the sums go to.
        again: another.
    """
    lib = library()
    arrays = (update, central, out, again)
    if (lib is not None and usable(*arrays) and len({a.size for a in arrays}) == 1 and out.flags.writeable
            and again.flags.writeable and len({a.ctypes.data for a in arrays}) == 4):
        lib.plug_asgd_add_twice(update.ctypes.data, central.ctypes.data, out.ctypes.data, again.ctypes.data,
                                out.size)
        return
    np.add(update, central, out=again)
    np.copyto(out, again)


def low_rank_product(p: np.ndarray, qt: np.ndarray, out: np.ndarray) -> bool:
    """``out = p @ qt`` for ``p [n, r]`` and ``qt [r, m]`` in one C pass over ``out``, each value's ``r`` float32
    products added in order; False, with nothing written, where the library is not available or the arrays are not
    C-contiguous float32 of those shapes (``out [n, m]``, writeable).

    Args:
        p: the left factor.
        qt: the right factor, transposed.
        out: where the product goes.
    """
    lib = library()
    if (lib is None or p.ndim != 2 or qt.ndim != 2 or out.ndim != 2 or p.shape[1] != qt.shape[0]
            or out.shape != (p.shape[0], qt.shape[1]) or p.shape[1] < 1 or not out.flags.writeable
            or any(a.dtype != np.float32 or not a.flags.c_contiguous for a in (p, qt, out))):
        return False
    (n, r), m = p.shape, qt.shape[1]
    lib.plug_asgd_low_rank_product(p.ctypes.data, qt.ctypes.data, n, m, r, out.ctypes.data)
    return True
