"""``plug-asgd status ADDR1 ADDR2 ...``: one table for a sharded PS, a column per shard and the totals; with
``--watch``, the live view of it (:class:`ShardsDashboard`, :func:`render_shards`).

Each shard is a PS of its own with its own counters; what an operator asks of the whole is whether
every shard is up, holds its place (``I/N``, in the order given) and has the same workers, and how
the traffic spreads over the shards (the reason to shard: each shard's link and core carry their
part). Versions are per shard: every push reaches every shard, so they advance together, and one
behind the others is a shard that was restarted from an older checkpoint. Only rich, the standard library and
:mod:`plug_asgd.cli.dashboard` (rich only): ``plug_asgd.cli.reporting`` imports this when ``status`` is given
several addresses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from plug_asgd.cli.dashboard import Dashboard, human_bytes, recent_rate, staleness_text


def order_problems(addresses: Sequence[str], stats: Sequence[Mapping[str, Any]]) -> list[str]:
    """What is wrong with the shards as listed: one started without ``--shard``, another shard count, out of
    order, or holding a model cut by another partition than the others; empty when they form one PS.

    Args:
        addresses: the shards' endpoints, in the order given (shard ``i`` at ``addresses[i]``).
        stats: each shard's counters, in the same order.
    """
    problems = []
    count = len(addresses)
    digests = {s.get("partition_digest") for s in stats if s.get("partition_digest")}
    for i, (address, s) in enumerate(zip(addresses, stats, strict=True)):
        spec = s.get("shard")
        if spec is None:
            problems.append(f"{address} holds a whole model (started without --shard), not shard {i}/{count}")
        elif spec != f"{i}/{count}":
            problems.append(f"{address} is shard {spec}, listed as shard {i}/{count}: list the shards in the "
                            "order of their --shard")
    if len(digests) > 1:
        problems.append(f"the shards hold models cut by {len(digests)} different partitions: they do not "
                        "serve one model")
    return problems


def sharded_table(addresses: Sequence[str], stats: Sequence[Mapping[str, Any] | None],
                  fmt_bytes: Callable[[Any], str], previous: Sequence[Mapping[str, Any] | None] | None = None,
                  title: str | None = None) -> Table:
    """A rich table: a row per counter, a column per shard (as listed) and one of totals where they add up.

    ``stats[i]`` None: shard i did not answer (the live view's), its column blank, the totals over the others.
    ``previous``: an older snapshot of each shard (None where there is none yet), for the live view: rows of
    the recent rates (updates, bytes in and out per second) measured between the two, and the staleness.

    Args:
        addresses: the shards' endpoints, in the order given.
        stats: each shard's counters, in the same order; None for a shard that did not answer.
        fmt_bytes: formats a byte count (or rate) for a cell.
        previous: each shard's older snapshot, for the recent rates; None for the one-off table without them.
        title: the table's title; None for one naming the shard count.
    """
    table = Table(title=f"sharded parameter server, {len(addresses)} shards" if title is None else title,
                  show_header=True, title_justify="left")
    table.add_column("counter", style="cyan", no_wrap=True)
    for i, address in enumerate(addresses):
        table.add_column(f"shard {i}\n{address}", overflow="fold")
    table.add_column("total", style="bold", overflow="fold")

    answering = [s for s in stats if s is not None]

    def row(name: str, cell: Callable[[Mapping[str, Any]], str], total: str = "") -> None:
        table.add_row(name, *("-" if s is None else cell(s) for s in stats), total)

    def summed(key: str) -> int:
        return sum(int(s.get(key) or 0) for s in answering)

    table.add_row("shard", *("[bold red]not answering[/]" if s is None else escape(str(s.get("shard") or "whole model"))
                             for s in stats), "")
    row("mode", lambda s: str(s.get("mode")))
    row("version", lambda s: str(s.get("version")),
        "equal" if len({s.get("version") for s in answering}) == 1 else "differ (a shard resumed from a checkpoint?)")
    row("initialized", lambda s: "yes" if s.get("initialized") else "no",
        "yes" if all(s.get("initialized") for s in answering) else "no")
    row("workers", lambda s: ", ".join(map(str, s.get("workers") or [])) or "none",
        str(len(set().union(*(set(s.get("workers") or []) for s in answering)))))
    row("lost", lambda s: ", ".join(map(str, s.get("lost") or [])) or "none")
    row("uptime", lambda s: f"{float(s.get('uptime_s') or 0):.1f} s")
    row("updates/s", lambda s: f"{float(s.get('updates_per_s') or 0):.3f}")
    if previous is not None:
        def rates(key: str) -> list[float | None]:
            return [None if s is None else recent_rate(s, p, key) for s, p in zip(stats, previous, strict=True)]

        def rate_row(name: str, key: str, fmt: Callable[[float], str], total: bool) -> None:
            each = rates(key)
            known = [r for r in each if r is not None]
            table.add_row(name, *("-" if r is None else fmt(r) for r in each),
                          fmt(sum(known)) if total and known else "")

        rate_row("updates/s recently", "version", lambda r: f"{r:.2f}", False)
        rate_row("bytes in/s recently", "bytes_in", lambda r: f"{fmt_bytes(r)}/s", True)
        rate_row("bytes out/s recently", "bytes_out", lambda r: f"{fmt_bytes(r)}/s", True)
    row("busy", lambda s: f"{100 * float(s.get('busy_fraction') or 0):.0f}%")
    row("messages in", lambda s: str(s.get("messages_in")), str(summed("messages_in")))
    for key, name in (("bytes_in", "bytes in"), ("push_bytes_in", "push bytes in"), ("bytes_out", "bytes out"),
                      ("model_bytes_out", "model bytes out")):
        row(name, lambda s, k=key: fmt_bytes(s.get(k)), fmt_bytes(summed(key)))
    row("pushes applied", lambda s: str(s.get("pushes_applied")), "each push reaches every shard")
    row("pushes dropped", lambda s: str(s.get("pushes_dropped")))
    row("refused", lambda s: ", ".join(f"{k}: {v}" for k, v in (s.get("refused") or {}).items()) or "none",
        str(sum(sum((s.get("refused") or {}).values()) for s in answering)))
    if previous is not None:
        row("staleness", lambda s: staleness_text(s.get("staleness"), max_buckets=6))
    row("resumed from", lambda s: str(s.get("resumed_from") or "no"))
    row("last checkpoint", lambda s: str(s.get("last_checkpoint") or "none"))
    return table


def render_shards(addresses: Sequence[str], stats: Sequence[Mapping[str, Any] | None],
                  previous: Sequence[Mapping[str, Any] | None] | None = None,
                  errors: Sequence[str | None] | None = None) -> RenderableType:
    """The live view of a sharded PS (``plug-asgd status --watch ADDR0 ADDR1 ...``): a header of the whole (its
    versions, updates per second, workers), the table of :func:`sharded_table` with the recent rates, and
    what is wrong: a shard that does not answer (``stats[i]`` None, ``errors[i]`` why), one listed out of
    order or cut by another partition.

    ``previous``: each shard's snapshot a few seconds back (None where there is none), for the rates.

    Args:
        addresses: the shards' endpoints, in the order given.
        stats: each shard's counters, in the same order; None for a shard that did not answer.
        previous: each shard's snapshot a few seconds back; None where there are none yet.
        errors: why each shard that did not answer did not; None where none is known.
    """
    count = len(addresses)
    previous = list(previous) if previous is not None else [None] * count
    errors = list(errors) if errors is not None else [None] * count
    up = [i for i in range(count) if stats[i] is not None]
    live = [stats[i] for i in up]
    text = Text()
    versions = [live_stat.get("version") for live_stat in live]
    text.append("versions ")
    text.append(" ".join(str(v) for v in versions) or "-", style="bold cyan")
    if len(set(versions)) > 1:
        text.append(" (differ: a shard resumed from a checkpoint?)", style="yellow")
    rates = [r for i in up if (r := recent_rate(stats[i], previous[i])) is not None]
    if rates:
        text.append("   ")
        text.append(f"{max(rates):.2f} updates/s", style="bold")
    workers = set().union(*(set(s.get("workers") or []) for s in live))
    text.append("   ")
    text.append(f"{len(workers)} worker{'' if len(workers) == 1 else 's'}", style="bold")
    lost = sorted(set().union(*(set(s.get("lost") or []) for s in live)))
    if lost:
        text.append(f"   lost: rank {', '.join(map(str, lost))}", style="bold red")
    text.append(f"   {len(up)} of {count} shards answering", style="bold" if len(up) == count else "bold red")
    table = sharded_table(addresses, stats, human_bytes, previous, title="")
    notes = [Text.from_markup(f"[bold red]shard {i} ({escape(addresses[i])}) does not answer:[/] "
                              f"{escape(errors[i] or 'no reply')}") for i in range(count) if i not in up]
    if len(up) == count:
        notes += [Text.from_markup(f"[bold yellow]warning:[/] {escape(p)}") for p in order_problems(addresses, live)]
    modes = sorted({str(s.get("mode")) for s in live})
    title = Text()
    title.append("plug_asgd sharded parameter server ", style="bold green")
    title.append(f"{count} shards", style="bold")
    title.append("  mode ")
    title.append("/".join(modes) or "?", style="bold")
    return Panel(Group(text, table, *notes), title=title, title_align="left", border_style="green")


class ShardsDashboard:
    """The live view of a sharded PS, redrawn from each shard's snapshots (None for one that did not answer);
    rates are measured per shard over the last ``window_s`` seconds of its snapshots, as :class:`Dashboard`'s.

    Args:
        addresses: the shards' endpoints, in the order given.
        console: where the view is drawn; None for a new console.
        window_s: seconds of snapshots the recent rates are measured over.
    """

    def __init__(self, addresses: Sequence[str], console: Console | None = None, *, window_s: float = 5.0) -> None:
        self.addresses = list(addresses)
        self.console = console or Console()
        self.shards = [Dashboard(a, self.console, window_s=window_s) for a in self.addresses]  # their histories
        self.live = Live(console=self.console, auto_refresh=False, transient=False)

    def previous(self, stats: Sequence[Mapping[str, Any] | None]) -> list[Mapping[str, Any] | None]:
        """Remember each shard's snapshot; each one's oldest within the window (None: none yet, or no answer).

        Args:
            stats: each shard's newest counters; None for a shard that did not answer.
        """
        out: list[Mapping[str, Any] | None] = []
        for shard, snapshot in zip(self.shards, stats, strict=True):
            if snapshot is None:
                out.append(None)
                continue
            if shard.history and float(shard.history[-1].get("uptime_s") or 0) > float(snapshot.get("uptime_s") or 0):
                shard.history.clear()  # restarted: its counters began again
            out.append(shard._previous(snapshot))
        return out

    def update(self, stats: Sequence[Mapping[str, Any] | None], errors: Sequence[str | None] | None = None) -> None:
        """Redraw the view from each shard's newest counters.

        Args:
            stats: each shard's newest counters, in shard order; None for a shard that did not answer.
            errors: why each shard that did not answer did not; None where none is known.
        """
        self.live.update(render_shards(self.addresses, stats, self.previous(stats), errors), refresh=True)

    def __enter__(self) -> ShardsDashboard:
        self.live.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.stop()
