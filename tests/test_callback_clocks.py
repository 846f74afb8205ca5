"""The callbacks' and the checkpoint policy's timing, on injected clocks: what they record and when they act
follows from the times and counters given to them, so each expected value is known before the test runs."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from plug_asgd.callbacks import CommunicationMonitor, PSCheckpoint, Supervisor, communication_monitor, supervisor
from plug_asgd.protocol.checkpoint import CheckpointPolicy, list_checkpoints
from plug_asgd.ps import PSConfig


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock(100.0)
    for module in (communication_monitor, supervisor):
        monkeypatch.setattr(module, "time", SimpleNamespace(monotonic=c, time=lambda: 0.0))
    return c


class FakeStrategy:
    """comm_stats() as AsyncPSStrategy gives it: counters since the client connected."""

    def __init__(self) -> None:
        self.stats = {"wait_seconds": 0.0, "bytes_up": 0, "bytes_down": 0, "push_bytes_up": 0,
                      "push_local_bytes_up": 0, "pushes": 0, "own_replies": 0, "local_steps": 0,
                      "staleness_mean": 0.0, "staleness_max": 0, "version": 0}
        self.in_flight: dict | None = None  # what the reply of the push in flight adds, once taken

    def comm_stats(self, settle: bool = False) -> dict:
        if settle and self.in_flight is not None:
            for key, more in self.in_flight.items():
                self.stats[key] += more
            self.in_flight = None
        return dict(self.stats)

    def ps_handle(self) -> SimpleNamespace:  # what the monitor reads of AsyncPSStrategy.ps_handle()
        return SimpleNamespace(comm_stats=self.comm_stats)


def test_communication_monitor_reports_the_wall_and_wait_times_it_was_given(tmp_path, clock):
    monitor = CommunicationMonitor(every_n_steps=2, dirpath=tmp_path)
    strategy = FakeStrategy()
    strategy.stats.update(wait_seconds=5.0, bytes_up=1000, pushes=3, local_steps=3)  # before training: setup
    monitor._file = tmp_path / "worker0.jsonl"
    trainer = SimpleNamespace(global_rank=0, is_global_zero=False, loggers=[], global_step=0, strategy=strategy)
    monitor.on_train_start(trainer, None)
    # three steps: each 2.5 s of wall time, of which 0.75 s waiting for the PS, 100 bytes up, one push
    for step in range(3):
        clock.now += 2.5
        strategy.stats.update(wait_seconds=strategy.stats["wait_seconds"] + 0.75,
                              bytes_up=strategy.stats["bytes_up"] + 100, pushes=strategy.stats["pushes"] + 1,
                              local_steps=strategy.stats["local_steps"] + 1)
        monitor.on_train_batch_end(trainer, None, {"loss": torch.tensor(float(step))}, None, step)
    monitor.on_train_end(trainer, None)
    first, last = (json.loads(line) for line in monitor._file.read_text().splitlines())
    assert (first["wall_s"], first["comm_s"], first["compute_s"]) == (5.0, 1.5, 3.5)  # after step 2 (every 2)
    assert (last["wall_s"], last["comm_s"], last["compute_s"]) == (7.5, 2.25, 5.25)  # at the end: step 3
    assert (last["bytes_up"], last["pushes"], last["local_steps"]) == (300, 3, 3)  # setup's counts left out
    assert first["train_loss_mean"] == 0.5 and last["train_loss_mean"] == 2.0  # (0 + 1) / 2, then 2 alone


def test_communication_monitor_counts_the_last_pushs_reply_at_the_end_of_training(tmp_path, clock):
    monitor = CommunicationMonitor(every_n_steps=2, dirpath=tmp_path)
    strategy = FakeStrategy()
    monitor._file = tmp_path / "worker0.jsonl"
    trainer = SimpleNamespace(global_rank=0, is_global_zero=False, loggers=[], global_step=0, strategy=strategy)
    monitor.on_train_start(trainer, None)
    for step in range(2):  # two pushes: the first answered with the model (1000 bytes), the second in flight
        strategy.stats.update(pushes=step + 1, local_steps=step + 1, bytes_down=1000)
        monitor.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, step)
    strategy.in_flight = {"bytes_down": 1000}  # the last step's reply, not yet taken at its record
    monitor.on_train_end(trainer, None)
    records = [json.loads(line) for line in monitor._file.read_text().splitlines()]
    assert [(r["local_steps"], r["bytes_down"]) for r in records] == [(2, 1000), (2, 2000)]
    strategy.in_flight = None  # a reply that changed nothing: the step's record is the last
    monitor.on_train_end(trainer, None)
    assert len(monitor._file.read_text().splitlines()) == 2


class FakeClient:
    """PSClient as the Supervisor's thread uses it: the version rises by ``rate`` per stats() call."""

    def __init__(self, rate: int, tensors: dict) -> None:
        self.version, self.rate, self.tensors, self.pulls = 0, rate, tensors, 0

    def stats(self) -> dict:
        self.version += self.rate
        return {"version": self.version, "push_bytes_in": 10 * self.version, "push_local_bytes_in": self.version,
                "bytes_in": 0, "bytes_out": 0}

    def pull(self):
        self.pulls += 1
        return SimpleNamespace(version=self.version, tensors=self.tensors)

    def close(self) -> None:
        pass


class Ticks:
    """The Supervisor's stop event: each wait(s) moves the clock by ``s`` and the n-th one stops the thread."""

    def __init__(self, clock: Clock, n: int) -> None:
        self.clock, self.left = clock, n

    def wait(self, seconds: float) -> bool:
        self.clock.now += 0.25  # the thread polls every 0.2 s; 0.25 keeps the sums exact in binary
        self.left -= 1
        return self.left < 0


def run_supervisor(monkeypatch, tmp_path, clock, polls: int, rate: int, final: bool = False,
                   **every) -> tuple[list[dict], FakeClient]:
    # a 2-class linear model that predicts class 0 for x = (1, 0) and class 1 for (0, 1) and (0, 2)
    tensors = {"weight": torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "bias": torch.zeros(2)}
    batch = (torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 2.0], [1.0, 0.0]]), torch.tensor([0, 1, 0, 1]))
    client = FakeClient(rate, tensors)
    monkeypatch.setattr(supervisor, "PSClient", lambda *a, **k: client)
    sup = Supervisor([batch], dirpath=tmp_path, **every)
    sup._file, sup._start, sup._stop = tmp_path / "supervisor.jsonl", clock.now, Ticks(clock, polls)
    sup._final = final  # the stop is the fit's end (on_train_end), not an exception
    sup._watch(torch.nn.Linear(2, 2), "tcp://unused:1", "asgd")
    assert sup._error is None
    return [json.loads(line) for line in sup._file.read_text().splitlines()], client


def expected_metrics() -> dict:
    # logits = x: rows 1 and 2 right, rows 3 and 4 wrong; cross-entropy of each row by hand
    loss = 2 * math.log(1 + math.exp(-1)) + math.log(1 + math.exp(2)) + math.log(1 + math.exp(1))
    return {"test_acc": 0.5, "test_loss": pytest.approx(loss / 4, rel=1e-6)}


def test_supervisor_evaluates_every_n_seconds_of_the_injected_clock(monkeypatch, tmp_path, clock):
    # 13 polls 0.25 s apart from t = 100 (the start), a new version at each. The thread's last evaluation
    # time starts at 0, so the first poll evaluates; then one every 1.0 s: at 100.25, 101.25, 102.25, 103.25
    records, client = run_supervisor(monkeypatch, tmp_path, clock, polls=13, rate=1, every_n_seconds=1.0)
    assert [r["wall_s"] for r in records] == [0.25, 1.25, 2.25, 3.25]
    assert [r["version"] for r in records] == [1, 5, 9, 13] and client.pulls == 4
    assert [r["bytes_pushed"] for r in records] == [11, 55, 99, 143]  # socket + shared memory bytes
    for r in records:
        assert {k: r[k] for k in ("test_acc", "test_loss")} == expected_metrics()


def test_supervisor_evaluates_every_n_updates_whatever_the_clock(monkeypatch, tmp_path, clock):
    # versions 3, 6, ..., 18 at the polls: the first is evaluated, then each at least 5 past the last one
    records, _ = run_supervisor(monkeypatch, tmp_path, clock, polls=6, rate=3, every_n_updates=5)
    assert [r["version"] for r in records] == [3, 9, 15]
    assert [r["wall_s"] for r in records] == [0.25, 0.75, 1.25]


def test_supervisor_evaluates_the_model_a_fit_ended_with_once_more(monkeypatch, tmp_path, clock):
    # as above, but the 7th wait is the fit's end: version 21 (one more poll's) is evaluated though only 6 past the
    # last evaluation; a fit shorter than one poll still gets its one evaluation, at its end
    records, _ = run_supervisor(monkeypatch, tmp_path, clock, polls=6, rate=3, final=True, every_n_updates=5)
    assert [r["version"] for r in records] == [3, 9, 15, 21]
    (tmp_path / "short").mkdir()
    records, _ = run_supervisor(monkeypatch, tmp_path / "short", clock, polls=0, rate=3, final=True,
                                every_n_seconds=60.0)
    assert [r["version"] for r in records] == [3]


def test_supervisor_evaluates_nothing_more_where_the_fits_last_model_was_evaluated(monkeypatch, tmp_path, clock):
    records, client = run_supervisor(monkeypatch, tmp_path, clock, polls=3, rate=0, final=True, every_n_updates=1)
    assert [r["version"] for r in records] == [0] and client.pulls == 1  # version 0 throughout: evaluated once


def test_supervisor_defaults_to_every_10_seconds():
    sup = Supervisor([])
    assert (sup.every_n_updates, sup.every_n_seconds) == (None, 10.0)


@pytest.fixture
def policy_clock(monkeypatch):
    from plug_asgd.protocol import checkpoint

    c = Clock(1000.0)
    monkeypatch.setattr(checkpoint, "time", SimpleNamespace(monotonic=c, time=lambda: 0.0))
    return c


def test_checkpoints_every_n_seconds_follow_the_clock_from_the_last_save(tmp_path, policy_clock):
    policy = CheckpointPolicy(tmp_path, every_n_seconds=30.0, keep=2)  # its clock starts at 1000
    policy_clock.now = 1029.75
    assert not policy.due(1)
    policy_clock.now = 1030.0
    assert policy.due(1)
    policy.save(1, {"version": 1}, {"w": torch.zeros(2)})
    assert not policy.due(1)  # nothing new
    policy_clock.now = 1059.75
    assert not policy.due(7)  # 29.75 s since the save, whatever the updates
    policy_clock.now = 1060.0
    assert policy.due(7)
    policy.save(7, {"version": 7}, {"w": torch.zeros(2)})
    policy_clock.now = 1090.0
    policy.save(9, {"version": 9}, {"w": torch.zeros(2)})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ps-v0000000007.ckpt", "ps-v0000000009.ckpt"]  # keep=2


def test_checkpoints_default_to_every_60_seconds_and_combine_updates_with_seconds(tmp_path, policy_clock):
    policy = CheckpointPolicy(tmp_path)
    assert (policy.every_n_updates, policy.every_n_seconds) == (None, 60.0)
    both = CheckpointPolicy(tmp_path, every_n_updates=10, every_n_seconds=5.0)
    assert not both.due(9) and both.due(10)  # 10 updates, no time passed
    policy_clock.now = 1005.0
    assert both.due(1)  # 5 s, one update


def test_ps_checkpoint_callback_hands_its_time_policy_to_the_embedded_ps(tmp_path):
    options = PSCheckpoint(tmp_path, every_n_seconds=12.5, keep=4).ps_options()
    policy = PSConfig(bind="tcp://127.0.0.1:1", mode="asgd", **options).checkpoint_policy()
    assert (policy.dirpath, policy.every_n_updates, policy.every_n_seconds, policy.keep) == (
        tmp_path.resolve(), None, 12.5, 4)
    with pytest.raises(ValueError, match="every_n_seconds must be > 0"):
        PSCheckpoint(tmp_path, every_n_seconds=0)


def test_the_stateful_callbacks_keep_their_records_across_a_lightning_checkpoint():
    """What Lightning saves of a callback (``state_dict``) and gives back on resume (``load_state_dict``)."""
    records = [{"version": 3, "test_acc": 0.5}, {"version": 7, "test_acc": 0.6}]
    for make in (lambda: CommunicationMonitor(every_n_steps=1), lambda: Supervisor([])):
        saved = make()
        saved.records = list(records)
        state = saved.state_dict()
        resumed = make()
        assert resumed.records == []
        resumed.load_state_dict(state)
        assert resumed.records == records and resumed.records is not saved.records
