"""One node of a multi-node job with one PS shard per node (``ps_shards="per_node"``): tests/scripts/bn_sched.py's
model fitted by one worker per node, launched by tests/scripts/per_node_launch.py on emulated hosts.

Lightning's own launcher reads NODE_RANK, MASTER_ADDR and MASTER_PORT (``--nodes`` nodes of one process each).
Each rank writes OUT/rank{r}.json: the shards' addresses it learned, each shard's counters as it left, its own
steps. Each node's shard writes OUT/ps/shard-I/ps_metrics.jsonl.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
from bn_sched import BNNet, loader

from plug_asgd import AsyncPSStrategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    # no CURVE keys between emulated hosts: ps_insecure; no shared memory between hosts: shm_pushes=False
    strategy = AsyncPSStrategy(ps_shards="per_node", ps_insecure=True, shm_pushes=False, ps_run_dir=args.out / "ps",
                               connect_timeout=60, request_timeout=60)
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=args.nodes, strategy=strategy, max_epochs=1,
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(BNNet(), loader(32 * args.nodes * args.steps, 0, True))
    stats = strategy.ps_stats()
    out = {"rank": trainer.global_rank, "node": strategy.node_rank, "steps": trainer.global_step,
           "endpoints": strategy.ps_endpoints, "shards": stats.get("shards", [stats])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
