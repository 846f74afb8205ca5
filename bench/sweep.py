"""Chosen training runs of the AdaComp benchmark's kind, with overrides: the experiments NOTES.md cites.

    PYTHONPATH=. python -m bench.sweep OUT '[{"mode": "asgd", "optimizer": "sgd", "lr": 0.2, "momentum": 0},
                                             {"mode": "adacomp", "compression": 0.0034, "optimizer": "sgd", ...}]'

Each object overrides the benchmark's run (2 workers, batch 32, 24,000 Fashion-MNIST images, 1 epoch,
pushes over the socket, test accuracy at the end); ``optimizer`` / ``lr`` / ``momentum`` go to the
recipe CNN. All runs share one 2-worker launch; a line per run is printed and ``OUT/summary.json``
keeps the records.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.runner import launch

BASE: dict[str, Any] = {"bench": "adacomp", "kind": "asgd", "batch_size": 32, "train_subset": 24000, "epochs": 1,
                        "test": True, "shm_pushes": False}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    try:
        overrides = json.loads(argv[1])
    except json.JSONDecodeError as exc:
        print(f"the runs must be a JSON list of objects: {exc}", file=sys.stderr)
        return 2
    if not isinstance(overrides, list) or not all(isinstance(o, dict) for o in overrides):
        print("the runs must be a JSON list of objects, e.g. '[{\"mode\": \"asgd\"}]'", file=sys.stderr)
        return 2
    runs = []
    for o in overrides:
        run = {**BASE, **o}
        run.setdefault("name", " ".join(f"{k}={v}" for k, v in o.items()))
        runs.append(run)
    results = launch(2, runs, {"test_subset": None, "timeout": 3000}, out)
    for r in results:
        if "launch_error" in r:
            print(r["launch_error"])
            continue
        print(f"{r['name']:50s} test acc {r['test_acc']:.4f}  bytes pushed {r['push_bytes']:>14,}  "
              f"pushes {r['pushes']}")
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    return 0 if results and not any("launch_error" in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
