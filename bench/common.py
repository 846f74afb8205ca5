"""What the benchmarks share: the machine, the statistics of repeated ratios and the wire-size formulas of the
codec table (docs/modes.md). Ports, processes and emulated hosts are the ``harness`` package's, which the tests
share too."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Debian's dataset-fashion-mnist; PLUG_ASGD_FASHION points elsewhere (a machine without the package)
FASHION = Path(os.environ.get("PLUG_ASGD_FASHION") or "/usr/share/datasets/fashion-mnist")


def commit() -> str | None:
    """The code a run measured: the commit, marked ``+changes`` where the tree differs from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+changes" if changed else "")


def machine() -> dict[str, Any]:
    import torch

    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import zmq

        zmq_version = zmq.zmq_version()
    except ImportError:  # pragma: no cover
        zmq_version = None
    return {"cpu_count": os.cpu_count(), "cpu_model": model, "torch": torch.__version__,
            "python": platform.python_version(), "zmq": zmq_version, "platform": platform.platform(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average_at_start": list(os.getloadavg()), "commit": commit()}


def ps_push_ms(stats: dict[str, Any]) -> dict[str, float | None] | None:
    """The PS's mean time per push (ms) from its stats, in all and on a core; None before any push."""
    from plug_asgd.cli.dashboard import push_ms  # (plug_asgd imports Lightning: not for every user of this module)

    per_push = push_ms(stats)
    if per_push is None:
        return None
    wall, cpu = per_push
    return {"wall": round(wall, 3), "on_a_core": None if cpu is None else round(cpu, 3)}


def summary(values: list[float]) -> dict[str, Any]:
    """Median and spread (min, max) of repeated measurements; None where nothing was measured."""
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    n = len(vals)
    median = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
    return {"median": median, "min": vals[0], "max": vals[-1], "n": n,
            "values": [None if v is None else round(v, 6) for v in values]}


def spread(s: dict[str, Any], fmt: str, scale: float = 1.0) -> str:
    """Median [min .. max] of a :func:`summary` (one value alone), each divided by ``scale``: a table's cell."""
    if not s["n"]:
        return "n/a"
    median, low, high = (format(s[k] / scale, fmt) for k in ("median", "min", "max"))
    return median if s["n"] == 1 else f"{median} [{low} .. {high}]"


def report_rates(label: str, results: dict[str, Any], table: str, out: Path) -> int:
    """Print a benchmark's table of rates and where its results went; 1 where a run of it failed, else 0.

    Args:
        label: the benchmark's name, for its lines.
        results: its results (``rates``: by rate, ``runs``: by configuration, each run's ``error`` where it failed).
        table: its markdown.
        out: its results folder.
    """
    failed = [f"{k} {r['name']} seed {r['seed']}" for k, e in results["rates"].items() for rs in e["runs"].values()
              for r in rs if "error" in r]
    print(table)
    print(f"[{label}] results in {out} ({results['wall_s']:.0f} s)" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


def ports_needed(runs: list[dict[str, Any]]) -> int:
    """The ports above ``MASTER_PORT`` that a launch of ``runs`` takes (``bench.train``): one per run, one per
    shard of a sharded run (``ps_shards``)."""
    return sum(int(run.get("ps_shards") or 1) for run in runs)


# -- wire sizes: the formulas of the codec table of docs/modes.md --------------------------

def sparse_bytes(numel: int, k: int) -> int:
    return 4 * max(1, -(-numel // 65536)) + 6 * k


def k_for(fraction: float, numel: int) -> int:
    return min(numel, max(1, math.ceil(fraction * numel)))


def payload_bytes(shapes: dict[str, tuple[int, ...]], compressor: str, *, fraction: float = 0.01, bits: int = 8,
                  rank: int = 4) -> int:
    """The tensor frames of one push of a float32 model, by the codec table of docs/modes.md (headers excluded)."""
    total = 0
    for shape in shapes.values():
        n = math.prod(shape)
        if compressor == "none":
            total += 4 * n
        elif compressor in ("fp16", "bf16"):
            total += 2 * n
        elif compressor in ("topk", "randomk", "adacomp"):
            total += sparse_bytes(n, k_for(fraction, n))
        elif compressor == "qsgd":
            total += -(-n * bits // 8) + -(-n // 8)  # the levels, then a sign bit each
        elif compressor == "sign":
            total += -(-n // 8)
        elif compressor == "powersgd":
            if len(shape) < 2:
                total += 4 * n
            else:
                a, b = shape[0], n // shape[0]
                total += 4 * rank * (a + b) if rank * (a + b) < a * b else 4 * n
        else:
            raise ValueError(compressor)
    return total


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def write_report(out: Path, name: str, report: dict[str, Any], text: str, errors: list[str], tag: str) -> int:
    """Write ``NAME.json`` and ``NAME.md`` into ``out``, print the text and each error: a benchmark's last step.

    Args:
        out: the results folder.
        name: the files' name, without suffix.
        report: what ``NAME.json`` holds.
        text: what ``NAME.md`` holds, printed too.
        errors: the runs that failed, each printed to stderr after ``[tag]``.
        tag: the benchmark's name in those lines.

    Returns:
        The exit code: 1 where a run failed, else 0.
    """
    write_json(out / f"{name}.json", report)
    (out / f"{name}.md").write_text(text)
    print(text)
    for e in errors:
        print(f"[{tag}] {e}", file=sys.stderr)
    return 1 if errors else 0


def time_calls(owner: Any, name: str, into: list[float]) -> None:
    """Wrap ``owner.name`` so that each call's duration (s) is appended to ``into`` (diagnostic scripts).

    Nothing happens where ``owner`` has no such attribute (an older plug_asgd, in a comparison).
    """
    inner = getattr(owner, name, None)
    if inner is None:
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t)

    setattr(owner, name, timed)
