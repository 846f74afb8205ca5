"""Tests for the ``plug-asgd`` command line: help (readable at 80 columns), version, serve-ps, status and train.

Commands that run a server are real subprocesses on 127.0.0.1, each in its own session so that
the teardown can kill its whole process group; every wait has a timeout.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

import plug_asgd
from plug_asgd.cli import app as cli
from plug_asgd.cli import options, training
from plug_asgd.cli import status as ps_status
from plug_asgd.modes import MODES
from plug_asgd.ps.config import PSConfig
from plug_asgd.worker.client import PSClient
from tests.conftest import child_env, free_port, kill_group

CLI_ENV = child_env(COLUMNS="200", NO_COLOR="1")

pytestmark = pytest.mark.timeout(60)

CLI = [sys.executable, "-m", "plug_asgd.cli.app"]
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
runner = CliRunner()


class Procs:
    """Starts CLI subprocesses in their own sessions; ``close`` kills every group still alive."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[subprocess.Popen] = []

    def start(self, *args: str, name: str = "proc") -> tuple[subprocess.Popen, Path, Path]:
        out, err = self.tmp_path / f"{name}.out", self.tmp_path / f"{name}.err"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen([*CLI, *args], stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                    start_new_session=True, env=CLI_ENV, cwd=self.tmp_path)
        self.started.append(proc)
        return proc, out, err

    def run(self, *args: str, timeout: float = 45) -> subprocess.CompletedProcess:
        """Run a command to its end (killing its group past ``timeout``); returns its output."""
        proc = subprocess.Popen([*CLI, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True, env=CLI_ENV,
                                cwd=self.tmp_path)
        self.started.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, err = proc.communicate(timeout=10)
            pytest.fail(f"{args} did not finish within {timeout} s:\n{out}\n{err}")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def close(self) -> None:
        for proc in self.started:
            kill_group(proc)


@pytest.fixture
def cli_procs(tmp_path: Path):
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.close()


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            pytest.fail(f"the process exited with {proc.returncode} before printing {text!r}:\n"
                        f"{path.read_text(errors='replace')}")
        time.sleep(0.1)
    pytest.fail(f"{text!r} not printed within {timeout} s")


# -- help and usage (in process) ---------------------------------------------------------------


def test_help_lists_commands():
    result = runner.invoke(cli.app, ["--help"])
    assert result.exit_code == 0, result.output
    for command in ("serve-ps", "train", "status"):
        assert command in result.output


def test_no_args_shows_help():
    result = runner.invoke(cli.app, [])
    assert result.exit_code == 2  # click's usage error: the help, shown because a command was missing
    assert "serve-ps" in result.output and "status" in result.output


@pytest.mark.integration
def test_module_entry_point_help(cli_procs):
    result = cli_procs.run("--help")
    assert result.returncode == 0, result.stderr
    for command in ("serve-ps", "train", "status"):
        assert command in result.stdout


def test_version_is_the_packages():
    result = runner.invoke(cli.app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"plug-asgd {plug_asgd.__version__}\n"
    assert "--version" in runner.invoke(cli.app, ["--help"]).output


def serve_ps_help(columns: int = 80) -> str:
    result = runner.invoke(cli.app, ["serve-ps", "--help"], env={"COLUMNS": str(columns), "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.output


def ps_flags() -> list[str]:
    """serve-ps's flags made from PSConfig's fields (a switch on by default is --no-NAME)."""
    flags = []
    for f in dataclasses.fields(PSConfig):
        if f.metadata["cli"]:
            flag = f.metadata["flags"][0] if f.metadata["flags"] else "--" + f.name.replace("_", "-")
            flags.append(f"--no-{flag[2:]}" if options.inverted(f) else flag)
    return flags


def test_serve_ps_help_is_readable_at_80_columns():
    text = serve_ps_help(80)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(line for line in lines if len(line) > 80)
    assert "…" not in text  # rich's mark of a cut cell
    for flag in [*ps_flags(), "--host", "--port", "--log-level", "--quiet", "--log-every"]:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), f"{flag} is not shown whole"
    for panel in options.PANELS:
        assert f"╭─ {panel} " in text
    assert "<bool>" not in text  # the switches take no value
    with_value = [name for name, shown in options.SHOWN.items() if shown.metavar]
    assert text.count("[default:") == len(with_value)  # every default shown, none for a flag
    assert 'AsyncPSStrategy(ps_address="tcp://HOST:PORT")' in text and "(ps_threads=)" in text
    # the description is wrapped by the terminal: wider, fewer lines
    description = text.split("╭─")[0]
    assert len(serve_ps_help(120).split("╭─")[0].splitlines()) < len(description.splitlines())


def test_every_ps_option_has_a_short_line_in_a_panel():
    for f in dataclasses.fields(PSConfig):
        if f.metadata["cli"]:
            assert f.name in options.SHOWN, f"{f.name}: add its line to plug_asgd.cli.options.SHOWN"
    for name, shown in options.SHOWN.items():
        assert shown.panel in options.PANELS and len(shown.help.replace(", ".join(MODES), "")) <= 80, name
        field = next((f for f in dataclasses.fields(PSConfig) if f.name == name), None)
        if field is not None and field.default is None:
            assert shown.default, f"{name}: say what its default of None means"


def test_commands_help_is_their_docstrings_unwrapped():
    assert options.unwrapped("First line\n    goes on.\n\n    Second\n    paragraph.\n    \f\n    Args: x") == (
        "First line goes on.\n\nSecond paragraph.")
    for command in cli.app.registered_commands:
        assert command.help and "\f" not in command.help
        assert all("\n" not in p for p in command.help.split("\n\n"))


def test_no_shm_pushes_is_the_switch_turned_off():
    assert options.config_values({"no_shm_pushes": True, "keep": 3}) == {"shm_pushes": False, "keep": 3}
    assert options.config_values({"no_shm_pushes": False}) == {"shm_pushes": True}
    result = runner.invoke(cli.app, ["serve-ps", "--shm-pushes"])
    assert result.exit_code == 2


def test_serve_ps_rejects_unknown_mode():
    result = runner.invoke(cli.app, ["serve-ps", "--mode", "nope"])
    assert result.exit_code == 2  # a usage error, as every refused option
    assert "unknown mode 'nope'" in result.output
    for mode in MODES:
        assert mode in result.output


def test_serve_ps_refuses_zero_fold_threads():
    result = runner.invoke(cli.app, ["serve-ps", "--threads", "0"])
    assert result.exit_code == 2 and "--threads" in result.output


def test_serve_ps_rejects_unknown_log_level():
    result = runner.invoke(cli.app, ["serve-ps", "--log-level", "loud"])
    assert result.exit_code == 2
    assert "loud" in result.output


def test_train_unknown_recipe():
    result = runner.invoke(cli.app, ["train", "imagenet", "--workers", "2"])
    assert result.exit_code == 2
    assert "cifar10" in result.output and "mnist" in result.output
    assert "Traceback" not in result.output


def test_train_without_recipe_lists_recipes():
    result = runner.invoke(cli.app, ["train"])
    assert result.exit_code == 2
    assert "mnist" in result.output


def test_train_help_is_the_recipes():
    result = runner.invoke(cli.app, ["train", "mnist", "--help"])
    assert result.exit_code == 0, result.output
    for flag in ("--data-dir", "--workers", "--accelerator", "--devices", "--mode", "--ps-address"):
        assert flag in result.output


def test_train_passes_arguments_unchanged(monkeypatch):
    seen: list[list[str]] = []
    fake = types.ModuleType("plug_asgd_fake_recipe")
    fake.main = lambda argv: seen.append(argv)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "plug_asgd_fake_recipe", fake)
    monkeypatch.setitem(training.RECIPES, "fake", ("plug_asgd_fake_recipe", "a test recipe"))
    argv = ["--workers", "2", "-x", "value", "--help", "--", "positional", "--mode=sync"]
    before = list(sys.argv)
    result = runner.invoke(cli.app, ["train", "fake", *argv])
    assert result.exit_code == 0, result.output
    assert seen == [argv]
    assert sys.argv == before


def test_stats_table_shows_counters():
    from rich.console import Console

    stats = {"mode": "adacomp", "version": 12, "initialized": True, "max_updates": None, "world_size": 2,
             "workers": [0, 1], "trainers": 2, "uptime_s": 3.0, "updates_per_s": 4.0, "messages_in": 40,
             "bytes_in": 2_500_000, "bytes_out": 999, "push_bytes_in": 1_000_000, "pushes_applied": 12,
             "pushes_dropped": 1, "pushes_after_stop": 0, "refused": {"bad_tensor": 3},
             "staleness": {"0": 7, "1": 5}, "pushes_by_rank": {"0": 6, "1": 6}}
    console = Console(width=200, file=io.StringIO())
    console.print(ps_status.stats_table("tcp://127.0.0.1:1", stats))
    text = console.file.getvalue()
    for expected in ("adacomp", "version", "12", "2.50 MB", "999 B", "bad_tensor: 3", "0: 7  1: 5", "ranks 0, 1"):
        assert expected in text
    console = Console(width=200, file=io.StringIO())
    console.print(ps_status.stats_table("tcp://127.0.0.1:1", {**stats, "push_local_bytes_in": 9_599_056}))
    assert "(pushes 1.00 MB, + 9.60 MB through shared memory)" in console.file.getvalue()
    assert "busy" not in text
    console = Console(width=200, file=io.StringIO())
    console.print(ps_status.stats_table("tcp://127.0.0.1:1", {**stats, "busy_s": 0.75, "push_messages": 12,
                                                        "push_busy_s": 0.03, "push_busy_cpu_s": 0.024}))
    # 0.75 s of 3 s; 30 ms / 12 pushes, 24 ms / 12 on a core
    assert "25% of its time, 2.50 ms a push (2.00 ms on a core)" in console.file.getvalue()


# -- real processes ----------------------------------------------------------------------------


@pytest.mark.integration
def test_serve_ps_status_and_sigterm(cli_procs):
    port = free_port()
    ps, out, err = cli_procs.start("serve-ps", "--port", str(port), "--mode", "adacomp", name="ps")
    wait_for_text(out, f"tcp://127.0.0.1:{port}", ps)
    result = cli_procs.run("status", f"tcp://127.0.0.1:{port}", "--timeout", "20")
    assert result.returncode == 0, result.stdout + result.stderr
    # the table's rows (counter │ value): a PS just started, that no worker has joined or initialised
    rows = {cells[1].strip(): cells[2].strip() for line in result.stdout.splitlines()
            if len(cells := line.split("│")) == 4}
    assert (rows["mode"], rows["version"], rows["initialized"], rows["workers"], rows["pushes applied"]) == (
        "adacomp", "0", "no", "0", "0"), result.stdout
    assert ps.poll() is None
    ps.send_signal(signal.SIGTERM)
    assert ps.wait(timeout=10) == 0
    assert "Traceback" not in err.read_text()
    assert "mode adacomp" in out.read_text()


@pytest.mark.integration
def test_serve_ps_exits_when_workers_have_left(cli_procs):
    port = free_port()
    ps, out, err = cli_procs.start("serve-ps", "--port", str(port), "--workers", "1", "--linger", "0.5", name="ps")
    wait_for_text(out, f"tcp://127.0.0.1:{port}", ps)
    client = PSClient(f"tcp://127.0.0.1:{port}", rank=0, world_size=1, mode="asgd", request_timeout=20)
    try:
        welcome = client.hello(stage=1, training=True)
        assert welcome["mode"] == "asgd"
        client.bye(stage=1, timeout=20)
    finally:
        client.close()
    assert ps.wait(timeout=10) == 0
    assert "Traceback" not in err.read_text()


@pytest.mark.integration
def test_serve_ps_port_in_use(cli_procs):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = cli_procs.run("serve-ps", "--port", str(port))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert result.stderr.startswith(f"error: the parameter server cannot listen on tcp://127.0.0.1:{port}: "
                                    "Address already in use"), result.stderr
    assert "choose another with --port" in result.stderr
    assert "Traceback" not in output


@pytest.mark.integration
def test_status_unreachable(cli_procs):
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    start = time.monotonic()
    result = cli_procs.run("status", address, "--timeout", "1")
    waited = time.monotonic() - start
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert f"no reply from the parameter server at {address} within 1 s (request 'stats')" in result.stderr
    assert "Traceback" not in output
    # it waited out its timeout of 1 s (not refused at once), then gave up: the rest is the process's start
    assert 1.0 <= waited < 30


@pytest.mark.integration
def test_status_malformed_address(cli_procs):
    result = cli_procs.run("status", "tcp://nohost", "--timeout", "1")
    assert result.returncode == 2
    assert "tcp://nohost" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.skipif(not FASHION_DIR.is_dir(), reason=f"no dataset at {FASHION_DIR}")
@pytest.mark.integration
@pytest.mark.timeout(240)  # a whole 2-worker launch (Lightning's import twice, on a loaded 2-core machine)
def test_train_mnist_two_workers(cli_procs, tmp_path):
    """Lightning re-runs the command line for the second worker: the CLI must survive that."""
    metrics = tmp_path / "metrics.json"
    result = cli_procs.run("train", "mnist", "--workers", "2", "--max-steps", "2", "--train-subset", "64",
                       "--test-subset", "32", "--no-val", "--quiet", "--no-download", "--data-dir", str(FASHION_DIR),
                       "--run-dir", str(tmp_path / "runs"), "--metrics-json", str(metrics), timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "central model test accuracy" in result.stdout
    summary = json.loads(metrics.read_text())
    # 64 images over 2 workers, batch 32, one epoch: one step each, before --max-steps 2 binds; one push a step
    assert summary["workers"] == 2 and summary["ps_version"] == summary["pushes_applied"] == 2, summary
