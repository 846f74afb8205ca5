"""Where the steps of 2 asgd workers go: timers around each worker's push, while the two race.

    PYTHONPATH=. python -m bench.worker_push_timing [--mode asgd] [--compression F] [--seconds 20] [--out DIR]
        [--port 48700]

:mod:`bench.push_timeline` does this for a lone worker; here 2 workers (one thread each, as in
the time-to-accuracy benchmark) train the recipe CNN on Fashion-MNIST for ``--seconds`` under
``AsyncPSStrategy(mode=...)`` (asgd, or ``--mode``) with its embedded PS, launched by :mod:`bench.train`. Each rank
prints, as one JSON line, the calls and median milliseconds of the pieces of its pushes: the
whole push (``PushExchange.send``), the update (``update``), loading a reply's model (``load``), the
client's request (send to reply, with whatever the worker does while it waits), and the whole
optimizer step (forward, backward and the push), and AdaComp's selection of what to send
(``encode``, adacomp only: one call per tensor of each push; ``encode_difference`` where the push went from the
client's held central model, plug_asgd.worker.exchange.held_base); and the guesses of an "own" reply it made
(``comm_stats``). Rank 0 then prints the run's samples/s and the PS's time per push.
Diagnostic only: it wraps those methods, so it measures this code, not a protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import FASHION, ROOT, time_calls

PIECES = (("PushExchange", "send"), ("PushExchange", "update"), ("Exchange", "load"), ("PSClient", "request"),
          ("AsyncPSStrategy", "optimizer_step"), ("TopKResidual", "encode"), ("TopKResidual", "encode_difference"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="asgd", help="the strategy's mode (adacomp: its top-k selection timed too)")
    parser.add_argument("--compression", type=float, default=None,
                        help="the fraction of coordinates adacomp sends (default: the mode's, 0.01)")
    parser.add_argument("--seconds", type=float, default=20.0, help="training time of each worker")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "worker-push-timing",
                        help="folder of the launch's files, emptied first (default: runs/worker-push-timing)")
    parser.add_argument("--port", type=int, default=48700, help="DDP's store port; the embedded PS takes the next")
    args = parser.parse_args(argv)
    if not FASHION.is_dir():
        print(f"Fashion-MNIST is not at {FASHION}: install Debian's dataset-fashion-mnist (scripts/setup.sh)")
        return 2
    # Lightning starts rank 1 by running this same command again, with LOCAL_RANK set: both ranks get here
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "LOCAL_RANK" not in os.environ:  # rank 0, before it starts rank 1: rank 0 polls for rank 1's record by name
        shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    run = {"bench": "worker_push_timing", "name": args.mode, "kind": "asgd", "mode": args.mode, "batch_size": 32,
           "max_steps": 100_000, "epochs": 1000, "time_limit_s": args.seconds, "warmup": 5}
    if args.compression is not None:
        run["compression"] = args.compression
    spec = {"workers": 2, "data_dir": str(FASHION), "test_subset": 500, "runs": [run]}

    from bench import train
    from plug_asgd.compressors.sparse import TopKResidual
    from plug_asgd.strategy import AsyncPSStrategy
    from plug_asgd.worker.client import PSClient
    from plug_asgd.worker.exchange import Exchange, PushExchange

    owners = {"AsyncPSStrategy": AsyncPSStrategy, "PSClient": PSClient, "Exchange": Exchange,
              "PushExchange": PushExchange, "TopKResidual": TopKResidual}
    times: dict[str, list[float]] = defaultdict(list)
    for owner, name in PIECES:
        time_calls(owners[owner], name, times[name])
    comm: dict[str, Any] = {}
    teardown = AsyncPSStrategy.teardown

    def keep_counters(self: AsyncPSStrategy) -> None:  # the worker's counters, before it leaves the PS
        comm.update(self.comm_stats())
        teardown(self)

    AsyncPSStrategy.teardown = keep_counters  # type: ignore[method-assign]
    rank = os.environ.get("LOCAL_RANK", "0")

    def report() -> None:
        pieces = {k: {"n": len(v), "median_ms": round(statistics.median(v) * 1000, 3)} for k, v in times.items() if v}
        print("rank " + rank + " " + json.dumps({"pieces": pieces, **{k: comm.get(k) for k in (
            "pushes", "own_replies", "own_guesses", "own_guesses_right")}}), flush=True)

    result = train.run_one(spec, run, 0, args.out)  # rank 1 returns None once rank 0 is done
    report()
    if result is not None:
        (args.out / "run0_done").touch()  # rank 1 waits for this
        print("samples/s " + json.dumps({"samples_per_s": round(result["samples_per_s"], 1),
                                         "step_time_median_ms": round(result["step_time_median_s"] * 1000, 2),
                                         "ps_ms_per_push": result["ps_push_ms"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
