"""The live dashboard of ``plug-asgd serve-ps``: rendering a snapshot, the plain log lines, and the
dashboard on a real pseudo-terminal.

Servers are real processes on 127.0.0.1, each in its own session; every wait has a timeout and
each test kills its process group in a ``finally``.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from plug_asgd.cli import app as cli
from plug_asgd.cli import status as ps_status
from plug_asgd.cli.dashboard import (
    Dashboard,
    human_bytes,
    human_duration,
    log_line,
    recent_rate,
    render,
    sparkline,
    staleness_text,
)
from tests.conftest import ROOT, child_env, free_port, kill_group

pytestmark = pytest.mark.timeout(120)

PLUG_ASGD = str(Path(sys.executable).with_name("plug-asgd"))
ANSI = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][0-9A-Za-z])")
START_TIMEOUT = 60.0  # the console script imports Lightning first: slow on a loaded 2-core machine

SNAPSHOT = {
    "mode": "adacomp", "version": 1234, "initialized": True, "max_updates": None, "world_size": 3,
    "workers": [0, 2], "trainers": 2,
    "worker_details": [
        {"rank": 0, "stage": 1, "training": True, "pushes": 700, "last_seen_s": 0.31},
        {"rank": 2, "stage": 1, "training": True, "pushes": 534, "last_seen_s": 12.04},
    ],
    "uptime_s": 83.5, "updates_per_s": 14.78, "messages_in": 2500, "bytes_in": 2_500_000,
    "bytes_out": 12_345_678, "push_bytes_in": 2_000_000, "pushes_applied": 1234, "pushes_dropped": 7,
    "pushes_after_stop": 0, "refused": {"bad_tensor": 3, "duplicate": 1},
    "staleness": {"0": 120, "1": 30, "2": 4}, "pushes_by_rank": {"0": 700, "2": 534},
}


def text_of(renderable, width: int = 120) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


# -- rendering (pure) --------------------------------------------------------------------------


def test_failed_writes_show_in_the_dashboard_and_in_status_only_once_there_are_some():
    failing = {**SNAPSHOT, "io_errors": {"checkpoint ENOSPC": 2, "metrics EROFS": 1},
               "io_last_error": "checkpoint: [Errno 28] No space left on device (08:51:02)",
               "last_checkpoint": "/ck/ps-v0000000016-r1.ckpt"}
    expected = ("failed writes checkpoint ENOSPC:2 metrics EROFS:1; last: checkpoint: [Errno 28] No space left on "
                "device (08:51:02); newest checkpoint ps-v0000000016-r1.ckpt")
    assert expected in " ".join(text_of(render(failing), width=400).split())
    console = Console(width=400, file=io.StringIO())
    console.print(ps_status.stats_table("tcp://127.0.0.1:1", failing))
    assert expected in console.file.getvalue()
    for snapshot in (SNAPSHOT, {**SNAPSHOT, "io_errors": {}}):
        assert "failed writes" not in text_of(render(snapshot), width=400)
        console = Console(width=400, file=io.StringIO())
        console.print(ps_status.stats_table("tcp://127.0.0.1:1", snapshot))
        assert " disk " not in console.file.getvalue()


def test_render_shows_workers_and_counters():
    text = text_of(render(SNAPSHOT, None, "tcp://127.0.0.1:2223"))
    for expected in ("tcp://127.0.0.1:2223", "adacomp", "version 1234", "2 workers", "2 training", "world size 3",
                     "1m 23s", "14.78 updates/s (since start)",
                     "2.50 MB", "12.35 MB", "applied 1234", "dropped 7", "bad_tensor:3", "duplicate:1",
                     "0:120 1:30 2:4", "0.3 s ago", "12.0 s ago", "700", "534"):
        assert expected in text, f"{expected!r} missing from:\n{text}"
    rows = [line for line in text.splitlines() if "s ago" in line]
    assert [re.findall(r"\d+", row)[0] for row in rows] == ["0", "2"]  # one row per rank, in order


def test_paced_workers_show_their_steps_per_second_and_pace_and_others_no_such_columns():
    """async_diloco's dynamic steps: each worker's rate and pace (the PS's ``worker_details``), blank for one that
    has said none or trains no more; a snapshot without rates has no such columns."""
    assert "steps/s" not in text_of(render(SNAPSHOT)) and "pace" not in text_of(render(SNAPSHOT))
    details = [{"rank": 0, "stage": 1, "training": True, "pushes": 12, "last_seen_s": 0.2, "rate": 58.14, "pace": 1.0},
               {"rank": 1, "stage": 1, "training": True, "pushes": 11, "last_seen_s": 0.4, "rate": 29.3,
                "pace": 0.5039},
               {"rank": 2, "stage": 1, "training": False, "pushes": 3, "last_seen_s": 9.0, "rate": 40.0, "pace": None},
               {"rank": 3, "stage": 1, "training": True, "pushes": 0, "last_seen_s": 1.0}]
    text = text_of(render({**SNAPSHOT, "mode": "async_diloco", "worker_details": details}))
    lines = text.splitlines()
    header = [c.strip() for c in next(line for line in lines if "pushes" in line).split("┃")[1:-1]]
    assert header == ["rank", "stage", "training", "pushes", "steps/s", "pace", "last contact"]
    cells = {row[0]: row[4:6] for row in ([c.strip() for c in line.split("│")[2:-2]] for line in lines
                                          if "s ago" in line)}
    assert cells == {"0": ["58.1", "1.00"], "1": ["29.3", "0.50"], "2": ["40.0", ""], "3": ["", ""]}


def test_update_bytes_through_shared_memory_are_shown_beside_those_on_the_socket():
    text = text_of(render({**SNAPSHOT, "push_local_bytes_in": 4_799_528}, None, "a"))
    assert "pushes 2.00 MB (+ 4.80 MB through shared memory)" in text, text
    assert "shared memory" not in text_of(render(SNAPSHOT, None, "a"))


def test_the_time_the_ps_spends_handling_requests_is_shown_when_the_ps_counts_it():
    busy = {**SNAPSHOT, "busy_s": 20.875, "push_messages": 1000, "push_busy_s": 1.25, "push_busy_cpu_s": 0.75}
    text = text_of(render(busy, None, "a"))
    assert "busy       25% of its time, 1.25 ms a push (0.75 ms on a core)" in text, text  # 20.875 s of 83.5
    previous = {**busy, "busy_s": 19.875, "uptime_s": 81.5}  # 1 s busy in the last 2 s
    assert "25% of its time (50% recently), 1.25 ms a push" in text_of(render(busy, previous, "a"))
    assert "busy" not in text_of(render(SNAPSHOT, None, "a"))  # an older PS does not say


def test_a_lost_worker_is_shown_as_lost():
    details = [*SNAPSHOT["worker_details"], {"rank": 1, "stage": 0, "training": True, "pushes": 9,
                                              "last_seen_s": 25.0, "lost": True}]
    text = text_of(render({**SNAPSHOT, "lost": [1], "worker_details": details}, None, "a"))
    assert "lost: rank 1" in text and "25.0 s ago: lost" in text
    assert "lost" not in text_of(render(SNAPSHOT, None, "a"))


def test_render_is_pure_and_rates_come_from_the_previous_snapshot():
    previous = {**SNAPSHOT, "version": 1200, "uptime_s": 81.5, "bytes_in": 2_000_000, "bytes_out": 12_345_678}
    first = text_of(render(SNAPSHOT, previous, "a"))
    assert first == text_of(render(SNAPSHOT, previous, "a"))
    assert "17.00 updates/s" in first and "since start" not in first  # (1234 - 1200) / 2 s
    assert "250.00 kB/s" in first  # 500 kB in 2 s
    assert recent_rate(SNAPSHOT, previous) == pytest.approx(17.0)
    assert recent_rate(SNAPSHOT, None) is None
    assert recent_rate(SNAPSHOT, SNAPSHOT) is None  # no time between them


def test_render_without_workers_or_counters():
    empty = {"mode": "asgd", "version": 0, "initialized": False, "workers": [], "trainers": 0, "worker_details": [],
             "uptime_s": 0.4, "updates_per_s": 0.0, "bytes_in": 0, "bytes_out": 0, "refused": {}, "staleness": {}}
    text = text_of(render(empty, None, "tcp://127.0.0.1:9"))
    for expected in ("0 workers", "no worker connected", "no model yet", "0 B", "refused    none",
                     "staleness  none"):
        assert expected in text, f"{expected!r} missing from:\n{text}"
    single = {**SNAPSHOT, "workers": [5], "worker_details": [{"rank": 5, "stage": 0, "training": False,
                                                              "pushes": 0, "last_seen_s": 1.0}]}
    assert "1 worker " in text_of(render(single))


def test_many_workers_are_cut_short():
    details = [{"rank": r, "stage": 1, "training": True, "pushes": r, "last_seen_s": 0.1} for r in range(40)]
    snapshot = {**SNAPSHOT, "workers": list(range(40)), "worker_details": details}
    text = text_of(render(snapshot))
    assert "40 workers" in text and "17 more" in text


def test_formatting_helpers():
    assert [human_bytes(n) for n in (0, 999, 1000, 2_500_000, 3.2e9)] == ["0 B", "999 B", "1.00 kB", "2.50 MB",
                                                                          "3.20 GB"]
    assert [human_duration(s) for s in (4.25, 83, 7384)] == ["4.2 s", "1m 23s", "2h 03m 04s"]
    long_tail = {str(k): 1 for k in range(15)}
    assert staleness_text(long_tail, max_buckets=4) == "0:1 1:1 2:1 >=3:12"
    assert staleness_text({"10": 2, "2": 5}) == "2:5 10:2"  # numeric order, not string order
    assert staleness_text({}) == "none"
    assert sparkline([8, 0, 1]) == "█ ▁"


def test_log_line_and_dashboard_window():
    line = log_line(SNAPSHOT)
    assert line == "version 1234 | 14.78 updates/s | 2 workers | in 2.50 MB | out 12.35 MB"
    dash = Dashboard("tcp://x:1", Console(file=io.StringIO(), width=100), window_s=2.0)
    snaps = [{**SNAPSHOT, "uptime_s": 0.5 * i, "version": 10 * i} for i in range(10)]
    previous = [dash._previous(s) for s in snaps]
    assert previous[0] is None and previous[1] is snaps[0]
    # past the window, rates are measured over the last ~2 s, not since start
    assert previous[-1] is snaps[-5]
    assert log_line(snaps[-1], previous[-1]).startswith("version 90 | 20.00 updates/s")


def test_log_every_is_checked():
    result = CliRunner().invoke(cli.app, ["serve-ps", "--log-every", "0.01"])
    assert result.exit_code == 2
    assert "log-every" in result.output


# -- real processes ----------------------------------------------------------------------------


@pytest.mark.integration
def test_serve_ps_quiet_prints_plain_log_lines(tmp_path):
    port = free_port()
    out_path, err_path = tmp_path / "ps.out", tmp_path / "ps.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([PLUG_ASGD, "serve-ps", "--port", str(port), "--quiet", "--log-every", "0.5"],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                env=child_env(COLUMNS="200"), cwd=tmp_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        lines: list[str] = []
        while time.monotonic() < deadline:
            lines = [line for line in out_path.read_text(errors="replace").splitlines() if "updates/s" in line]
            if len(lines) >= 3 or proc.poll() is not None:
                break
            time.sleep(0.1)
        output = out_path.read_text(errors="replace")
        assert len(lines) >= 3, f"fewer than 3 log lines within {START_TIMEOUT} s (exit {proc.poll()}):\n{output}"
        for line in lines:
            assert re.search(r"version \d+ \| [\d.]+ updates/s \| \d+ workers? \| in [\d.]+ k?B \| out [\d.]+ k?B$",
                             line), line
        assert f"tcp://127.0.0.1:{port}" in output
        assert "\x1b[" not in output and "╭" not in output  # no dashboard, no escape codes
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert "Traceback" not in err_path.read_text(errors="replace")
    finally:
        kill_group(proc)


def _read_available(fd: int, timeout: float) -> bytes:
    """What the pty's master has within ``timeout`` seconds (b"" when nothing; the child's end closed raises)."""
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return b""
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: every process holding the slave end has exited
        raise EOFError from None


@pytest.mark.integration
def test_serve_ps_dashboard_on_a_terminal(tmp_path):
    port = free_port()
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = child_env(TERM="xterm-256color")
    for name in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TERM_PROGRAM"):
        env.pop(name, None)
    try:
        proc = subprocess.Popen([PLUG_ASGD, "serve-ps", "--port", str(port), "--mode", "sync"],
                                stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True,
                                env=env, cwd=tmp_path)
    finally:
        os.close(slave)
    raw = b""
    try:
        deadline = time.monotonic() + START_TIMEOUT
        text = ""
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                raw += _read_available(master, 0.2)
            except EOFError:
                break
            text = ANSI.sub("", raw.decode(errors="replace"))
            if "no worker connected" in text and "╰" in text:
                break
        assert "no worker connected" in text, f"no dashboard within {START_TIMEOUT} s (exit {proc.poll()}):\n{text}"
        assert "\x1b[" in raw.decode(errors="replace")  # drawn with terminal codes
        title = next(line for line in text.splitlines() if "plug_asgd parameter server tcp://" in line)
        assert f"127.0.0.1:{port}" in title and "mode sync" in title
        assert "workers" in text and "0 workers" in text and "updates/s" in text and "staleness" in text
        assert "last contact" in text
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:  # keep draining: a full pty would block it
            try:
                raw += _read_available(master, 0.1)
            except EOFError:
                break
        assert proc.wait(timeout=max(0.1, deadline - time.monotonic())) == 0
        assert "Traceback" not in ANSI.sub("", raw.decode(errors="replace"))
    finally:
        kill_group(proc)
        os.close(master)


# -- a sharded PS: status --watch ADDR0 ADDR1 (plug_asgd.cli.shard_status) ----------------------------

SHARDS = ["tcp://10.0.0.1:2223", "tcp://10.0.0.2:2224"]


def _shard(i: int, **changes) -> dict:
    """SNAPSHOT as shard i of 2 holds it: every push reaches both, each carries its share of the bytes."""
    return {**SNAPSHOT, "shard": f"{i}/2", "partition_digest": "d1", "bytes_in": 1_000_000 * (i + 1),
            "bytes_out": 3_000_000 * (i + 1), "lost": [], **changes}


def _rows(text: str) -> dict[str, list[str]]:
    """The table's rows inside the panel: counter -> its cells (each shard's, then the total)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("│")]
        if len(cells) >= 6 and cells[2]:
            rows[cells[2]] = cells[3:-2]
    return rows


def test_the_sharded_live_view_shows_every_shard_and_the_totals():
    from plug_asgd.cli.shard_status import render_shards

    stats = [_shard(0), _shard(1)]
    # 2 s earlier: 34 updates fewer on each shard, 1 MB fewer in on shard 0
    previous = [_shard(0, version=1200, uptime_s=81.5, bytes_in=0), _shard(1, version=1200, uptime_s=81.5)]
    text = text_of(render_shards(SHARDS, stats, previous), width=160)
    title = text.splitlines()[0]
    assert "plug_asgd sharded parameter server" in title and "2 shards" in title and "mode adacomp" in title
    assert "versions 1234 1234" in text and "17.00 updates/s" in text and "2 workers" in text, text
    assert "2 of 2 shards answering" in text
    rows = _rows(text)
    assert rows["shard"][:2] == ["0/2", "1/2"]
    assert rows["bytes in"] == ["1.00 MB", "2.00 MB", "3.00 MB"]  # each shard's, and the total
    assert rows["bytes out"] == ["3.00 MB", "6.00 MB", "9.00 MB"]
    assert rows["updates/s recently"][:2] == ["17.00", "17.00"]  # (1234 - 1200) / 2 s on each
    assert rows["bytes in/s recently"] == ["500.00 kB/s", "0 B/s", "500.00 kB/s"]
    assert rows["staleness"][:2] == ["0:120 1:30 2:4"] * 2
    assert rows["workers"] == ["0, 2", "0, 2", "2"]
    assert "tcp://10.0.0.1:2223" in text and "tcp://10.0.0.2:2224" in text
    assert "warning" not in text and "does not answer" not in text
    # no previous snapshot yet: no recent rate, the header's updates/s left out
    first = text_of(render_shards(SHARDS, stats), width=160)
    assert "updates/s recently" in first and "17.00" not in first


def test_the_sharded_live_view_says_which_shard_does_not_answer_or_is_out_of_place():
    from plug_asgd.cli.shard_status import render_shards

    text = text_of(render_shards(SHARDS, [_shard(0, lost=[2]), None], None, [None, "no reply within 5 s"]),
                   width=160)
    assert "1 of 2 shards answering" in text and "lost: rank 2" in text, text
    assert "shard 1 (tcp://10.0.0.2:2224) does not answer: no reply within 5 s" in " ".join(text.split())
    rows = _rows(text)
    assert rows["shard"][:2] == ["0/2", "not answering"]  # its column blank, the totals over the others
    assert rows["version"][1] == "-" and rows["bytes in"] == ["1.00 MB", "-", "1.00 MB"], rows
    swapped = text_of(render_shards(SHARDS, [_shard(1), _shard(0, version=1230)]), width=200)
    assert "is shard 1/2, listed as shard 0/2" in " ".join(swapped.split())
    assert "versions 1234 1230 (differ" in swapped


def test_the_sharded_dashboard_measures_each_shards_rates_over_its_own_window():
    from plug_asgd.cli.shard_status import ShardsDashboard

    dash = ShardsDashboard(SHARDS, Console(file=io.StringIO(), width=160), window_s=2.0)
    snaps = [[_shard(i, uptime_s=0.5 * t, version=10 * t) for i in range(2)] for t in range(10)]
    previous = [dash.previous(s) for s in snaps[:9]]
    assert previous[0] == [None, None] and previous[1] == snaps[0]
    assert previous[-1] == snaps[4]  # the oldest within 2 s
    assert dash.previous([None, snaps[9][1]]) == [None, snaps[5][1]]  # a shard that did not answer: no rate
    restarted = _shard(0, uptime_s=0.2, version=3)
    assert dash.previous([restarted, None])[0] is None  # its counters began again: no rate across the restart


def test_status_watch_is_checked():
    result = CliRunner().invoke(cli.app, ["status", "--watch", "0.01", "tcp://127.0.0.1:1"])
    assert result.exit_code == 2 and "at least 0.1 seconds" in result.output
    result = CliRunner().invoke(cli.app, ["status", "--watch", "1", "--json", "tcp://127.0.0.1:1"])
    assert result.exit_code == 2 and "takes no --json" in result.output


class _OnATerminal:
    """``plug-asgd ARGS`` on a pseudo-terminal of 160 x 60: what it drew read as text, its exit after Ctrl-C."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 160, 0, 0))
        # this checkout's plug_asgd, from a folder of its own (an installed one may be another checkout's)
        env = child_env(TERM="xterm-256color",
                        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        for name in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TERM_PROGRAM"):
            env.pop(name, None)
        self.master, self.raw = master, b""
        try:
            self.proc = subprocess.Popen([PLUG_ASGD, *args], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                         start_new_session=True, env=env, cwd=cwd)
        finally:
            os.close(slave)

    def read_until(self, *wanted: str, timeout: float) -> str:
        """What it drew from now until every one of ``wanted`` is there (fails after ``timeout`` s)."""
        start = len(self.raw)
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                self.raw += _read_available(self.master, 0.2)
            except EOFError:
                break
            text = ANSI.sub("", self.raw[start:].decode(errors="replace"))
            if all(w in text for w in wanted):
                break
        assert all(w in text for w in wanted), f"{wanted} not shown (exit {self.proc.poll()}):\n{text[-6000:]}"
        return text

    def interrupt(self) -> int:
        """Ctrl-C; its exit code (read on meanwhile: a full pty would block it)."""
        self.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                self.raw += _read_available(self.master, 0.1)
            except EOFError:
                break
        code = self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        assert "Traceback" not in ANSI.sub("", self.raw.decode(errors="replace"))
        return code

    def close(self) -> None:
        kill_group(self.proc)
        os.close(self.master)


@pytest.mark.integration
def test_status_watch_shows_every_shard_live_on_a_terminal(tmp_path, start_ps):
    shards = [start_ps("asgd", shard=f"{i}/2") for i in range(2)]
    term = _OnATerminal(["status", "--watch", "0.3", "--timeout", "1", *shards], tmp_path)
    try:
        text = term.read_until("2 of 2 shards answering", "╰", timeout=START_TIMEOUT)
        title = next(line for line in text.splitlines() if "plug_asgd sharded parameter server" in line)
        assert "2 shards" in title and "mode asgd" in title
        for expected in ("0/2", "1/2", shards[0], shards[1], "updates/s recently", "total"):
            assert expected in text, f"{expected!r} missing from:\n{text}"
        start_ps.stop(shards[1])  # a shard that goes away: shown as such, the view goes on
        text = term.read_until("1 of 2 shards answering", "does not answer", "╰", timeout=20)
        assert "not answering" in text
        assert term.interrupt() == 0  # Ctrl-C ends the view, not in error
    finally:
        term.close()


@pytest.mark.integration
def test_status_watch_of_one_ps_is_serve_pss_dashboard(tmp_path, start_ps):
    address = start_ps("sync")
    term = _OnATerminal(["status", "--watch", "0.3", address], tmp_path)
    try:
        text = term.read_until("no worker connected", "╰", timeout=START_TIMEOUT)
        title = next(line for line in text.splitlines() if "plug_asgd parameter server tcp://" in line)
        assert address.removeprefix("tcp://") in title and "mode sync" in title
        assert term.interrupt() == 0
    finally:
        term.close()


def test_a_pair_of_primary_and_standby_shows_its_roles_epoch_lag_and_failovers():
    from plug_asgd.cli.roles import failover_text

    alone = {"role": "primary", "epoch": 1, "failovers": 0, "standby": None, "standbys_joined": 0}
    assert failover_text(alone) is None  # a PS that never had a standby: nothing to say
    paired = {**alone, "standby": "tcp://h:2224", "standby_lag": 0, "standbys_joined": 1, "version": 7}
    assert failover_text(paired) == "primary, epoch 1, standby tcp://h:2224 (lag 0 updates)"
    led = {**alone, "epoch": 2, "failovers": 1}
    assert failover_text(led) == "primary, epoch 2, WITHOUT a standby, 1 failover"
    dropped = {**alone, "standbys_joined": 1, "standby_lost_reason": "no acknowledgement within 1.5 s"}
    assert failover_text(dropped) == "primary, epoch 1, WITHOUT a standby (dropped: no acknowledgement within 1.5 s)"
    assert failover_text({"role": "standby", "epoch": 1, "standby_of": "tcp://p:2223", "version": 9}) == (
        "hot standby of tcp://p:2223, epoch 1, at version 9")
    assert "REPLACED by tcp://h:2224" in failover_text({"role": "replaced", "epoch": 1, "leader": "tcp://h:2224"})
    console = Console(record=True, width=120)
    console.print(render({**paired, "version": 7, "workers": []}))
    assert "standby tcp://h:2224 (lag 0 updates)" in console.export_text()
    assert log_line({**led, "version": 3}).endswith("| primary, epoch 2, WITHOUT a standby, 1 failover")
