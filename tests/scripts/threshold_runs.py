"""Repeats the training tests' launch of every mode and codec (tests/test_training.py, ``scheme_runs``), to set
ACCURACY_THRESHOLD (tests/conftest.py) from the measured spread: ``python tests/scripts/threshold_runs.py
--repeats 10 --out DIR`` writes each launch's results and, at the end, each case's min, median and max."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.runner import launch  # noqa: E402
from tests.test_training import LAUNCH_TIMEOUT_S, scheme_specs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    accuracies: dict[str, list[float]] = {}
    for i in range(args.repeats):
        records = launch(2, scheme_specs(with_asgd=True), {"test_subset": 1000, "timeout": LAUNCH_TIMEOUT_S},
                         args.out / f"launch{i}")
        for r in records:
            if "name" in r:
                accuracies.setdefault(r["name"], []).append(r["test_acc"])
        errors = [r["launch_error"] for r in records if "launch_error" in r]
        print(f"launch {i}: {len(records)} records, errors {errors}", flush=True)
        (args.out / "accuracies.json").write_text(json.dumps(accuracies, indent=1))
    for name, accs in sorted(accuracies.items(), key=lambda kv: min(kv[1])):
        print(f"{name:>20}  n={len(accs):2d}  min {min(accs):.4f}  median {statistics.median(accs):.4f}  "
              f"max {max(accs):.4f}")


if __name__ == "__main__":
    main()
