"""async_diloco's dynamic local steps (``AsyncDiLoCo(dynamic_steps=True)``): each push says the worker's local steps
per second, the PS answers it with its pace (those over the fastest training worker's) and the worker makes that
share of ``inner_steps``. The PS's arithmetic on a real PS process and socket, what it refuses, the clock's
median, a sharded worker's lowest pace, and two workers on their own threads, one 4x slower, whose rounds come out
in proportion."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch

from plug_asgd import AsyncDiLoCo
from plug_asgd.protocol.partition import Partition
from plug_asgd.sharding.client import ShardedClient
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.errors import PSError
from plug_asgd.worker.exchange import Link, make_exchange
from plug_asgd.worker.exchange import pace as pace_module
from plug_asgd.worker.exchange.pace import StepClock
from plug_asgd.worker.exchange.push import PushExchange
from plug_asgd.worker.model_reply import ModelReply
from tests.conftest import in_process_ps
from tests.test_diloco_fragments import join_worker, take_step

W0 = np.arange(6, dtype=np.float32)


def _pair(address: str) -> list[PSClient]:
    out = [PSClient(address, rank=r, world_size=2, mode="async_diloco", request_timeout=30, heartbeat_s=None)
           for r in (0, 1)]
    for c in out:
        c.hello(stage=1, training=True, timeout=30)
    return out


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_ps_process_answers_each_push_with_its_pace_over_the_fastest_trainer(start_ps):
    """Paces by hand from the rates said, in the push replies and in the stats ``plug-asgd status`` shows: the
    fastest trainer's latest rate divides each; a worker that left training no longer counts; a push that says no
    rate gets none; a rate that is not a positive number of steps per second (at most 10^6) is refused with
    ``bad_field`` and the push is not applied."""
    pair = _pair(start_ps("async_diloco"))
    try:
        pair[0].init({"w": W0.copy()})
        u = {"w": np.full(6, 0.01, np.float32)}

        def push(rank: int, rate: float | None) -> ModelReply:
            return pair[rank].push(pair[rank].pull().version, u, rate=rate)

        assert push(0, 40.0).pace == 1.0  # alone with a rate: the fastest
        assert push(1, 10.0).pace == 0.25
        assert push(0, 50.0).pace == 1.0
        assert push(1, 12.5).pace == 0.25  # against rank 0's latest, 50

        def shown() -> dict[int, tuple]:  # what plug-asgd status shows of each worker
            return {w["rank"]: (w.get("rate"), w.get("pace")) for w in pair[0].stats()["worker_details"]}

        assert shown() == {0: (50.0, 1.0), 1: (12.5, 0.25)}
        assert push(1, 100.0).pace == 1.0 and push(0, 50.0).pace == 0.5  # rank 1 is now the faster
        assert push(0, None).pace is None
        pair[1].hello(stage=1, training=False)  # rank 1's fit ended: its rate no longer counts
        assert push(0, 5.0).pace == 1.0
        assert shown() == {0: (5.0, 1.0), 1: (None, None)}  # (a hello forgets the rate)
        version = pair[0].pull().version
        for bad in (0, -3.0, float("nan"), float("inf"), 1e7, "fast", True):
            fields = {"rank": 0, "base_version": version, "seq": 10_000, "session": pair[0].session,
                      "model": True, "rate": bad}
            with pytest.raises(PSError) as refused:
                pair[0].request("push", fields, u)
            assert refused.value.code == "bad_field" and "rate" in str(refused.value), bad
        assert pair[0].pull().version == version  # none of them applied
        assert push(0, 5.0).status == "applied"  # and the worker goes on
    finally:
        for c in pair:
            c.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_sharded_worker_takes_the_lowest_of_its_shards_paces(start_ps):
    """Two shard processes, rank 0's rate (40) said to both, then forgotten by shard 0 (a hello there): rank 1's
    push at 10 steps per second is paced 1.0 by shard 0 (the fastest it knows of) and 0.25 by shard 1, and takes
    0.25; once rank 0 says its rate again, both say 0.25."""
    shapes = {"w": (8, 5), "b": (5,)}
    part = Partition(shapes, 2)
    addresses = [start_ps("async_diloco", shard="0/2"), start_ps("async_diloco", shard="1/2")]
    workers = [ShardedClient(addresses, part, rank=r, world_size=2, mode="async_diloco", request_timeout=30,
                             heartbeat_s=None) for r in (0, 1)]
    update = {n: np.full(s, 0.01, np.float32) for n, s in shapes.items()}
    try:
        for w in workers:
            w.hello(stage=1, training=True, timeout=30)
        assert workers[0].init({n: np.ones(s, np.float32) for n, s in shapes.items()})
        assert workers[0].push(workers[0].pull().version, update, rate=40.0).pace == 1.0
        workers[0].clients[0].hello(stage=1, training=True)  # shard 0 forgets rank 0's rate
        assert workers[1].push(workers[1].pull().version, update, rate=10.0).pace == 0.25
        assert workers[0].push(workers[0].pull().version, update, rate=40.0).pace == 1.0
        assert workers[1].push(workers[1].pull().version, update, rate=10.0).pace == 0.25
    finally:
        for w in workers:
            w.close()


@pytest.mark.parametrize(("pace", "steps"), [(1.0, 8), (0.5, 4), (0.26, 2), (0.01, 1), (0.999, 8), (None, 8)])
def test_a_worker_makes_its_pace_of_the_inner_steps(pace, steps):
    """``round(pace * inner_steps)``, at least 1 and at most ``inner_steps``; no pace said: the steps stay as they
    were; ``dynamic_steps=False``: ``inner_steps`` whatever the pace."""
    for knobs, want in (({}, steps), ({"dynamic_steps": False}, 8)):
        exchange = PushExchange(AsyncDiLoCo(inner_steps=8, **knobs))
        exchange.start_fit([], 1, 2)
        assert exchange.paced == (knobs == {})
        exchange.count_staleness(ModelReply(2, "applied", False, {}, pace=pace), 0)
        assert exchange.steps_per_push == want
    assert AsyncDiLoCo(inner_steps=100).steps_for(0.42) == 42


def test_the_step_clock_times_steps_without_their_exchange_and_takes_the_median(monkeypatch):
    """A step's time runs from the end of the last step's exchange to the end of its own step: a push's 0.5 s is
    left out, and a step that also ran a validation (1 s) does not move the median of the round's 0.1 s steps."""
    now = [0.0]
    monkeypatch.setattr(pace_module.time, "perf_counter", lambda: now[0])
    clock = StepClock()
    clock.start()
    for step_end, exchange_end in [(0.1, 0.6), (0.7, 0.7), (0.8, 0.8), (1.8, 1.8), (1.9, 1.9)]:
        now[0] = step_end
        clock.stepped()
        now[0] = exchange_end
        clock.exchanged()
    assert clock.steps == pytest.approx([0.1, 0.1, 1.0, 0.1])  # the first step: nothing to time it from
    assert clock.rate() == pytest.approx(10.0)
    assert clock.rate() is None  # each push says the steps since the last one's
    for step_s, said in ((0.0, 1e6), (1e-9, 1e6), (1e7, 1 / 86400)):  # within what a push may say (RATE_RANGE)
        clock.steps = [step_s]
        assert clock.rate() == said


class _Paced:
    """A client whose push replies say the pace ``pace``, whatever the PS said."""

    def __init__(self, client, pace: float) -> None:
        self._client, self.pace = client, pace

    def __getattr__(self, name):
        return getattr(self._client, name)

    def push(self, *args, **kwargs):
        return dataclasses.replace(self._client.push(*args, **kwargs), pace=self.pace)


@pytest.mark.integration
def test_an_overlapped_reply_that_halves_the_pace_shortens_the_round_under_way():
    """``overlap=True``, H = 8: the push at step 8 goes from a thread; its reply, merged after step 9, says pace
    0.5, and the round under way ends at step 12 (4 steps after the push), not 16."""
    mode = AsyncDiLoCo(inner_steps=8, overlap=True, momentum_lookahead=False)
    with in_process_ps(mode.name, shm_pushes=False) as server:
        client, exchange, log, tensors = join_worker(server.address, mode, 0, 1)
        exchange.link.client = _Paced(exchange.link.client, 0.5)
        try:
            for t in range(1, 9):
                take_step(exchange, tensors, 0, t)
            exchange.pending[0].thread.join(30)
            for t in range(9, 14):
                take_step(exchange, tensors, 0, t)
            assert exchange.steps_per_push == 4
            assert exchange.fragment_trace == [(8, 0), (12, 0)]
        finally:
            client.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_worker_4x_slower_makes_a_quarter_of_the_inner_steps(start_ps):
    """Two workers of AsyncDiLoCo(inner_steps=12) on a PS process, each on a thread of its own, one sleeping 10 ms
    a step, the other 40 ms: after its first push the slower makes rounds of about 3 steps, the faster keeps 12."""
    address = start_ps("async_diloco")
    shapes = {"a": (16, 8), "b": (8,)}
    steps_seen: dict[int, list[int]] = {0: [], 1: []}
    clients: list[PSClient] = []
    errors: list[BaseException] = []

    def worker(rank: int, sleep_s: float, joined: threading.Barrier) -> None:
        try:
            client = PSClient(address, rank=rank, world_size=2, mode="async_diloco", request_timeout=30,
                              heartbeat_s=None)
            clients.append(client)
            client.hello(stage=1, training=True, timeout=30)
            tensors = {n: torch.zeros(s) for n, s in shapes.items()}
            exchange = make_exchange(AsyncDiLoCo(inner_steps=12), codec=None, shm_pushes=False)
            exchange.attach(Link(client=client, tensors=lambda: tensors, rank=rank, world_size=2, stage=1,
                                 fitting=True, barrier=lambda name: None, stop=lambda: None))
            exchange.start_fit([torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)], rank, 2)
            if rank == 1:
                joined.wait(30)  # rank 0 initialised the PS
            exchange.join(init=rank == 0)
            if rank == 0:
                joined.wait(30)

            def run() -> None:
                time.sleep(sleep_s)
                with torch.no_grad():
                    for x in tensors.values():
                        x.add_(0.01)

            pushes = 0
            while pushes < (12 if rank == 0 else 4):
                before = exchange.since_push
                exchange.step(run, exchange.optimizers[0])
                if exchange.since_push < before + 1:  # it pushed: the steps of its next round
                    pushes += 1
                    steps_seen[rank].append(exchange.steps_per_push)
        except BaseException as exc:  # noqa: BLE001 (reported by the test's thread)
            errors.append(exc)

    joined = threading.Barrier(2)
    threads = [threading.Thread(target=worker, args=(r, s, joined)) for r, s in ((0, 0.01), (1, 0.04))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads) and not errors, errors
    finally:
        for c in clients:
            c.close()
    assert steps_seen[0] == [12] * 12  # the faster worker's pace is 1
    # 12 x 10/40 = 3; 2 to 5 where either sleep overran (5: the faster's steps measured at 18 ms)
    assert all(2 <= s <= 5 for s in steps_seen[1]), steps_seen[1]
