"""A worker without Lightning, for fault tests: pushes a constant update, logs every reply.

Each line of --log is one push as this process saw it: its base version, the version and
status of the reply, and the time. A test derives from these lines, by hand, what the central
model must hold and how stale each push was.
"""

import argparse
import json
import sys
import time
import types
from pathlib import Path

import numpy as np

# The client without plug_asgd/__init__ (which imports Lightning to register the strategy): this
# worker starts in 0.2 s instead of 3.5, as the embedded PS does (plug_asgd.ps.embedded_command).
_package = types.ModuleType("plug_asgd")
_package.__path__ = [str(Path(__file__).resolve().parents[2] / "plug_asgd")]
sys.modules.setdefault("plug_asgd", _package)

from plug_asgd.worker.client import PSClient  # noqa: E402

SHAPE = (4,)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mode", default="asgd")
    parser.add_argument("--pushes", type=int, default=100)
    parser.add_argument("--delta", type=float, default=1.0)
    parser.add_argument("--interval", type=float, default=0.05, help="seconds of 'compute' before each push")
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--log", required=True)
    parser.add_argument("--keys", default=None, help="CURVE keys (DIR/worker of plug-asgd keygen)")
    args = parser.parse_args()
    client = PSClient(args.address, rank=args.rank, world_size=args.world, mode=args.mode, request_timeout=120,
                      heartbeat_s=args.heartbeat, keys=args.keys)
    with open(args.log, "a") as log:
        def record(**fields) -> None:
            log.write(json.dumps({**fields, "t": time.time()}) + "\n")
            log.flush()

        client.hello(stage=0, training=True, timeout=30)
        client.init({"w": np.zeros(SHAPE)})
        reply = client.pull()
        record(event="pulled", version=reply.version, w=reply.tensors["w"].tolist())
        version = reply.version
        for _ in range(args.pushes):
            time.sleep(args.interval)
            reply = client.push(version, {"w": np.full(SHAPE, args.delta)}, want_model=False)
            record(event="push", base=version, version=reply.version, status=reply.status)
            version = reply.version
            if reply.stop:
                break
        final = client.pull()  # what the PS holds as this worker leaves
        record(event="done", version=final.version, w=final.tensors["w"].tolist())
        client.bye(stage=0)
    client.close()


if __name__ == "__main__":
    main()
