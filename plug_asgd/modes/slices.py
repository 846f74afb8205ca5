"""Elementwise work on large arrays, split into contiguous slices that threads run at once.

numpy releases the GIL inside its ufunc loops, so a fold (``w += delta``) or a NaN/Inf check
of a 1M-value tensor split over N threads runs on N cores. This is what the parameter
server's ``threads`` option buys: while one request is being folded in, the rest of the PS
(decoding, replying) stays in its one serving thread, so the order of updates, and with it
every version number, is the same as with one thread.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# Below this many values a split costs more (a hand-off between threads, tens of microseconds)
# than it saves.
MIN_SPLIT = 1 << 17


class SlicePool:
    """``threads`` threads (the caller's and ``threads - 1`` others) over slices of one range.

    Args:
        threads: the threads a range is split over, the caller's included (1: no other thread is started).
        min_split: the least size split over them; a smaller range runs in the caller's thread alone.

    Raises:
        ValueError: where ``threads`` is below 1.
    """

    def __init__(self, threads: int, min_split: int = MIN_SPLIT) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.min_split = min_split
        self._pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="plug_asgd-fold") if threads > 1 else None

    def map(self, fn: Callable[[slice], T], size: int) -> list[T]:
        """``fn`` over contiguous slices covering ``range(size)``, in parallel when ``size`` is large.

        Args:
            fn: the work on one slice; it must release the GIL (numpy ufuncs do) for the threads to help.
            size: the length of the range covered.

        Returns:
            ``fn``'s results, in the order of the slices.
        """
        if self._pool is None or size < self.min_split:
            return [fn(slice(0, size))]
        bounds = [size * i // self.threads for i in range(self.threads + 1)]
        slices = [slice(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        futures = [self._pool.submit(fn, s) for s in slices[1:]]
        first = fn(slices[0])
        return [first, *(f.result() for f in futures)]

    def close(self) -> None:
        """Stop the other threads, once the work given to them is done."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
