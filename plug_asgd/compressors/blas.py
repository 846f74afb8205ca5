"""numpy's BLAS on one thread for a block of code: PowerSGD's encoding products on a worker.

On a worker, the idle threads of OpenBLAS spin for a long while after each call, on the cores its training
computes on (what they cost PowerSGD: bench/results/README.md, "The exchange at ResNet size"). The thread
count is OpenBLAS's (numpy's wheels bundle it); where numpy uses another BLAS, nothing is changed. (The
decoding, which the PS and a worker answered "own" must make to the same bits, uses no BLAS:
:func:`plug_asgd.compressors.lowrank.low_rank_product`.)
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_NAMES = (("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
          ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads"),
          ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
          ("openblas_set_num_threads", "openblas_get_num_threads"))
_lock = threading.Lock()
_inside = 0
_saved: list[int] = []


@functools.cache
def _controls() -> list[tuple[Callable[[int], None], Callable[[], int]]]:
    """The (set, get) thread-count functions of every OpenBLAS this process has loaded (Linux's maps)."""
    import numpy  # noqa: F401 (loads its BLAS)

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
    except OSError:
        return []
    found = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for set_name, get_name in _NAMES:
            if hasattr(lib, set_name) and hasattr(lib, get_name):
                setter, getter = getattr(lib, set_name), getattr(lib, get_name)
                setter.argtypes, getter.restype = [ctypes.c_int], ctypes.c_int
                found.append((setter, getter))
                break
    return found


@contextmanager
def one_thread() -> Iterator[None]:
    """numpy's BLAS on one thread inside the block (blocks of several threads nest: the last one out restores)."""
    global _inside, _saved
    with _lock:
        if _inside == 0:
            _saved = [get() for _, get in _controls()]
            for (set_threads, _), count in zip(_controls(), _saved, strict=True):
                if count != 1:
                    set_threads(1)
        _inside += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                for (set_threads, _), count in zip(_controls(), _saved, strict=True):
                    if count != 1:
                        set_threads(count)
