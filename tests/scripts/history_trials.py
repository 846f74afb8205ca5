"""Trials of the history checker: a primary PS and its hot standby, two one-hot workers, one fault at a seeded point.

    .venv/bin/python tests/scripts/history_trials.py --trials 30             # seeds 0..29, every fault in turn
    .venv/bin/python tests/scripts/history_trials.py --seeds 7 12 --keep     # those seeds, their folders kept
    .venv/bin/python tests/scripts/history_trials.py --trials 10 --faults kill restart
    .venv/bin/python tests/scripts/history_trials.py --trials 6 --faults twice      # two failovers, a new standby

Each trial (a seed) starts a primary (mode asgd, checkpoints every few updates) and its standby, and two workers
(tests/scripts/history_worker.py) whose every push adds 1 to a coordinate of its own; once the workers hold a seeded
number of acknowledgements, one fault (FAULTS) strikes the primary. The workers go on to their end, every PS still
alive is asked for its role, epoch and model, and tests/scripts/history_check.py judges the history. Every wait has
a deadline; every process is ended by its process group's id, every namespace deleted, whatever happened.

One line per trial, then the tally; exit 1 where any trial broke a rule (its folder is then kept, its history in
``events.jsonl``, the PS's output in ``*.out``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's packages (harness, plug_asgd, tests)
    sys.path.insert(0, str(ROOT))

from harness.netns import Topology, TopologyError, ip  # noqa: E402
from harness.ports import free_port_block  # noqa: E402
from harness.processes import child_env, group_members, start  # noqa: E402
from tests.scripts.history_check import Verdict, check  # noqa: E402

WORKER = str(ROOT / "tests" / "scripts" / "history_worker.py")
# kill: SIGKILL, the standby leads. stop: SIGSTOP for `hold` s, then SIGCONT (past the failover timeout: the standby
# leads and the primary, back, must be fenced). restart: SIGKILL, then the same PS started again with --resume on its
# address after `hold` s (before the failover or after it). partition: the primary's host cut from everyone (its
# link down) for `hold` s (network namespaces). cut: the primary and its standby cut from each other alone, for good.
# split: the primary cut from the workers alone (it still reaches its standby, which must refuse to lead), for `hold` s.
FAULTS = ("kill", "stop", "restart", "partition", "cut", "split")
NETNS_FAULTS = ("partition", "cut", "split")
# twice (not in the default rotation, --faults twice): SIGKILL, then once the standby leads a new standby given the
# members' addresses (primary|standby: the dead primary's first) joins it, and the leader is SIGKILLed in turn once
# it has acknowledged a few pushes through the new pair: the new standby leads epoch 3
EXTRA_FAULTS = ("twice",)


@dataclass
class Plan:
    """One trial, as its seed makes it: the fault, after how many acknowledgements, held how long (seconds)."""

    seed: int
    fault: str
    at: int
    hold: float


def make_plan(seed: int, faults: tuple[str, ...], pushes: int, world: int, failover: float) -> Plan:
    """The seed's trial: its fault in turn among ``faults``, its point and hold drawn from the seed.

    Args:
        seed: the trial's seed.
        faults: the faults to take turns over.
        pushes: the pushes of each worker.
        world: the workers.
        failover: the PS's failover timeout, which the holds straddle.
    """
    rng = random.Random(seed)
    fault = faults[seed % len(faults)]
    at = rng.randint(1, int(pushes * world * 0.8))
    hold = rng.uniform(0.2, 2.5) * failover
    if fault == "restart" and rng.random() < 0.5:  # half the restarts answer before any worker asks the standby
        hold = rng.uniform(0.05, 0.3) * failover
    if fault == "twice":  # early enough for two failovers and a join before the workers end
        at = rng.randint(1, int(pushes * world * 0.3))
    return Plan(seed, fault, at, round(hold, 2))


class Trial:
    """The processes of one trial, the fault, and the verdict (:meth:`run`).

    Args:
        plan: what to do.
        folder: where the logs go.
        failover: the PS's failover timeout.
        pushes: each worker's pushes.
        world: the workers.
        deadline: seconds the workers may take, fault included, before they are killed (a hang).
        checkpoint_every: the primary's updates between two checkpoints (what a restart resumes from).
    """

    def __init__(self, plan: Plan, folder: Path, failover: float = 1.5, pushes: int = 60, world: int = 2,
                 deadline: float = 60.0, checkpoint_every: int = 7) -> None:
        self.plan, self.folder, self.checkpoint_every = plan, folder, checkpoint_every
        self.failover, self.pushes, self.world, self.deadline = failover, pushes, world, deadline
        self.procs: dict[str, subprocess.Popen] = {}
        self.topology: Topology | None = None
        self.notes: dict[str, Any] = {}

    # -- processes -------------------------------------------------------------------------------------------

    def _prefix(self, host: str) -> list[str]:
        return [] if self.topology is None else self.topology.hosts[host].prefix

    def _address(self, host: str) -> str:
        ip_address = "127.0.0.1" if self.topology is None else self.topology.hosts[host].address
        return f"tcp://{ip_address}:{free_port_block(1)}"

    def _start(self, name: str, host: str, cmd: list[str]) -> subprocess.Popen:
        proc = start([*self._prefix(host), *cmd], env=child_env(PLUG_ASGD_LOG="INFO"), log=self.folder / f"{name}.out")
        self.procs[name] = proc
        return proc

    def _start_ps(self, name: str, host: str, bind: str, **options: Any) -> subprocess.Popen:
        from plug_asgd.ps import PSConfig, embedded_command

        config = PSConfig(bind=bind, mode="asgd", failover_timeout=self.failover, insecure=self.topology is not None,
                          **options)
        return self._start(name, host, embedded_command(config))

    def query(self, address: str, timeout: float = 5.0) -> dict[str, Any] | None:
        """The stats and model of the PS at ``address`` (from the workers' host), None where it does not answer.

        Args:
            address: the PS's address.
            timeout: seconds to wait for it.
        """
        cmd = [*self._prefix("wk"), sys.executable, WORKER, "--query", address, "--request-timeout", str(timeout)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * 2 + 10, cwd=ROOT,
                                  env=child_env())
        except subprocess.TimeoutExpired:
            return None
        if done.returncode != 0:
            return None
        return json.loads(done.stdout.strip().splitlines()[-1])

    def _wait(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.05)

    def close(self) -> None:
        """Every process group this trial started, ended by its id (a stopped one woken first), every namespace
        deleted."""
        for proc in self.procs.values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        left = [pid for proc in self.procs.values() for pid in group_members(proc.pid)]
        self.notes["left_running"] = left
        if self.topology is not None:
            self.topology.down()

    # -- the trial -------------------------------------------------------------------------------------------

    def events(self) -> list[dict[str, Any]]:
        """Every worker's log lines so far."""
        out = []
        for rank in range(self.world):
            path = self.folder / f"w{rank}.jsonl"
            if path.exists():
                out += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        return out

    def _acks(self) -> int:
        return sum(1 for e in self.events() if e["event"] == "ack")

    def setup(self) -> None:
        """The hosts (for a partition), the primary, its standby once it joined, and the workers."""
        if self.plan.fault in NETNS_FAULTS:
            self.topology = Topology(["ps", "sb", "wk"], tag=f"{os.getpid()}h")
            self.topology.up()
        self.primary, self.standby = self._address("ps"), self._address("sb")
        self.notes.update(primary=self.primary, standby=self.standby)
        self._start_ps("primary", "ps", self.primary, checkpoint_dir=self.folder / "ck",
                       checkpoint_every_updates=self.checkpoint_every)
        self._wait(lambda: self.query(self.primary, 1.0) is not None, 30, "the primary to answer")
        self._start_ps("standby", "sb", self.standby, standby_of=self.primary)
        self._wait(lambda: (self.query(self.primary, 2.0) or {"stats": {}})["stats"].get("standby") == self.standby,
                   30, "the standby to join")
        for rank in range(self.world):
            self._start(f"w{rank}", "wk", [sys.executable, WORKER, "--members", f"{self.primary}|{self.standby}",
                                           "--rank", str(rank), "--world", str(self.world), "--pushes",
                                           str(self.pushes), "--log", str(self.folder / f"w{rank}.jsonl"),
                                           "--interval", "0.1" if self.plan.fault == "twice" else "0.02"])

    def strike(self) -> None:
        """The plan's fault, once the workers hold ``plan.at`` acknowledgements (or have ended)."""
        workers = [self.procs[f"w{r}"] for r in range(self.world)]
        self._wait(lambda: self._acks() >= self.plan.at or all(w.poll() is not None for w in workers), self.deadline,
                   f"{self.plan.at} acknowledgements")
        self.notes["struck_at_acks"] = self._acks()
        primary, hold, fault = self.procs["primary"], self.plan.hold, self.plan.fault
        if fault in ("kill", "restart", "twice"):
            os.killpg(primary.pid, signal.SIGKILL)
            primary.wait(10)
        if fault == "twice":
            self._fail_over_again(workers)
        if fault == "stop":
            os.killpg(primary.pid, signal.SIGSTOP)
            time.sleep(hold)
            os.killpg(primary.pid, signal.SIGCONT)
        elif fault == "restart":
            time.sleep(hold)
            again = self._start_ps("restarted", "ps", self.primary, resume=self.folder / "ck",
                                   checkpoint_dir=self.folder / "ck", checkpoint_every_updates=self.checkpoint_every)
            self.notes["restarted_after_s"] = hold
            self.notes["restarted"] = again
        elif fault == "partition":
            assert self.topology is not None
            ip("-n", self.topology.hosts["ps"].ns, "link", "set", "eth0", "down")
            time.sleep(hold)
            ip("-n", self.topology.hosts["ps"].ns, "link", "set", "eth0", "up")
        elif fault in ("cut", "split"):
            self._blackhole("sb" if fault == "cut" else "wk", heal_after=None if fault == "cut" else hold)

    def _fail_over_again(self, workers: list[subprocess.Popen]) -> None:
        """``twice``: once the standby leads, a new standby given ``primary|standby`` joins it; once the new pair has
        acknowledged 5 pushes, the leader is SIGKILLed too (not where the workers have ended by then)."""
        self._wait(lambda: (self.query(self.standby, 2.0) or {"stats": {}})["stats"].get("role") == "primary",
                   self.deadline, "the standby to lead")
        self.renewed = self._address("sb")
        self._start_ps("renewed", "sb", self.renewed, standby_of=f"{self.primary}|{self.standby}")
        self._wait(lambda: (self.query(self.standby, 2.0) or {"stats": {}})["stats"].get("standby") == self.renewed,
                   30, "the new standby to join the leader")
        joined = self._acks()
        self._wait(lambda: self._acks() >= joined + 5 or all(w.poll() is not None for w in workers), self.deadline,
                   "5 pushes through the new pair")
        self.notes.update(renewed=self.renewed, renewed_joined_at_acks=joined, second_kill=self._acks())
        if all(w.poll() is not None for w in workers):
            self.notes["second_kill"] = None  # the workers ended first: the leader is left as it is
            return
        os.killpg(self.procs["standby"].pid, signal.SIGKILL)
        self.procs["standby"].wait(10)

    def _blackhole(self, other: str, heal_after: float | None) -> None:
        """Drop every packet between the primary's host and ``other``'s, both ways; lifted after ``heal_after`` s
        (None: for good)."""
        assert self.topology is not None
        hosts = self.topology.hosts
        routes = [(hosts[a].ns, f"{hosts[b].address}/32") for a, b in (("ps", other), (other, "ps"))]
        for ns, to in routes:
            ip("-n", ns, "route", "add", "blackhole", to)
        if heal_after is not None:
            time.sleep(heal_after)
            for ns, to in routes:
                ip("-n", ns, "route", "del", "blackhole", to)

    def finish(self) -> Verdict:
        """Wait for the workers (killed past the deadline: a hang), ask every PS still alive, judge."""
        done: dict[int, int | None] = {}
        end = time.monotonic() + self.deadline
        for rank in range(self.world):
            try:
                done[rank] = self.procs[f"w{rank}"].wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                done[rank] = None
        again = self.notes.pop("restarted", None)
        finals = self._settled_finals()
        if again is not None:  # 2: it found the standby leading and stopped; None: it still runs
            self.notes["restarted_exit"] = again.poll()
        self.notes["finals"] = {k: {s: v["stats"].get(s) for s in ("role", "epoch", "version", "failovers")}
                                for k, v in finals.items()}
        events = self.events()
        (self.folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        verdict = check(events, finals, self.world * self.pushes, done, self.pushes)
        return verdict

    def _finals(self) -> dict[str, dict[str, Any]]:
        """Each PS process still running, by ``name@address``: its stats and model, where it answers."""
        finals = {}
        named = (("primary", self.primary), ("standby", self.standby), ("restarted", self.primary),
                 ("renewed", getattr(self, "renewed", "")))
        for name, address in named:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None and (answer := self.query(address)) is not None:
                finals[f"{name}@{address}"] = answer
        return finals

    def _settled_finals(self) -> dict[str, dict[str, Any]]:
        """:meth:`_finals` once at most one PS says it leads, or as they are ``3 * failover`` s after the workers'
        end: a primary cut off that dropped its standby learns it was replaced when it next asks the standby
        (every ``failover`` s), and until then says it leads (epoch 1, without a standby: a push that reached it then
        would be lost, which the checker would find)."""
        began = time.monotonic()
        while True:
            finals = self._finals()
            leading = sum(1 for f in finals.values() if f["stats"].get("role") == "primary")
            if leading <= 1 or time.monotonic() - began > 3 * self.failover:
                self.notes["settled_after_s"] = round(time.monotonic() - began, 2)
                return finals
            time.sleep(0.2)

    def run(self) -> dict[str, Any]:
        """Set up, strike, finish, close: the trial's record (plan, verdict, notes, seconds)."""
        began = time.monotonic()
        try:
            self.setup()
            self.strike()
            verdict = self.finish()
        except (TimeoutError, subprocess.TimeoutExpired) as exc:
            verdict = Verdict(stuck=[f"{type(exc).__name__}: {exc}"])
        finally:
            self.close()
        if self.notes.get("left_running"):
            verdict.stuck.append(f"processes left running: {self.notes['left_running']}")
        return {**asdict(self.plan), "ok": verdict.ok, "summary": verdict.summary(), "violations": verdict.violations,
                "stuck": verdict.stuck, "seconds": round(time.monotonic() - began, 1), "folder": str(self.folder),
                **{k: v for k, v in self.notes.items() if k != "left_running"}}


def netns_available() -> str | None:
    """None where this machine can make the partition trials' namespaces; else why not."""
    try:
        with Topology(["a", "b"], tag=f"{os.getpid()}q"):
            return None
    except (TopologyError, FileNotFoundError, OSError) as exc:
        return str(exc)


def run_trial(plan: Plan, base: Path, keep: bool = False, **options: Any) -> dict[str, Any]:
    """One trial in a folder of its own under ``base``, removed after unless ``keep`` or the trial failed.

    Args:
        plan: the trial.
        base: the folder its folder goes under.
        keep: keep its folder even where it passed.
        **options: :class:`Trial`'s options.
    """
    folder = base / f"seed{plan.seed}-{plan.fault}"
    folder.mkdir(parents=True, exist_ok=True)
    record = Trial(plan, folder, **options).run()
    (folder / "trial.json").write_text(json.dumps(record, indent=1, default=str))
    if record["ok"] and not keep:
        shutil.rmtree(folder, ignore_errors=True)
    return record


def _ends(record: dict[str, Any]) -> str:
    """How the PSes ended: each one's role, epoch and version, and the restarted one's exit code."""
    finals = record.get("finals", {})
    text = " ".join(f"{k.split('@')[0]}={v['role']}/e{v['epoch']}/v{v['version']}" for k, v in finals.items())
    if "restarted_exit" in record:
        text += f" restarted_exit={record['restarted_exit']}"
    return text


def main() -> int:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=10, help="seeds 0 .. N-1 (after --first)")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--seeds", type=int, nargs="*", help="these seeds instead")
    parser.add_argument("--faults", nargs="*", choices=FAULTS + EXTRA_FAULTS, default=list(FAULTS))
    parser.add_argument("--failover", type=float, default=1.5, help="the PS's failover_timeout, s")
    parser.add_argument("--pushes", type=int, default=60, help="each worker's pushes")
    parser.add_argument("--out", type=Path, default=None, help="where the trials' folders go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep every trial's folder, not only the failed ones'")
    args = parser.parse_args()
    faults = tuple(args.faults)
    if any(f in NETNS_FAULTS for f in faults) and (why := netns_available()) is not None:
        print(f"no network namespaces here ({why}): the partition faults are left out", file=sys.stderr)
        faults = tuple(f for f in faults if f not in NETNS_FAULTS)
    base = args.out or Path(tempfile.mkdtemp(prefix="history-"))
    seeds = args.seeds if args.seeds else list(range(args.first, args.first + args.trials))
    records = []
    for seed in seeds:
        plan = make_plan(seed, faults, args.pushes, 2, args.failover)
        record = run_trial(plan, base, args.keep, failover=args.failover, pushes=args.pushes)
        records.append(record)
        print(f"seed {seed:3d} {plan.fault:9s} at {plan.at:3d} hold {plan.hold:5.2f}s "
              f"{'ok  ' if record['ok'] else 'FAIL'} {record['seconds']:5.1f}s {record['summary']}; "
              f"{_ends(record)}", flush=True)
    bad = [r for r in records if not r["ok"]]
    by_fault = {f: sum(1 for r in records if r["fault"] == f) for f in faults}
    print(f"{len(records)} trials ({', '.join(f'{f} {n}' for f, n in by_fault.items())}): {len(records) - len(bad)} "
          f"passed, {len(bad)} failed{': seeds ' + str([r['seed'] for r in bad]) if bad else ''}; folders under {base}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
