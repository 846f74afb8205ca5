"""Learning curves of finished runs: test accuracy against wall time and against bytes pushed.

A run is a ``supervisor.jsonl`` file (one JSON object per line: ``wall_s``, ``version``,
``bytes_pushed``, ``test_acc``, ``test_loss``) or a directory holding one or more of them.
Files are read with the json module only; matplotlib is imported when a figure is drawn, and
draws with the Agg backend (no display, no pyplot global state).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPERVISOR_FILE = "supervisor.jsonl"
REQUIRED_KEYS = ("wall_s", "bytes_pushed", "test_acc")
INSTALL_HINT = "matplotlib is needed for plot: pip install 'plug-asgd[plot]'"


class RunError(ValueError):
    """A run that cannot be plotted (no supervisor.jsonl, an empty or garbled one); the message names it."""


class MatplotlibMissing(ImportError):
    """matplotlib is not installed."""


@dataclass
class Series:
    """One run's evaluations, in file order; points without a test accuracy are left out.

    Attributes:
        path: the supervisor.jsonl file read.
        label: the curve's name in the legend.
        wall_s: seconds since the run started, one per evaluation.
        bytes_pushed: bytes all workers had pushed by then, one per evaluation.
        test_acc: the central model's test accuracy, one per evaluation.
        version: the central model's version evaluated, one per evaluation; None where the line has none.
    """

    path: Path
    label: str
    wall_s: list[float] = field(default_factory=list)
    bytes_pushed: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)
    version: list[int | None] = field(default_factory=list)


def find_supervisor_files(run: str | Path) -> list[Path]:
    """The supervisor.jsonl files of one RUN argument: the file itself, or every one under the directory.

    Args:
        run: a supervisor.jsonl file, or a directory searched for them (recursively).

    Raises:
        RunError: where ``run`` does not exist, or is a directory with no supervisor.jsonl in or below it.
    """
    path = Path(run)
    if path.is_file():
        return [path]
    if path.is_dir():
        found = sorted(p for p in path.rglob(SUPERVISOR_FILE) if p.is_file())
        if not found:
            raise RunError(f"{run}: no {SUPERVISOR_FILE} in this directory or below it")
        return found
    raise RunError(f"{run}: no such file or directory")


def _number(value: Any, key: str, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RunError(f"{where}: {key!r} is {value!r}, not a finite number")
    return float(value)


def load_series(path: str | Path, label: str | None = None) -> Series:
    """Read one supervisor.jsonl; raises :class:`RunError` naming the file (and line) when it cannot be used.

    Args:
        path: the supervisor.jsonl file.
        label: the curve's name; None for the name of the file's directory.

    Raises:
        RunError: where the file cannot be read, is empty, has a line that is not a JSON object with finite
            ``wall_s``, ``bytes_pushed`` and ``test_acc``, or has no test accuracy at all.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"{path}: cannot read it: {exc}") from None
    series = Series(path, label or path.parent.resolve().name or str(path))
    lines = 0
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        lines += 1
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RunError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise RunError(f"{where}: expected a JSON object, got {type(record).__name__}")
        missing = [k for k in REQUIRED_KEYS if k not in record]
        if missing:
            raise RunError(f"{where}: missing {', '.join(map(repr, missing))} (each line needs "
                           f"{', '.join(REQUIRED_KEYS)})")
        values = [_number(record[k], k, where) for k in REQUIRED_KEYS]
        if any(v is None for v in values):
            continue  # an evaluation that did not happen
        wall, pushed, acc = values
        series.wall_s.append(wall)  # type: ignore[arg-type]
        series.bytes_pushed.append(pushed)  # type: ignore[arg-type]
        series.test_acc.append(acc)  # type: ignore[arg-type]
        version = record.get("version")
        series.version.append(version if isinstance(version, int) else None)
    if lines == 0:
        raise RunError(f"{path}: empty file, no evaluation to plot")
    if not series.test_acc:
        raise RunError(f"{path}: no line has a test accuracy")
    return series


def load_runs(runs: Sequence[str | Path], labels: Sequence[str] | None = None) -> list[Series]:
    """Every curve of the RUN arguments, labelled by their directory name or by ``labels`` (one per curve).

    Args:
        runs: the RUN arguments: supervisor.jsonl files or directories holding them.
        labels: one name per supervisor.jsonl found, in order; None or empty for their directory names.

    Raises:
        RunError: where no run is given, the labels do not match the files found one for one, or a run
            cannot be read.
    """
    files = [f for run in runs for f in find_supervisor_files(run)]
    if not files:
        raise RunError("no run given")
    if labels:
        if len(labels) != len(files):
            found = "\n  ".join(str(f) for f in files)
            raise RunError(f"{len(labels)} label(s) for {len(files)} run(s); give one --label per "
                           f"{SUPERVISOR_FILE} found:\n  {found}")
        names = list(labels)
    else:
        names = _default_labels(files)
    return [load_series(f, name) for f, name in zip(files, names, strict=True)]


def _default_labels(files: list[Path]) -> list[str]:
    """Each file's directory name; where two share one, the shortest distinct tail of their paths."""
    parents = [f.resolve().parent for f in files]
    labels = [p.name for p in parents]
    for depth in range(2, 8):
        clashing = {lab for lab in labels if labels.count(lab) > 1}
        if not clashing:
            break
        labels = ["/".join(p.parts[-depth:]) if lab in clashing else lab
                  for p, lab in zip(parents, labels, strict=True)]
    return labels


def require_matplotlib() -> Any:
    """Import matplotlib with the Agg backend; raises :class:`MatplotlibMissing` with the install hint.

    Raises:
        MatplotlibMissing: where matplotlib is not installed.
    """
    try:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError:
        raise MatplotlibMissing(INSTALL_HINT) from None
    return matplotlib


def title_for(labels: Sequence[str]) -> str:
    """``["sync", "asgd"]`` -> ``"sync vs asgd: test accuracy of the central model"``.

    Args:
        labels: the curves' names; more than four are counted instead of listed.
    """
    names = " vs ".join(labels) if len(labels) <= 4 else f"{len(labels)} runs"
    return f"{names}: test accuracy of the central model"


def make_figure(series: Sequence[Series]) -> Any:
    """A matplotlib Figure (Agg canvas) with the two panels; one line per series in each.

    Args:
        series: the runs' curves, as :func:`load_runs` returns them.
    """
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter, PercentFormatter

    fig = Figure(figsize=(12, 4.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    by_time, by_bytes = fig.subplots(1, 2, sharey=True)
    as_percent = all(0 <= a <= 1 for s in series for a in s.test_acc)
    for s in series:
        marker = "o" if len(s.test_acc) <= 30 else None
        by_time.plot(s.wall_s, s.test_acc, marker=marker, markersize=3.5, linewidth=1.6, label=s.label)
        pushed = [(b, a) for b, a in zip(s.bytes_pushed, s.test_acc, strict=True) if b > 0]  # log axis
        by_bytes.plot([b for b, _ in pushed], [a for _, a in pushed], marker=marker, markersize=3.5,
                      linewidth=1.6, label=s.label)
    by_time.set_title("test accuracy vs wall time")
    by_time.set_xlabel("wall time (s)")
    by_time.set_ylabel("test accuracy")
    by_bytes.set_title("test accuracy vs bytes pushed")
    by_bytes.set_xlabel("bytes pushed by all workers (log scale)")
    by_bytes.set_xscale("log")
    by_bytes.xaxis.set_major_formatter(EngFormatter(unit="B", places=0, sep=" "))  # 1 MB, 10 MB, ...
    for ax in (by_time, by_bytes):
        ax.grid(True, which="major", alpha=0.35)
        if as_percent:
            ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    by_time.legend(loc="lower right", fontsize="small")
    fig.suptitle(title_for([s.label for s in series]), fontsize="large")
    return fig


def plot_runs(paths: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None) -> Path:
    """Draw the runs at ``paths`` into ``out`` (PNG unless its suffix names another format); returns ``out``.

    Args:
        paths: the RUN arguments: supervisor.jsonl files or directories holding them.
        out: the image file to write (its folder is made where missing).
        labels: one name per supervisor.jsonl found, in order; None for their directory names.
    """
    require_matplotlib()
    series = load_runs(paths, labels)
    fig = make_figure(series)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=None if out.suffix else "png")
    return out
