"""The PS round trip next to its floor: a bare echo, a minimal server of the protocol, and ``serve-ps``.

    OMP_NUM_THREADS=2 PYTHONPATH=. python -m bench.ps_floor [--reps 10] [--rounds 60] [--parts 2,4,8]
        [--works codec,add,check,torch]

Benchmark 3 divides the PS's dense push + model reply by a bare pyzmq echo of the same bytes.
This adds the server in between (``python -m bench.zmqtools minimal``): it parses each push with
the library's codec, folds it in and checks it as the PS does, and answers with the model from
the same frames, with nothing else (no sessions, version checks, statistics or modes). The
minimal server over the echo is what the fold and the codec cost; the PS over the minimal server
is what the rest of the PS costs. ``minimal_W`` takes the minimal server's work apart (see
:func:`bench.zmqtools.minimal`): the codec alone, the add alone, the check alone, the fold and check
in torch. The same client code drives these servers (encode a push, send, receive, decode); a
second PS is driven by :meth:`PSClient.push` itself, as in the benchmark.
``split_K`` sends the same push to ``python -m bench.zmqtools split`` in K messages, each folded
as it arrives while the next are on the wire: whether that takes the fold off the critical path.
Blocks of ``--rounds`` round trips, each kind in each position of the rotation; per repetition
the ratio of the block medians to the echo's. Diagnostic only: it prints, and keeps nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq

from bench.common import ps_push_ms, summary
from bench.zmqtools import MINIMAL_WORK, model, split_update, update
from harness.ports import free_port_block
from harness.processes import start, stop
from plug_asgd.protocol.wire import Message, decode, encode
from plug_asgd.ps import PSConfig, embedded_command
from plug_asgd.worker.client import PSClient


def dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def pusher(sock: zmq.Socket, session: str, version: int, up: dict[str, Any]) -> Callable[[], None]:
    """One dense push and its decoded reply per call, on ``sock``, with the fields the PS checks."""
    state = {"seq": 0, "version": version}

    def push() -> None:
        state["seq"] += 1
        fields = {"rank": 0, "base_version": state["version"], "seq": state["seq"], "session": session,
                  "model": True, "rid": state["seq"]}
        sock.send_multipart(encode("push", fields, up), copy=False)
        state["version"] = int(_model_reply(sock, len(up)).fields["version"])
    return push


def _model_reply(sock: zmq.Socket, tensors: int) -> Message:
    """The decoded answer to a push: a model of ``tensors`` tensors, within 30 s."""
    if not sock.poll(30000):
        raise TimeoutError("no reply within 30 s")
    reply = decode(sock.recv_multipart(copy=False))
    if reply.type != "model" or len(reply.tensors) != tensors:
        raise RuntimeError(f"unexpected reply: {reply.type} {reply.fields}")
    return reply


def _split_pusher(sock: zmq.Socket, up: dict[str, Any], parts: int) -> Callable[[], None]:
    """One dense push in ``parts`` messages, then its decoded reply, per call."""
    pieces = split_update(up, parts)
    state = {"seq": 0}

    def push() -> None:
        state["seq"] += 1
        for i, piece in enumerate(pieces):
            fields = {"rank": 0, "seq": state["seq"], "part": i, "parts": parts, "rid": state["seq"]}
            sock.send_multipart(encode("push", fields, piece), copy=False)
        _model_reply(sock, len(up) * parts)
    return push


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=60, help="round trips per block")
    parser.add_argument("--parts", default="2,4,8", help="messages per push for the split server, comma-separated")
    parser.add_argument("--works", default="codec,add,check,torch",
                        help="pieces of the minimal server's work to time alone, comma-separated (none: '')")
    args = parser.parse_args(argv)
    parts = [int(p) for p in args.parts.split(",") if p]
    if any(p < 2 for p in parts):
        parser.error("--parts: each count of messages must be at least 2")
    works = [w for w in args.works.split(",") if w]
    if unknown := set(works) - (set(MINIMAL_WORK) - {"fold"}):
        parser.error(f"--works: unknown {', '.join(sorted(unknown))}; choose from codec, add, check, torch")
    port = free_port_block(5 + len(works))
    address = [f"tcp://127.0.0.1:{port + i}" for i in range(5 + len(works))]
    procs = [start([sys.executable, "-m", "bench.zmqtools", "echo", address[0]]),
             start([sys.executable, "-m", "bench.zmqtools", "minimal", address[1]]),
             *(start(embedded_command(PSConfig(bind=a, parent_pid=os.getpid()))) for a in address[2:4]),
             start([sys.executable, "-m", "bench.zmqtools", "split", address[4]]),
             *(start([sys.executable, "-m", "bench.zmqtools", "minimal", a, w]) for a, w in zip(address[5:], works,
                                                                                            strict=True))]
    ctx = zmq.Context.instance()
    socks: list[zmq.Socket] = []
    clients: list[PSClient] = []
    try:
        up = update("dense")
        echo_sock, minimal_sock, split_sock = (dealer(ctx, a) for a in (address[0], address[1], address[4]))
        work_socks = [dealer(ctx, a) for a in address[5:]]
        socks += [echo_sock, minimal_sock, split_sock, *work_socks]
        frames = encode("push", {"rank": 0, "base_version": 0, "seq": 1, "session": "x", "model": True, "rid": 1},
                        up)

        def echo() -> None:
            echo_sock.send_multipart(frames, copy=False)
            if not echo_sock.poll(30000):
                raise TimeoutError("the echo server did not answer within 30 s")
            echo_sock.recv_multipart(copy=False)

        for a in address[2:4]:
            clients.append(PSClient(a, rank=0, world_size=1, mode="asgd", request_timeout=60))
            clients[-1].hello(1, True, timeout=30)
            clients[-1].init(model())
        raw, client = clients
        versions = [client.pull().version]

        def ps_client() -> None:
            versions[0] = client.push(versions[0], up, want_model=True).version

        kinds: dict[str, Callable[[], None]] = {
            "echo": echo, "minimal": pusher(minimal_sock, "x", 0, up),
            "ps": pusher(raw._sock, raw.session, raw.pull().version, up),  # noqa: SLF001 (its hello'd connection)
            "ps_client": ps_client, **{f"split_{p}": _split_pusher(split_sock, up, p) for p in parts},
            **{f"minimal_{w}": pusher(s, "x", 0, up) for w, s in zip(works, work_socks, strict=True)}}
        for fn in kinds.values():
            for _ in range(10):
                fn()
        blocks: dict[str, list[float]] = {k: [] for k in kinds}
        names = list(kinds)
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                times = []
                for _ in range(args.rounds):
                    t = time.perf_counter()
                    kinds[name]()
                    times.append(time.perf_counter() - t)
                blocks[name].append(statistics.median(times))
        ps_ms = {"ps": ps_push_ms(raw.stats()), "ps_client": ps_push_ms(client.stats())}
    finally:
        for c in clients:
            c.close()
        for sock in socks:
            sock.close(0)
        for proc in procs:
            stop(proc)
    ratios = {k: summary([b / e for b, e in zip(v, blocks["echo"], strict=True)]) for k, v in blocks.items()
              if k != "echo"}
    print(json.dumps({"round_trip_ms": {k: round(statistics.median(v) * 1000, 3) for k, v in blocks.items()},
                      "over_echo": {k: {"median": round(r["median"], 3), "min": round(r["min"], 3),
                                        "max": round(r["max"], 3)} for k, r in ratios.items()},
                      "ps_over_minimal": round(statistics.median(
                          p / m for p, m in zip(blocks["ps"], blocks["minimal"], strict=True)), 3),
                      "ps_ms_per_push": ps_ms}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
