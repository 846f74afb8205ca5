"""Each codec pass the C loops make, alone on one core, against numpy's path: milliseconds per tensor.

    PYTHONPATH=. python -m bench kernels [--numel N] [--repeats N]

A tensor of ``--numel`` float32 values (2.8M by default: one of the exchange benchmark's four layers), the worker's
weights ``w`` and the central model ``c`` drawn at random; each pass timed ``--repeats`` times in a loop that frees
its result before the next (as a push does, the heap kept: :mod:`plug_asgd.compressors.heap`), the median printed,
with the library's C loops and without them (:func:`plug_asgd.compressors.native.library` made None: numpy's
path, the same bits).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from unittest import mock

import numpy as np

from plug_asgd.compressors import QSGD, PowerSGD, Sign, TopKResidual, decode, native
from plug_asgd.compressors.decoding import Undecoded
from plug_asgd.compressors.difference import accumulate
from plug_asgd.compressors.heap import keep_freed_memory
from plug_asgd.modes.fold import all_finite
from plug_asgd.protocol.wire import Packed


def timed(fn: Callable[[], object], repeats: int) -> float:
    """The median milliseconds of ``fn``, its result dropped before the next call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
        del result
    return statistics.median(times) * 1e3


def passes(w: np.ndarray, c: np.ndarray) -> dict[str, Callable[[], object]]:
    """The passes timed, by name."""
    sign, qsgd = Sign().encode_difference("w", w, c), QSGD().encode_difference("w", w, c)
    residual = np.zeros_like(w)
    side = math.isqrt(w.size)  # PowerSGD's matrix: as square as the tensor allows
    matrix = w[: side * (w.size // side)].reshape(side, -1)
    factors = PowerSGD(rank=4).encode("w", matrix)
    return {
        "sign: encode w - c": lambda: Sign().encode_difference("w", w, c),
        "sign: decode": lambda: decode(sign, np.float32),
        "qsgd (8 bits): encode w - c": lambda: QSGD().encode_difference("w", w, c),
        "qsgd (8 bits): decode": lambda: decode(qsgd, np.float32),
        "qsgd (8 bits): a worker's guess, decoded and added twice": lambda: _guess(qsgd, c),
        "top-k 1%, residual in the model: encode w - c": lambda: TopKResidual(0.01).encode_difference(
            "w", w, c, implicit_residual=True),
        "residual += w - c (error feedback)": lambda: accumulate(residual, w, c),
        "the PS's dense fold out of place, checked": lambda: _fold(w, c),
        "PowerSGD (rank 4): decode P @ Q.T": lambda: decode(factors, np.float32),
        "the PS's fold of sign's push (decoded in the pass)": lambda: _fold_packed(sign, c),
        "the PS's fold of qsgd's push (decoded in the pass)": lambda: _fold_packed(qsgd, c),
        "the PS's fold of PowerSGD's push (decoded in the pass)": lambda: _fold_packed(factors, c[: matrix.size]),
    }


def _guess(packed: Packed, c: np.ndarray) -> None:
    """A worker's guess of an own reply: ``c + decoded`` written twice, in one pass where it can."""
    out, again = np.empty_like(c), np.empty_like(c)
    if not QSGD.add_decoded(packed, c, out, again):
        native.add_twice(decode(packed, np.float32).reshape(-1), c, out, again)


def _fold_packed(packed: Packed, c: np.ndarray) -> bool:
    """The PS's fold of ``packed``: in one pass where it can (:meth:`Codec.fold_packed`), else decoded, then folded."""
    out = np.empty_like(c)
    checked = Undecoded(packed, np.dtype(np.float32)).fold(c.reshape(packed.shape), out.reshape(packed.shape), 1.0)
    return checked if checked is not None else _fold(decode(packed, np.float32).reshape(-1), c)


def _fold(u: np.ndarray, c: np.ndarray) -> bool:
    out = np.empty_like(u)
    checked = native.add_finite(u, c, out, 1.0)
    if checked is None:
        np.add(u, c, out=out)
        checked = all_finite(out)
    return checked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=1673 * 1673, help="values per tensor (default 2,798,929)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls of each pass (default 20)")
    args = parser.parse_args(argv)
    keep_freed_memory()
    if native.library() is None:
        print("no C compiler here (or PLUG_ASGD_NATIVE=0): only numpy's path can be timed")
    rng = np.random.default_rng(0)
    w, c = rng.standard_normal(args.numel).astype(np.float32), rng.standard_normal(args.numel).astype(np.float32)
    print(f"one core, a tensor of {args.numel:,} float32 values, median of {args.repeats}: ms per pass")
    print(f"{'pass':56s} {'C':>7s} {'numpy':>7s}")
    for name, fn in passes(w, c).items():
        ours = timed(fn, args.repeats) if native.library() is not None else float("nan")
        with mock.patch.object(native, "library", lambda: None):
            theirs = timed(fn, args.repeats)
        print(f"{name:56s} {ours:7.2f} {theirs:7.2f}")
    return 0
