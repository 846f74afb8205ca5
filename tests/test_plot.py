"""``plug-asgd plot``: supervisor.jsonl runs -> a two-panel PNG (accuracy vs wall time and vs bytes pushed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from plug_asgd.cli import app as cli
from plug_asgd.cli import plot as plotting

pytestmark = pytest.mark.timeout(120)

runner = CliRunner()
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

SYNC = [
    {"wall_s": 0.0, "version": 0, "bytes_pushed": 0, "test_acc": 0.1, "test_loss": 2.3},
    {"wall_s": 10.0, "version": 50, "bytes_pushed": 4_000_000, "test_acc": 0.62, "test_loss": 1.1},
    {"wall_s": 20.0, "version": 100, "bytes_pushed": 8_000_000, "test_acc": 0.81, "test_loss": 0.6},
    {"wall_s": 30.0, "version": 150, "bytes_pushed": 12_000_000, "test_acc": 0.86, "test_loss": 0.45},
]
ASGD = [
    {"wall_s": 0.0, "version": 0, "bytes_pushed": 0, "test_acc": 0.1, "test_loss": 2.3},
    {"wall_s": 5.0, "version": 120, "bytes_pushed": 300_000, "test_acc": 0.55, "test_loss": 1.3},
    {"wall_s": 12.5, "version": 300, "bytes_pushed": 750_000, "test_acc": 0.74, "test_loss": 0.8},
    {"wall_s": 25.0, "version": 600, "bytes_pushed": 1_500_000, "test_acc": 0.83, "test_loss": 0.5},
    {"wall_s": 31.0, "version": 744, "bytes_pushed": 1_860_000, "test_acc": 0.85, "test_loss": 0.47},
]


def write_run(directory: Path, rows: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "supervisor.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def two_runs(tmp_path: Path) -> tuple[Path, Path]:
    return write_run(tmp_path / "runs" / "sync", SYNC).parent, write_run(tmp_path / "runs" / "asgd", ASGD).parent


def test_load_series_reads_the_file(two_runs):
    sync, _ = two_runs
    series = plotting.load_series(sync / "supervisor.jsonl")
    assert series.label == "sync"
    assert series.wall_s == [r["wall_s"] for r in SYNC]
    assert series.bytes_pushed == [r["bytes_pushed"] for r in SYNC]
    assert series.test_acc == [r["test_acc"] for r in SYNC]
    assert series.version == [r["version"] for r in SYNC]


def test_figure_curves_come_from_the_files(two_runs):
    series = plotting.load_runs(two_runs)
    fig = plotting.make_figure(series)
    by_time, by_bytes = fig.axes
    assert [line.get_label() for line in by_time.lines] == ["sync", "asgd"]
    for line, rows in zip(by_time.lines, (SYNC, ASGD), strict=True):
        assert list(line.get_xdata()) == [r["wall_s"] for r in rows]
        assert list(line.get_ydata()) == [r["test_acc"] for r in rows]
    for line, rows in zip(by_bytes.lines, (SYNC, ASGD), strict=True):  # bytes = 0 cannot sit on a log axis
        assert list(line.get_xdata()) == [r["bytes_pushed"] for r in rows if r["bytes_pushed"] > 0]
        assert list(line.get_ydata()) == [r["test_acc"] for r in rows if r["bytes_pushed"] > 0]
    assert by_bytes.get_xscale() == "log" and by_time.get_xscale() == "linear"
    assert "wall time (s)" in by_time.get_xlabel() and "bytes pushed" in by_bytes.get_xlabel()
    assert fig.get_suptitle().startswith("sync vs asgd")


def test_plot_command_writes_a_png(two_runs, tmp_path):
    out = tmp_path / "figs" / "sync_vs_async.png"
    result = runner.invoke(cli.app, ["plot", *map(str, two_runs), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert str(out) in result.output.replace("\n", "")
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > 20_000


def test_plot_searches_directories_and_takes_labels(two_runs, tmp_path):
    root = two_runs[0].parent
    write_run(root / "deeper" / "adacomp" / "version_0", ASGD[:3])
    series = plotting.load_runs([root])
    assert sorted(s.label for s in series) == ["asgd", "sync", "version_0"]
    out = plotting.plot_runs([root], tmp_path / "all.png", labels=["a", "b", "c"])
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    labelled = plotting.load_runs(list(two_runs), labels=["synchronous", "asynchronous"])
    assert [s.label for s in labelled] == ["synchronous", "asynchronous"]
    result = runner.invoke(cli.app, ["plot", str(two_runs[0]), str(two_runs[1] / "supervisor.jsonl"),
                                     "--label", "S", "--label", "A", "--out", str(tmp_path / "labelled.png")])
    assert result.exit_code == 0, result.output
    fig = plotting.make_figure(plotting.load_runs(list(two_runs), ["S", "A"]))
    assert [line.get_label() for line in fig.axes[0].lines] == ["S", "A"]


def test_same_directory_names_are_told_apart(tmp_path):
    write_run(tmp_path / "a" / "run", SYNC)
    write_run(tmp_path / "b" / "run", ASGD)
    assert [s.label for s in plotting.load_runs([tmp_path])] == ["a/run", "b/run"]


def _plot_error(args: list[str], tmp_path: Path) -> str:
    result = runner.invoke(cli.app, ["plot", *args, "--out", str(tmp_path / "x.png")])
    output = result.output.replace("\n", "")
    assert result.exit_code == 2, output
    assert "Traceback" not in output
    assert not (tmp_path / "x.png").exists()
    return output


def test_plot_errors_name_the_run(two_runs, tmp_path):
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    assert f"{nothing}: no supervisor.jsonl" in _plot_error([str(nothing)], tmp_path)
    assert "no such file" in _plot_error([str(tmp_path / "absent")], tmp_path)

    empty = tmp_path / "empty" / "supervisor.jsonl"
    empty.parent.mkdir()
    empty.write_text("\n")
    output = _plot_error([str(two_runs[0]), str(empty.parent)], tmp_path)
    assert str(empty) in output and "empty" in output

    garbled = write_run(tmp_path / "garbled", SYNC[:2])
    garbled.write_text(garbled.read_text() + '{"wall_s": 3, "test_ac\n')
    output = _plot_error([str(garbled)], tmp_path)
    assert f"{garbled}, line 3" in output and "not JSON" in output

    missing = write_run(tmp_path / "missing", [{"wall_s": 1.0, "version": 1, "test_acc": 0.5}])
    output = _plot_error([str(missing)], tmp_path)
    assert str(missing) in output and "bytes_pushed" in output

    output = _plot_error([*map(str, two_runs), "--label", "only-one"], tmp_path)
    assert "1 label(s) for 2 run(s)" in output


def test_plot_without_matplotlib(two_runs, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    result = runner.invoke(cli.app, ["plot", *map(str, two_runs), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2, result.output
    assert "matplotlib is needed for plot: pip install 'plug-asgd[plot]'" in result.output.replace("\n", "")
    assert "Traceback" not in result.output
    assert not (tmp_path / "x.png").exists()
