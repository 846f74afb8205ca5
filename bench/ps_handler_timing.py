"""The PS's own time per push, without sockets or threads: where its per-message Python goes.

    PYTHONPATH=. python -m bench.ps_handler_timing [--values 2] [--pushes 3000]

A :class:`~plug_asgd.ps.ParameterServer` in this process takes pushes of the recipe CNN's
8 tensors, each cut to ``--values`` values (2: the per-message costs alone; 0: the whole CNN),
through ``on_frames`` called directly, its socket's sends replaced by a no-op. It prints the
median time of the whole handling and of its pieces (decode, fold, reply). Diagnostic only: it
wraps private methods, so it measures this code, not a protocol.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from typing import Any

import zmq

import bench.zmqtools as zt
from bench.common import time_calls
from plug_asgd.modes import fold
from plug_asgd.protocol.wire import encode
from plug_asgd.ps import ParameterServer, PSConfig
from plug_asgd.ps import server as serving

TIMES: dict[str, list[float]] = defaultdict(list)


class _NoSocket:
    def __init__(self, copy_threshold: int) -> None:
        self.copy_threshold = copy_threshold

    def send_multipart(self, parts: Any, flags: int = 0, copy: bool = True) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, default=2, help="values per tensor (0: the CNN's own shapes)")
    parser.add_argument("--pushes", type=int, default=3000)
    args = parser.parse_args(argv)
    shapes = zt.CNN_SHAPES if args.values == 0 else {n: (args.values,) for n in zt.CNN_SHAPES}
    zt.CNN_SHAPES = shapes  # model() and update() read it
    server = ParameterServer(PSConfig(bind="tcp://127.0.0.1:0", shm_pushes=False))
    real = server.socket
    server.socket = _NoSocket(real.copy_threshold)  # type: ignore[assignment]
    identity = zmq.Frame(b"\x00bench")

    def message(msg_type: str, fields: dict[str, Any], tensors: Any = None) -> list[Any]:
        frames = encode(msg_type, {**fields, "rid": 1}, tensors)
        return [identity, *(zmq.Frame(bytes(memoryview(f))) for f in frames)]

    try:
        session = "s" * 32
        server.on_frames(message("hello", {"rank": 0, "world_size": 1, "stage": 1, "training": True,
                                            "session": session, "mode": "asgd", "protocol": 1}))
        server.on_frames(message("init", {"rank": 0}, zt.model()))
        update = zt.update("dense")
        pushes = [message("push", {"rank": 0, "base_version": i, "seq": i + 1, "session": session, "model": True},
                          update) for i in range(args.pushes)]
        warm = args.pushes // 5
        for frames in pushes[:warm]:
            server.on_frames(frames)
        for owner, name, label in ((ParameterServer, "on_frames", "whole handling"), (serving, "decode", "decode"),
                                   (fold, "_fold_out_of_place", "fold and check"),
                                   (ParameterServer, "_send_model", "reply")):
            time_calls(owner, name, TIMES[label])
        for frames in pushes[warm:]:
            server.on_frames(frames)
        if server.store.version != args.pushes or server.stats.refused:
            raise SystemExit(f"the PS refused pushes: {dict(server.stats.refused)}")
    finally:
        server.socket = real
        real.close(0)
    for label, times in TIMES.items():
        print(f"{label:16s} {statistics.median(times) * 1e6:8.1f} us  (median of {len(times)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
