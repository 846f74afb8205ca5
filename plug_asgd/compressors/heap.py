"""A process's heap kept: the arrays a push makes and frees reuse their pages instead of faulting in fresh ones.

Each push makes arrays of the model's size and frees them: on the worker a codec's decoding, a difference, a copy;
on the PS the decoding of each packed update it folds. glibc hands an
array above its mmap threshold straight back to the system when it is freed, and trims the heap's free top above
its trim threshold; either way the next push's arrays come from fresh pages, which the kernel faults in and zeroes
one 4 KiB page at a time (``python -m bench exchange`` measures what that costs: bench/results/README.md, "The
exchange at ResNet size"). So a fitting worker and a serving PS raise both: arrays up to 32 MiB (glibc's
most) come from the heap, and up to 256 MiB freed at its top stays there for the next push.

Only glibc has ``mallopt``; elsewhere, or where the user set glibc's own ``MALLOC_*`` variables or
``GLIBC_TUNABLES``, or ``PLUG_ASGD_KEEP_HEAP=0``, nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import threading

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 256 << 20
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX",
                 "GLIBC_TUNABLES")

_lock = threading.Lock()
_done: list[bool] = []


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process, once; whether they are raised now.

    Nothing is done where the C library has no ``mallopt`` (not glibc), where the user set glibc's malloc
    variables (theirs stand), or where ``PLUG_ASGD_KEEP_HEAP=0``.
    """
    with _lock:
        if not _done:
            _done.append(_apply())
        return _done[0]


def _apply() -> bool:
    if os.environ.get("PLUG_ASGD_KEEP_HEAP", "1") == "0" or any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
