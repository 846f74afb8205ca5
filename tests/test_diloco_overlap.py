"""``overlap=True`` on diloco and async_diloco with one fragment: the whole model's push sent from a thread while the
inner steps go on, its reply merged after the first step that ends with it arrived, keeping the steps made since.
Through a real PS: the pushes' steps and tensors, the central model of each round against the outer step by hand,
and the merge of a reply that came during a step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plug_asgd import AsyncDiLoCo, DiLoCo
from plug_asgd.modes import APPLIED
from plug_asgd.worker.exchange import make_exchange
from plug_asgd.worker.exchange.fragments import FragmentExchange
from plug_asgd.worker.exchange.push import PushExchange
from tests.conftest import in_process_ps
from tests.test_diloco import by_hand
from tests.test_diloco_fragments import SHAPES, fit, join_worker, step_of, take_step

F32 = np.float32
ALL = sorted(SHAPES)


def test_overlap_takes_streamings_exchange_with_one_fragment_and_is_a_bool():
    for mode in (DiLoCo(inner_steps=8, overlap=True), AsyncDiLoCo(inner_steps=8, overlap=True)):
        exchange = make_exchange(mode)
        assert mode.exchange == "fragments" and isinstance(exchange, FragmentExchange) and exchange.count == 1
        assert mode.config()["overlap"] is True
    assert type(make_exchange(DiLoCo(inner_steps=8))) is PushExchange  # (the default: the worker waits)
    with pytest.raises(ValueError, match="overlap must be True or False"):
        DiLoCo(overlap=1)
    with pytest.raises(ValueError, match="pull_every stays unset"):
        AsyncDiLoCo(overlap=True, pull_every=4)


@pytest.mark.integration
def test_overlapped_diloco_rounds_are_the_outer_steps_of_each_workers_inner_steps_and_keep_the_progress():
    """Two diloco workers, H = 4, 13 steps: a push of every tensor at steps 4, 8 and 12, each a round. Whenever
    its reply was merged, a push carries exactly the steps since the one before (the merge keeps what was made
    while the reply travelled), so each round's central model is the outer step of those sums by hand; after the
    last reply a worker holds the central model plus step 13."""
    workers, central, rule = fit(DiLoCo(inner_steps=4, overlap=True), steps=13)
    g = torch.Generator().manual_seed(42)  # join_worker's initial model
    w0 = {n: torch.randn(s, generator=g).numpy() for n, s in SHAPES.items()}
    rounds = [[{n: sum(step_of(rank, t)[n].numpy() for t in range(4 * k + 1, 4 * k + 5)) for n in SHAPES}
               for rank in (0, 1)] for k in range(3)]
    for name in SHAPES:  # the outer step of each round's two sums, by hand
        expected = by_hand(w0[name], [(r[0][name], r[1][name]) for r in rounds])[-1]
        np.testing.assert_allclose(central.tensors[name], expected, rtol=0, atol=2e-5)
    assert rule.outer_steps == 3 and central.version == 3
    for rank, (exchange, log, tensors) in enumerate(workers):
        assert exchange.stats()["fragment_trace"] == [(4, 0), (8, 0), (12, 0)]
        assert [p.names for p in log] == [ALL] * 3 and all(p.status == APPLIED for p in log)
        assert [p.base for p in log] == [0, 1, 2] and [p.version for p in log] == [1, 2, 3]
        assert all(p.part and p.returned == ALL for p in log)  # each reply the tensors pushed: all of them
        for name in SHAPES:
            assert exchange.base[name].numpy().tobytes() == central.tensors[name].tobytes()
            np.testing.assert_allclose(tensors[name] - exchange.base[name], step_of(rank, 13)[name], rtol=0,
                                       atol=1e-6)


@pytest.mark.integration
def test_an_overlapped_reply_that_came_during_a_step_is_merged_after_it():
    """One async_diloco worker, H = 4: the push at step 4 goes from a thread; its reply, waited for before step 5,
    is merged after step 5, which the worker made meanwhile: its base the central model, its weights that plus step
    5's progress."""
    mode = AsyncDiLoCo(inner_steps=4, overlap=True, dynamic_steps=False, momentum_lookahead=False)
    with in_process_ps(mode.name, shm_pushes=False) as server:
        client, exchange, log, tensors = join_worker(server.address, mode, 0, 1)
        try:
            for t in range(1, 5):
                take_step(exchange, tensors, 0, t)
            assert exchange.pending is not None and exchange.fragment_trace == [(4, 0)]
            exchange.pending[0].thread.join(30)
            take_step(exchange, tensors, 0, 5)
            assert exchange.pending is None
            (push,) = log
            assert push.names == ALL and push.part and push.status == APPLIED
            central = client.pull().tensors
            for name in SHAPES:
                assert exchange.base[name].numpy().tobytes() == central[name].tobytes()
                np.testing.assert_allclose(tensors[name] - exchange.base[name], step_of(0, 5)[name], rtol=0,
                                           atol=1e-6)
        finally:
            client.close()
