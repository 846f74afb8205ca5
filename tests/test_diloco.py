"""DiLoCo (plug_asgd/modes/diloco.py): the outer step of a round against a hand computation, bit for bit on the
rule and on a real PS process; the outer optimizers against torch's; the outer state kept by a checkpoint so that a
resumed PS goes on to the bit; the mode's knobs and refusals."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from plug_asgd import DiLoCo, OuterOptimizer
from plug_asgd.modes import CentralState, Push, get
from plug_asgd.modes.diloco import DiLoCoRule
from plug_asgd.worker.client import PSClient
from tests.test_faults import wait_for

F32 = np.float32
RNG = np.random.default_rng(7)
W0 = RNG.standard_normal(6).astype(F32)
ROUNDS = [(RNG.standard_normal(6).astype(F32) * F32(0.1), RNG.standard_normal(6).astype(F32) * F32(0.1))
          for _ in range(3)]  # each round: island 0's and island 1's update (w - w_base) after their inner steps


def by_hand(w0: np.ndarray, rounds, lr: float = 0.7, mu: float = 0.9) -> list[np.ndarray]:
    """The central model after each round: the mean update in rank order (u0 + u1, halved), its negative the
    pseudo-gradient g, Nesterov's momentum b = mu b + g (b = g at first), w -= lr (g + mu b), in float32."""
    w, b, out = w0.copy(), None, []
    for u0, u1 in rounds:
        g = -((np.zeros_like(u0) + u0 + u1) / F32(2))
        b = g.copy() if b is None else b * F32(mu) + g
        w = w - F32(lr) * (g + F32(mu) * b)
        out.append(w.copy())
    return out


def test_a_rounds_outer_step_is_nesterovs_on_the_mean_pseudo_gradient_bit_for_bit():
    rule = DiLoCoRule()
    rule.set_trainers(CentralState({"w": W0.copy()}), frozenset({0, 1}))
    state = CentralState({"w": W0.copy()})
    for r, (u0, u1) in enumerate(ROUNDS):
        assert rule.push(state, Push("a", 1, state.version, {"w": u1.copy()})) == []  # waits for the round
        done = rule.push(state, Push("b", 0, state.version, {"w": u0.copy()}))
        assert sorted(t for t, _ in done) == ["a", "b"] and state.version == r + 1
        assert state.tensors["w"].tobytes() == by_hand(W0, ROUNDS)[r].tobytes()
    assert rule.outer_steps == 3


@pytest.mark.parametrize("outer", [OuterOptimizer("nesterov", lr=0.7, momentum=0.9),
                                   OuterOptimizer("sgd", lr=0.5, momentum=0.8), OuterOptimizer("sgd", lr=1.0,
                                                                                               momentum=0.0),
                                   OuterOptimizer("adam", lr=0.01)])
def test_each_outer_optimizer_steps_as_torchs_does(outer):
    """Three rounds of each, against torch's own SGD and Adam fed the same pseudo-gradients (float32 rounding
    apart: torch fuses some of its operations)."""
    rule = DiLoCoRule(outer=outer)
    rule.set_trainers(CentralState({"w": W0.copy()}), frozenset({0, 1}))
    state = CentralState({"w": W0.copy()})
    param = torch.nn.Parameter(torch.from_numpy(W0.copy()))
    if outer.name == "adam":
        opt = torch.optim.Adam([param], lr=outer.lr, betas=(outer.beta1, outer.beta2), eps=outer.eps, foreach=False)
    else:
        opt = torch.optim.SGD([param], lr=outer.lr, momentum=outer.momentum, nesterov=outer.name == "nesterov",
                              foreach=False)
    for u0, u1 in ROUNDS:
        rule.push(state, Push("a", 0, state.version, {"w": u0.copy()}))
        rule.push(state, Push("b", 1, state.version, {"w": u1.copy()}))
        param.grad = torch.from_numpy(-((u0 + u1) / F32(2)))
        opt.step()
        np.testing.assert_allclose(state.tensors["w"], param.detach().numpy(), rtol=1e-6, atol=1e-7)
    # plain SGD at lr 1 without momentum is local SGD's average: w_base + mean update, exactly
    if outer.name == "sgd" and outer.momentum == 0:
        w = W0.copy()
        for u0, u1 in ROUNDS:
            w = w - F32(1.0) * -((np.zeros(6, F32) + u0 + u1) / F32(2))
        assert state.tensors["w"].tobytes() == w.tobytes()


def test_the_outer_state_a_checkpoint_keeps_continues_the_run_to_the_bit():
    def run(rule: DiLoCoRule, state: CentralState, rounds) -> None:
        for u0, u1 in rounds:
            rule.push(state, Push("a", 0, state.version, {"w": u0.copy()}))
            rule.push(state, Push("b", 1, state.version, {"w": u1.copy()}))

    for outer in (OuterOptimizer(), OuterOptimizer("adam", lr=0.01)):
        rule, state = DiLoCoRule(outer=outer), CentralState({"w": W0.copy()})
        rule.set_trainers(state, frozenset({0, 1}))
        run(rule, state, ROUNDS[:2])
        fields, arrays = rule.state()
        assert fields["outer_steps"] == 2 and any(k.startswith("outer/") for k in arrays)
        resumed, state2 = DiLoCoRule(outer=outer), CentralState({"w": state.tensors["w"].copy()}, version=2)
        resumed.restore(fields, {k: v.copy() for k, v in arrays.items()})
        resumed.set_trainers(state2, frozenset({0, 1}))
        run(rule, state, ROUNDS[2:])
        run(resumed, state2, ROUNDS[2:])
        assert state2.tensors["w"].tobytes() == state.tensors["w"].tobytes()
    with pytest.raises(ValueError, match="not this PS's"):
        DiLoCoRule(outer=OuterOptimizer("sgd")).restore(fields, arrays)


def test_the_modes_knobs_and_refusals():
    mode = get({"name": "diloco", "inner_steps": 20, "outer": {"name": "adam", "lr": 0.001}})
    assert isinstance(mode, DiLoCo) and mode.push_every == 20 and mode.outer == OuterOptimizer("adam", lr=0.001)
    assert get("diloco").push_every == 100 and get("diloco").outer == OuterOptimizer()
    rule = mode.make_rule({"outer": '{"name": "sgd", "lr": 0.9}'})  # the PS's --outer flag wins
    assert rule.outer == OuterOptimizer("sgd", lr=0.9)
    assert DiLoCo().make_rule({}).outer == OuterOptimizer()
    with pytest.raises(ValueError, match="inner_steps must be"):
        DiLoCo(inner_steps=0)
    with pytest.raises(ValueError, match="give inner_steps, not push_every"):
        DiLoCo(push_every=3)
    with pytest.raises(ValueError, match="choose one of nesterov, sgd, adam"):
        DiLoCo(outer="lamb")
    with pytest.raises(ValueError, match="momentum must be in"):
        OuterOptimizer(momentum=1.0)


@pytest.mark.integration
def test_a_real_ps_folds_two_islands_rounds_as_the_hand_computation_and_resumes_its_outer_state(start_ps, tmp_path):
    """A PS process, two workers pushing a round each time (each push waits for the other's): the central model is
    the hand computation's after every round, bit for bit; killed after round 2's checkpoint, a PS resumed from it
    makes round 3 exactly as one that went on."""
    ck = tmp_path / "ck"
    address = start_ps("diloco", checkpoint_dir=ck, checkpoint_every_updates=1)
    expected = by_hand(W0, ROUNDS)

    def clients(addr: str) -> list[PSClient]:
        out = [PSClient(addr, rank=r, world_size=2, mode="diloco", request_timeout=30, lost_timeout=30,
                        heartbeat_s=None) for r in (0, 1)]
        for c in out:
            c.hello(stage=1, training=True, timeout=30)
        return out

    def round_(pair: list[PSClient], seq: int, base: int, updates) -> list:
        replies: list = [None, None]

        def push(r: int) -> None:
            fields = {"rank": r, "base_version": base, "seq": seq, "session": pair[r].session, "model": True}
            replies[r] = pair[r].request("push", fields, {"w": updates[r]})

        threads = [threading.Thread(target=push, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return replies

    pair = clients(address)
    try:
        pair[0].init({"w": W0.copy()})
        for r in range(2):
            replies = round_(pair, r, r, ROUNDS[r])
            assert all(rep.fields["version"] == r + 1 for rep in replies)
            assert pair[0].pull().tensors["w"].tobytes() == expected[r].tobytes()
    finally:
        for c in pair:
            c.close()
    start_ps.stop(address)
    resumed = start_ps("diloco", resume=ck)
    pair = clients(resumed)
    try:
        assert pair[0].pull().version == 2
        round_(pair, 2, 2, ROUNDS[2])
        assert pair[0].pull().tensors["w"].tobytes() == expected[2].tobytes()
    finally:
        for c in pair:
            c.close()


@pytest.mark.integration
@pytest.mark.faults
def test_a_failover_between_rounds_loses_no_outer_state(start_ps):
    """Round 1 on the primary alone (its outer momentum made there), then a standby joins (it is sent the outer
    state with the model), round 2 folds on both, the primary is SIGKILLed, round 3 goes to the standby: the model
    is the hand computation's after every round, bit for bit."""
    start_ps.env["PLUG_ASGD_LOG"] = "INFO"
    primary = start_ps("diloco", expected_workers=2)
    expected = by_hand(W0, ROUNDS)
    workers = [PSClient(primary, rank=r, world_size=2, mode="diloco", request_timeout=60, heartbeat_s=None)
               for r in (0, 1)]
    try:
        for w in workers:
            w.hello(1, True, timeout=30)
        workers[0].init({"w": W0.copy()})

        def round_(r: int) -> None:
            with ThreadPoolExecutor(2) as pool:
                replies = list(pool.map(lambda i: workers[i].push(r, {"w": ROUNDS[r][i].copy()}), (0, 1)))
            assert [rep.version for rep in replies] == [r + 1, r + 1], replies

        round_(0)
        standby = start_ps("diloco", standby_of=primary)
        wait_for(lambda: workers[0].stats().get("standby") == standby, 30, "the standby to join")
        round_(1)
        assert workers[0].pull().tensors["w"].tobytes() == expected[1].tobytes()
        os.killpg(start_ps.started[primary].pid, signal.SIGKILL)
        start_ps.started.pop(primary).wait(10)
        round_(2)  # each worker finds the standby, which leads
        reply = workers[1].pull()
        assert reply.version == 3 and reply.tensors["w"].tobytes() == expected[2].tobytes()
    finally:
        for w in workers:
            w.close()


# -- async_diloco: each pseudo-gradient as it arrives, the momentum every N arrivals ---------------------------------


def test_the_delayed_nesterov_moves_the_momentum_exactly_every_n_arrivals():
    """N = 2 workers: each arrival applies lr/N of its pseudo-gradient at once; at every 2nd arrival the momentum
    takes the mean of the two and lr mu b is applied: by hand, in float32, after every arrival; the momentum's bytes
    unchanged at the arrivals in between."""
    from plug_asgd.modes.diloco_async import AsyncDiLoCoRule

    rule, state = AsyncDiLoCoRule(), CentralState({"w": W0.copy()})
    rule.set_trainers(state, frozenset({0, 1}))
    lr, mu, n = F32(0.7), F32(0.9), F32(2)
    w, b, pending, momenta = W0.copy(), None, [], []
    arrivals = [u for pair in ROUNDS for u in pair]  # 6 arrivals, ranks 0, 1, 0, 1, ...
    for i, u in enumerate(arrivals):
        rule.push(state, Push(i, i % 2, state.version, {"w": u.copy()}))
        g = np.zeros(6, F32) + -u
        w = w - (lr / n) * g
        pending.append(g)
        if (i + 1) % 2 == 0:
            mean = (np.zeros(6, F32) + pending[0] + pending[1]) / n
            b = mean.copy() if b is None else b * mu + mean
            w = w - lr * mu * b
            pending = []
        assert state.tensors["w"].tobytes() == w.tobytes(), f"arrival {i + 1}"
        momenta.append(rule.state()[1].get("outer/b/w", np.zeros(6, F32)).tobytes())
    assert momenta[0] != momenta[1] == momenta[2] != momenta[3] == momenta[4] != momenta[5]
    assert state.version == 6 and rule.state()[0]["arrivals"] == 6


def test_over_n_arrivals_the_delayed_form_moves_as_one_synchronous_round():
    from plug_asgd.modes.diloco_async import AsyncDiLoCoRule

    sync_rule, sync_state = DiLoCoRule(), CentralState({"w": W0.copy()})
    async_rule, async_state = AsyncDiLoCoRule(), CentralState({"w": W0.copy()})
    for rule, state in ((sync_rule, sync_state), (async_rule, async_state)):
        rule.set_trainers(state, frozenset({0, 1}))
    for u0, u1 in ROUNDS:
        for rank, u in ((0, u0), (1, u1)):
            sync_rule.push(sync_state, Push(rank, rank, sync_state.version, {"w": u.copy()}))
            async_rule.push(async_state, Push(rank, rank, async_state.version, {"w": u.copy()}))
        np.testing.assert_allclose(async_state.tensors["w"], sync_state.tensors["w"], rtol=1e-5, atol=1e-6)


def test_a_worker_that_stops_training_mid_cycle_leaves_the_cycles_period_as_it_was():
    """2 workers; rank 0 pushes its last pseudo-gradient and stops training (its fit's end) before rank 1's arrives:
    the cycle keeps N = 2, so the two arrivals move the model as one synchronous round on their mean. Were N taken
    anew (1 after rank 0 left), rank 1's would be applied at lr and the momentum at the sum: 0.98x and 1.33x of
    the pseudo-gradients instead of 0.665x each (a threaded fit of the regression model ended at 57.2, not 10.9)."""
    from plug_asgd.modes.diloco_async import AsyncDiLoCoRule

    sync_rule, sync_state = DiLoCoRule(), CentralState({"w": W0.copy()})
    rule, state = AsyncDiLoCoRule(), CentralState({"w": W0.copy()})
    for r, s in ((sync_rule, sync_state), (rule, state)):
        r.set_trainers(s, frozenset({0, 1}))
    u0, u1 = ROUNDS[0]
    for r, s in ((sync_rule, sync_state), (rule, state)):
        r.push(s, Push(0, 0, 0, {"w": u0.copy()}))
    rule.set_trainers(state, frozenset({1}))  # rank 0's hello(training=False); sync's round waits for rank 1 anyway
    for r, s in ((sync_rule, sync_state), (rule, state)):
        r.push(s, Push(1, 1, 0, {"w": u1.copy()}))
    lr, mu = F32(0.7), F32(0.9)
    mean = -(np.zeros(6, F32) + u0 + u1) / F32(2)
    by_hand = W0 - lr * mean - lr * mu * mean
    np.testing.assert_allclose(state.tensors["w"], by_hand, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.tensors["w"], sync_state.tensors["w"], rtol=1e-5, atol=1e-6)
    # the next cycle keeps N = 2, the most workers that trained at once: rank 1's arrival applied at lr / 2, its
    # momentum not moved until a second arrival (at N = 1 it was applied whole, with the momentum, at once)
    before = state.tensors["w"].copy()
    b = rule.state()[1]["outer/b/w"].copy()
    rule.push(state, Push(2, 1, 1, {"w": ROUNDS[1][1].copy()}))
    assert rule.state()[0]["cycles"] == {"w": [2, 1]} and rule.state()[0]["peak"] == 2
    assert state.tensors["w"].tobytes() == (before - (lr / F32(2)) * (np.zeros(6, F32) + -ROUNDS[1][1])).tobytes()
    assert rule.state()[1]["outer/b/w"].tobytes() == b.tobytes()
    rule.set_trainers(state, frozenset())  # every worker has left: the next fit counts its own
    rule.set_trainers(state, frozenset({0}))
    assert rule.period == 1 and rule.state()[0]["peak"] == 1


def test_a_checkpoint_without_cycles_resumes_its_count_of_arrivals():
    """A PS checkpoint written before cycles were kept counts its pending arrivals from the arrivals and skips."""
    from plug_asgd.modes.diloco_async import AsyncDiLoCoRule

    rule, state = AsyncDiLoCoRule(), CentralState({"w": W0.copy()})
    rule.set_trainers(state, frozenset({0, 1}))
    rule.push(state, Push(0, 0, 0, {"w": ROUNDS[0][0].copy()}))  # one arrival of the cycle's 2
    fields, arrays = rule.state()
    old = {k: v for k, v in fields.items() if k != "cycles"}
    resumed, state2 = AsyncDiLoCoRule(), CentralState({"w": state.tensors["w"].copy()}, version=1)
    resumed.restore(old, arrays)
    for r, s in ((rule, state), (resumed, state2)):
        r.set_trainers(s, frozenset({0, 1}))
        for i, u in enumerate([ROUNDS[0][1], ROUNDS[1][0]]):  # the cycle closed, another begun
            r.push(s, Push(i + 1, (i + 1) % 2, s.version, {"w": u.copy()}))
    assert state2.tensors["w"].tobytes() == state.tensors["w"].tobytes()
    assert resumed.state()[0]["cycles"] == rule.state()[0]["cycles"] == {"w": [2, 1]}


def test_async_state_survives_a_checkpoint_and_its_knobs_are_checked():
    from plug_asgd import AsyncDiLoCo
    from plug_asgd.modes.diloco_async import AsyncDiLoCoRule

    rule, state = AsyncDiLoCoRule(delay=2), CentralState({"w": W0.copy()})
    for i, u in enumerate([u for pair in ROUNDS[:2] for u in pair][:3]):  # 3 arrivals: one pending in the sum
        rule.push(state, Push(i, 0, state.version, {"w": u.copy()}))
    resumed, state2 = AsyncDiLoCoRule(delay=2), CentralState({"w": state.tensors["w"].copy()}, version=3)
    resumed.restore(*rule.state())
    for r, s in ((rule, state), (resumed, state2)):
        for i, u in enumerate(ROUNDS[2]):
            r.push(s, Push(i, i, s.version, {"w": u.copy()}))
    assert state2.tensors["w"].tobytes() == state.tensors["w"].tobytes()
    with pytest.raises(ValueError, match="Nesterov's or SGD's"):
        AsyncDiLoCo(outer="adam")
    with pytest.raises(ValueError, match="delay must be"):
        AsyncDiLoCo(delay=0)
    mode = get({"name": "async_diloco", "inner_steps": 40, "delay": 3})
    assert mode.push_every == 40 and mode.make_rule({}).period == 3
