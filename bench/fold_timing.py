"""The fold of one dense push on warm data, in a loop: what it costs outside the round trip.

    OMP_NUM_THREADS=2 PYTHONPATH=. python -m bench.fold_timing [--values 1179648] [--calls 200]
        [--pause-ms 2]

``bench.ps_floor`` times the fold inside the round trip, where the update arrives from the
socket. This times the same pieces on arrays that stay in this process: numpy's add, the PS's
NaN/Inf check (``modes.all_finite``), both (the fold, as ``bench.zmqtools minimal`` does it), the
fold split over the PS's fold threads (``plug_asgd.slices.SlicePool``, 2 threads), and the fold
in torch on its intra-op threads (``OMP_NUM_THREADS``). A pause between calls leaves the helper
threads idle, as they are between pushes. It prints the median time of each, in ms.
Diagnostic only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from plug_asgd.modes import _finite, _quiet, all_finite
from plug_asgd.slices import SlicePool

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
    out = np.empty_like(update)

    def fold(part: slice | None = None) -> bool:
        u, c, o = (update, central, out) if part is None else (update[part], central[part], out[part])
        np.add(u, c, out=o)
        return _finite(o)

    pool = SlicePool(2, min_split=1)
    tu, tc, to = (torch.from_numpy(a) for a in (update, central, out))

    def torch_fold() -> bool:
        torch.add(tu, tc, out=to)
        return bool(torch.isfinite(torch.dot(to, to)))

    pause = args.pause_ms / 1000
    try:
        report = {
            "values": args.values, "torch_threads": torch.get_num_threads(),
            "add_ms": _median_ms(lambda: np.add(update, central, out=out), args.calls, pause),
            "check_ms": _median_ms(lambda: all_finite(out), args.calls, pause),
            "fold_ms": _median_ms(fold, args.calls, pause),
            "fold_2_threads_ms": _median_ms(lambda: all(pool.map(_quiet(fold), args.values)), args.calls, pause),
            "fold_torch_ms": _median_ms(torch_fold, args.calls, pause),
        }
    finally:
        pool.close()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
