"""A history checker for the hot standby (issue 59), as Jepsen checks a register: every push identifiable in the model.

Two workers (tests/scripts/history_worker.py, the library's PSClient, no Lightning) push one-hots, each push a
coordinate of its own, to a primary PS (mode asgd: ``w += update``) with a hot standby; one fault strikes the primary at
a point drawn from the trial's seed (tests/scripts/history_trials.py: SIGKILL, SIGSTOP then SIGCONT, a restart with
``--resume``, its host cut off, its link to the standby cut, its link to the workers cut). The checker
(tests/scripts/history_check.py) then asks of the history and of the final model: every acknowledged push in the
model exactly once, no push twice, one history (each version one push), one leader per epoch, no hang.

Here the checker's own rules on made-up histories (quick), and a few trials for real (integration, faults): a primary
frozen past the failover, a primary's host cut off (network namespaces), and the pinned reproduction of what the
checker found (a primary restarted with ``--resume`` before the failover leads from its checkpoint: acknowledged
pushes lost, now fixed: the restart stops), and two failovers with a new standby between (``--faults twice``).
Many trials: ``python tests/scripts/history_trials.py --trials 30``, or
``PLUG_ASGD_HISTORY_TRIALS=N`` to add N seeded trials (seeds 100 ..) to this file's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import skip_unless_required
from tests.scripts.history_check import check
from tests.scripts.history_trials import (
    EXTRA_FAULTS,
    FAULTS,
    NETNS_FAULTS,
    Plan,
    make_plan,
    netns_available,
    run_trial,
)

FAILOVER = 1.5  # the PS's failover_timeout in these trials (the default is 3.0): a trial takes 5 to 8 s alone
PUSHES, WORLD = 60, 2
TRIAL_TIMEOUT = 150  # a trial's own deadlines: 30 s to start each PS, 60 s for the workers, 10 s per process to end
# seed 1: SIGSTOP for 2.26 s at the 18th acknowledgement (past the failover: the standby leads, the primary is fenced
# once back); seed 3: the primary's host cut from everyone for 2.34 s at the 31st (the same, by the network)
SEEDS = [1, 3, *range(100, 100 + int(os.environ.get("PLUG_ASGD_HISTORY_TRIALS", "0")))]


# -- the checker's rules, on made-up histories -----------------------------------------------------------------------

A, B = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"


def _history(acks: list[tuple[int, int, int, str]], sent: list[int] | None = None) -> list[dict[str, Any]]:
    """Log lines of a history: each ack (coordinate, version, epoch, address), rank = coordinate // 2, each sent
    first; ``sent``: pushes sent and never acknowledged."""
    events: list[dict[str, Any]] = []
    for coord, version, epoch, by in acks:
        events.append({"event": "send", "rank": coord // 2, "coord": coord})
        events.append({"event": "ack", "rank": coord // 2, "coord": coord, "status": "applied", "version": version,
                       "epoch": epoch, "by": by})
    events += [{"event": "send", "rank": c // 2, "coord": c} for c in sent or []]
    return events


def _final(w: list[float], epoch: int = 2, role: str = "primary") -> dict[str, Any]:
    return {"stats": {"role": role, "epoch": epoch, "version": round(sum(w))}, "w": w}


CLEAN = [(0, 1, 1, A), (2, 2, 1, A), (1, 3, 2, B), (3, 4, 2, B)]  # ranks 0 and 1, two pushes each, a failover


def test_a_clean_history_with_a_failover_passes() -> None:
    verdict = check(_history(CLEAN), {B: _final([1, 1, 1, 1])}, 4, {0: 0, 1: 0}, 2)
    assert verdict.ok, verdict.summary()
    assert verdict.epochs == {1: [A], 2: [B]} and verdict.acked == 4


def test_an_unacknowledged_push_may_be_in_the_model_once_but_not_twice() -> None:
    events = _history(CLEAN[:3], sent=[3])
    assert check(events, {B: _final([1, 1, 1, 1])}, 4, {0: 0, 1: 0}, 2).violations == []
    assert check(events, {B: _final([1, 1, 1, 0])}, 4, {0: 0, 1: 0}, 2).violations == []
    doubled = check(events, {B: _final([1, 1, 1, 2])}, 4, {0: 0, 1: 0}, 2)
    assert any("not 0 or 1" in v for v in doubled.violations), doubled.summary()


@pytest.mark.parametrize("w, found", [
    ([1, 0, 1, 1], "acknowledged pushes LOST (coordinates [1])"),
    ([1, 2, 1, 1], "not 0 or 1"),
    ([1, 1, 1, 1, 1], "has 5 coordinates"),
])
def test_a_lost_or_doubled_acknowledged_push_is_a_violation(w: list[float], found: str) -> None:
    verdict = check(_history(CLEAN), {B: _final(w)}, 4, {0: 0, 1: 0}, 2)
    assert any(found in v for v in verdict.violations), verdict.summary()


def test_two_leaders_in_one_epoch_a_forked_history_and_an_epoch_going_back_are_violations() -> None:
    two = [(0, 1, 1, A), (2, 2, 1, A), (1, 3, 1, B), (3, 4, 1, B)]
    assert any("two leaders acknowledged pushes in epoch 1" in v
               for v in check(_history(two), {B: _final([1, 1, 1, 1], 1)}, 4, {0: 0, 1: 0}, 2).violations)
    forked = [(0, 1, 1, A), (2, 2, 1, A), (1, 2, 1, A), (3, 3, 1, A)]
    verdict = check(_history(forked), {A: _final([1, 1, 1, 1], 1)}, 4, {0: 0, 1: 0}, 2)
    assert any("both acknowledged as version 2" in v for v in verdict.violations), verdict.summary()
    back = [(0, 1, 2, B), (1, 2, 1, A), (2, 3, 2, B), (3, 4, 2, B)]
    assert any("rank 0 was acknowledged at epoch 1 after epoch 2" in v
               for v in check(_history(back), {B: _final([1, 1, 1, 1])}, 4, {0: 0, 1: 0}, 2).violations)


def test_two_live_leaders_at_the_end_or_none_are_violations_and_a_stuck_worker_is_reported() -> None:
    finals = {A: _final([1, 1, 1, 1], 1), B: _final([1, 1, 1, 1])}
    verdict = check(_history(CLEAN), finals, 4, {0: 0, 1: 0}, 2)
    assert any("side by side" in v for v in verdict.violations), verdict.summary()
    verdict = check(_history(CLEAN), {A: _final([1, 1, 1, 1], 1, "replaced")}, 4, {0: 0, 1: 0}, 2)
    assert any("no PS leads" in v for v in verdict.violations), verdict.summary()
    verdict = check(_history(CLEAN[:3]), {B: _final([1, 1, 1, 0])}, 4, {0: 0, 1: None}, 2)
    assert verdict.violations == [] and verdict.stuck == ["rank 1 exit None with 1 of 2 pushes acked"]


def test_the_seeds_take_turns_over_the_faults_and_draw_the_same_plan_each_time() -> None:
    plans = [make_plan(s, FAULTS, PUSHES, WORLD, FAILOVER) for s in range(len(FAULTS))]
    assert [p.fault for p in plans] == list(FAULTS)
    assert make_plan(1, FAULTS, PUSHES, WORLD, FAILOVER) == plans[1]
    assert all(1 <= p.at <= PUSHES * WORLD and 0.05 * FAILOVER <= p.hold <= 2.5 * FAILOVER for p in plans)


# -- trials for real -------------------------------------------------------------------------------------------------


def _explain(record: dict[str, Any]) -> str:
    """The trial's record and the end of its history, for a failure's message."""
    events = Path(record["folder"], "events.jsonl")
    tail = events.read_text().splitlines()[-12:] if events.exists() else []
    return json.dumps(record, indent=1, default=str) + "\n" + "\n".join(tail)


@pytest.mark.integration
@pytest.mark.faults
@pytest.mark.timeout(TRIAL_TIMEOUT)
@pytest.mark.parametrize("seed", SEEDS)
def test_every_acknowledged_push_is_in_the_model_once_and_each_epoch_has_one_leader(seed: int, tmp_path: Path,
                                                                                   fault_report: Any) -> None:
    plan = make_plan(seed, FAULTS, PUSHES, WORLD, FAILOVER)
    if plan.fault in NETNS_FAULTS and (why := netns_available()) is not None:
        skip_unless_required(f"cannot make network namespaces here ({why}); this trial needs root and iproute2")
    record = run_trial(plan, tmp_path, keep=True, failover=FAILOVER, pushes=PUSHES)
    assert record["ok"], _explain(record)
    if seed in (1, 3):
        what = {"stop": "SIGSTOPped past the failover, then SIGCONTed",
                "partition": "its host cut from everyone past the failover (network namespaces)"}[plan.fault]
        fault_report(fault=f"history checker: primary {what}; 2 one-hot workers, every push's coordinate checked",
                     injected=1, handled=1, pushes_lost=0, recovery_s=None,
                     detail=f"{record['summary']} (tests/scripts/history_trials.py for many seeds)")


@pytest.mark.integration
@pytest.mark.faults
@pytest.mark.timeout(TRIAL_TIMEOUT)
def test_a_primary_restarted_with_resume_before_the_failover_keeps_every_acknowledged_push(tmp_path: Path) -> None:
    # what the checker found first: checkpoints every 25 updates, the kill at the 30th acknowledgement, the restart
    # 0.1 s later, the failover timeout 3 s (the restart answers long before any worker asks the standby to lead).
    # The restart resumed version 25 and led epoch 1 again beside its standby, which held every acknowledged push:
    # those after 25 were lost. Now the restart finds the run's standby at a version past its checkpoint and stops
    # (exit 2); the workers, who cannot reach it, make the standby lead epoch 2
    plan = Plan(seed=2, fault="restart", at=30, hold=0.1)
    record = run_trial(plan, tmp_path, keep=True, failover=3.0, pushes=PUSHES, checkpoint_every=25)
    assert record["ok"], _explain(record)
    assert record["restarted_exit"] == 2, _explain(record)
    finals = record["finals"]
    assert list(finals) == [f"standby@{record['standby']}"], _explain(record)
    assert finals[f"standby@{record['standby']}"] == {"role": "primary", "epoch": 2, "version": PUSHES * WORLD,
                                                      "failovers": 1}, _explain(record)
    out = Path(record["folder"], "restarted.out").read_text()
    resumed = int(out.split("resumed from ")[1].split(" at version ")[1].split()[0])
    assert resumed < record["struck_at_acks"] <= PUSHES * WORLD, out  # the checkpoint is behind the acknowledged
    assert ("does not lead: it resumed epoch 1 of run" in out and f"at version {resumed}" in out
            and f"the parameter server at {record['standby']} is the run's hot standby at epoch 1, version" in out
            and "later than this checkpoint" in out and f"--standby-of {record['standby']}" in out), out


@pytest.mark.integration
@pytest.mark.faults
@pytest.mark.timeout(TRIAL_TIMEOUT)
def test_two_failovers_with_a_new_standby_between_keep_every_acknowledged_push(tmp_path: Path) -> None:
    # the primary SIGKILLed; once the standby leads, a new standby given the members' addresses (the dead primary's
    # first) joins it; after 5 pushes through the new pair the leader is SIGKILLed too: the new standby leads epoch 3
    plan = make_plan(0, EXTRA_FAULTS, PUSHES, WORLD, FAILOVER)
    assert plan.fault == "twice"
    record = run_trial(plan, tmp_path, keep=True, failover=FAILOVER, pushes=PUSHES)
    assert record["ok"], _explain(record)
    assert record["second_kill"] is not None and record["second_kill"] < PUSHES * WORLD, _explain(record)
    assert record["finals"] == {f"renewed@{record['renewed']}": {"role": "primary", "epoch": 3,
                                                                  "version": PUSHES * WORLD, "failovers": 2}}
    assert f"e3: {record['renewed']}" in record["summary"] and "e2: " in record["summary"], record["summary"]
