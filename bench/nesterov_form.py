"""Heavy-ball SGD steps in Nesterov's form, or as they are: ``bench.remedy_pairs --remedy nesterov``.

    PYTHONPATH=. python -m bench.nesterov_form [--seeds 0 1 2] [--rows hogwild downpour agn asgd+randomk]
        [--workers 2] [--lr 0.05] [--train-subset 16000] [--out DIR]

The name the commands of ``docs/momentum.md`` ("Nesterov's form") use; ``--out`` defaults to runs/nesterov-form.
"""

from __future__ import annotations

import sys

from bench import remedy_pairs
from bench.common import ROOT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    given = any(a == "--out" or a.startswith("--out=") for a in argv)
    out = [] if given else ["--out", str(ROOT / "runs" / "nesterov-form")]
    return remedy_pairs.main(["--remedy", "nesterov", *out, *argv])


if __name__ == "__main__":
    raise SystemExit(main())
