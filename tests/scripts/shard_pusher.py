"""A worker of a sharded PS without Lightning, for fault tests: a ShardedClient pushing a constant update.

Each line of --log is one push as this process saw it: the reply's version on each shard and its
status, and the time; the last line (``done``) the model assembled from every shard as it left, and
whether it is finite. A test derives from these lines what each shard must hold.
"""

import argparse
import json
import sys
import time
import types
from pathlib import Path

import numpy as np

# The client without plug_asgd/__init__ (which imports Lightning to register the strategy), as ps_worker.py
_package = types.ModuleType("plug_asgd")
_package.__path__ = [str(Path(__file__).resolve().parents[2] / "plug_asgd")]
sys.modules.setdefault("plug_asgd", _package)

from plug_asgd.protocol.partition import Partition  # noqa: E402
from plug_asgd.sharding.client import ShardedClient  # noqa: E402

# "w" is cut over both shards (more than a quarter of a shard's share), "b" stays whole
SHAPES = {"w": (64,), "b": (8,)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--addresses", required=True, help="the shards', comma-separated, in order")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--pushes", type=int, default=100)
    parser.add_argument("--delta", type=float, default=1.0)
    parser.add_argument("--interval", type=float, default=0.02, help="seconds of 'compute' before each push")
    parser.add_argument("--log", required=True)
    args = parser.parse_args()
    addresses = args.addresses.split(",")
    client = ShardedClient(addresses, Partition(SHAPES, len(addresses)), rank=args.rank, world_size=args.world,
                           mode="asgd", request_timeout=120, heartbeat_s=0.5)
    update = {n: np.full(s, args.delta, np.float32) for n, s in SHAPES.items()}
    with open(args.log, "a") as log:
        def record(**fields) -> None:
            log.write(json.dumps({**fields, "t": time.time()}) + "\n")
            log.flush()

        client.hello(stage=0, training=True, timeout=30)
        if args.rank == 0:
            client.init({n: np.zeros(s, np.float32) for n, s in SHAPES.items()})
        reply = client.pull_once_initialized(30)
        assert reply is not None, "the shards were not initialised within 30 s"
        record(event="pulled", versions=list(reply.version.per_shard))
        for _ in range(args.pushes):
            time.sleep(args.interval)
            reply = client.push(reply.version, update, want_model=True)
            record(event="push", versions=list(reply.version.per_shard), status=reply.status)
        final = client.pull()  # the model assembled from every shard as this worker leaves
        record(event="done", versions=list(final.version.per_shard),
               model={n: t.tolist() for n, t in final.tensors.items()},
               finite=bool(all(np.isfinite(t).all() for t in final.tensors.values())),
               reconnections=client.reconnections)
        client.bye(stage=0)
    client.close()


if __name__ == "__main__":
    main()
