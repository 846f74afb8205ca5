"""Loops in C, where a C compiler is at hand: the sparse codecs' selection pass, a sparse fold, qsgd's decoding.

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
in three passes: the same float32 additions, so the same bits. And qsgd's decoding (:func:`qsgd_decode`), which
numpy makes in five passes over the tensor (the sign bits unpacked, the signs, the signed levels, their float64
values, float32), reads each level's value from a table of the ``2 * 2**bits`` results, computed by the same
float64 product: the same bits.

The source is compiled once per machine by the system's C compiler (``cc``, or ``$CC``) into
``$PLUG_ASGD_CACHE`` (default ``~/.cache/plug_asgd``), and loaded from there after. Where there is no compiler,
or ``PLUG_ASGD_NATIVE=0``, or the compilation fails, :func:`library` is None and numpy does it all: the same
results, slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdint.h>

/* Compiled twice on x86-64 (AVX2 and the baseline), the loader picking the one the CPU runs. */
#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* Blocks of BLOCK values, made branch-free (vectorised): v = w - c (mode 0), r += s * (w - c) written back
   (mode 1), or r itself (mode 2), the scale s applied only where it is not 1, as numpy's path does. A block
   with a coordinate where !(|v| < t) (NaN included) is then compacted: its index and v appended to idx and
   val while fewer than cap were found. Returns how many were found, which may exceed cap. */
#define BLOCK 16
CLONES
int64_t plug_asgd_above(const float *w, const float *c, float *r, int64_t n, float t, float s, int mode,
                        int64_t *idx, float *val, int64_t cap) {
    int64_t m = 0;
    float v[BLOCK];
    for (int64_t b = 0; b < n; b += BLOCK) {
        int64_t len = n - b < BLOCK ? n - b : BLOCK;
        int hit = 0;
        if (mode == 2) {
            for (int64_t j = 0; j < len; j++) { v[j] = r[b + j]; hit |= !(fabsf(v[j]) < t); }
        } else if (mode == 1 && s != 1.0f) {
            for (int64_t j = 0; j < len; j++) {
                float d = r[b + j] + (w[b + j] - c[b + j]) * s;
                r[b + j] = d; v[j] = d; hit |= !(fabsf(d) < t);
            }
        } else if (mode == 1) {
            for (int64_t j = 0; j < len; j++) {
                float d = r[b + j] + (w[b + j] - c[b + j]);
                r[b + j] = d; v[j] = d; hit |= !(fabsf(d) < t);
            }
        } else if (s != 1.0f) {
            for (int64_t j = 0; j < len; j++) { v[j] = (w[b + j] - c[b + j]) * s; hit |= !(fabsf(v[j]) < t); }
        } else {
            for (int64_t j = 0; j < len; j++) { v[j] = w[b + j] - c[b + j]; hit |= !(fabsf(v[j]) < t); }
        }
        if (!hit) continue;
        if (m + len <= cap) {  /* room for the whole block: written unconditionally, kept where a hit */
            for (int64_t j = 0; j < len; j++) { idx[m] = b + j; val[m] = v[j]; m += !(fabsf(v[j]) < t); }
        } else {
            for (int64_t j = 0; j < len; j++) {
                if (!(fabsf(v[j]) < t)) {
                    if (m < cap) { idx[m] = b + j; val[m] = v[j]; }
                    m++;
                }
            }
        }
    }
    return m;
}

/* dst[idx[i]] += val[i] for i in [0, k): a sparse update folded in. Unless the indices ascend strictly within
   [0, n), nothing is written and -1 is returned. */
int64_t plug_asgd_scatter_add(float *dst, int64_t n, const int64_t *idx, const float *val, int64_t k) {
    int64_t prev = -1;
    for (int64_t i = 0; i < k; i++) {
        if (idx[i] <= prev || idx[i] >= n) return -1;
        prev = idx[i];
    }
    for (int64_t i = 0; i < k; i++) dst[idx[i]] += val[i];
    return k;
}

/* qsgd's decoding (compressors/quantize.py, QSGD.decode_packed): the level (8 or 16 bits) times 1 - 2 * its
   sign bit, in int32, times q in float64, rounded to float32; each of the 2 * 2**bits results computed once into
   table (of that size). */
CLONES
void plug_asgd_qsgd_decode(const void *levels, int wide, const uint8_t *signs, int64_t n, double q, float *table,
                           float *out) {
    const uint8_t *narrow = (const uint8_t *)levels;
    const uint16_t *words = (const uint16_t *)levels;
    int32_t count = wide ? 65536 : 256;
    for (int32_t level = 0; level < count; level++) {
        table[level] = (float)((double)level * q);
        table[count + level] = (float)((double)(-level) * q);
    }
    if (wide) {
        for (int64_t i = 0; i < n; i++) out[i] = table[(((signs[i >> 3] >> (i & 7)) & 1) << 16) | words[i]];
    } else {
        for (int64_t i = 0; i < n; i++) out[i] = table[(((signs[i >> 3] >> (i & 7)) & 1) << 8) | narrow[i]];
    }
}
"""

# -O3 vectorises the blocks; no -march (a cache shared by other machines must run there too: the AVX2 clone is
# chosen at load time), no fast-math and no contraction: the float operations stay those numpy does
FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math")
DIFFERENCE, ADDED, MADE = 0, 1, 2  # the modes: v = w - c, r += s * (w - c), v = r

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # [the library], or [None] where it cannot be had


def cache_dir() -> Path:
    """Where the compiled loops are kept: ``$PLUG_ASGD_CACHE``, else ``$XDG_CACHE_HOME/plug_asgd``, else
    ``~/.cache/plug_asgd``."""
    explicit = os.environ.get("PLUG_ASGD_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plug_asgd"


def _build(target: Path) -> None:
    """Compile :data:`SOURCE` into ``target``, written whole or not at all (another process may build it too)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc) found")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        source = Path(tmp) / "above.c"
        source.write_text(SOURCE)
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, "-o", str(built), str(source), "-lm"], check=True, capture_output=True,
                       timeout=120)
        os.replace(built, target)


def library() -> ctypes.CDLL | None:
    """The compiled loops (built at the first call on this machine, loaded after), or None where they cannot be
    had (no compiler, ``PLUG_ASGD_NATIVE=0``, a failed build): the callers then use numpy."""
    if _loaded:
        return _loaded[0]
    with _lock:
        if _loaded:
            return _loaded[0]
        found = None
        if os.environ.get("PLUG_ASGD_NATIVE", "1") != "0":
            digest = hashlib.sha256((SOURCE + " ".join(FLAGS)).encode()).hexdigest()[:16]
            try:
                target = cache_dir() / f"native-{digest}.so"  # (no home folder: RuntimeError)
                if not target.exists():
                    _build(target)
                lib = ctypes.CDLL(str(target))
                lib.plug_asgd_above.restype = ctypes.c_int64
                lib.plug_asgd_above.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                ctypes.c_float, ctypes.c_float, ctypes.c_int, ctypes.c_void_p,
                                                ctypes.c_void_p, ctypes.c_int64]
                lib.plug_asgd_scatter_add.restype = ctypes.c_int64
                lib.plug_asgd_scatter_add.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                      ctypes.c_void_p, ctypes.c_int64]
                lib.plug_asgd_qsgd_decode.restype = None
                lib.plug_asgd_qsgd_decode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                                      ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p]
                found = lib
            except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as exc:
                log.info("plug_asgd: the C loops are not available (%s); numpy's are used", exc)
        _loaded.append(found)
        return found


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

    def ptr(a: np.ndarray | None) -> int | None:
        return None if a is None else a.ctypes.data

    found = lib.plug_asgd_above(ptr(w), ptr(c), ptr(residual), n, float(np.float32(threshold)),
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


def _readable(array: np.ndarray, dtype: str, size: int) -> bool:
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
    if (lib is None or not _readable(levels, "uint16" if wide else "uint8", numel)
            or not _readable(signs, "uint8", -(-numel // 8))):
        return None
    out = np.empty(numel, dtype=np.float32)
    table = np.empty(2 << (16 if wide else 8), dtype=np.float32)
    lib.plug_asgd_qsgd_decode(levels.ctypes.data, int(wide), signs.ctypes.data, numel, float(step),
                              table.ctypes.data, out.ctypes.data)
    return out
