"""The commands that report: ``status`` (the counters of a running PS, or of every shard of a sharded one, once or
live) and ``plot`` (the learning curves of finished runs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from plug_asgd.cli.output import console, err_console, fail


def _check_positive(value: float) -> float:
    if not value > 0:
        raise typer.BadParameter(f"must be positive, got {value:g}")
    return value


def _check_watch(value: float | None) -> float | None:
    if value is not None and not value >= 0.1:
        raise typer.BadParameter(f"must be at least 0.1 seconds, got {value:g}")
    return value


def status(
    addresses: Annotated[list[str], typer.Argument(metavar="ADDRESS", help="the PS's address, e.g. "
                                                   "tcp://127.0.0.1:2223 (tcp:// may be left out), or its members' "
                                                   "joined by | (the primary's, its standby's: the one that leads "
                                                   "answers); a sharded PS's shards' addresses, in order, for one "
                                                   "table of them all",
                                                   show_default=False)],
    timeout: Annotated[float, typer.Option(callback=_check_positive, metavar="S",
                                           help="seconds to wait for the PS's answer")] = 5.0,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="print the counters as JSON instead of a "
                                          "table (a list, one per shard, for several addresses)")] = False,
    keys: Annotated[Path | None, typer.Option(metavar="DIR", help="worker CURVE keys (DIR/worker of 'plug-asgd "
                                              "keygen'), for a PS started with --keys")] = None,
    watch: Annotated[float | None, typer.Option("--watch", "-w", metavar="SECONDS", callback=_check_watch,
                                                help="a live view redrawn every SECONDS seconds until Ctrl-C: the "
                                                "dashboard serve-ps shows, or for several shards a column per "
                                                "shard and the totals", show_default=False)] = None,
) -> None:
    """Show the counters of a running parameter server (version, workers, traffic, staleness...); of every
    shard of a sharded PS, side by side, given their addresses; live with --watch.
    \f

    Args:
        addresses: the PS's endpoint (or its members', joined by ``|``: the one that leads answers), or a sharded
            PS's shards' endpoints in shard order (``tcp://`` may be left out).
        timeout: seconds to wait for each PS's answer.
        as_json: print the counters as JSON (a list, one per shard, for several addresses) instead of a table.
        keys: the worker CURVE keys folder, for a PS started with ``--keys``; None for a PS without keys.
        watch: seconds between redraws of a live view until Ctrl-C; None for the counters once.

    Raises:
        Exit: with code 2 where ``--watch`` and ``--json`` are both given; with code 1 or 2 where a PS does
            not answer or cannot be asked (see :func:`plug_asgd.cli.status.ask`).
    """
    from plug_asgd.cli import status as ps_status

    addresses = ["|".join(m if "://" in m else f"tcp://{m}" for m in a.split("|")) for a in addresses]
    if watch is not None and as_json:
        raise fail("--watch draws a live view: it takes no --json (run status --json in a loop instead)", 2)
    each = [_stats(address, timeout, keys) for address in addresses]  # one that does not answer ends it here
    if watch is not None:
        ps_status.watch(addresses, each, timeout, keys, watch, console, err_console)
    elif as_json:
        print(json.dumps(each[0] if len(each) == 1 else each, indent=2, sort_keys=True))
    elif len(each) == 1:
        console.print(ps_status.stats_table(addresses[0], each[0]))
    else:
        from plug_asgd.cli.dashboard import human_bytes
        from plug_asgd.cli.shard_status import order_problems, sharded_table

        console.print(sharded_table(addresses, each, human_bytes))
        for problem in order_problems(addresses, each):
            err_console.print(f"[bold yellow]warning:[/] {escape(problem)}", soft_wrap=True, highlight=False)


def _stats(address: str, timeout: float, keys: Path | None) -> dict[str, Any]:
    """One PS's counters, asked as a bystander; exits 1 (unreachable, refused) or 2 (bad address, keys)."""
    from plug_asgd.cli.status import StatusError, ask

    try:
        return ask(address, timeout, keys)
    except StatusError as exc:
        raise fail(str(exc), exc.code) from None


def plot(
    runs: Annotated[list[Path], typer.Argument(metavar="RUN", show_default=False,
                                               help="a supervisor.jsonl, or a directory searched for them")],
    out: Annotated[Path, typer.Option("--out", "-o", help="the image to write (PNG)", show_default=False)],
    label: Annotated[list[str] | None, typer.Option("--label", help="a curve's name, once per curve in order "
                                                    "(default: each run's directory name)", show_default=False)]
    = None,
) -> None:
    """Plot test accuracy against wall time and against bytes pushed, one curve per run.
    \f

    Args:
        runs: the runs: supervisor.jsonl files, or directories searched for them.
        out: the image file to write (PNG unless its suffix names another format).
        label: one curve name per supervisor.jsonl found, in order; None for each run's directory name.

    Raises:
        Exit: with code 2 where matplotlib is missing, a run cannot be read, or the image cannot be written.
    """
    from plug_asgd.cli import plot as plotting

    try:
        plotting.require_matplotlib()
    except plotting.MatplotlibMissing as exc:
        raise fail(str(exc), 2) from None
    try:
        path = plotting.plot_runs(runs, out, labels=label or None)
    except (plotting.RunError, OSError, ValueError) as exc:
        raise fail(str(exc), 2) from None
    console.print(f"wrote [bold]{escape(str(path))}[/]", soft_wrap=True, highlight=False)
