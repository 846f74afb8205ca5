"""The dashboard's table of workers: each one's rank, stage, pushes and last contact, and, where async_diloco's
dynamic local steps pace them, its local steps per second and its pace (those over the fastest training worker's:
the share of the inner steps it makes), so that an operator sees why a worker's rounds are short.

Only rich is imported: the PS never imports torch or Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.table import Table

MAX_WORKER_ROWS = 24  # past that, the table ends with a "... N more" row


def workers_table(snapshot: Mapping[str, Any]) -> Table:
    """The workers of a PS's snapshot (``worker_details``; an older PS's ``workers``, ranks only).

    Args:
        snapshot: the PS's counters, as ``ParameterServer.snapshot()`` gives them.
    """
    details = snapshot.get("worker_details")
    if details is None:  # an older PS: ranks only
        details = [{"rank": r} for r in snapshot.get("workers") or []]
    paced = any(w.get("rate") is not None for w in details)
    columns = [("rank", "right"), ("stage", "right"), ("training", "center"), ("pushes", "right")]
    columns += [("steps/s", "right"), ("pace", "right")] if paced else []
    table = Table(title="workers", title_justify="left", show_edge=True, expand=False)
    for name, justify in [*columns, ("last contact", "right")]:
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    blank = [""] * (len(columns) - 1)
    shown = details if len(details) <= MAX_WORKER_ROWS else details[:MAX_WORKER_ROWS - 1]
    for w in shown:
        seen, rate, pace = w.get("last_seen_s"), w.get("rate"), w.get("pace")
        cells = [
            str(w.get("rank")),
            "" if w.get("stage") is None else str(w.get("stage")),
            "" if w.get("training") is None else ("[green]yes[/]" if w.get("training") else "[dim]no[/]"),
            "" if w.get("pushes") is None else str(w.get("pushes")),
        ]
        if paced:
            cells += ["" if rate is None else f"{float(rate):.1f}", "" if pace is None else f"{float(pace):.2f}"]
        cells.append("" if seen is None else (f"[red]{float(seen):.1f} s ago: lost[/]" if w.get("lost")
                                              else f"{float(seen):.1f} s ago"))
        table.add_row(*cells)
    if len(shown) < len(details):
        table.add_row("[dim]...[/]", *blank, f"[dim]{len(details) - len(shown)} more[/]")
    if not details:
        table.add_row("[dim]-[/]", *blank, "[dim]no worker connected[/]")
    return table
