"""One hivemind peer of ``bench.diloco``: the language-model recipe's ByteGPT trained with ``hivemind.Optimizer``.

Runs in ``.venv-hivemind`` (hivemind 1.1.12, torch, pytorch-lightning: ``bench.slowlink``'s), one process per
emulated worker host, as ``bench.slowlink_hivemind``'s CNN peers do (its DHT address exchange and start barrier are
reused). The model, data and optimiser are the other runs': ``ByteGPT`` of the spec's size (the recipe's AdamW and
its warmup, then a constant rate: without a Trainer the recipe's schedule has no end to decay to, as
``bench.diloco_train.BenchGPT``'s), ``FortunesDataModule``'s training windows of the run's seed, a
``DistributedSampler`` shard as Lightning gives each rank, batch ``batch_size``. hivemind's configuration for
training over slow links with parameter averaging (its quickstart's, docs/user/quickstart.md of hivemind 1.1.x):
``use_local_updates=True`` (the local optimiser steps on every batch; the parameters are averaged in the background
each time the peers together have processed ``target_batch_size`` samples), ``matchmaking_time=3``,
``averaging_timeout=10``, with ``target_batch_size`` set by ``bench.diloco`` to DiLoCo's round: the samples 2
workers train in H inner steps, so both average their models as often.

A peer stops after ``max_steps`` steps, or as soon as the other has stopped: a peer left alone would wait out
``averaging_timeout`` at each of its later rounds (measured: 10 s a step), which is not training. Peer 0 keeps its
weights every ``snapshot_every_s`` seconds, at step ``equal_steps`` (the samples DDP trains) and at
the end, on the wall clock (``time.time()``); each peer writes ``peer{P}.json``: its steps, the end of each step after
the warm-up, its wall-clock start, hivemind's epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.slowlink_hivemind import _barrier, _initial_peers, _peers


def _config(spec: dict[str, Any]) -> dict[str, Any]:
    """hivemind.Optimizer's keyword arguments beside the model's: the quickstart's, at DiLoCo's round of samples
    (``matchmaking_time`` and ``averaging_timeout`` as the spec gives them: the quickstart's 3 and 10 s by default)."""
    return {"target_batch_size": spec["hivemind_target_batch_size"], "use_local_updates": True,
            "matchmaking_time": spec.get("hivemind_matchmaking_time", 3.0),
            "averaging_timeout": spec.get("hivemind_averaging_timeout", 10.0)}


def _partner_done(args: argparse.Namespace) -> bool:
    """Whether another peer has finished: alone, a peer's every averaging round would wait out its timeout."""
    return any((args.out / f"done{p}").exists() for p in range(args.peers) if p != args.peer)


def _loop(args: argparse.Namespace, spec: dict[str, Any], model: torch.nn.Module, loader: Any, sampler: Any,
          opt: Any, schedule: Any) -> tuple[list[Any], int, list[float], float | None]:
    """The training loop: ``(peer 0's snapshots, steps, each step's end after the warm-up, the warm-up's end)``."""
    import torch.nn.functional as F

    snapshots: list[tuple[float, dict[str, torch.Tensor], dict[str, int]]] = []
    keep = args.peer == 0
    steps, step_ends, window_start = 0, [], None

    def snapshot() -> None:
        snapshots.append((time.time(), {k: v.detach().clone() for k, v in model.state_dict().items()},
                          {"steps": steps}))

    if keep:
        snapshot()
    next_snapshot = time.monotonic() + spec["snapshot_every_s"]
    model.train()
    for epoch in range(1000):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            steps += 1
            now = time.time()
            if steps == spec["warmup"]:
                window_start = now
            elif steps > spec["warmup"]:
                step_ends.append(now)
            if keep and (steps == spec["equal_steps"] or time.monotonic() >= next_snapshot):
                snapshot()
                next_snapshot = time.monotonic() + spec["snapshot_every_s"]
            if steps >= spec["max_steps"] or _partner_done(args):
                break
        if steps >= spec["max_steps"] or _partner_done(args):
            break
    (args.out / f"done{args.peer}").touch()
    if keep:
        snapshot()
    return snapshots, steps, step_ends, window_start


def train(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    """Train this peer for ``max_steps`` steps; peer 0's snapshots written to ``snapshots.pt``.

    Args:
        args: the parsed command line.
        spec: the launch's spec.
    """
    import hivemind
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, DistributedSampler

    from plug_asgd.recipes.lm import ByteGPT
    from plug_asgd.recipes.lm_data import FortunesDataModule

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    pl.seed_everything(spec["seed"], workers=True, verbose=False)
    model = ByteGPT(**spec["model"])  # the same initialization on both peers: the seed's
    data = spec["data"]
    dm = FortunesDataModule(data["data_dir"], context=data["context"], batch_size=spec["batch_size"],
                            val_windows=data["val_windows"], seed=spec["seed"])
    dm.setup("fit")
    sampler = DistributedSampler(dm.train_set, num_replicas=args.peers, rank=args.peer, shuffle=True,
                                 seed=spec["seed"])
    loader = DataLoader(dm.train_set, batch_size=spec["batch_size"], sampler=sampler)
    configured = model.configure_optimizers()  # no Trainer: the warmup, then a constant rate
    schedule = configured["lr_scheduler"]["scheduler"]
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{args.address}/tcp/0"], initial_peers=_initial_peers(args), start=True)
    _peers(args, dht)
    opt = hivemind.Optimizer(dht=dht, run_id=f"diloco-bench-{spec['seed']}", batch_size_per_step=spec["batch_size"],
                             optimizer=configured["optimizer"], verbose=True, **_config(spec))
    _barrier(args)
    wall_start = time.time()
    snapshots, steps, step_ends, window_start = _loop(args, spec, model, loader, sampler, opt, schedule)
    if snapshots:
        torch.save(snapshots, args.out / "snapshots.pt")
    record = {"peer": args.peer, "rank": args.peer, "steps": steps, "step_ends": step_ends,
              "window_start": window_start, "wall_start": wall_start, "local_epoch": opt.local_epoch,
              "config": _config(spec), "hivemind": hivemind.__version__}
    opt.shutdown()
    dht.shutdown()
    return record


def main(argv: list[str] | None = None) -> None:
    """Run this peer of the launch and write ``peer{P}.json``.

    Args:
        argv: ``--spec SPEC.json --peer P --address IP --peers-file FILE --out DIR``; None: the command line's.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--peer", type=int, required=True)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--address", required=True, help="this host's IP address")
    parser.add_argument("--peers-file", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    record = train(args, json.loads(args.spec.read_text()))
    tmp = args.out / f"peer{args.peer}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(args.out / f"peer{args.peer}.json")


if __name__ == "__main__":
    main()
