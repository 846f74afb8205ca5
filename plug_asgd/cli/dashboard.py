"""A live terminal view of a parameter server's counters (what ``plug-asgd serve-ps`` shows on a terminal).

:func:`render` turns one ``ParameterServer.snapshot()`` (plus an older one, for rates) into a rich
renderable and depends on nothing else, so it can be tested with a recording console.
:class:`Dashboard` keeps the last few snapshots and redraws a :class:`rich.live.Live` display; its
:meth:`Dashboard.on_tick` is meant for ``ParameterServer.serve_forever(on_tick=...)``, which calls
it in the serving thread, between requests.

Only rich, the standard library and plug_asgd.cli.roles are imported: the PS never imports torch or Lightning.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from plug_asgd.cli.roles import failover_text
from plug_asgd.cli.workers_table import workers_table

Snapshot = Mapping[str, Any]

_BLOCKS = " ▁▂▃▄▅▆▇█"


def human_bytes(n: Any) -> str:
    """``2500000`` -> ``"2.50 MB"`` (decimal units, as ``plug-asgd status`` prints them).

    Args:
        n: a byte count (or bytes per second); None reads as 0.

    Raises:
        AssertionError: never: the loop returns at ``TB`` at the latest (the raise marks the end unreachable).
    """
    value = float(n or 0)
    if value < 1000:
        return f"{int(value)} B"
    for unit in ("kB", "MB", "GB", "TB"):
        value /= 1000
        if value < 1000 or unit == "TB":
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")


def human_duration(seconds: Any) -> str:
    """``4.25`` -> ``"4.2 s"``, ``83`` -> ``"1m 23s"``, ``7384`` -> ``"2h 03m 04s"``.

    Args:
        seconds: the duration in seconds; None reads as 0, a negative one as 0.
    """
    s = max(0.0, float(seconds or 0))
    if s < 60:
        return f"{s:.1f} s"
    whole = int(s)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an ``s`` unless ``n`` is 1: ``"1 worker"``, ``"3 workers"``.

    Args:
        n: the count.
        word: the noun in the singular (one made plural by an ``s``).
    """
    return f"{n} {word}{'' if n == 1 else 's'}"


def recent_rate(snapshot: Snapshot, previous: Snapshot | None, key: str = "version") -> float | None:
    """Change of ``snapshot[key]`` per second of PS uptime since ``previous``; None without a usable previous.

    Args:
        snapshot: the PS's newest counters.
        previous: an older snapshot of the same PS; None where there is none yet.
        key: the counter whose rate to measure (``version``: updates per second).
    """
    if previous is None:
        return None
    dt = float(snapshot.get("uptime_s") or 0) - float(previous.get("uptime_s") or 0)
    if dt <= 0:
        return None
    return max(0.0, (float(snapshot.get(key) or 0) - float(previous.get(key) or 0)) / dt)


def updates_per_s(snapshot: Snapshot, previous: Snapshot | None) -> tuple[float, bool]:
    """(updates per second, True when measured over the recent window rather than since start).

    Args:
        snapshot: the PS's newest counters.
        previous: an older snapshot of the same PS; None for the average since the PS started.
    """
    rate = recent_rate(snapshot, previous)
    if rate is None:
        return float(snapshot.get("updates_per_s") or 0), False
    return rate, True


def push_ms(snapshot: Snapshot) -> tuple[float, float | None] | None:
    """The PS's mean time per push, ms: in all, and on a core (None if the PS does not say); None before a push.

    Args:
        snapshot: the PS's counters, as ``ParameterServer.snapshot()`` returns them.
    """
    pushes = int(snapshot.get("push_messages") or 0)
    if not pushes:
        return None
    cpu = snapshot.get("push_busy_cpu_s")
    return (1000 * float(snapshot.get("push_busy_s") or 0) / pushes,
            None if cpu is None else 1000 * float(cpu) / pushes)


def busy_text(snapshot: Snapshot, previous: Snapshot | None = None) -> str | None:
    """How much of its time the PS spends handling requests, and per push; None from a PS that does not say.

    Near 100% the PS is the bottleneck: more workers will not train faster (give it ``--threads``,
    a compressor, or fewer pushes). A push's time on a core well below its wall time means the
    PS waits for a core: the machine is oversubscribed.

    Args:
        snapshot: the PS's newest counters.
        previous: an older snapshot of the same PS, for the recent share; None to show the share since start only.
    """
    busy = snapshot.get("busy_s")
    if busy is None:
        return None
    uptime = float(snapshot.get("uptime_s") or 0)
    text = f"{100 * min(1.0, float(busy) / uptime):.0f}% of its time" if uptime > 0 else "0% of its time"
    recent = recent_rate(snapshot, previous, "busy_s")
    if recent is not None:
        text += f" ({100 * min(1.0, recent):.0f}% recently)"
    per_push = push_ms(snapshot)
    if per_push is not None:
        wall, cpu = per_push
        text += f", {wall:.2f} ms a push" + (f" ({cpu:.2f} ms on a core)" if cpu is not None else "")
    return text


def disk_text(snapshot: Snapshot) -> str | None:
    """The PS's failed writes (``checkpoint ENOSPC:2``) and the last error; None while none failed.

    A failed checkpoint or metrics write does not stop the PS: it is counted and tried again, and
    the updates since the last checkpoint written (``last_checkpoint``) are at risk until one is.

    Args:
        snapshot: the PS's counters, as ``ParameterServer.snapshot()`` returns them.
    """
    errors = snapshot.get("io_errors")
    if not errors:
        return None
    last = snapshot.get("last_checkpoint")
    return (f"failed writes {counts_text(errors)}; last: {snapshot.get('io_last_error')}; newest checkpoint "
            + (PurePath(last).name if last else "none"))


def counts_text(counts: Mapping[str, Any] | None, empty: str = "none") -> str:
    """``{"bad_tensor": 3, "duplicate": 1}`` -> ``"bad_tensor:3 duplicate:1"``.

    Args:
        counts: the counts by key, shown in the map's order; None or empty for none.
        empty: the text shown where there are none.
    """
    if not counts:
        return empty
    return " ".join(f"{k}:{v}" for k, v in counts.items())


def staleness_buckets(hist: Mapping[Any, Any] | None, max_buckets: int = 10) -> list[tuple[str, int]]:
    """The staleness histogram in order of staleness, the tail past ``max_buckets - 1`` folded into ``">=k"``.

    Args:
        hist: pushes by staleness (keys are staleness values, as strings or integers); None for none.
        max_buckets: the most buckets returned, the last one folding the tail.
    """
    items = sorted(((int(k), int(v)) for k, v in (hist or {}).items()), key=lambda kv: kv[0])
    if len(items) <= max_buckets:
        return [(str(k), v) for k, v in items]
    head, tail = items[:max_buckets - 1], items[max_buckets - 1:]
    return [(str(k), v) for k, v in head] + [(f">={tail[0][0]}", sum(v for _, v in tail))]


def staleness_text(hist: Mapping[Any, Any] | None, max_buckets: int = 10) -> str:
    """``{"0": 120, "1": 30, "2": 4}`` -> ``"0:120 1:30 2:4"``.

    Args:
        hist: pushes by staleness, as :func:`staleness_buckets` takes it; None for none.
        max_buckets: the most buckets shown, the last one folding the tail.
    """
    buckets = staleness_buckets(hist, max_buckets)
    return " ".join(f"{k}:{v}" for k, v in buckets) if buckets else "none"


def sparkline(values: list[int]) -> str:
    """One block character per value, scaled to the largest (a nonzero count never shows as blank).

    Args:
        values: the counts to draw, in order; empty (or all zero) for an empty string.
    """
    top = max(values, default=0)
    if top <= 0:
        return ""
    return "".join(_BLOCKS[max(1 if v > 0 else 0, round(v / top * (len(_BLOCKS) - 1)))] for v in values)


def _title(address: str, snapshot: Snapshot) -> Text:
    text = Text()
    text.append("plug_asgd parameter server ", style="bold green")
    text.append(address, style="bold")
    text.append("  mode ")
    text.append(str(snapshot.get("mode")), style="bold")
    return text


def _header(snapshot: Snapshot, previous: Snapshot | None) -> Text:
    rate, recent = updates_per_s(snapshot, previous)
    workers = snapshot.get("workers") or []
    text = Text()
    text.append("version ")
    text.append(str(snapshot.get("version")), style="bold cyan")
    if snapshot.get("max_updates") is not None:
        text.append(f" of {snapshot.get('max_updates')}")
    text.append("   ")
    text.append(f"{rate:.2f} updates/s", style="bold")
    if not recent:
        text.append(" (since start)", style="dim")
    text.append(f"   uptime {human_duration(snapshot.get('uptime_s'))}   ")
    text.append(plural(len(workers), "worker"), style="bold")
    details = [f"{snapshot.get('trainers') or 0} training"]
    if snapshot.get("world_size") is not None:
        details.append(f"world size {snapshot.get('world_size')}")
    text.append(f" ({', '.join(details)})")
    if snapshot.get("lost"):
        text.append(f"   lost: rank {', '.join(map(str, snapshot['lost']))}", style="bold red")
    if not snapshot.get("initialized", True):
        text.append("   no model yet (the first worker sends it)", style="yellow")
    return text


def _counters_table(snapshot: Snapshot, previous: Snapshot | None) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="cyan", no_wrap=True)
    table.add_column(overflow="fold")

    def with_rate(key: str) -> str:
        rate = recent_rate(snapshot, previous, key)
        return f"{human_bytes(snapshot.get(key))}" + ("" if rate is None else f" ({human_bytes(rate)}/s)")

    refused = snapshot.get("refused") or {}
    stale = staleness_buckets(snapshot.get("staleness"))
    rows = [
        ("bytes in", f"{with_rate('bytes_in')}, pushes {human_bytes(snapshot.get('push_bytes_in'))}"
                     + (f" (+ {human_bytes(snapshot['push_local_bytes_in'])} through shared memory)"
                        if snapshot.get("push_local_bytes_in") else "")),
        ("bytes out", with_rate("bytes_out")),
        ("pushes", f"applied {snapshot.get('pushes_applied') or 0}, dropped {snapshot.get('pushes_dropped') or 0}"
                   + (f", after stop {snapshot['pushes_after_stop']}" if snapshot.get("pushes_after_stop") else "")),
        ("refused", f"[red]{escape(counts_text(refused))}[/]" if refused else "none"),
        *([("replies dropped", f"[red]{escape(counts_text(dropped))}[/]")]  # to clients that do not read them
          if (dropped := snapshot.get("replies_dropped")) else []),
        ("staleness", escape(staleness_text(snapshot.get("staleness")))
         + (f"  [magenta]{sparkline([v for _, v in stale])}[/]" if stale else "")),
    ]
    busy = busy_text(snapshot, previous)
    if busy is not None:
        rows.insert(3, ("busy", busy))
    disk = disk_text(snapshot)
    if disk is not None:
        rows.append(("disk", f"[bold red]{escape(disk)}[/]"))
    if (role := failover_text(snapshot)) is not None:
        rows.insert(0, ("role", escape(role) if snapshot.get("standby") else f"[bold yellow]{escape(role)}[/]"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def render(snapshot: Snapshot, previous: Snapshot | None = None, address: str | None = None) -> RenderableType:
    """The dashboard for one snapshot: a header, the workers table and the counters.

    ``previous`` is an older snapshot of the same PS (a few ticks back): rates are measured
    between the two. Without one, updates/s is the average since the PS started.

    Args:
        snapshot: the PS's newest counters.
        previous: an older snapshot of the same PS, for the rates; None where there is none yet.
        address: the PS's address, shown in the title; None for none.
    """
    body = Group(_header(snapshot, previous), workers_table(snapshot), _counters_table(snapshot, previous))
    return Panel(body, title=_title(address or "", snapshot), title_align="left", border_style="green")


def log_line(snapshot: Snapshot, previous: Snapshot | None = None) -> str:
    """One plain line of the main counters (what ``serve-ps --quiet`` prints every ``--log-every`` seconds).

    Args:
        snapshot: the PS's newest counters.
        previous: an older snapshot of the same PS, for the recent rate; None for the average since start.
    """
    rate, _ = updates_per_s(snapshot, previous)
    workers = len(snapshot.get("workers") or [])
    role = failover_text(snapshot)
    return (f"version {snapshot.get('version')} | {rate:.2f} updates/s | {plural(workers, 'worker')} | "
            f"in {human_bytes(snapshot.get('bytes_in'))} | out {human_bytes(snapshot.get('bytes_out'))}"
            + (f" | {role}" if role else ""))


class Dashboard:
    """A :class:`rich.live.Live` view of a PS, redrawn from its snapshots.

    ``with Dashboard(address) as dash: server.serve_forever(on_tick=dash.on_tick)``; rates are
    measured over the last ``window_s`` seconds of snapshots.

    Args:
        address: the PS's address, shown in the title.
        console: where the view is drawn; None for a new console.
        window_s: seconds of snapshots the recent rates are measured over.
    """

    def __init__(self, address: str, console: Console | None = None, *, window_s: float = 5.0) -> None:
        self.address = address
        self.console = console or Console()
        self.window_s = window_s
        self.history: deque[Snapshot] = deque()
        # no refresh thread: the serving thread redraws on each tick; stray prints go above the view
        self.live = Live(console=self.console, auto_refresh=False, transient=False)

    def render(self, snapshot: Snapshot, previous: Snapshot | None = None) -> RenderableType:
        """The view of one snapshot, as :func:`render` draws it, titled with this PS's address.

        Args:
            snapshot: the PS's newest counters.
            previous: an older snapshot of the same PS, for the rates; None where there is none yet.
        """
        return render(snapshot, previous, self.address)

    def _previous(self, snapshot: Snapshot) -> Snapshot | None:
        """Remember ``snapshot``; return the oldest one still within the window (None for the first)."""
        now = float(snapshot.get("uptime_s") or 0)
        # drop the oldest while the next one is already a full window back
        while len(self.history) > 1 and now - float(self.history[1].get("uptime_s") or 0) >= self.window_s:
            self.history.popleft()
        previous = self.history[0] if self.history else None
        self.history.append(snapshot)
        return previous

    def update(self, snapshot: Snapshot) -> None:
        """Remember ``snapshot`` and redraw the view, rates measured over the window.

        Args:
            snapshot: the PS's newest counters.
        """
        self.live.update(self.render(snapshot, self._previous(snapshot)), refresh=True)

    def on_tick(self, server: Any) -> None:
        """Redraw from the server's counters now; meant for ``serve_forever(on_tick=...)``, in the serving thread.

        Args:
            server: the ``ParameterServer`` to show (anything with a ``snapshot()`` method).
        """
        self.update(server.snapshot())

    def __enter__(self) -> Dashboard:
        self.live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.stop()
