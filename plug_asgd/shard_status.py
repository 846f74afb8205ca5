"""``plug-asgd status ADDR1 ADDR2 ...``: one table for a sharded PS, a column per shard and the totals.

Each shard is a PS of its own with its own counters; what an operator asks of the whole is whether
every shard is up, holds its place (``I/N``, in the order given) and has the same workers, and how
the traffic spreads over the shards (the reason to shard: each shard's link and core carry their
part). Versions are per shard: every push reaches every shard, so they advance together, and one
behind the others is a shard that was restarted from an older checkpoint. Only rich and the standard
library: ``plug_asgd.cli`` imports this when ``status`` is given several addresses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich.table import Table


def order_problems(addresses: Sequence[str], stats: Sequence[Mapping[str, Any]]) -> list[str]:
    """What is wrong with the shards as listed: one started without ``--shard``, another shard count, out of
    order, or holding a model cut by another partition than the others; empty when they form one PS."""
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


def sharded_table(addresses: Sequence[str], stats: Sequence[Mapping[str, Any]],
                  fmt_bytes: Callable[[Any], str]) -> Table:
    """A rich table: a row per counter, a column per shard (as listed) and one of totals where they add up."""
    table = Table(title=f"sharded parameter server, {len(addresses)} shards", show_header=True,
                  title_justify="left")
    table.add_column("counter", style="cyan", no_wrap=True)
    for i, address in enumerate(addresses):
        table.add_column(f"shard {i}\n{address}", overflow="fold")
    table.add_column("total", style="bold", overflow="fold")

    def row(name: str, cell: Callable[[Mapping[str, Any]], str], total: str = "") -> None:
        table.add_row(name, *(cell(s) for s in stats), total)

    def summed(key: str) -> int:
        return sum(int(s.get(key) or 0) for s in stats)

    row("shard", lambda s: str(s.get("shard") or "whole model"))
    row("mode", lambda s: str(s.get("mode")))
    row("version", lambda s: str(s.get("version")),
        "equal" if len({s.get("version") for s in stats}) == 1 else "differ (a shard resumed from a checkpoint?)")
    row("initialized", lambda s: "yes" if s.get("initialized") else "no",
        "yes" if all(s.get("initialized") for s in stats) else "no")
    row("workers", lambda s: ", ".join(map(str, s.get("workers") or [])) or "none",
        str(len(set().union(*(set(s.get("workers") or []) for s in stats)))))
    row("lost", lambda s: ", ".join(map(str, s.get("lost") or [])) or "none")
    row("uptime", lambda s: f"{float(s.get('uptime_s') or 0):.1f} s")
    row("updates/s", lambda s: f"{float(s.get('updates_per_s') or 0):.3f}")
    row("busy", lambda s: f"{100 * float(s.get('busy_fraction') or 0):.0f}%")
    row("messages in", lambda s: str(s.get("messages_in")), str(summed("messages_in")))
    for key, name in (("bytes_in", "bytes in"), ("push_bytes_in", "push bytes in"), ("bytes_out", "bytes out"),
                      ("model_bytes_out", "model bytes out")):
        row(name, lambda s, k=key: fmt_bytes(s.get(k)), fmt_bytes(summed(key)))
    row("pushes applied", lambda s: str(s.get("pushes_applied")), "each push reaches every shard")
    row("pushes dropped", lambda s: str(s.get("pushes_dropped")))
    row("refused", lambda s: ", ".join(f"{k}: {v}" for k, v in (s.get("refused") or {}).items()) or "none",
        str(sum(sum((s.get("refused") or {}).values()) for s in stats)))
    row("resumed from", lambda s: str(s.get("resumed_from") or "no"))
    row("last checkpoint", lambda s: str(s.get("last_checkpoint") or "none"))
    return table
