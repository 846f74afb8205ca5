"""all_gather and every reduction (sum, mean, max, min) across two ranks through a real PS process: the
strategy's Collectives on two PSClients, one per rank, each value worked out by hand."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch.distributed import ReduceOp

from plug_asgd.worker.client import PSClient
from plug_asgd.worker.collectives import Collectives

X = [torch.tensor([1.0, -3.0, 2.5]), torch.tensor([4.0, 0.5, -1.0])]  # rank 0's and rank 1's
N = [torch.tensor([3, -7], dtype=torch.int64), torch.tensor([-2, 10], dtype=torch.int64)]


def two_ranks(address: str, calls) -> list[list]:
    """Each rank runs ``calls(collectives, rank)``, rank 0 in a thread; every collective pairs the two."""
    clients = [PSClient(address, rank=r, world_size=2, mode="asgd", request_timeout=20, heartbeat_s=None)
               for r in (0, 1)]
    for c in clients:
        c.hello(stage=1, training=False, timeout=20)
    results: list = [None, None]

    def run(rank: int) -> None:
        seq = iter(range(100))
        gather = lambda kind, obj=None, tensors=None: clients[rank].gather(1, next(seq), obj, tensors, kind=kind)  # noqa: E731
        results[rank] = calls(Collectives(gather), rank)

    t = threading.Thread(target=run, args=(0,))
    t.start()
    try:
        run(1)
    finally:
        t.join(30)
        for c in clients:
            c.close()
    assert not t.is_alive()
    return results


@pytest.mark.integration
def test_all_gather_and_every_reduction_across_two_ranks_through_the_ps(start_ps):
    def calls(coll: Collectives, rank: int) -> dict:
        x, n = X[rank], N[rank]
        return {"gather": coll.all_gather(x, sync_grads=False), "gather_int": coll.all_gather(n, sync_grads=False),
                "sum": coll.reduce(x, ReduceOp.SUM, False), "mean": coll.reduce(x, "mean", False),
                "max": coll.reduce(x, ReduceOp.MAX, False), "min": coll.reduce(x, "min", False),
                "sum_int": coll.reduce(n, "sum", False), "mean_int": coll.reduce(n, "avg", False),
                "training": coll.reduce(x, "sum", True)}

    expected = {
        "gather": torch.tensor([[1.0, -3.0, 2.5], [4.0, 0.5, -1.0]]),
        "gather_int": torch.tensor([[3, -7], [-2, 10]], dtype=torch.int64),
        "sum": torch.tensor([5.0, -2.5, 1.5]), "mean": torch.tensor([2.5, -1.25, 0.75]),
        "max": torch.tensor([4.0, 0.5, 2.5]), "min": torch.tensor([1.0, -3.0, -1.0]),
        "sum_int": torch.tensor([1, 3], dtype=torch.int64),
        "mean_int": torch.tensor([0.5, 1.5], dtype=torch.float32),  # the mean of integers is a float
    }
    results = two_ranks(start_ps(), calls)
    for rank, got in enumerate(results):
        for key, want in expected.items():
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), (rank, key, got[key])
        assert torch.equal(got["training"], X[rank])  # during training a reduction is the local value
    assert np.array_equal(results[0]["gather"].numpy(), results[1]["gather"].numpy())
