"""async_diloco's momentum lookahead (``AsyncDiLoCo(momentum_lookahead=True)``): a push that opens a cycle of the
delayed momentum is answered with the central model less the momentum step that cycle is expected to take. The step
against a hand computation on the rule, bit for bit on a real PS process (pulls and the push that closes the cycle
stay exact), and the worker training its next round from that model and pushing what it made since (on two shards
as on one PS: tests/test_sharding_modes.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from plug_asgd import AsyncDiLoCo, OuterOptimizer
from plug_asgd.modes import CentralState, Push
from plug_asgd.modes.diloco_async import AsyncDiLoCoRule
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.exchange import Link, make_exchange
from plug_asgd.worker.exchange.push import PushExchange
from tests.conftest import in_process_ps

F32 = np.float32
RNG = np.random.default_rng(11)
W0 = RNG.standard_normal(6).astype(F32)
U = [RNG.standard_normal(6).astype(F32) * F32(0.1) for _ in range(4)]  # arrivals' updates (w - w_base): 0, 1, 0, 1


def expected(lr: float = 0.7, mu: float = 0.9) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """After each of the 4 arrivals (2 workers: a cycle of 2), by hand in float32: the central model, and the model
    a reply ahead carries (None where the arrival closed the cycle). Each arrival applies ``lr / 2`` of its
    pseudo-gradient ``g = -u``; the 2nd of a cycle moves Nesterov's momentum ``b = mu b + mean`` and applies
    ``lr mu b``; after the 1st, the step anticipated is ``lr mu (mu b + g)`` (``b`` the momentum so far, none at
    first)."""
    lr_, mu_, two = F32(lr), F32(mu), F32(2)
    w, b, out = W0.copy(), None, []
    for i, u in enumerate(U):
        g = np.zeros(6, F32) + -u
        w = w - (lr_ / two) * g
        if i % 2 == 0:
            first = g
            step = (lr_ * mu_) * (g / F32(1) if b is None else mu_ * b + g / F32(1))
            out.append((w.copy(), w - step))
        else:
            mean = (np.zeros(6, F32) + first + g) / two
            b = mean.copy() if b is None else b * mu_ + mean
            w = w - lr_ * mu_ * b
            out.append((w.copy(), None))
    return out


def test_the_step_anticipated_is_the_momentums_of_the_cycle_under_way_by_hand():
    rule, state = AsyncDiLoCoRule(), CentralState({"w": W0.copy()})
    rule.set_trainers(state, frozenset({0, 1}))
    for i, (u, (central, ahead)) in enumerate(zip(U, expected(), strict=True)):
        rule.push(state, Push(i, i % 2, state.version, {"w": u.copy()}))
        assert state.tensors["w"].tobytes() == central.tobytes(), f"arrival {i + 1}"
        steps = rule.ahead()
        if ahead is None:
            assert steps == {}, f"arrival {i + 1} closed its cycle: nothing to anticipate"
        else:
            assert (state.tensors["w"] - steps["w"]).tobytes() == ahead.tobytes(), f"arrival {i + 1}"
    # SGD's momentum step, lr mu b, is known at the cycle's first arrival: none before a momentum exists
    sgd = AsyncDiLoCoRule(OuterOptimizer("sgd", lr=0.5, momentum=0.8))
    state = CentralState({"w": W0.copy()})
    sgd.set_trainers(state, frozenset({0, 1}))
    sgd.push(state, Push(0, 0, 0, {"w": U[0].copy()}))
    assert sgd.ahead() == {}
    sgd.push(state, Push(1, 1, 1, {"w": U[1].copy()}))
    sgd.push(state, Push(2, 0, 2, {"w": U[2].copy()}))
    b = (np.zeros(6, F32) + -U[0] + -U[1]) / F32(2)
    assert sgd.ahead()["w"].tobytes() == ((F32(0.5) * F32(0.8)) * b).tobytes()
    assert sgd.ahead(frozenset({"w"})).keys() == {"w"} and sgd.ahead(frozenset({"v"})) == {}  # a fragment's only
    for rule in (AsyncDiLoCoRule(OuterOptimizer("sgd", lr=1.0, momentum=0.0)), AsyncDiLoCoRule(delay=1)):
        state = CentralState({"w": W0.copy()})
        rule.set_trainers(state, frozenset({0, 1}))
        rule.push(state, Push(0, 0, 0, {"w": U[0].copy()}))
        assert rule.ahead() == {}  # no momentum, or a cycle of one arrival: nothing under way


def test_the_knob_and_when_a_worker_asks():
    assert AsyncDiLoCo().momentum_lookahead and AsyncDiLoCo().asks_ahead
    assert not AsyncDiLoCo(momentum_lookahead=False).asks_ahead
    assert not AsyncDiLoCo(outer={"name": "sgd", "lr": 1.0, "momentum": 0.0}).asks_ahead  # nothing to anticipate
    assert AsyncDiLoCo(outer={"name": "sgd", "lr": 0.7, "momentum": 0.5}).asks_ahead
    with pytest.raises(ValueError, match="momentum_lookahead must be True or False"):
        AsyncDiLoCo(momentum_lookahead="yes")  # type: ignore[arg-type]


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_real_ps_answers_the_push_opening_a_cycle_ahead_and_every_other_request_with_the_central_model(start_ps):
    """Two workers on a PS process: rank 0's push opens a cycle and asks ahead: its reply is the central model less
    the anticipated step, bit for bit, counted as ``ahead``, and its client holds no central model after it (no
    later reply is a delta of it); a pull meanwhile is the central model itself. Rank 1's push closes the cycle:
    the central model. Rank 0's next push opens a cycle without asking: the central model."""
    address = start_ps("async_diloco")
    clients = [PSClient(address, rank=r, world_size=2, mode="async_diloco", request_timeout=30, heartbeat_s=None)
               for r in (0, 1)]
    hand = expected()
    try:
        for c in clients:
            c.hello(stage=1, training=True, timeout=30)
        assert clients[0].init({"w": W0.copy()})
        assert clients[0].held is not None and clients[0].held.model_id is not None
        first = clients[0].push(0, {"w": U[0].copy()}, ahead=True)
        assert first.ahead and first.version == 1 and first.tensors["w"].tobytes() == hand[0][1].tobytes()
        assert clients[0].counters.replies["ahead"] == 1 and clients[0].held.model_id is None
        assert clients[1].pull().tensors["w"].tobytes() == hand[0][0].tobytes()
        second = clients[1].push(0, {"w": U[1].copy()}, ahead=True)
        assert not second.ahead and second.tensors["w"].tobytes() == hand[1][0].tobytes()
        third = clients[0].push(1, {"w": U[2].copy()})
        assert not third.ahead and third.tensors["w"].tobytes() == hand[2][0].tobytes()
        stats = clients[0].stats()
        assert stats["ahead_replies"] == 1 and stats["version"] == 3
    finally:
        for c in clients:
            c.close()


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_push_that_wants_its_own_tensors_gets_them_only_ahead_or_central_and_the_held_model_stays(start_ps):
    """Streaming's fragments (``want_model="pushed"``) on a PS process: a model of two tensors, pushes of ``w``
    only. Rank 0's opens ``w``'s cycle: its reply is ``w`` alone, less the anticipated step, bit for bit, marked
    ``ahead`` and ``part``, and the client still holds the central model it held (the init's). Rank 1's closes the
    cycle: ``w`` alone, central. A pull after them is then a delta of that held model: the central model."""
    address = start_ps("async_diloco")
    clients = [PSClient(address, rank=r, world_size=2, mode="async_diloco", request_timeout=30, heartbeat_s=None)
               for r in (0, 1)]
    hand, v0 = expected(), RNG.standard_normal(4).astype(F32)
    try:
        for c in clients:
            c.hello(stage=1, training=True, timeout=30)
        assert clients[0].init({"w": W0.copy(), "v": v0})
        held = clients[0].held.have
        first = clients[0].push(0, {"w": U[0].copy()}, want_model="pushed", ahead=True)
        assert first.ahead and first.part and list(first.tensors) == ["w"] and first.version == 1
        assert first.tensors["w"].tobytes() == hand[0][1].tobytes()
        assert clients[0].held.have == held and clients[0].counters.replies["ahead"] == 1
        second = clients[1].push(0, {"w": U[1].copy()}, want_model="pushed", ahead=True)
        assert second.part and not second.ahead and list(second.tensors) == ["w"]
        assert second.tensors["w"].tobytes() == hand[1][0].tobytes() and clients[1].counters.replies["part"] == 1
        pulled = clients[0].pull()
        assert clients[0].counters.replies["pulled_delta"] == 1 and pulled.version == 2
        assert pulled.tensors["w"].tobytes() == hand[1][0].tobytes() and pulled.tensors["v"].tobytes() == v0.tobytes()
        stats = clients[0].stats()
        assert stats["ahead_replies"] == 1 and stats["part_replies"] == 2 and stats["model_replies"] == 3
    finally:
        for c in clients:
            c.close()


class Recording:
    """A PSClient that records each push's update and reply."""

    def __init__(self, client: PSClient, log: list) -> None:
        self._client, self.log = client, log

    def __getattr__(self, name):
        return getattr(self._client, name)

    def push(self, base_version, update, **kwargs):
        reply = self._client.push(base_version, update, **kwargs)
        self.log.append(SimpleNamespace(update={n: np.array(t) for n, t in update.items()}, reply=reply,
                                        asked=kwargs.get("ahead", False)))
        return reply


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_a_worker_trains_its_next_round_from_the_model_ahead_and_pushes_what_it_made_since():
    """Two workers of AsyncDiLoCo(inner_steps=4) on an in-process PS, stepped in turn: rank 0's pushes open the
    cycles and are answered ahead, rank 1's close them. After each, rank 0's weights and base are its reply's model;
    its next push carries the 4 steps it made since, measured from that model; rank 1's replies are the central
    model."""
    shapes = {"a": (16, 8), "b": (8,)}
    workers = []
    with in_process_ps("async_diloco", shm_pushes=False) as server:
        try:
            _steps_in_turn(server, shapes, workers)
        finally:
            for w in workers:
                w.client.close()
    first, second = workers
    assert [p.asked for p in first.log] == [True] * 3 and [p.reply.ahead for p in first.log] == [True] * 3
    assert [p.reply.ahead for p in second.log] == [False] * 3
    assert first.client.counters.replies["ahead"] == 3 and second.client.counters.replies["ahead"] == 0
    for k, push in enumerate(first.log):
        for name, (x, base) in first.bases[k].items():  # after the push: the reply's model, the base too
            assert x.numpy().tobytes() == base.numpy().tobytes() == push.reply.tensors[name].tobytes()
        if k:  # the next push: the 4 steps made since, from the model ahead
            for name in shapes:
                since = sum(first.made[s][name] for s in range(4 * k, 4 * k + 4))
                np.testing.assert_allclose(push.update[name], since.numpy(), rtol=0, atol=1e-6)
    assert not first.exchange.base_is_central
    rule = server.store.rule
    assert isinstance(rule, AsyncDiLoCoRule) and rule.arrivals == 6 and server.stats.ahead_replies == 3


def _steps_in_turn(server, shapes: dict, workers: list) -> None:
    """Two AsyncDiLoCo(inner_steps=4) workers joined to ``server`` (appended to ``workers`` as they join), each
    making 12 local steps in turn; each worker's steps, its push log, and its weights and base after each push."""
    for rank in (0, 1):
        client = PSClient(server.address, rank=rank, world_size=2, mode="async_diloco", request_timeout=30,
                          heartbeat_s=None)
        workers.append(SimpleNamespace(client=client, log=[], bases=[], made=[]))
        client.hello(stage=1, training=True, timeout=20)
        g = torch.Generator().manual_seed(3)
        tensors = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        exchange = make_exchange(AsyncDiLoCo(inner_steps=4, dynamic_steps=False), codec=None, shm_pushes=False)
        assert isinstance(exchange, PushExchange)
        exchange.attach(Link(client=Recording(client, workers[-1].log), tensors=lambda t=tensors: t,  # type: ignore[arg-type]
                             rank=rank, world_size=2, stage=1, fitting=True, barrier=lambda name: None,
                             stop=lambda: None))
        exchange.start_fit([torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)], rank, 2)
        exchange.join(init=rank == 0)
        workers[-1].exchange, workers[-1].tensors = exchange, tensors
    for t in range(1, 13):
        for rank, w in enumerate(workers):
            g = torch.Generator().manual_seed(100 * rank + t)
            delta = {n: 0.01 * torch.randn(s, generator=g) for n, s in shapes.items()}
            w.made.append(delta)

            def run(w=w, delta=delta) -> None:
                with torch.no_grad():
                    for name, x in w.tensors.items():
                        x.add_(delta[name])

            w.exchange.step(run, w.exchange.optimizers[0])
            if t % 4 == 0:  # just pushed: the weights and the base
                w.bases.append({n: (x.clone(), w.exchange.base[n].clone()) for n, x in w.tensors.items()})
