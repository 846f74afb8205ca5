"""What ``plug-asgd status`` shows of a running parameter server, asked as a bystander.

:func:`ask` gets a PS's counters, :func:`stats_table` draws them as one table, :func:`watch` redraws
the live view of one PS (``serve-ps``'s dashboard) or of every shard of a sharded PS. The command line
(:mod:`plug_asgd.cli.reporting`) parses the arguments and turns a :class:`StatusError` into its exit code. Only
rich, the standard library and the PS's client (no torch) are imported.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from plug_asgd.cli.dashboard import Dashboard, busy_text, disk_text, human_bytes
from plug_asgd.cli.roles import failover_text
from plug_asgd.cli.shard_status import ShardsDashboard
from plug_asgd.protocol.security import KeysError
from plug_asgd.worker.client import PSClient, PSError, PSUnreachableError


def histogram_text(counts: dict[str, Any] | None, empty: str = "none") -> str:
    """A counter map as one line, ``key: value`` pairs in the map's order.

    Args:
        counts: the counts by key (a histogram, refusals by code, ...); None or empty for none.
        empty: the text shown where there are none.
    """
    if not counts:
        return empty
    return "  ".join(f"{k}: {v}" for k, v in counts.items())


def stats_table(address: str, stats: dict[str, Any]) -> Table:
    """A rich table of a PS's ``snapshot()`` counters.

    Args:
        address: the PS's address, shown in the title.
        stats: the PS's counters, as its ``stats`` reply holds them.
    """
    table = Table(title=f"parameter server {address}", show_header=True, title_justify="left")
    table.add_column("counter", style="cyan", no_wrap=True)
    table.add_column("value", overflow="fold")
    workers = stats.get("workers") or []
    rows = [
        ("mode", str(stats.get("mode"))),
        ("version", str(stats.get("version"))),
        ("initialized", "yes" if stats.get("initialized") else "no"),
        ("max updates", "none" if stats.get("max_updates") is None else str(stats.get("max_updates"))),
        ("world size", "unknown" if stats.get("world_size") is None else str(stats.get("world_size"))),
        ("workers", f"{len(workers)}" + (f" (ranks {', '.join(map(str, workers))})" if workers else "")),
        ("trainers", str(stats.get("trainers"))),
        ("uptime", f"{float(stats.get('uptime_s') or 0):.1f} s"),
        ("updates/s", f"{float(stats.get('updates_per_s') or 0):.3f} (average since start)"),
        ("messages in", str(stats.get("messages_in"))),
        ("bytes in", f"{human_bytes(stats.get('bytes_in'))} (pushes {human_bytes(stats.get('push_bytes_in'))}"
                     + (f", + {human_bytes(stats['push_local_bytes_in'])} through shared memory"
                        if stats.get("push_local_bytes_in") else "") + ")"),
        ("bytes out", human_bytes(stats.get("bytes_out"))),
        *([("busy", busy)] if (busy := busy_text(stats)) is not None else []),
        ("pushes applied", str(stats.get("pushes_applied"))),
        ("pushes dropped", str(stats.get("pushes_dropped"))),
        ("pushes after stop", str(stats.get("pushes_after_stop"))),
        ("refused by code", histogram_text(stats.get("refused"))),
        *([("replies dropped", histogram_text(dropped))] if (dropped := stats.get("replies_dropped")) else []),
        ("staleness histogram", histogram_text(stats.get("staleness"))),
        ("pushes by rank", histogram_text(stats.get("pushes_by_rank"))),
        *([("disk", disk)] if (disk := disk_text(stats)) is not None else []),
        *([("role", role)] if (role := failover_text(stats)) is not None else []),
    ]
    for name, value in rows:
        table.add_row(name, escape(value))
    return table


class StatusError(Exception):
    """A PS's counters could not be had: ``code`` 1 (unreachable, refused) or 2 (bad address, keys).

    Args:
        message: what went wrong, the exception's text.
        code: the exit code the command ends with: 1 (unreachable, refused) or 2 (bad address, keys).
    """

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def ask(address: str, timeout: float, keys: Path | None) -> dict[str, Any]:
    """One PS's counters, asked as a bystander; raises :class:`StatusError`.

    Args:
        address: the PS's endpoint, ``tcp://HOST:PORT``.
        timeout: seconds to wait for the answer.
        keys: the worker keys folder for a PS with CURVE keys; None for a PS without.

    Raises:
        StatusError: where the keys or the address are bad (code 2), or the PS does not answer or refuses
            (code 1).
    """
    try:
        client = PSClient(address, rank=0, world_size=1, mode="", request_timeout=timeout, keys=keys)
    except KeysError as exc:
        raise StatusError(str(exc), 2) from None
    except Exception as exc:  # zmq refuses a malformed endpoint at connect time
        raise StatusError(f"cannot connect to {address}: {exc} (expected tcp://HOST:PORT)", 2) from None
    try:
        return client.stats(timeout=timeout)
    except (PSUnreachableError, PSError) as exc:  # names the address and says what to check
        raise StatusError(str(exc), 1) from None
    finally:
        client.close()


def watch(addresses: list[str], first: list[dict[str, Any]], timeout: float, keys: Path | None, every: float,
          console: Console, err_console: Console) -> None:
    """``status --watch``: the live view of one PS (serve-ps's dashboard) or of every shard, until Ctrl-C.

    ``first``: every PS's counters, asked once by the caller (a PS that does not answer then ends the command, as
    without --watch). Later, a shard that stops answering is shown as such and asked again at the next redraw
    (one PS: a line above the view).

    Args:
        addresses: the PS's endpoint, or every shard's in shard order.
        first: every PS's counters, asked once by the caller, in the order of ``addresses``.
        timeout: seconds to wait for each answer.
        keys: the worker keys folder for a PS with CURVE keys; None for a PS without.
        every: seconds between redraws.
        console: where the live view is drawn.
        err_console: where a lone PS's missed answers are printed.
    """
    each: list[dict[str, Any] | None] = list(first)
    errors: list[str | None] = [None] * len(addresses)
    if len(addresses) == 1:
        one = Dashboard(addresses[0], console)

        def show() -> None:
            if each[0] is not None:
                one.update(each[0])
            else:  # above the view, which keeps the last counters
                err_console.print(f"[bold red]{time.strftime('%H:%M:%S')} no answer:[/] {escape(errors[0] or '')}",
                                  soft_wrap=True, highlight=False)

        view: Dashboard | ShardsDashboard = one
    else:
        shards = view = ShardsDashboard(addresses, console)

        def show() -> None:
            shards.update(each, errors)

    try:
        with view:
            while True:
                started = time.monotonic()
                show()
                time.sleep(max(0.0, every - (time.monotonic() - started)))
                for i, address in enumerate(addresses):
                    try:
                        each[i], errors[i] = ask(address, timeout, keys), None
                    except StatusError as exc:
                        each[i], errors[i] = None, str(exc)
    except KeyboardInterrupt:
        pass
