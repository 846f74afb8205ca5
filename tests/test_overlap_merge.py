"""An overlapped sparse push's reply, merged at the coordinates it changed only (OverlapExchange._merge_changes).

Two adacomp workers with ``overlap=True`` push through a real PS over a socket, in turn, each reply
merged at the worker's next push after a local step, as on the slow-link benchmark. The merge that
touches only what the reply changed must land where the merge over every coordinate lands (the same
steps with it turned off), and leave each worker on the central model it holds plus its codec's residual.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from plug_asgd.modes import AdaComp
from plug_asgd.ps import ParameterServer, PSConfig
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.compensation import resolve
from plug_asgd.worker.exchange import Link, make_exchange
from plug_asgd.worker.exchange.overlap import OverlapExchange
from plug_asgd.worker.exchange.push import PushExchange

SHAPES = {"w": (8, 8), "b": (8,)}  # 1/16 of each: 4 and 1 coordinates a push
ROUNDS = 12


def fit(steps: list[list[dict[str, torch.Tensor]]]) -> list[tuple[OverlapExchange, PSClient, dict]]:
    """Each worker in turn: one local step (which merges its last reply and sends the next push), then its push
    folded before the other's (the order, and so every value, is the same in every run); then a last merge."""
    server = ParameterServer(PSConfig(bind="tcp://127.0.0.1:*", mode="adacomp"))
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_ms": 20}, daemon=True)
    serving.start()
    mode = AdaComp(fraction=1 / 16, overlap=True)
    workers = []
    try:
        for rank in (0, 1):
            client = PSClient(server.address, rank=rank, world_size=2, mode="adacomp", request_timeout=10,
                              heartbeat_s=None)
            client.hello(stage=1, training=True, timeout=20)
            g = torch.Generator().manual_seed(rank)
            tensors = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
            exchange = make_exchange(mode, compensation=resolve(None, "adacomp", mode.compensate))
            assert isinstance(exchange, OverlapExchange)
            exchange.attach(Link(client=client, tensors=lambda t=tensors: t, rank=rank, world_size=2, stage=1,
                                 fitting=True, barrier=lambda name: None, stop=lambda: None))
            # Adam's steps are normalized: a push of one step goes unscaled (only the optimizer's kind matters)
            exchange.start_fit([torch.optim.Adam([torch.zeros(1, requires_grad=True)])], rank, 2)
            exchange.join(init=rank == 0)
            workers.append((exchange, client, tensors))
        for round_steps in steps:
            for (exchange, _, tensors), step in zip(workers, round_steps, strict=True):
                def run(tensors=tensors, step=step) -> None:
                    with torch.no_grad():
                        for name, t in tensors.items():
                            t.add_(step[name])

                exchange.step(run, exchange.optimizers[0])
                exchange.in_flight.join(10)  # folded before the other worker pushes
        for exchange, _, _ in workers:
            exchange.finish()
        return workers
    finally:
        for _, client, _ in workers:
            client.close()
        server.request_stop()
        serving.join(10)


@pytest.mark.integration
def test_a_reply_merged_at_what_it_changed_lands_where_the_whole_merge_does(monkeypatch):
    # the overlapped push's own merges: a worker whose pushes land fresh would push from its held model instead
    # (tests/test_held_base.py)
    monkeypatch.setattr(PushExchange, "held_base_for", lambda self, tensors, want_model: None)
    g = torch.Generator().manual_seed(7)
    steps = [[{n: 0.1 * torch.randn(s, generator=g) for n, s in SHAPES.items()} for _ in (0, 1)]
             for _ in range(ROUNDS)]
    changes_only = fit(steps)
    for exchange, client, tensors in changes_only:
        # every merge but the first (the base was the model pulled at the join, not one merged)
        assert exchange.stats()["merges_of_changes"] == ROUNDS - 1
        for name, t in tensors.items():  # no step since the last push: the central model it holds plus the residual
            want = client.held.tensors[name] + exchange.encoder.pending(name).reshape(t.shape)
            np.testing.assert_allclose(t.numpy(), want, rtol=0, atol=1e-6)
            np.testing.assert_allclose(exchange.base[name].numpy(), want, rtol=0, atol=1e-6)
    monkeypatch.setattr(OverlapExchange, "_merge_changes", lambda *args: False)
    whole = fit(steps)
    assert [x.stats()["merges_of_changes"] for x, _, _ in whole] == [0, 0]
    for (_, c_changes, t_changes), (_, c_whole, t_whole) in zip(changes_only, whole, strict=True):
        for name in SHAPES:
            np.testing.assert_allclose(t_changes[name].numpy(), t_whole[name].numpy(), rtol=0, atol=1e-6)
            np.testing.assert_allclose(c_changes.held.tensors[name], c_whole.held.tensors[name], rtol=0, atol=1e-6)
