"""Streaming DiLoCo (``fragments=F`` on diloco and async_diloco): the split of the synced tensors, the staggered
schedule through a real PS (which tensors each push carried, at which local step, and the merge of each reply),
the rule's rounds of one fragment by hand bit for bit, per-fragment state through a checkpoint, and the bytes of a
push against a whole one's."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from plug_asgd import AsyncDiLoCo, DiLoCo, OuterOptimizer
from plug_asgd.compressors import get as get_codec
from plug_asgd.modes import APPLIED, DROPPED, CentralState, Push, get
from plug_asgd.modes.diloco import DiLoCoRule
from plug_asgd.modes.diloco_async import AsyncDiLoCoRule
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.exchange import Link, make_exchange
from plug_asgd.worker.exchange.fragments import FragmentExchange, offsets, split
from plug_asgd.worker.exchange.push import PushExchange
from plug_asgd.worker.tensors import synced_tensors
from tests.conftest import in_process_ps

F32 = np.float32
SHAPES = {"l1.weight": (64, 32), "l1.bias": (64,), "l2.weight": (32, 64), "l2.bias": (32,)}
# the split of SHAPES in 2: each tensor to the fragment of the fewest elements so far (the first of equals)
HALVES = [["l1.weight", "l2.bias"], ["l1.bias", "l2.weight"]]


# -- the knobs -------------------------------------------------------------------------------------------------------


def test_fragments_is_a_knob_of_both_modes_and_one_keeps_the_push_exchange():
    assert DiLoCo().fragments == 1 and DiLoCo().exchange == "push"
    assert AsyncDiLoCo().fragments == 1 and AsyncDiLoCo().exchange == "push"
    mode = get({"name": "diloco", "inner_steps": 8, "fragments": 4})
    assert mode.exchange == "fragments" and mode.config()["fragments"] == 4
    assert isinstance(make_exchange(mode), FragmentExchange)
    assert isinstance(make_exchange(AsyncDiLoCo(inner_steps=8, fragments=2)), FragmentExchange)
    assert type(make_exchange(DiLoCo(inner_steps=8))) is PushExchange
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="fragments must be a whole number"):
            DiLoCo(fragments=bad)
    with pytest.raises(ValueError, match="fragments <= inner_steps"):
        AsyncDiLoCo(inner_steps=3, fragments=4)


# -- (b) the split ---------------------------------------------------------------------------------------------------


def test_the_split_is_disjoint_covers_every_tensor_and_is_balanced_within_the_largest_tensor():
    module = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                 torch.nn.Linear(32, 16), torch.nn.Linear(16, 2))
    model_sizes = {n: t.numel() for n, t in synced_tensors(module).items()}
    rng = np.random.default_rng(3)
    cases = [model_sizes] + [{f"t{i}": int(rng.integers(1, 5000)) for i in range(int(rng.integers(8, 40)))}
                             for _ in range(50)]
    for sizes in cases:
        for fragments in range(1, 9):
            groups = split(sizes, fragments)
            flat = [n for g in groups for n in g]
            assert sorted(flat) == sorted(sizes) and len(flat) == len(set(flat))  # disjoint, covering
            assert all(groups)
            loads = [sum(sizes[n] for n in g) for g in groups]
            assert max(loads) - min(loads) <= max(sizes.values())
            for g in groups:  # each group keeps the synced tensors' order
                assert g == sorted(g, key=list(sizes).index)
            assert split(dict(sizes), fragments) == groups  # the same on every worker
    assert split({n: int(np.prod(s)) for n, s in SHAPES.items()}, 2) == HALVES
    with pytest.raises(ValueError, match="choose at most that many fragments"):
        split({"a": 3, "b": 4}, 3)


def test_the_staggered_offsets_and_the_gaps_between_fragments():
    assert offsets(8, 2) == [0, 4] and offsets(10, 3) == [0, 3, 6] and offsets(4, 4) == [0, 1, 2, 3]
    exchange = make_exchange(AsyncDiLoCo(inner_steps=10, fragments=3))
    exchange.start_fit([], 0, 2)
    assert [exchange.gap(f) for f in range(3)] == [3, 3, 4]  # pushes at 3, 6, 10, 13, 16, 20, ...
    exchange.steps_per_push = 4  # a slower worker's shortened rounds (dynamic_steps), staggered alike
    assert [exchange.gap(f) for f in range(3)] == [1, 1, 2]
    exchange.steps_per_push = 2  # fewer steps than fragments: one a step
    assert [exchange.gap(f) for f in range(3)] == [1, 1, 1]


# -- (c) the schedule through a real PS, (e) the bytes -------------------------------------------------------------


class Recording:
    """A PSClient that records each push: its base version, the tensors it carried, its frame bytes, the reply (its
    bytes, the tensors it carried where it is a delta)."""

    def __init__(self, client: PSClient, log: list) -> None:
        self._client, self.log = client, log

    def __getattr__(self, name):
        return getattr(self._client, name)

    def push(self, base_version, update, **kwargs):
        counters = self._client.counters
        up, down = counters.push_bytes_up, counters.bytes_down
        reply = self._client.push(base_version, update, **kwargs)
        self.log.append(SimpleNamespace(base=base_version, names=sorted(update), status=reply.status,
                                        version=reply.version, bytes=counters.push_bytes_up - up,
                                        down=counters.bytes_down - down,
                                        sent_back=None if reply.changed is None else sorted(reply.changed.indices),
                                        part=reply.part, returned=sorted(reply.tensors)))
        return reply


def step_of(rank: int, t: int) -> dict[str, torch.Tensor]:
    """What worker ``rank``'s local step ``t`` adds to its weights (an inner optimizer's step, made up)."""
    g = torch.Generator().manual_seed(1000 * rank + t)
    return {n: 0.01 * torch.randn(s, generator=g) for n, s in SHAPES.items()}


def join_worker(address: str, mode, rank: int, world: int, codec: str = "none"):
    """A worker of ``mode`` joined to the PS at ``address`` (rank 0 initialises it), its weights made the same on
    every rank: its client, exchange, push log and weights."""
    client = PSClient(address, rank=rank, world_size=world, mode=mode.name, request_timeout=30, heartbeat_s=None)
    client.hello(stage=1, training=True, timeout=20)
    g = torch.Generator().manual_seed(42)  # the same initial model on every rank
    tensors = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    log: list = []
    exchange = make_exchange(mode, codec=get_codec(codec), shm_pushes=False)
    exchange.attach(Link(client=Recording(client, log), tensors=lambda: tensors, rank=rank,  # type: ignore[arg-type]
                         world_size=world, stage=1, fitting=True, barrier=lambda name: None, stop=lambda: None))
    exchange.start_fit([torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)], rank, world)
    exchange.join(init=rank == 0)
    return client, exchange, log, tensors


def take_step(exchange, tensors: dict[str, torch.Tensor], rank: int, t: int) -> None:
    """Worker ``rank``'s local step ``t`` (:func:`step_of`) through its exchange."""
    delta = step_of(rank, t)

    def run() -> None:
        with torch.no_grad():
            for name, w in tensors.items():
                w.add_(delta[name])

    exchange.step(run, exchange.optimizers[0])


def fit(mode, steps: int, codec: str = "none", end: str = "finish", threads: bool = False):
    """Two workers of ``mode`` against an in-process PS. Stepped in turn from this thread (each push goes from a
    thread of its worker's exchange, and a sync round completes once both pushed), or (``threads``: for F = 1,
    whose push waits for its round) each from a thread of its own; then each takes its last reply
    (``end="finish"``), or flushes (``"flush"``, both at once: a flush's rounds wait for the other worker).
    Returns the workers (exchange, push log, weights) and the PS's central model and rule."""
    workers, clients = [], []
    with in_process_ps(mode.name, shm_pushes=False) as server:
        try:
            for rank in (0, 1):
                client, exchange, log, tensors = join_worker(server.address, mode, rank, 2, codec)
                clients.append(client)
                workers.append((exchange, log, tensors))

            def step(rank: int, t: int) -> None:
                exchange, _, tensors = workers[rank]
                take_step(exchange, tensors, rank, t)
                if isinstance(exchange, FragmentExchange):  # sent from a thread from the first fragment's step on
                    assert exchange.fragment_pushes > 0 or t < exchange.gap(0)

            def whole(rank: int) -> None:
                for t in range(1, steps + 1):
                    step(rank, t)
                getattr(workers[rank][0], end)()

            if not threads:
                for t in range(1, steps + 1):
                    for rank in (0, 1):
                        step(rank, t)
            errors: list[BaseException] = []

            def each(rank: int) -> None:
                try:
                    whole(rank) if threads else getattr(workers[rank][0], end)()
                except BaseException as exc:  # re-raised below
                    errors.append(exc)

            runs = [threading.Thread(target=each, args=(r,)) for r in (0, 1)]
            for run in runs:
                run.start()
            for run in runs:
                run.join(60)
            assert not errors and not any(run.is_alive() for run in runs), errors
            return workers, clients[0].pull(), server.store.rule
        finally:
            for client in clients:
                client.close()


@pytest.mark.integration
@pytest.mark.parametrize("mode", [DiLoCo(inner_steps=4, fragments=2),
                                  AsyncDiLoCo(inner_steps=4, fragments=2, dynamic_steps=False)],
                         ids=["diloco", "async_diloco"])
def test_fragments_are_synced_at_their_staggered_steps_and_merged_keeping_the_progress(mode):
    """H = 4, F = 2: fragment 1 at steps 2, 6, 10, fragment 0 at 4, 8, 12, each push carrying its fragment's
    tensors only, based on the version its fragment's base came from; no push dropped (a sync push's base is older
    than the round of the other fragment that came between). After the last replies, a worker's fragment 0 is its
    reply's model and fragment 1 its reply's plus steps 11 and 12 (made since it was sent); the reply to each
    fragment's last push (sync: every worker's) carried the final central tensors of that fragment."""
    workers, central, rule = fit(mode, steps=12)
    by_fragment = HALVES
    for rank, (exchange, log, tensors) in enumerate(workers):
        assert exchange.fragments == by_fragment
        assert exchange.stats()["fragment_trace"] == [(2, 1), (4, 0), (6, 1), (8, 0), (10, 1), (12, 0)]
        assert [p.names for p in log] == [sorted(by_fragment[f]) for f in (1, 0, 1, 0, 1, 0)]
        assert all(p.status == APPLIED for p in log)
        if isinstance(mode, DiLoCo):  # one round per push, in turn: the versions each fragment's base came from
            assert [p.base for p in log] == [0, 0, 1, 2, 3, 4] and [p.version for p in log] == [1, 2, 3, 4, 5, 6]
        for name in by_fragment[0]:  # merged at step 12's reply, no step since: the reply's model
            assert tensors[name].numpy().tobytes() == exchange.base[name].numpy().tobytes()
        for name in by_fragment[1]:  # sent at step 10, merged at 12: the reply's model plus steps 11 and 12
            progress = step_of(rank, 11)[name] + step_of(rank, 12)[name]
            np.testing.assert_allclose(tensors[name] - exchange.base[name], progress, rtol=0, atol=1e-6)
    for fragment in (0, 1):  # the reply to a fragment's last push (sync: both) carried its final central tensors
        last = max(p.version for _, log, _ in workers for p in log if p.names == sorted(by_fragment[fragment]))
        for exchange, log, _ in workers:
            if isinstance(mode, DiLoCo) or [p.version for p in log if p.names == sorted(by_fragment[fragment])][-1] \
                    == last:
                for name in by_fragment[fragment]:
                    assert exchange.base[name].numpy().tobytes() == central.tensors[name].tobytes()
    if isinstance(rule, DiLoCoRule):  # 6 rounds, 3 of each fragment: each tensor's outer steps its fragment's
        assert rule.outer_steps == 6 and rule.skipped == {n: 3 for n in SHAPES}
    else:  # 12 arrivals, 6 carrying each tensor: its momentum moved 3 times, every 2 of them
        assert rule.arrivals == 12 and rule.skipped == {n: 6 for n in SHAPES}


@pytest.mark.integration
def test_a_fragments_reply_that_came_during_a_step_is_merged_after_that_step_not_when_the_next_is_due():
    """One async_diloco worker (H = 8, F = 2) on an in-process PS: fragment 1 goes at step 4, and its reply is waited
    for before step 5. After step 5 it is merged (fragment 0 is due at step 8 only): nothing in flight, fragment 1's
    base is the central model and its weights that plus step 5's progress; fragment 0 untouched. The reply was a part
    of fragment 1's tensors only, and the client keeps the held model it had (the init's)."""
    mode = AsyncDiLoCo(inner_steps=8, fragments=2, dynamic_steps=False, momentum_lookahead=False)
    with in_process_ps(mode.name, shm_pushes=False) as server:
        client, exchange, log, tensors = join_worker(server.address, mode, 0, 1)
        try:
            held = client.held.have
            for t in range(1, 5):
                take_step(exchange, tensors, 0, t)
            assert exchange.pending is not None and exchange.fragment_trace == [(4, 1)]
            exchange.pending[0].thread.join(30)  # the reply is in before step 5
            before = {n: exchange.base[n].clone() for n in HALVES[0]}
            take_step(exchange, tensors, 0, 5)
            assert exchange.pending is None and exchange.fragment_trace == [(4, 1)]
            (push,) = log
            assert push.part and push.returned == sorted(HALVES[1]) and client.held.have == held
            central = client.pull().tensors
            for name in HALVES[1]:  # merged: the central fragment, and the progress made since it was sent
                assert exchange.base[name].numpy().tobytes() == central[name].tobytes()
                np.testing.assert_allclose(tensors[name] - exchange.base[name], step_of(0, 5)[name], rtol=0,
                                           atol=1e-6)
            for name in HALVES[0]:  # not pushed yet: its base as it was, its weights every step since
                assert exchange.base[name].numpy().tobytes() == before[name].numpy().tobytes()
                np.testing.assert_allclose(tensors[name] - exchange.base[name],
                                           sum(step_of(0, t)[name] for t in range(1, 6)), rtol=0, atol=1e-6)
        finally:
            client.close()


@pytest.mark.integration
def test_a_flush_pushes_every_fragment_with_steps_not_pushed_and_leaves_every_base_central():
    """Stopping at step 5 (fragment 0 pushed at 4, its reply in flight): the flush merges it, then pushes fragment
    1 (steps 3 to 5) and fragment 0 (step 5), each a round of both workers; the weights are then the central
    model."""
    workers, central, rule = fit(DiLoCo(inner_steps=4, fragments=2), steps=5, end="flush")
    for _, log, tensors in workers:
        assert [p.names for p in log] == [sorted(HALVES[f]) for f in (1, 0, 1, 0)]
        assert all(p.status == APPLIED for p in log) and [p.version for p in log] == [1, 2, 3, 4]
        for name, t in tensors.items():
            assert t.numpy().tobytes() == central.tensors[name].tobytes()
    assert rule.outer_steps == 4 and central.version == 4


@pytest.mark.integration
@pytest.mark.parametrize("codec", ["none", "fp16"])
def test_a_fragments_push_carries_about_one_fragment_of_a_whole_pushs_bytes(codec):
    """F = 2: each push's frame bytes against the whole push of diloco at F = 1 (same tensors, same codec): about
    half, and a fragment of each pushes together what the whole one does (less one frame's header). The replies
    too: each carries its fragment's tensors only (``part``), not the whole model."""
    whole, _, _ = fit(DiLoCo(inner_steps=4), steps=8, codec=codec, threads=True)
    whole_bytes = [p.bytes for p in whole[0][1]]
    assert len(whole_bytes) == 2 and abs(whole_bytes[0] - whole_bytes[1]) < 64  # (the headers' numbers)
    parts, _, _ = fit(DiLoCo(inner_steps=4, fragments=2), steps=8, codec=codec, threads=True)
    part_bytes = [p.bytes for p in parts[0][1]]
    assert len(part_bytes) == 4
    sizes = {n: int(np.prod(s)) for n, s in SHAPES.items()}
    itemsize = 2 if codec == "fp16" else 4
    for p, nbytes in zip(parts[0][1], part_bytes, strict=True):
        tensor_bytes = sum(sizes[n] for n in p.names) * itemsize
        assert tensor_bytes <= nbytes < tensor_bytes + 1024  # its tensors, and a header
        assert 0.45 < nbytes / whole_bytes[0] < 0.55
    assert abs(part_bytes[0] + part_bytes[1] - whole_bytes[0]) < 1024
    whole_down = whole[0][1][0].down
    assert all(p.sent_back is None and not p.part for p in whole[0][1])  # (F = 1: the whole model, as before)
    for p in parts[0][1]:
        assert p.part and p.returned == p.names and p.sent_back is None  # the fragment, whole
        assert sum(sizes[n] for n in p.names) * 4 <= p.down < sum(sizes[n] for n in p.names) * 4 + 1024
        assert 0.45 < p.down / whole_down < 0.55


# -- (d) the rule's rounds of one fragment, by hand ----------------------------------------------------------------


RNG = np.random.default_rng(11)
A0, B0 = RNG.standard_normal(5).astype(F32), RNG.standard_normal(3).astype(F32)


def nesterov(w: np.ndarray, b: np.ndarray | None, u0: np.ndarray, u1: np.ndarray, lr=0.7, mu=0.9):
    g = -((np.zeros_like(w) + u0 + u1) / F32(2))
    b = g.copy() if b is None else b * F32(mu) + g
    return w - F32(lr) * (g + F32(mu) * b), b


def test_two_fragments_rounds_step_only_their_tensors_by_hand_bit_for_bit():
    """Fragments {b} and {a} in turn (b's rounds first, as fragment 1 is due first), two workers, Nesterov: each
    round is the outer step of its own tensor on the mean of the two pushes, with its own momentum; the other tensor,
    its momentum and its step count are left as they are. A push based on the version its fragment's base came
    from is current though the other fragment's round came between; one based on a version older than its own
    fragment's last round is dropped."""
    rule = DiLoCoRule()
    state = CentralState({"a": A0.copy(), "b": B0.copy()})
    rule.set_trainers(state, frozenset({0, 1}))
    w = {"a": A0.copy(), "b": B0.copy()}
    momentum: dict[str, np.ndarray | None] = {"a": None, "b": None}
    based = {"a": 0, "b": 0}  # the version each fragment's base came from
    rng = np.random.default_rng(5)
    for r in range(6):
        name = "b" if r % 2 == 0 else "a"
        u0, u1 = (rng.standard_normal(w[name].size).astype(F32) * F32(0.1) for _ in range(2))
        other = "a" if name == "b" else "b"
        before = state.tensors[other].tobytes(), rule.slots.get(other, {}).get("b", np.zeros(0)).tobytes()
        assert rule.push(state, Push("x", 1, based[name], {name: u1.copy()})) == []
        done = rule.push(state, Push("y", 0, based[name], {name: u0.copy()}))
        assert sorted(done) == [("x", APPLIED), ("y", APPLIED)] and state.version == r + 1
        w[name], momentum[name] = nesterov(w[name], momentum[name], u0, u1)
        based[name] = state.version
        assert state.tensors[name].tobytes() == w[name].tobytes(), f"round {r + 1}"
        assert rule.slots[name]["b"].tobytes() == momentum[name].tobytes()
        assert (state.tensors[other].tobytes(), rule.slots.get(other, {}).get("b", np.zeros(0)).tobytes()) == before
    assert rule.outer_steps == 6 and rule.skipped == {"a": 3, "b": 3}
    # a push of "a" based before a's last round (version 6): stale, dropped; of "b" on its base (5): current
    assert rule.push(state, Push("z", 0, 4, {"a": np.zeros(5, F32)})) == [("z", DROPPED)]
    assert rule.push(state, Push("z", 0, 5, {"b": np.zeros(3, F32)})) == []
    # with every tensor in every push, sync's rule: only the current version
    assert rule.push(state, Push("q", 1, 5, {"a": np.zeros(5, F32), "b": np.zeros(3, F32)})) == [("q", DROPPED)]


def test_adams_bias_correction_counts_each_fragments_own_steps():
    """Adam on two fragments in turn: each tensor as torch's Adam stepping it alone (its own step count)."""
    outer = OuterOptimizer("adam", lr=0.01)
    rule, state = DiLoCoRule(outer=outer), CentralState({"a": A0.copy(), "b": B0.copy()})
    rule.set_trainers(state, frozenset({0}))
    params = {n: torch.nn.Parameter(torch.from_numpy(state.tensors[n].copy())) for n in ("a", "b")}
    opts = {n: torch.optim.Adam([p], lr=outer.lr, betas=(outer.beta1, outer.beta2), eps=outer.eps, foreach=False)
            for n, p in params.items()}
    rng = np.random.default_rng(9)
    for name in ("b", "a", "b", "b", "a"):  # uneven: b three times, a twice
        u = rng.standard_normal(params[name].numel()).astype(F32) * F32(0.1)
        rule.push(state, Push("t", 0, state.version, {name: u.copy()}))
        params[name].grad = torch.from_numpy(-u)
        opts[name].step()
    for name, p in params.items():
        np.testing.assert_allclose(state.tensors[name], p.detach().numpy(), rtol=1e-6, atol=1e-7)
    assert rule.outer_steps - rule.skipped["a"] == 2 and rule.outer_steps - rule.skipped["b"] == 3


def test_async_diloco_moves_a_fragments_momentum_every_delay_arrivals_of_that_fragment():
    """Arrivals b, a, b, a, ... of 2 workers (delay 2): b's momentum moves at b's 2nd and 4th arrivals, a's at
    a's; an arrival of one fragment leaves the other's tensor, sum and momentum as they are."""
    rule, state = AsyncDiLoCoRule(), CentralState({"a": A0.copy(), "b": B0.copy()})
    rule.set_trainers(state, frozenset({0, 1}))
    lr, mu, n = F32(0.7), F32(0.9), F32(2)
    w = {"a": A0.copy(), "b": B0.copy()}
    b: dict[str, np.ndarray | None] = {"a": None, "b": None}
    pending: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    rng = np.random.default_rng(4)
    for i, name in enumerate("bbaabbaa"):
        u = rng.standard_normal(w[name].size).astype(F32) * F32(0.1)
        other = "a" if name == "b" else "b"
        before = state.tensors[other].tobytes()
        rule.push(state, Push(i, i % 2, state.version, {name: u.copy()}))
        g = np.zeros_like(w[name]) + -u
        w[name] = w[name] - (lr / n) * g
        pending[name].append(g)
        if len(pending[name]) == 2:
            mean = (np.zeros_like(w[name]) + pending[name][0] + pending[name][1]) / n
            b[name] = mean.copy() if b[name] is None else b[name] * mu + mean
            w[name] = w[name] - lr * mu * b[name]
            pending[name] = []
        assert state.tensors[name].tobytes() == w[name].tobytes(), f"arrival {i + 1}"
        assert state.tensors[other].tobytes() == before
    assert rule.arrivals == 8 and rule.skipped == {"a": 4, "b": 4}


def test_per_fragment_state_survives_a_checkpoint_to_the_bit():
    """Mid-run (b's round done, a's pending push held): a rule restored from its state goes on as the first does,
    both the synchronous and the asynchronous one; an old checkpoint without the fields restores as before."""
    rng = np.random.default_rng(2)
    script = [(name, rank, rng.standard_normal(5 if name == "a" else 3).astype(F32) * F32(0.1))
              for name in "babab" for rank in (0, 1)]

    def play(rule, state, moves, based):
        for name, rank, u in moves:
            rule.push(state, Push((name, rank), rank, based.get(name, 0), {name: u.copy()}))
            if rank == 1 and isinstance(rule, DiLoCoRule):
                based[name] = state.version

    for make in (lambda: DiLoCoRule(outer=OuterOptimizer("adam", lr=0.01)), AsyncDiLoCoRule):
        rule, state, based = make(), CentralState({"a": A0.copy(), "b": B0.copy()}), {}
        rule.set_trainers(state, frozenset({0, 1}))
        play(rule, state, script[:5], based)
        fields, arrays = rule.state()
        resumed = make()
        state2 = CentralState({n: t.copy() for n, t in state.tensors.items()}, version=state.version)
        resumed.restore(fields, {k: np.array(v) for k, v in arrays.items()})
        resumed.set_trainers(state2, frozenset({0, 1}))
        play(rule, state, script[5:], dict(based))
        play(resumed, state2, script[5:], dict(based))
        for name in ("a", "b"):
            assert state2.tensors[name].tobytes() == state.tensors[name].tobytes()
        assert resumed.skipped == rule.skipped
    old = {k: v for k, v in DiLoCoRule().state()[0].items() if k not in ("skipped", "changed_at", "floor")}
    rule = DiLoCoRule()
    rule.restore(old, {})
    assert rule.skipped == {} and rule.changed_at == {} and rule.floor is None


# -- through the strategy: a Lightning fit -------------------------------------------------------------------------


@pytest.mark.integration
def test_a_lightning_fit_syncs_fragments_validates_on_the_central_model_and_ends_on_it():
    """One worker, an embedded PS, diloco with 8 inner steps in 2 fragments, 20 steps with a validation after 12:
    fragment 1 at steps 4, 12 and 20, fragment 0 at 8 and 16 (the flushes of the validation and of the fit's end
    between); the fit ends on the central model."""
    import pytorch_lightning as pl

    from plug_asgd import AsyncPSStrategy
    from tests.test_strategy import Tiny, data

    class TwoLayers(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    strategy = AsyncPSStrategy(mode=DiLoCo(inner_steps=8, fragments=2))
    try:
        pl.seed_everything(5)
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, val_check_interval=12,
                             num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False)
        module = TwoLayers()
        trainer.fit(module, data(), data(64))
        trace = strategy._exchange.stats()["fragment_trace"]
        # 4 and 8 on schedule; 12: fragment 1 due (pushed), then the validation's flush pushes fragment 0 (steps
        # 9 to 12); 16: fragment 0 due, 20: fragment 1 due; the end's flush pushes fragment 0's steps 17 to 20
        assert trace == [(4, 1), (8, 0), (12, 1), (12, 0), (16, 0), (20, 1), (20, 0)], trace
        central = strategy.connection.client.pull()
        assert central.version == 7
        for name, p in module.named_parameters():
            assert p.detach().numpy().tobytes() == central.tensors[name].tobytes()
    finally:
        strategy._shutdown(wait_for_workers=0)


def test_the_change_log_sends_a_worker_the_tensors_of_the_rounds_since_its_model():
    """A round of one fragment logs its tensors (the PS's replies carry those only); a round of every tensor, as
    at fragments=1, clears the log as before (the whole model)."""
    from plug_asgd.ps.changes import ChangeLog

    central = {"a": np.ones(3, F32), "b": np.zeros(2, F32), "c": np.zeros(4, F32)}
    log = ChangeLog()
    log.reset(0)
    log.tensors(1, frozenset({"a"}))
    log.tensors(2, frozenset({"b"}))
    assert sorted(log.delta((log.model_id, 0), 2, central)) == ["a", "b"]
    assert list(log.delta((log.model_id, 1), 2, central)) == ["b"] and log.delta((log.model_id, 2), 2, central) == {}
    rule, state = DiLoCoRule(), CentralState({n: t.copy() for n, t in central.items()})
    rule.set_trainers(state, frozenset({0}))
    rule.push(state, Push(0, 0, 0, {"a": np.ones(3, F32), "c": np.ones(4, F32)}))
    assert rule.changed() == {"a", "c"}
    rule.push(state, Push(0, 0, 1, {n: np.ones_like(t) for n, t in central.items()}))
    assert rule.changed() is None  # every tensor: the PS logs everything, as it did
