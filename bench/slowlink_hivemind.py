"""One hivemind peer of ``bench.slowlink``: the recipe CNN trained with ``hivemind.Optimizer``.

Runs in its own virtualenv (``.venv-hivemind``: hivemind 1.1.12, torch, pytorch-lightning; no
plug_asgd dependencies beyond Lightning), one process per emulated host. The model, data, shard
and optimizer are the other runs' (``MnistCNN`` and its default Adam 1e-3, ``MnistDataModule``,
a ``DistributedSampler`` shard as Lightning injects), wrapped in the configuration of hivemind's
quickstart (:data:`HIVEMIND_CONFIG`). Peer 0 starts the DHT and writes its address for peer 1;
peer 0 snapshots its weights every ``--snapshot-every`` seconds of training (the snapshot's
time off the clock) for ``bench.slowlink`` to evaluate after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

# hivemind's quickstart (docs/user/quickstart.md of hivemind 1.1.x): local Adam steps on every batch, parameters
# averaged in the background each time the peers together have processed target_batch_size samples
HIVEMIND_CONFIG: dict[str, Any] = {"target_batch_size": 10000, "use_local_updates": True, "matchmaking_time": 3.0,
                                   "averaging_timeout": 10.0}


def _peers(args: argparse.Namespace, dht: Any) -> None:
    """Peer 0 publishes its DHT address; the others have found it before they started their DHT."""
    if args.peer == 0:
        tmp = args.peers_file.with_suffix(".tmp")
        tmp.write_text(json.dumps([str(a) for a in dht.get_visible_maddrs()]))
        tmp.replace(args.peers_file)


def _initial_peers(args: argparse.Namespace) -> list[str]:
    if args.peer == 0:
        return []
    deadline = time.monotonic() + 120
    while not args.peers_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"peer 0 wrote no address to {args.peers_file} within 120 s")
        time.sleep(0.1)
    return json.loads(args.peers_file.read_text())


def _barrier(args: argparse.Namespace) -> None:
    """Every peer starts training once all have joined: a peer that starts behind finds itself out of sync
    (hivemind then loads the others' state instead of averaging), and stays a round behind thereafter
    (measured: peer 0 waited about 9 s at every epoch for a round its partner had skipped)."""
    (args.out / f"ready{args.peer}").touch()
    deadline = time.monotonic() + 120
    while not all((args.out / f"ready{p}").exists() for p in range(args.peers)):
        if time.monotonic() > deadline:
            raise TimeoutError("the other peers did not join within 120 s")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> None:
    import hivemind
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, DistributedSampler

    from plug_asgd.recipes.mnist import MnistCNN, MnistDataModule

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", type=int, required=True)
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--address", required=True, help="this host's IP address")
    parser.add_argument("--peers-file", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--train-subset", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--time-limit", type=float, default=None, help="seconds of training after 3 warm-up steps")
    parser.add_argument("--snapshot-every", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # the cores its host has (bench.slowlink)
    pl.seed_everything(args.seed, workers=True, verbose=False)
    dm = MnistDataModule(args.data_dir, batch_size=args.batch_size, train_subset=args.train_subset, download=False,
                         seed=args.seed)
    dm.setup("fit")
    sampler = DistributedSampler(dm.train_set, num_replicas=args.peers, rank=args.peer, shuffle=True, seed=args.seed)
    loader = DataLoader(dm.train_set, batch_size=args.batch_size, sampler=sampler)
    model = MnistCNN()
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{args.address}/tcp/0"], initial_peers=_initial_peers(args), start=True)
    _peers(args, dht)
    opt = hivemind.Optimizer(dht=dht, run_id="slowlink", batch_size_per_step=args.batch_size,
                             optimizer=model.configure_optimizers(), verbose=True, **HIVEMIND_CONFIG)
    _barrier(args)
    snapshots: list[tuple[float, dict[str, torch.Tensor]]] = []
    excluded = 0.0
    steps, window_start = 0, None
    start = time.perf_counter()

    def snapshot() -> None:
        nonlocal excluded
        t = time.perf_counter()
        snapshots.append((t - start - excluded, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        excluded += time.perf_counter() - t

    if args.snapshot_every and args.peer == 0:
        snapshot()
    next_snapshot = args.snapshot_every or 0.0
    done = False
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            now = time.perf_counter()
            if steps == 3:
                window_start = now
            if args.snapshot_every and args.peer == 0 and now - start - excluded >= next_snapshot:
                snapshot()
                next_snapshot = time.perf_counter() - start - excluded + args.snapshot_every
            if (args.max_steps and steps >= args.max_steps) or (
                    args.time_limit and window_start is not None and now - window_start >= args.time_limit):
                done = True
                break
        if done:
            break
    if args.snapshot_every and args.peer == 0:
        snapshot()
    record = {"peer": args.peer, "steps": steps, "local_epoch": opt.local_epoch, "config": HIVEMIND_CONFIG,
              "hivemind": hivemind.__version__, "train_s": time.perf_counter() - start - excluded}
    args.out.mkdir(parents=True, exist_ok=True)
    if snapshots:
        torch.save(snapshots, args.out / "snapshots.pt")
    (args.out / f"peer{args.peer}.json").write_text(json.dumps(record))
    opt.shutdown()
    dht.shutdown()


if __name__ == "__main__":
    main()
