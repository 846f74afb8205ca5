"""A process's imports of torch and Lightning with Python's cycle collector paused.

Importing torch and Lightning leaves hundreds of thousands of long-lived objects, and CPython's cycle
collector makes full passes over them while they accumulate, and again as the process exits, in every
worker process (``python -m bench startup`` measures what that costs). None of them is garbage, so the
recipes, the CLI's ``train`` and the benchmarks' ranks import with the collector paused, then freeze
what the imports made (:func:`gc.freeze`), so the collector's later passes skip it too. A script of
your own can do the same: ``with gc_paused(): import pytorch_lightning as pl``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the block (a process's imports) with the cycle collector off, then freeze what it made.

    The collector is on again afterwards only where it was on before, also when the block raises.
    Everything alive as the block ends is frozen: what of it is later dropped in a cycle is never
    collected, so keep the block to a process's first imports and module-level set-up. The garbage
    already there is collected first (a millisecond in a fresh interpreter), so that a long-lived
    process importing an entry point's module (a test run) freezes none of it.
    """
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
