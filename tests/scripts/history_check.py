"""The history checker's verdict on one trial, as Jepsen's checker reads a register's history.

The workers (tests/scripts/history_worker.py) log what they sent and what was acknowledged; the trial
(tests/scripts/history_trials.py) asks each PS still alive at the end for its role, epoch, version and model. A
push of coordinate ``c`` adds exactly 1 to ``w[c]`` and to nothing else, so the final model of the leader holds the
whole story. What must hold, whatever the faults:

- **exactly once**: every acknowledged push is in the final model once (``w[c] == 1``); a push sent but not
  acknowledged is there at most once (``w[c]`` 0 or 1); a coordinate never sent is 0;
- **one history**: every fold makes one version (the model's sum is its version), and no two pushes acknowledged
  as applied name the same version (two states of one version: a forked history);
- **one leader per epoch**: every acknowledgement of an epoch comes from one address; each worker's epochs never go
  back; at the end, no two PS of one epoch say they lead;
- **no hang**: every worker ends on its own, every push of it acknowledged (the failover is transparent).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Verdict:
    """What the checker found in one trial: ``violations`` (safety) and ``stuck`` (liveness), each a sentence."""

    violations: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)
    acked: int = 0
    sent: int = 0
    in_model_unacked: int = 0
    epochs: dict[int, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """No safety violation and every worker done."""
        return not self.violations and not self.stuck

    def summary(self) -> str:
        """One line: the counts, the leaders by epoch, and what went wrong."""
        leaders = ", ".join(f"e{e}: {' '.join(a)}" for e, a in sorted(self.epochs.items()))
        text = (f"{self.acked} acked of {self.sent} sent, {self.in_model_unacked} unacked in the model; "
                f"leaders {leaders or '-'}")
        if self.violations:
            text += "; VIOLATIONS: " + "; ".join(self.violations)
        if self.stuck:
            text += "; STUCK: " + "; ".join(self.stuck)
        return text


def check(events: list[dict[str, Any]], finals: dict[str, dict[str, Any]], size: int,
          workers_done: dict[int, int | None], pushes: int) -> Verdict:
    """The verdict on a trial.

    Args:
        events: every worker's log lines (``rank``, ``event``, ``coord``, ``status``, ``version``, ``epoch``,
            ``by``), each worker's in its own order.
        finals: per PS address still answering at the end, its ``stats`` and its model ``w`` (None where it does
            not lead).
        size: the model's length (every coordinate a push of its own).
        workers_done: per rank, the worker's exit code (None: it did not end in time and was killed).
        pushes: the pushes each worker was to make.
    """
    verdict = Verdict()
    acked = {e["coord"] for e in events if e["event"] == "ack"}
    sent = {e["coord"] for e in events if e["event"] == "send"}
    verdict.acked, verdict.sent = len(acked), len(sent)
    _check_leaders(events, finals, verdict)
    leader = _leader(finals, verdict)
    if leader is not None:
        _check_model(leader, acked, sent, size, verdict)
        later = [e for e in verdict.epochs if e > leader["stats"]["epoch"]]
        if later:
            verdict.violations.append(f"pushes acknowledged in epochs {later}, after the leader's at the end "
                                      f"({leader['stats']['epoch']})")
    _check_versions(events, verdict)
    for rank, code in sorted(workers_done.items()):
        mine = sum(1 for e in events if e["event"] == "ack" and e["rank"] == rank)
        if code != 0 or mine != pushes:
            verdict.stuck.append(f"rank {rank} exit {code} with {mine} of {pushes} pushes acked")
    return verdict


def _leader(finals: dict[str, dict[str, Any]], verdict: Verdict) -> dict[str, Any] | None:
    """The PS that leads the latest epoch at the end (it holds the run's model); None, said, where none does."""
    leading = [f for f in finals.values() if f["stats"].get("role") == "primary"]
    if not leading:
        roles = {a: f["stats"].get("role") for a, f in finals.items()}
        verdict.violations.append(f"no PS leads at the end ({roles})")
        return None
    best = max(leading, key=lambda f: f["stats"]["epoch"])
    if best.get("w") is None:
        verdict.violations.append(f"the leader's model could not be read: {best.get('pull_error')}")
        return None
    return best


def _check_leaders(events: list[dict[str, Any]], finals: dict[str, dict[str, Any]], verdict: Verdict) -> None:
    """One address acknowledges each epoch's pushes; each worker's epochs never go back; one leader per epoch at the
    end; no acknowledgement names an epoch later than the leader's at the end."""
    by_epoch: dict[int, set[str]] = defaultdict(set)
    last: dict[int, int] = {}
    for e in events:
        if e["event"] != "ack":
            continue
        by_epoch[e["epoch"]].add(e["by"])
        if e["epoch"] < last.get(e["rank"], 0):
            verdict.violations.append(f"rank {e['rank']} was acknowledged at epoch {e['epoch']} after epoch "
                                      f"{last[e['rank']]} (coordinate {e['coord']})")
        last[e["rank"]] = max(last.get(e["rank"], 0), e["epoch"])
    verdict.epochs = {epoch: sorted(addresses) for epoch, addresses in by_epoch.items()}
    for epoch, addresses in sorted(by_epoch.items()):
        if len(addresses) > 1:
            verdict.violations.append(f"two leaders acknowledged pushes in epoch {epoch}: {sorted(addresses)}")
    leading: dict[int, list[str]] = defaultdict(list)
    for address, final in finals.items():
        if final["stats"].get("role") == "primary":
            leading[final["stats"]["epoch"]].append(address)
    for epoch, addresses in leading.items():
        if len(addresses) > 1:
            verdict.violations.append(f"at the end, {addresses} all lead epoch {epoch}")
    if len(leading) > 1:
        verdict.violations.append(f"at the end, PSes lead epochs {sorted(leading)} side by side: "
                                  f"{dict(leading)}")


def _check_model(leader: dict[str, Any], acked: set[int], sent: set[int], size: int, verdict: Verdict) -> None:
    """Exactly once: acknowledged pushes once, the others at most once, never-sent coordinates not at all."""
    w = leader["w"]
    if len(w) != size:
        verdict.violations.append(f"the leader's model has {len(w)} coordinates, not {size}")
        return
    lost = sorted(c for c in acked if w[c] == 0)
    doubled = sorted(c for c in range(size) if w[c] not in (0.0, 1.0))
    phantom = sorted(c for c in range(size) if c not in sent and w[c] != 0)
    verdict.in_model_unacked = sum(1 for c in sent - acked if w[c] == 1.0)
    if lost:
        verdict.violations.append(f"{len(lost)} acknowledged pushes LOST (coordinates {lost[:20]})")
    if doubled:
        verdict.violations.append(f"{len(doubled)} coordinates not 0 or 1 (applied twice or torn): "
                                  f"{[(c, w[c]) for c in doubled[:20]]}")
    if phantom:
        verdict.violations.append(f"coordinates never pushed are set: {phantom[:20]}")
    version = leader["stats"].get("version")
    if version != round(sum(w)):
        verdict.violations.append(f"the leader's version {version} is not the number of pushes its model holds "
                                  f"({sum(w):g})")


def _check_versions(events: list[dict[str, Any]], verdict: Verdict) -> None:
    """No two pushes acknowledged as applied name the same version: each applied push made a version of its own."""
    seen: dict[int, int] = {}
    for e in events:
        if e["event"] == "ack" and e.get("status") == "applied":
            other = seen.setdefault(e["version"], e["coord"])
            if other != e["coord"]:
                verdict.violations.append(f"pushes {other} and {e['coord']} were both acknowledged as version "
                                          f"{e['version']}: the history forked")
