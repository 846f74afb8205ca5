"""A fit of 2 workers as threads of this process, through the library's own exchange, client and PS.

What the quick tier's regression case runs (``tests/test_momentum_quick.py``): the worker side is
the strategy's (:func:`plug_asgd.worker.exchange.make_exchange` with the mode's default staleness
compensation, joined, stepped and left as ``AsyncPSStrategy`` does), the PS is a
:class:`~plug_asgd.ps.ParameterServer` configured as the embedded one
(:func:`plug_asgd.placement.ps_launcher.ps_config`), and the wire is the real one (msgpack frames through
ZeroMQ) over an ``inproc://`` endpoint: no process starts, no OS socket opens, so a fit of the
small regression model takes a fraction of a second. Lightning is left out; its part (the
sampler, the optimizer step, the stage's hooks) is done here the way it does it, and the
real-process launch of ``tests/test_momentum.py`` covers the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from plug_asgd import AsyncPSStrategy
from plug_asgd.placement.ps_launcher import ps_config
from plug_asgd.ps import ParameterServer
from plug_asgd.strategy import synced_tensors
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.collectives import Collectives
from plug_asgd.worker.exchange import Link, make_exchange

WORKERS = 2
TIMEOUT_S = 60.0  # a request's limit, and each thread's: a failure ends in an error, never a hang


def fit_in_threads(make_model: Callable[[], torch.nn.Module], data: TensorDataset, *, epochs: int, batch_size: int,
                   seed: int = 0, workers: int = WORKERS, stats: list[dict[str, Any]] | None = None,
                   lockstep: bool = False, **strategy: Any) -> torch.nn.Module:
    """Rank 0's model after a fit of ``workers`` threads (``strategy``: ``AsyncPSStrategy``'s arguments), which
    holds the central model as the strategy's does. ``make_model`` builds a module with ``configure_optimizers``
    (the same initial weights on every call, as seeded ranks have). ``stats`` receives each rank's exchange and
    client counters at the end. ``lockstep``: every worker starts each step together (a barrier), so that each
    step's pushes are made from one version and all but the first land stale, whatever the scheduler does: the
    staleness processes meet, where threads of a loaded machine may otherwise run one after the other."""
    arguments = AsyncPSStrategy(**strategy)  # parsed and checked as a user's; it starts nothing
    tag = uuid.uuid4().hex  # the PS's address, and the name of hogwild's shared model
    address = f"inproc://plug-asgd-quick-{tag}"
    # the embedded PS's config; no parent process to outlive: this PS is a thread of the test's
    config = ps_config(arguments.connection.settings, arguments.mode, None, address, None)
    server = ParameterServer(dataclasses.replace(config, parent_pid=None))
    serving = threading.Thread(target=server.serve_forever, name="ps", daemon=True)
    serving.start()
    models = [make_model() for _ in range(workers)]
    errors: list[BaseException] = []
    steps = threading.Barrier(workers, timeout=TIMEOUT_S) if lockstep else None
    try:
        threads = [threading.Thread(target=_worker, name=f"rank{r}", daemon=True, args=(
            arguments, address, tag, r, workers, models[r], data, epochs, batch_size, seed, errors,
            stats if stats is not None else [], steps)) for r in range(workers)]
        for w in threads:
            w.start()
        for w in threads:
            w.join(TIMEOUT_S * 4)
        if any(w.is_alive() for w in threads):
            raise TimeoutError(f"a worker of {strategy} did not finish within {TIMEOUT_S * 4:.0f} s")
        if errors:
            raise errors[0]
    finally:
        server.request_stop()
        serving.join(TIMEOUT_S)
        server.close()
    return models[0]


def _worker(arguments: AsyncPSStrategy, address: str, tag: str, rank: int, workers: int, model: Any,
            data: TensorDataset, epochs: int, batch_size: int, seed: int, errors: list[BaseException],
            stats: list[dict[str, Any]], steps: threading.Barrier | None) -> None:
    client = PSClient(address, rank=rank, world_size=workers, mode=arguments.mode.name, request_timeout=TIMEOUT_S,
                      lost_timeout=TIMEOUT_S, heartbeat_s=None)
    exchange = make_exchange(arguments.mode, codec=arguments.compressor,
                             compensation=arguments.staleness_compensation, shm_pushes=False)
    try:
        optimizer = model.configure_optimizers()
        welcome = client.hello(1, True, timeout=TIMEOUT_S)
        seq = itertools.count()

        def gather(kind: str, obj: Any = None, tensors: Any = None) -> list[Any]:  # the strategy's _gather
            exchange.finish()
            return client.gather(1, next(seq), obj, tensors, kind=kind)

        barrier = Collectives(gather).barrier
        exchange.attach(Link(client=client, tensors=lambda: synced_tensors(model), rank=rank, world_size=workers,
                             stage=1, fitting=True, barrier=barrier, stop=lambda: None, shared_tag=tag,
                             one_cpu_machine=True))
        # Lightning's setup hook waits for every rank (after each said hello), before any push: without these, a
        # sync round could close on rank 0's push alone, rank 1 not yet counted by the PS (seen: sync 1.79, not 2.72)
        barrier("pre_setup")
        barrier("post_setup")
        exchange.start_fit([optimizer], rank, workers)
        arguments.mode.check_optimizers([optimizer])
        exchange.join(init=not welcome.get("initialized"))
        sampler = DistributedSampler(data, num_replicas=workers, rank=rank, shuffle=True, seed=seed)
        # as AsyncPSStrategy.on_train_start: randomk's fraction follows the fit's length (without it, 1%, not 10.4%)
        exchange.fit_length(epochs * -(-len(sampler) // batch_size))
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for i, batch in enumerate(DataLoader(data, batch_size=batch_size, sampler=sampler)):
                def run(batch: Any = batch, i: int = i) -> None:  # Lightning's automatic optimization
                    if steps is not None:
                        steps.wait()
                    optimizer.zero_grad()
                    model.training_step(batch, i).backward()
                    optimizer.step()

                exchange.step(run, optimizer)
        exchange.leave()
        stats.append({**client.counters.as_dict(), **exchange.stats(), "rank": rank})
    except BaseException as exc:  # noqa: BLE001 (handed to the test's thread)
        errors.append(exc)
        if steps is not None:
            steps.abort()  # the other workers' next step raises at once instead of waiting out the timeout
    finally:
        exchange.let_go()
        try:
            client.bye(1)
        finally:
            exchange.close()
            client.close()
