"""A worker process's start: importing Lightning with the cycle collector on, and paused (plug_asgd.startup).

    python -m bench startup [--module pytorch_lightning] [--repeats 7] [--out bench/results]

Each repeat starts two fresh interpreters one after the other, in alternating order: one imports ``--module`` as
a plain script does, the other inside :func:`plug_asgd.startup.gc_paused`, as the recipes, the CLI's ``train``
and the benchmarks' ranks do. For each: the process's CPU time (user + system, the interpreter's start
included, from ``getrusage`` of the waited child), the import's own CPU time and wall time, and the
collector's passes during the import by generation. Medians [min .. max] over the repeats.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine, spread, summary, write_report

# what a worker's first lines do, timed from inside the process; PAUSED picks the plain import or gc_paused's
PROBE = """
import gc, json, time
passes = [0, 0, 0]
gc.callbacks.append(lambda phase, info: phase == "start" and passes.__setitem__(
    info["generation"], passes[info["generation"]] + 1))
cpu, wall = time.process_time(), time.perf_counter()
if {paused}:
    from plug_asgd.startup import gc_paused
    with gc_paused():
        import {module}
else:
    import {module}
print(json.dumps({{"import_cpu_s": time.process_time() - cpu, "import_wall_s": time.perf_counter() - wall,
                  "passes": passes}}))
"""
KINDS = {"collector on": False, "collector paused": True}


def one(module: str, paused: bool) -> dict[str, Any]:
    """One fresh interpreter importing ``module``: its figures, with the process's CPU time from getrusage."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-c", PROBE.format(module=module, paused=paused)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    figures["process_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return figures


def measure(module: str, repeats: int) -> dict[str, list[dict[str, Any]]]:
    """``repeats`` processes of each kind, the kinds' order alternated from one repeat to the next."""
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for i in range(repeats):
        for kind in (list(KINDS) if i % 2 == 0 else list(KINDS)[::-1]):
            runs[kind].append(one(module, KINDS[kind]))
    return runs


def table(module: str, runs: dict[str, list[dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    """The Markdown table of the runs and its figures: medians [min .. max], and paused over on per process."""
    figures: dict[str, Any] = {}
    lines = [f"`import {module}` in a fresh interpreter, {len(runs['collector on'])} repeats of each kind "
             "(alternated): medians [min .. max]", "",
             "| kind | process CPU (s) | import CPU (s) | import wall (s) | passes of generation 0 / 1 / 2 |",
             "|---|---|---|---|---|"]
    for kind, kind_runs in runs.items():
        cells = {key: summary([r[key] for r in kind_runs]) for key in ("process_cpu_s", "import_cpu_s",
                                                                        "import_wall_s")}
        passes = [summary([r["passes"][g] for r in kind_runs])["median"] for g in range(3)]
        figures[kind] = {**cells, "passes_median": passes}
        lines.append(f"| {kind} | {spread(cells['process_cpu_s'], '.2f')} | {spread(cells['import_cpu_s'], '.2f')} | "
                     f"{spread(cells['import_wall_s'], '.2f')} | {' / '.join(f'{p:g}' for p in passes)} |")
    on, paused = (figures[k]["process_cpu_s"]["median"] for k in KINDS)
    figures["process_cpu_paused_over_on"] = paused / on
    figures["process_cpu_saved_s"] = on - paused
    lines += ["", f"A process's CPU time paused over on: {paused / on:.2f} ({on - paused:.2f} s saved per process)."]
    return "\n".join(lines) + "\n", figures


def main(argv: list[str] | None = None) -> int:
    """Entry point (``python -m bench startup``); 0 once the table is written.

    Args:
        argv: the command-line arguments; None: ``sys.argv[1:]``.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", default="pytorch_lightning", help="what each process imports")
    parser.add_argument("--repeats", type=int, default=7, help="processes of each kind")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    started = time.monotonic()
    runs = measure(args.module, args.repeats)
    text, figures = table(args.module, runs)
    report = {"machine": machine(), "module": args.module, "repeats": args.repeats, **figures, "runs": runs,
              "seconds": round(time.monotonic() - started, 1)}
    return write_report(args.out, "startup", report, text, [], "startup")


if __name__ == "__main__":
    sys.exit(main())
