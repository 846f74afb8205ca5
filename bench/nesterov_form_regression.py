"""Nesterov's form on the small regression case: each row's fits with the default compensation and without the form.

    PYTHONPATH=. python -m bench.nesterov_form_regression [--rows asgd adacomp asgd+topk ssp asgd+randomk] [--fits 5]

The case of ``tests/test_momentum.py`` (two linear layers, ``SGD(lr=0.05, momentum=0.9)``, batch 32, 3
epochs of 2,048 samples), each fit's 2 workers threads of this process through the library's exchange,
client, wire and PS (``tests/threaded_fit.py``): about half a second a fit. Prints each row's
validation losses and their medians; one process reaches 6.81. ``docs/momentum.md`` holds the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from bench.common import ROOT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=["asgd", "adacomp", "asgd+topk", "ssp", "asgd+randomk"])
    parser.add_argument("--fits", type=int, default=5)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from momentum_regression import threaded_fit

    from plug_asgd.modes import get
    from plug_asgd.worker.compensation import resolve

    for row in args.rows:
        mode = row.partition("+")[0]
        default = resolve(None, mode, get(mode).compensate)
        for label, compensation in (("as-is", dataclasses.replace(default, nesterov=False)), ("form", default)):
            losses = [threaded_fit(row, compensation) for _ in range(args.fits)]
            print(f"{row:14s} {label:6s} median {statistics.median(losses):7.2f}  {[round(v, 2) for v in losses]}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
