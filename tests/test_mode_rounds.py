"""Exact results of whole rounds: the worker's exchange (plug_asgd.worker.exchange) and the PS's fold rule
(plug_asgd.modes.rules) together, in this process, on a two-coordinate model whose every value is a
sum of powers of two, so the expected tensors below are computed by hand and compared bit for bit."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from plug_asgd.modes import EASGD, LOSP, SAGN, LocalSGD, Mode
from plug_asgd.modes.fold import APPLIED, CentralState, Push
from plug_asgd.worker.compensation import resolve
from plug_asgd.worker.exchange import Exchange, Link, make_exchange
from plug_asgd.worker.model_reply import ModelReply

CENTRAL0 = [1.0, -2.0]


class LocalPS:
    """The PS's part: the mode's real fold rule on the central state; ``while_held`` runs when a push waits."""

    def __init__(self, mode: Mode, ranks: frozenset[int]) -> None:
        self.state = CentralState({"w": np.array(CENTRAL0, dtype=np.float32)})
        self.rule = mode.make_rule()
        self.rule.set_trainers(self.state, ranks)
        self.resolved: dict[int, str] = {}
        self.pushes: list[tuple[int, int, np.ndarray]] = []  # (rank, base version, update) as received
        self.while_held: Callable[[], None] = lambda: None

    def reply(self) -> ModelReply:
        return ModelReply(self.state.version, APPLIED, False, {n: t.copy() for n, t in self.state.tensors.items()})


class StubClient:
    """PSClient as an exchange uses it, answering from a :class:`LocalPS` (no shared memory, no socket)."""

    shares_memory = False
    takes_weights = True  # as PSClient

    def __init__(self, ps: LocalPS, rank: int) -> None:
        self.ps, self.rank = ps, rank

    def pull(self) -> ModelReply:
        return self.ps.reply()

    def push_buffers(self, shapes):
        return None

    def push(self, base: int, update: dict, want_model=True, while_waiting=None, **kwargs) -> ModelReply:
        ps = self.ps
        copy = {n: np.array(u, dtype=np.float32) for n, u in update.items()}
        ps.pushes.append((self.rank, base, copy["w"]))
        ps.resolved.update(ps.rule.push(ps.state, Push(self.rank, self.rank, base, copy)))
        if self.rank not in ps.resolved:  # a sync round: the PS answers once the other worker's push completes it
            ps.while_held()
        assert ps.resolved.pop(self.rank) == APPLIED
        return ps.reply()


def worker(mode: Mode, ps: LocalPS, rank: int, start: list[float]) -> tuple[Exchange, torch.Tensor]:
    w = torch.tensor(start, dtype=torch.float32)
    exchange = make_exchange(mode)
    exchange.attach(Link(client=StubClient(ps, rank), tensors=lambda: {"w": w}, rank=rank, world_size=2, stage=1,
                         fitting=True, barrier=lambda name: None, stop=lambda: None))
    exchange.start_fit([], rank, 2)
    exchange.join(init=False)
    return exchange, w


def local_steps(exchange, w: torch.Tensor, n: int, step: list[float]) -> None:
    def run() -> None:
        with torch.no_grad():
            w.add_(torch.tensor(step))

    for _ in range(n):
        exchange.step(run, None)


def sync_round(mode: Mode, steps: int) -> tuple[LocalPS, torch.Tensor, torch.Tensor]:
    """Worker 0 steps by (0.5, 0.25), worker 1 by (-0.25, 1.0), ``steps`` times each, then one round."""
    ps = LocalPS(mode, frozenset({0, 1}))
    (x0, w0), (x1, w1) = worker(mode, ps, 0, CENTRAL0), worker(mode, ps, 1, CENTRAL0)
    local_steps(x0, w0, steps - 1, [0.5, 0.25])
    assert ps.pushes == []  # nothing before push_every local steps
    ps.while_held = lambda: local_steps(x1, w1, steps, [-0.25, 1.0])
    local_steps(x0, w0, 1, [0.5, 0.25])
    return ps, w0, w1


def test_a_localsgd_round_averages_the_two_workers_8_step_progress():
    ps, w0, w1 = sync_round(LocalSGD(), 8)
    # deltas: 8 * (0.5, 0.25) = (4, 2) and 8 * (-0.25, 1) = (-2, 8), pushed as they are
    assert [(r, b, u.tolist()) for r, b, u in ps.pushes] == [(0, 0, [4.0, 2.0]), (1, 0, [-2.0, 8.0])]
    # central (1, -2) + ((4, 2) + (-2, 8)) / 2 = (2, 3), one version for the round; both workers take it
    assert ps.state.version == 1 and ps.state.tensors["w"].tolist() == [2.0, 3.0]
    assert w0.tolist() == w1.tolist() == [2.0, 3.0]


def test_a_sagn_round_averages_the_updates_divided_by_their_4_steps():
    ps, w0, w1 = sync_round(SAGN(), 4)
    # deltas (2, 1) and (-1, 4) over 4 steps each: pushed divided by 4
    assert [(r, b, u.tolist()) for r, b, u in ps.pushes] == [(0, 0, [0.5, 0.25]), (1, 0, [-0.25, 1.0])]
    # central (1, -2) + ((0.5, 0.25) + (-0.25, 1)) / 2 = (1.125, -1.375)
    assert ps.state.version == 1 and ps.state.tensors["w"].tolist() == [1.125, -1.375]
    assert w0.tolist() == w1.tolist() == [1.125, -1.375]


def test_easgd_moves_the_worker_and_the_center_by_alpha_times_their_difference():
    mode = EASGD(tau=4, alpha=0.25)
    ps = LocalPS(mode, frozenset({0}))
    exchange, w = worker(mode, ps, 0, [7.0, 7.0])  # joining takes the center (1, -2)
    assert w.tolist() == CENTRAL0
    local_steps(exchange, w, 3, [0.5, 0.25])
    assert ps.pushes == []  # nothing before tau local steps
    # meanwhile another worker moved the center to (2, -4), version 3
    ps.state.tensors["w"], ps.state.version = np.array([2.0, -4.0], dtype=np.float32), 3
    local_steps(exchange, w, 1, [0.5, 0.25])  # the worker is at (1, -2) + 4 * (0.5, 0.25) = (3, -1)
    # e = 0.25 * ((3, -1) - (2, -4)) = (0.25, 0.75): the worker steps -e, the center +e
    assert [(r, b, u.tolist()) for r, b, u in ps.pushes] == [(0, 3, [0.25, 0.75])]
    assert w.tolist() == [2.75, -1.75]
    assert ps.state.tensors["w"].tolist() == [2.25, -3.25] and ps.state.version == 4
    assert exchange.version == 4 and exchange.since_push == 0


class BlockingClient(StubClient):
    """As StubClient, for pushes sent from the overlapping exchange's thread: a push of a sync round waits,
    in its thread, for the other worker's push to complete the round."""

    def push(self, base: int, update: dict, want_model=True, while_waiting=None, **kwargs) -> ModelReply:
        ps = self.ps
        with ps.cond:
            ps.pushes.append((self.rank, base, np.array(update["w"], dtype=np.float32)))
            ps.resolved.update(ps.rule.push(ps.state, Push(self.rank, self.rank, base, {"w": ps.pushes[-1][2]})))
            ps.cond.notify_all()
            assert ps.cond.wait_for(lambda: self.rank in ps.resolved, timeout=10)
            assert ps.resolved.pop(self.rank) == APPLIED
            return ps.reply()


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_losp_with_momentum_keeps_its_own_share_of_the_round_in_flight_and_sends_half(momentum):
    mode = LOSP(push_every=2)
    ps = LocalPS(mode, frozenset({0, 1}))
    ps.cond = threading.Condition()
    workers = []
    for rank in (0, 1):
        w = torch.tensor(CENTRAL0, dtype=torch.float32)
        # the optimizer only says whether it keeps momentum; the steps below are made by hand
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05, momentum=momentum)
        exchange = make_exchange(mode, compensation=resolve(None, "losp", mode.compensate))
        exchange.attach(Link(client=BlockingClient(ps, rank), tensors=lambda w=w: {"w": w}, rank=rank, world_size=2,
                             stage=1, fitting=True, barrier=lambda name: None, stop=lambda: None))
        exchange.start_fit([optimizer], rank, 2)
        exchange.join(init=False)
        workers.append((exchange, w))
    (x0, w0), (x1, w1) = workers
    # each round: 2 steps of each worker, progress p = (1, 0.5) and (-0.5, 2); a worker's push stays in flight
    # (its thread waits for the other's) while the other steps, and is merged at its next push
    if momentum:  # sent at 1/2 (a round lands a round late); the weights keep half of the progress made meanwhile
        sent = [(0, 0, [0.5, 0.25]), (1, 0, [-0.25, 1.0]), (0, 1, [0.5, 0.25]), (1, 1, [-0.25, 1.0])]
        # central (1, -2) + ((0.5, 0.25) + (-0.25, 1)) / 2 = (1.125, -1.375), then + (0.125, 0.625) again
        central = [[1.125, -1.375], [1.25, -0.75]]
        # at the second push, round 1 merged: (1.125, -1.375) + p / 2
        weights = ([1.625, -1.125], [0.875, -0.375])
    else:  # plain SGD: the progress kept whole, sent whole
        sent = [(0, 0, [1.0, 0.5]), (1, 0, [-0.5, 2.0]), (0, 1, [1.0, 0.5]), (1, 1, [-0.5, 2.0])]
        central = [[1.25, -0.75], [1.5, 0.5]]
        weights = ([2.25, -0.25], [0.75, 1.25])  # (1.25, -0.75) + p
    steps = ([0.5, 0.25], [-0.25, 1.0])
    try:
        for round_ in range(2):
            local_steps(x0, w0, 2, steps[0])
            local_steps(x1, w1, 2, steps[1])
            if round_ == 1:
                assert (w0.tolist(), w1.tolist()) == weights
    finally:
        x0.finish()
        x1.finish()
    assert sorted((r, b, u.tolist()) for r, b, u in ps.pushes) == sorted(sent)
    assert ps.state.version == 2 and ps.state.tensors["w"].tolist() == central[1]
    # the finish above merged round 2 the same way: no progress since its send, so the central model itself
    assert w0.tolist() == w1.tolist() == central[1]


def test_overlapped_pushes_count_the_staleness_they_land_with():
    """An overlapped push's staleness is counted when its reply is merged, as a blocking push's is when it comes:
    the worker's counters and the compensation's estimate. The two workers alternate, a push each per step:
    worker 0's land at versions 1 and 3 from bases 0 and 1 (staleness 0, then 1: worker 1's first came between),
    worker 1's at 2 and 4 from bases 0 and 2 (1 and 1). The last pushes are merged by the finish below."""
    from plug_asgd.modes import Asgd

    mode = Asgd(overlap=True)
    ps = LocalPS(mode, frozenset({0, 1}))
    workers = []
    for rank in (0, 1):
        w = torch.tensor(CENTRAL0, dtype=torch.float32)
        exchange = make_exchange(mode, compensation=resolve(None, "asgd", mode.compensate))
        exchange.attach(Link(client=StubClient(ps, rank), tensors=lambda w=w: {"w": w}, rank=rank, world_size=2,
                             stage=1, fitting=True, barrier=lambda name: None, stop=lambda: None))
        exchange.start_fit([], rank, 2)
        exchange.join(init=False)
        workers.append((exchange, w))
    (x0, w0), (x1, w1) = workers
    try:
        for _ in range(2):
            local_steps(x0, w0, 1, [0.5, 0.25])
            x0.finish()  # the stub has answered in the sender thread: the next worker's push lands after this one
            local_steps(x1, w1, 1, [-0.25, 1.0])
            x1.finish()
    finally:
        x0.finish()
        x1.finish()
    assert [(r, b) for r, b, _ in ps.pushes] == [(0, 0), (1, 0), (0, 1), (1, 2)]
    assert x0.staleness == [1, 2, 1] and x1.staleness == [2, 2, 1]  # sum, count, max
    assert list(x0.compensator.recent) == [0, 1] and list(x1.compensator.recent) == [1, 1]
    assert x0.stats()["overlapped_steps"] == 0  # each reply was merged before the next step: none computed during one
