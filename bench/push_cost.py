"""The worker's CPU per overlapped AdaComp push of the recipe CNN, piece by piece, in one process on one core.

    PYTHONPATH=. python -m bench.push_cost [--pushes 400] [--fraction 0.0033] [--seed 0]

What an ``AdaComp(overlap=True)`` worker computes on its training thread at each push, by the library's own
code: the update (``PushExchange.update``: ``w - base``, then the codec's top-k with its residual), the copy
of the weights sent (``OverlapExchange.copy_of``), and the merge of the reply of the push before
(``OverlapExchange._merge_changes``, at the coordinates the reply changed, against ``_merge`` over every
coordinate, measured in turn on the same replies). Each reply is the delta a PS of 2 workers sends: the
central model changed at this push's coordinates and at as many others (the other worker's). No socket, no
PS, no sender thread: those are ``bench.worker_push_timing``'s (a live run). Prints the median milliseconds of each
piece, over the pushes after the first 50.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from plug_asgd.modes import APPLIED, AdaComp
from plug_asgd.recipes.mnist import MnistCNN
from plug_asgd.worker.client import Changes, ModelReply
from plug_asgd.worker.compensation import resolve
from plug_asgd.worker.exchange import Link, make_exchange
from plug_asgd.worker.exchange.overlap import OverlapExchange

WARMUP = 50


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pushes", type=int, default=400, help="pushes timed (default 400)")
    parser.add_argument("--fraction", type=float, default=0.0033, help="adacomp's fraction (default 0.0033)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.pushes <= WARMUP:
        parser.error(f"--pushes {args.pushes}: more than the {WARMUP} warm-up pushes, please")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    weights = {n: p.detach().clone() for n, p in MnistCNN().named_parameters()}
    held = {n: t.numpy().copy() for n, t in weights.items()}  # the central model the worker holds
    mode = AdaComp(fraction=args.fraction, overlap=True)
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
    for i in range(args.pushes):
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
        if i >= WARMUP:
            times["update"].append(sent_at - start)
            times["copy of the weights sent"].append(copied_at - sent_at)
            times["merge, every coordinate" if whole else "merge, changed coordinates"].append(merged_at - merge_start)
    print(f"the recipe CNN ({sum(t.numel() for t in weights.values()):,} values), adacomp at {args.fraction:g}, "
          f"{args.pushes - WARMUP} pushes: median ms")
    for name, values in times.items():
        print(f"  {name:28s} {statistics.median(values) * 1e3:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
