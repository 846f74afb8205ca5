"""The fold of one dense push on warm data, in a loop: what it costs outside the round trip.

    OMP_NUM_THREADS=2 PYTHONPATH=. python -m bench.fold_timing [--values 1179648] [--calls 200]
        [--pause-ms 2]

``bench.ps_floor`` times the fold inside the round trip, where the update arrives from the
socket. This times the same pieces on arrays that stay in this process: numpy's add, the PS's
NaN/Inf check (``modes.all_finite``), both (``bench.zmqtools.fold_into``, the minimal server's
fold), that fold split over the PS's fold threads (``plug_asgd.modes.slices.SlicePool``, 2 threads),
and the fold in torch on its intra-op threads (``bench.zmqtools.torch_fold``, ``OMP_NUM_THREADS``).
Each folds into the same update again and again, as the PS folds into a push's buffer. A pause
between calls leaves the helper threads idle, as they are between pushes. It prints the median
time of each, in ms. Diagnostic only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.zmqtools import fold_into, torch_fold
from plug_asgd.modes.fold import _quiet, all_finite
from plug_asgd.modes.slices import SlicePool

# the recipe CNN's largest tensor, 128 x 9216; the fold of the other 20K values is noise beside it
CNN_LARGEST = 128 * 9216


def _median_ms(fn: Callable[[], object], calls: int, pause: float) -> float:
    fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        time.sleep(pause)
    return round(statistics.median(times) * 1000, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=CNN_LARGEST)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--pause-ms", type=float, default=2.0, help="idle time between calls")
    args = parser.parse_args(argv)
    if args.values < 1 or args.calls < 1 or args.pause_ms < 0:
        parser.error("--values and --calls must be at least 1, --pause-ms at least 0")
    rng = np.random.default_rng(0)
    update, central = (rng.standard_normal(args.values).astype(np.float32) for _ in range(2))
    pool = SlicePool(2, min_split=1)
    in_torch = torch_fold()
    pause = args.pause_ms / 1000
    try:
        report = {
            "values": args.values, "torch_threads": torch.get_num_threads(),
            "add_ms": _median_ms(lambda: np.add(update, central, out=update), args.calls, pause),
            "check_ms": _median_ms(lambda: all_finite(update), args.calls, pause),
            "fold_ms": _median_ms(lambda: fold_into(update, central), args.calls, pause),
            "fold_2_threads_ms": _median_ms(
                lambda: all(pool.map(_quiet(lambda part: fold_into(update[part], central[part])), args.values)),
                args.calls, pause),
            "fold_torch_ms": _median_ms(lambda: in_torch(update, central), args.calls, pause),
        }
    finally:
        pool.close()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
