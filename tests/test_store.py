"""The store that serves (FastStore: lends, reuses frames and spares, copies on write) against the
plain copying one (ReferenceStore): the same push sequences end on the same bits, in every mode.

No socket: pushes are encoded and decoded as the PS receives them (each store its own frames,
since the fast one folds into them), shared-memory pushes name a real sealed segment of this
process, and replies are made and held as the serving loop does (a few still "in flight").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import zmq

from plug_asgd.compressors import QSGD, PowerSGD, Sign, native
from plug_asgd.modes import APPLIED, MODES
from plug_asgd.protocol import push_memory
from plug_asgd.protocol.push_memory import PushSegment
from plug_asgd.protocol.wire import Sparse, WireError, decode, encode
from plug_asgd.ps import PSConfig
from plug_asgd.ps.fast_store import FastStore
from plug_asgd.ps.reference_store import ReferenceStore
from plug_asgd.ps.store import Store
from plug_asgd.ps.store_records import FOLDED, NOT_CURRENT, PushIn

SHAPES = {"w": (24, 40), "b": (40,), "h": (3, 5)}
WORKERS = 3
STEPS = 150
KINDS = ("dense", "dense_shm", "sparse", "weights_shm", "weights", "stale_weights", "not_finite", "packed")
PACKING = (lambda: QSGD(bits=8), Sign, lambda: PowerSGD(rank=2))  # the codecs that send Packed tensors

needs_shm = pytest.mark.skipif(not push_memory.available(), reason="no sealed shared memory on this system")


@dataclass
class Token:
    session: str
    want: str  # "all" or "unless_own", as the client asks
    own_version: int | None = None  # as the serving loop notes it: the version this push alone made

    def own(self, status: str, version: int) -> bool:
        """Whether the serving loop answers "own" (no model): nothing but this push changed the model."""
        return status == APPLIED and self.want == "unless_own" and self.own_version == version


@dataclass
class Worker:
    rank: int
    session: str
    segment: PushSegment
    base: int = 0
    seq: int = 0
    waiting: bool = False
    turn: int = 0  # which of its two sets of shared buffers the next push writes
    lent: int | None = None  # the set its last push lent (weights_shm)

    def buffers(self) -> dict[str, np.ndarray]:
        """The set not lent by its last push (the strategy keeps two and alternates)."""
        self.turn ^= 1
        return {n: self.segment.buffers[f"{self.turn}:{n}"] for n in SHAPES}

    def answered(self) -> None:
        """Its push is answered: it may write any of its buffers but those that push lent (the PS holds
        them until it answers the next request), and does: NaN, which a store still reading them would keep."""
        for k in (0, 1):
            if k != self.lent:
                for n in SHAPES:
                    self.segment.buffers[f"{k}:{n}"][...] = np.nan


@dataclass
class Run:
    """One store and what the serving loop would keep around it."""

    store: Store
    replies: list[tuple[list[Any], dict[str, np.ndarray]]] = field(default_factory=list)  # still being sent
    answers: list[tuple[int, str, dict[str, np.ndarray]]] = field(default_factory=list)

    def answer(self, token: Token, status: str, request: int, own: bool) -> None:
        """As the serving loop answers: without the model (``own``), or with it (a reply still in flight)."""
        if own:
            self.store.before_answer(token.session, request)
            self.answers.append((self.store.version, status, {}))
            return
        payload = self.store.reply_payload({"rid": 1, "status": status})
        model = sent(payload)
        self.replies = [*self.replies[-2:], (payload, model)]
        self.answers.append((self.store.version, status, model))

    def check_replies(self) -> None:
        """What ZeroMQ would still be sending reads as it did when the reply was made."""
        for payload, model in self.replies:
            now = sent(payload)
            assert all(np.array_equal(now[n], t) for n, t in model.items())


def sent(payload: list[Any]) -> dict[str, np.ndarray]:
    """The model a reply's frames carry, copied out."""
    frames = [zmq.Frame(bytes(f.buffer if isinstance(f, zmq.Frame) else memoryview(f))) for f in payload]
    return {n: np.array(t) for n, t in decode(frames).tensors.items()}


def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def received(tensors: dict[str, Any], local: dict[str, int]) -> Any:
    """A push as the PS's socket hands it over: frames of its own, decoded."""
    frames = encode("push", {"rid": 1}, tensors, local=local or None)
    return decode([zmq.Frame(bytes(memoryview(f))) for f in frames])


def step(runs: list[Run], worker: Worker, kind: str, rng: np.random.Generator, request: int) -> list[Any]:
    """One push of ``worker`` to every store; the resolutions of each (or the refusal's code)."""
    version = runs[0].store.version
    local: dict[str, int] = {}
    weights = kind.startswith("weights") or kind == "stale_weights"
    if kind == "sparse":
        tensors: dict[str, Any] = {}
        for n, s in SHAPES.items():
            idx = np.sort(rng.choice(int(np.prod(s)), size=max(1, int(np.prod(s)) // 10), replace=False))
            tensors[n] = Sparse(idx, rng.standard_normal(idx.size).astype(np.float32), s)
    elif kind == "packed":  # folded in one pass by the fast store (test_fused.py), decoded by the reference
        codec = PACKING[rng.integers(len(PACKING))]()
        tensors = {n: codec.encode(n, (rng.standard_normal(s) * 0.01).astype(np.float32)) for n, s in SHAPES.items()}
    else:
        tensors = {n: (rng.standard_normal(s) * (1.0 if weights else 0.01)).astype(np.float32)
                   for n, s in SHAPES.items()}
        if kind == "not_finite":
            tensors["b"][3] = np.nan
    if kind in ("dense_shm", "weights_shm"):
        buffers = worker.buffers()
        for n, t in tensors.items():
            buffers[n][...] = t
        tensors = buffers
        local = {n: worker.segment.offset(b) for n, b in buffers.items()}
    worker.lent = worker.turn if kind == "weights_shm" else None
    base = worker.base if kind != "stale_weights" else max(0, version - 1)
    worker.seq += 1
    token = Token(worker.session, "unless_own" if rng.random() < 0.5 else "all")
    outcomes = []
    for run in runs:
        msg = received(tensors, local)
        push = PushIn(token, worker.rank, worker.session, worker.seq, base, msg.tensors, msg.frames,
                      weights=weights, lend=kind == "weights_shm", request=request)
        try:
            folded = run.store.fold(push)
        except WireError as exc:
            run.store.before_answer(worker.session, request)
            outcomes.append(exc.code)
            continue
        token.own_version = folded.own_version
        if folded.status != FOLDED:
            run.answer(token, folded.status, request, own=folded.status == NOT_CURRENT)
        for tok, status in folded.resolutions:
            run.answer(tok, status, request, own=tok.own(status, run.store.version))
        outcomes.append((folded.status, folded.own_version, folded.staleness,
                         [(t.session, s) for t, s in folded.resolutions]))
    return outcomes


def assert_same(runs: list[Run]) -> None:
    ref, fast = (r.store for r in runs)
    for run in runs:
        run.check_replies()
    assert ref.version == fast.version
    assert ref.state.tensors.keys() == fast.state.tensors.keys()
    for n, t in ref.state.tensors.items():
        assert np.array_equal(t, fast.state.tensors[n]), n
    assert len(runs[0].answers) == len(runs[1].answers)
    for (v1, s1, m1), (v2, s2, m2) in zip(runs[0].answers, runs[1].answers, strict=True):
        assert (v1, s1, m1.keys()) == (v2, s2, m2.keys())
        assert all(np.array_equal(m1[n], m2[n]) for n in m1)


@needs_shm
@pytest.mark.parametrize("max_updates", [None, 25])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_both_stores_end_every_push_sequence_on_the_same_bits(mode, max_updates):
    config = PSConfig(mode=mode, max_updates=max_updates, staleness_bound=1 if mode == "ssp" else None)
    runs = [Run(ReferenceStore(config)), Run(FastStore(config, copy_threshold=0))]
    rng = np.random.default_rng(sum(map(ord, mode)))
    workers = [Worker(r, f"session-{r}", PushSegment({f"{k}:{n}": (s, np.float32) for n, s in SHAPES.items()
                                                      for k in (0, 1)})) for r in range(WORKERS)]
    try:
        for run in runs:
            assert run.store.init(initial())
            for w in workers:
                run.store.attach(w.session, os.getpid(), w.segment.fd, w.segment.token)
        trainers = frozenset(range(WORKERS))
        for run in runs:
            assert run.store.set_trainers(trainers) == []
        for request in range(1, STEPS + 1):
            if request in (STEPS // 3, 2 * STEPS // 3):  # a worker stops training, then comes back
                trainers = frozenset(range(WORKERS - 1)) if len(trainers) == WORKERS else frozenset(range(WORKERS))
                outcomes = []
                for run in runs:
                    resolutions = run.store.set_trainers(trainers)
                    for tok, status in resolutions:
                        run.answer(tok, status, request, own=tok.own(status, run.store.version))
                    outcomes.append([(t.session, s) for t, s in resolutions])
                assert outcomes[0] == outcomes[1]
                free_now = {s for s, _ in outcomes[0]}
                for w in workers:
                    if w.session in free_now:
                        w.waiting, w.base = False, runs[0].store.version
                        w.answered()
            ready = [w for w in workers if not w.waiting and w.rank in trainers]
            if not ready:
                continue
            worker = ready[rng.integers(len(ready))]
            kind = KINDS[rng.choice(len(KINDS), p=[0.2, 0.2, 0.15, 0.15, 0.1, 0.05, 0.05, 0.1])]
            before = runs[0].store.version
            ref, fast = step(runs, worker, kind, rng, request)
            assert ref == fast, (request, kind)
            if isinstance(ref, str):  # refused: the worker goes on from where it was
                worker.answered()
                continue
            status, _, _, resolutions = ref
            mine = [s for sess, s in resolutions if sess == worker.session]
            if status != FOLDED or mine:
                worker.base = runs[0].store.version
                worker.answered()
            else:
                worker.waiting = True  # held: a sync round, or ssp's bound
            for w in workers:
                if w is not worker and any(sess == w.session for sess, _ in resolutions):
                    w.waiting, w.base = False, runs[0].store.version
                    w.answered()
            assert_same(runs)  # (after the workers wrote their buffers again)
            assert runs[0].store.version >= before
        assert runs[0].store.version > 0
        snaps = [run.store.snapshot() for run in runs]
        assert snaps[0].version == snaps[1].version and snaps[0].last_seq == snaps[1].last_seq
        assert all(np.array_equal(snaps[0].tensors[n], snaps[1].tensors[n]) for n in SHAPES)
        if MODES[mode]().folds_into_update and max_updates is None:  # the sequences reached the fast paths
            stats = runs[1].store.stats
            assert stats.weights_lent > 0 and stats.weights_pushes > 0 and stats.weights_not_current > 0
    finally:
        for run in runs:
            run.replies.clear()
            run.store.close()
        for w in workers:
            w.segment.close()


@pytest.mark.parametrize("mode", ["asgd", "dynsgd", "ssp", "adacomp"])
def test_the_fast_store_folds_packed_pushes_without_decoding_them_where_its_rule_folds(monkeypatch, mode):
    calls: list[str] = []
    for codec in (QSGD, Sign, PowerSGD):
        original = codec.decode_packed.__func__  # type: ignore[attr-defined]
        monkeypatch.setattr(codec, "decode_packed", classmethod(
            lambda cls, packed, dtype, _f=original: calls.append(packed.codec) or _f(cls, packed, dtype)))
    config = PSConfig(mode=mode)
    stores = [ReferenceStore(config), FastStore(config)]
    rng = np.random.default_rng(4)
    for store in stores:
        store.init(initial())
    decoded = []
    for seq, codec in enumerate([QSGD(bits=8), Sign(), PowerSGD(rank=2)] * 2, start=1):
        tensors = {n: codec.encode(n, (rng.standard_normal(s) * 0.01).astype(np.float32)) for n, s in SHAPES.items()}
        for store in stores:
            calls.clear()
            msg = received(tensors, {})
            store.fold(PushIn(None, 0, "s", seq, store.version, msg.tensors, msg.frames, request=seq))
            decoded.append(len(calls))
        assert all(np.array_equal(stores[0].state.tensors[n], stores[1].state.tensors[n]) for n in SHAPES)
    packed_tensors = [3, 3, 1] * 2  # PowerSGD packs "w" alone: the others are smaller dense
    if native.library() is not None and mode != "adacomp":  # adacomp's rule scales per coordinate: it decodes
        assert decoded == [x for n in packed_tensors for x in (n, 0)]
    else:
        assert decoded == [x for n in packed_tensors for x in (n, n)]
