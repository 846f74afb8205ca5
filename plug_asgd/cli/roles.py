"""A PS's place in a pair of primary and hot standby, in words: what ``status``, the dashboard and the plain lines
show of it (the counters of :mod:`plug_asgd.ps.failover`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def failover_text(snapshot: Mapping[str, Any]) -> str | None:
    """``primary, epoch 2, standby tcp://h:2224 (lag 0 updates), 1 failover`` and the like; None for a PS that
    never had a standby nor led after one (nothing to say).

    Args:
        snapshot: the PS's counters, as ``ParameterServer.snapshot()`` returns them.
    """
    role, epoch = snapshot.get("role"), snapshot.get("epoch")
    failovers = snapshot.get("failovers") or 0
    tail = f", {failovers} failover{'s' if failovers != 1 else ''}" if failovers else ""
    if role == "standby":
        return f"hot standby of {snapshot.get('standby_of')}, epoch {epoch}, at version {snapshot.get('version')}"
    if role == "replaced":
        return f"REPLACED by {snapshot.get('leader')} (this one led epoch {epoch}): it folds in nothing more"
    standby = snapshot.get("standby")
    if standby is not None:
        return f"primary, epoch {epoch}, standby {standby} (lag {snapshot.get('standby_lag')} updates){tail}"
    if snapshot.get("standbys_joined") or failovers:
        why = snapshot.get("standby_lost_reason")
        return f"primary, epoch {epoch}, WITHOUT a standby" + (f" (dropped: {why})" if why else "") + tail
    return None
