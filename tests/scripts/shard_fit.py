"""tests/scripts/bn_sched.py's model fitted by 2 workers on a sharded PS (``ps_shards``), one fit per mode.

Each rank writes OUT/MODE/rank{r}.json: the weights it holds after fit, the test accuracy, each shard's
version as it left; rank 0 also the central model assembled from the shards by a bystander client after fit
(its embedded shards stop only when it exits). ``--ps-address`` (comma-separated) uses shards started by
hand instead of embedded ones; ``--ps-ports`` gives each mode's first embedded port. ``--checkpoint-dir``
adds a PSCheckpoint (each embedded shard writes DIR/shard-I), ``--resume-from`` starts the shards from one.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
from bn_sched import BNNet, loader

from plug_asgd import AsyncPSStrategy, PSCheckpoint
from plug_asgd.sharding import connect
from plug_asgd.strategy import synced_tensors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="asgd,adacomp")
    parser.add_argument("--ps-ports", default=None, help="each mode's first embedded port, comma-separated")
    parser.add_argument("--ps-address", default=None, help="hand-started shards, comma-separated, in order")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="a PSCheckpoint, every 10 updates")
    parser.add_argument("--resume-from", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    modes = args.modes.split(",")
    ports = [int(p) for p in args.ps_ports.split(",")] if args.ps_ports else [None] * len(modes)
    for mode, port in zip(modes, ports, strict=True):
        fit(mode, port, args, args.out / mode)


def fit(mode: str, port: int | None, args: argparse.Namespace, out_dir: Path) -> None:
    pl.seed_everything(0, verbose=False)
    model = BNNet()
    shards = {"ps_address": args.ps_address.split(",")} if args.ps_address else {"ps_shards": args.shards}
    strategy = AsyncPSStrategy(mode={"name": mode, "fraction": 0.1} if mode == "adacomp" else mode, ps_port=port,
                               resume_from=args.resume_from, **shards)
    callbacks = [PSCheckpoint(args.checkpoint_dir, every_n_updates=10)] if args.checkpoint_dir else []
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    trainer.fit(model, loader(1280, 0, True))
    held = {n: t.detach().flatten().tolist() for n, t in synced_tensors(model).items()}
    out = {"rank": trainer.global_rank, "steps": trainer.global_step, "held": held,
           "shard_versions": [s["version"] for s in strategy.ps_stats()["shards"]],
           "comm": strategy.comm_stats()}
    if trainer.global_rank == 0:
        shapes = {n: tuple(t.shape) for n, t in synced_tensors(model).items()}
        client = connect(strategy.ps_endpoints, shapes, rank=0, world_size=1, mode=mode, request_timeout=30)
        try:
            out["central"] = {n: t.flatten().tolist() for n, t in client.pull().tensors.items()}
        finally:
            client.close()
    out["test_acc"] = trainer.test(model, loader(512, 1, False), verbose=False)[0]["test_acc"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
