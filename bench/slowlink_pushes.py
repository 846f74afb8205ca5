"""Where a push's time goes, for the slow-link benchmark's write-up: ``bench.slowlink --push-cost`` and
``--push-timing``.

``python -m bench slowlink --push-cost [--pushes 400] [--fraction 0.0033] [--seed 0]``: what an
``AdaComp(overlap=True)`` worker computes on its training thread at each push of the recipe CNN, by the library's
own code, in this process on one core: the update (``PushExchange.update``: ``w - base``, then the codec's top-k
with its residual), the copy of the weights sent (``OverlapExchange.copy_of``), and the merge of the reply of the
push before (``OverlapExchange._merge_changes``, at the coordinates the reply changed, against ``_merge`` over
every coordinate, measured in turn on the same replies). Each reply is the delta a PS of 2 workers sends: the
central model changed at this push's coordinates and at as many others (the other worker's). No socket, no PS, no
sender thread: those are ``--push-timing``'s. Prints the median milliseconds of each piece, after 50 pushes.

``python -m bench slowlink --push-timing CONFIG [--time-limit 20] [--out DIR]``: 2 workers of a configuration of
the asgd family (``asgd``, ``adacomp``, ``adacomp-0.0033``, ...; one torch thread each, as in the time-to-accuracy
benchmark) train the recipe CNN on Fashion-MNIST for ``--time-limit`` seconds with their embedded PS over
loopback (no emulated hosts: no root), launched by :mod:`bench.train`. Each rank prints, as one JSON line, the
calls and median milliseconds of the pieces of its pushes: the whole push (``PushExchange.send``), the update
(``update``), loading a reply's model (``load``), the client's request (send to reply, with whatever the worker
does while it waits), the whole optimizer step (forward, backward and the push), and AdaComp's selection of what
to send (``encode``: one call per tensor of each push; ``encode_difference`` where the push went from the client's
held central model); and the guesses of an "own" reply it made (``comm_stats``). Rank 0 then prints the run's
samples/s and the PS's time per push. Both wrap the library's methods: they measure this code, not a protocol.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import FASHION, time_calls

PUSH_COST_WARMUP = 50
PIECES = (("PushExchange", "send"), ("PushExchange", "update"), ("Exchange", "load"), ("PSClient", "request"),
          ("AsyncPSStrategy", "optimizer_step"), ("TopKResidual", "encode"), ("TopKResidual", "encode_difference"))


def push_cost(pushes: int, fraction: float, seed: int) -> int:
    """``--push-cost``: the median ms of each piece of an overlapped AdaComp push, printed."""
    import numpy as np
    import torch

    from plug_asgd.modes import APPLIED, AdaComp
    from plug_asgd.recipes.mnist import MnistCNN
    from plug_asgd.worker.compensation import resolve
    from plug_asgd.worker.exchange import Link, make_exchange
    from plug_asgd.worker.exchange.overlap import OverlapExchange
    from plug_asgd.worker.model_reply import Changes, ModelReply

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    weights = {n: p.detach().clone() for n, p in MnistCNN().named_parameters()}
    held = {n: t.numpy().copy() for n, t in weights.items()}  # the central model the worker holds
    mode = AdaComp(fraction=fraction, overlap=True)
    exchange = make_exchange(mode, compensation=resolve(None, "adacomp", mode.compensate))
    assert isinstance(exchange, OverlapExchange)
    exchange.attach(Link(client=None, tensors=lambda: weights, rank=0, world_size=2,  # type: ignore[arg-type]
                         stage=1, fitting=True, barrier=lambda name: None, stop=lambda: None))
    exchange.start_fit([torch.optim.Adam([torch.zeros(1, requires_grad=True)])], 0, 2)
    exchange.base = {n: t.clone() for n, t in weights.items()}
    times: dict[str, list[float]] = {"update": [], "copy of the weights sent": [],
                                     "merge, changed coordinates": [], "merge, every coordinate": []}
    pending = exchange.pending_residual()
    assert pending is not None
    for i in range(pushes):
        with torch.no_grad():  # a step: Adam moves every coordinate a little
            for t in weights.values():
                t.add_(torch.randn(t.shape), alpha=1e-3)
        start = time.perf_counter()
        update, _, _ = exchange.update(weights)
        sent_at = time.perf_counter()
        sent = exchange.copy_of(weights)
        copied_at = time.perf_counter()
        # the PS folds this push and the other worker's as many coordinates; its delta reply: their current values
        indices = {}
        for name, part in update.items():
            flat = held[name].reshape(-1)
            other = rng.choice(flat.size, size=part.indices.size, replace=False)
            idx = np.union1d(part.indices, other)
            flat[part.indices] += part.values
            flat[other] += rng.standard_normal(other.size).astype(np.float32) * 1e-3
            indices[name] = idx
        reply = ModelReply(i + 1, APPLIED, False, {n: a.copy() for n, a in held.items()},
                           changed=Changes(i, indices))
        with torch.no_grad():  # a step while the push is in flight
            for t in weights.values():
                t.add_(torch.randn(t.shape), alpha=1e-3)
        # the two merges in turn, each on its own copy of the same state (the base before, the weights now)
        whole = i % 2 == 1
        merge_start = time.perf_counter()
        if whole:
            exchange.spare = sent
            exchange._merge(weights, sent, reply, 1.0, pending)
        else:
            assert exchange._merge_changes(weights, sent, reply, pending)
        merged_at = time.perf_counter()
        if i >= PUSH_COST_WARMUP:
            times["update"].append(sent_at - start)
            times["copy of the weights sent"].append(copied_at - sent_at)
            times["merge, every coordinate" if whole else "merge, changed coordinates"].append(merged_at - merge_start)
    print(f"the recipe CNN ({sum(t.numel() for t in weights.values()):,} values), adacomp at {fraction:g}, "
          f"{pushes - PUSH_COST_WARMUP} pushes: median ms")
    for name, values in times.items():
        print(f"  {name:28s} {statistics.median(values) * 1e3:7.3f}")
    return 0


def push_timing(config: dict[str, Any], name: str, seconds: float, out: Path) -> int:
    """``--push-timing``: one launch of 2 workers of ``config``, its pushes' pieces timed on each rank, printed.

    Lightning starts rank 1 by running the same command again, with LOCAL_RANK set: both ranks get here.
    """
    from harness.ports import free_port_block

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:  # rank 0: rank 1 inherits it
        os.environ["MASTER_PORT"] = str(free_port_block(3))  # DDP's store; the embedded PS takes the next
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "LOCAL_RANK" not in os.environ:  # rank 0, before it starts rank 1: rank 0 polls for rank 1's record by name
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    run = {"bench": "slowlink_push_timing", "name": name, "batch_size": 32, "max_steps": 100_000, "epochs": 1000,
           "time_limit_s": seconds, "warmup": 5, **config}
    spec = {"workers": 2, "data_dir": str(FASHION), "test_subset": 500, "runs": [run]}

    from bench import train
    from plug_asgd.compressors.sparse import TopKResidual
    from plug_asgd.strategy import AsyncPSStrategy
    from plug_asgd.worker.client import PSClient
    from plug_asgd.worker.exchange import Exchange, PushExchange

    owners = {"AsyncPSStrategy": AsyncPSStrategy, "PSClient": PSClient, "Exchange": Exchange,
              "PushExchange": PushExchange, "TopKResidual": TopKResidual}
    times: dict[str, list[float]] = defaultdict(list)
    for owner, method in PIECES:
        time_calls(owners[owner], method, times[method])
    comm: dict[str, Any] = {}
    teardown = AsyncPSStrategy.teardown

    def keep_counters(self: AsyncPSStrategy) -> None:  # the worker's counters, before it leaves the PS
        comm.update(self.comm_stats())
        teardown(self)

    AsyncPSStrategy.teardown = keep_counters  # type: ignore[method-assign]
    rank = os.environ.get("LOCAL_RANK", "0")
    result = train.run_one(spec, run, 0, out)  # rank 1 returns None once rank 0 is done
    pieces = {k: {"n": len(v), "median_ms": round(statistics.median(v) * 1000, 3)} for k, v in times.items() if v}
    print("rank " + rank + " " + json.dumps({"pieces": pieces, **{k: comm.get(k) for k in (
        "pushes", "own_replies", "own_guesses", "own_guesses_right")}}), flush=True)
    if result is not None:
        (out / "run0_done").touch()  # rank 1 waits for this
        print("samples/s " + json.dumps({"samples_per_s": round(result["samples_per_s"], 1),
                                         "step_time_median_ms": round(result["step_time_median_s"] * 1000, 2),
                                         "ps_ms_per_push": result["ps_push_ms"]}), flush=True)
    return 0
