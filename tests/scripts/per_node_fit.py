"""One node of a multi-node job with one PS shard per node (``ps_shards="per_node"``), or with the embedded PS's
standby on node 1 (``--standby``: ``ps_standby=True``): tests/scripts/bn_sched.py's model fitted by one worker per
node, launched by tests/scripts/per_node_launch.py on emulated hosts. ``--kill-ps-at K``: rank 0 SIGKILLs its
embedded PS after its K-th step (its time in the list of step ends, negated).

Lightning's own launcher reads NODE_RANK, MASTER_ADDR and MASTER_PORT (``--nodes`` nodes of one process each).
Each rank writes OUT/rank{r}.json: the shards' addresses it learned, each shard's counters as it left, its own
steps, and the PS addresses its client ends on. Each node's shard writes OUT/ps/shard-I/ps_metrics.jsonl.
"""

import argparse
import json
import os
import signal
import time
from pathlib import Path

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    import pytorch_lightning as pl
    from bn_sched import BNNet, loader

    from plug_asgd import AsyncPSStrategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--standby", action="store_true")
    parser.add_argument("--kill-ps-at", type=int, default=None)
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    # no CURVE keys between emulated hosts: ps_insecure; no shared memory between hosts: shm_pushes=False
    placement = {"ps_standby": True} if args.standby else {"ps_shards": "per_node"}
    strategy = AsyncPSStrategy(**placement, ps_insecure=True, shm_pushes=False, ps_run_dir=args.out / "ps",
                               connect_timeout=60, request_timeout=60)

    step_ends: list[float] = []

    class KillPS(pl.Callback):
        def on_train_batch_end(self, trainer, *_):
            step_ends.append(time.time())
            if trainer.global_rank == 0 and trainer.global_step == args.kill_ps_at:
                step_ends.append(-time.time())  # the kill's time, negated
                os.kill(strategy.connection.embedded.process.pid, signal.SIGKILL)

    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=args.nodes, strategy=strategy, max_epochs=1,
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                         callbacks=[KillPS()])
    trainer.fit(BNNet(), loader(32 * args.nodes * args.steps, 0, True))
    stats = strategy.ps_stats()
    client = strategy.connection.client
    out = {"rank": trainer.global_rank, "node": strategy.node_rank, "steps": trainer.global_step,
           "endpoints": strategy.ps_endpoints, "shards": stats.get("shards", [stats]),
           "step_ends": step_ends, "ends_on": [c.address for c in getattr(client, "clients", [client])]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
