"""A PS under a flood: its RSS and an honest worker's round trip before, during and after (issue 19).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.flood [--idle 500] [--rate 1000] [--slow-clients 8]
        [--gather-every 2] [--seconds 10]

One PS (``serve-ps``'s, on loopback, no keys) and one honest worker (rank 0 of 2, the recipe
CNN's 1,199,882 parameters, dense pushes answered with the model: a 4.8 MB reply each). The
worker pushes back to back for ``--seconds`` idle; then, for ``--seconds`` more, a second process
floods the PS with:

- ``--idle`` connections that say nothing;
- ``--slow-clients`` clients that never read their replies: they ask for the model ``--slow-rate``
  times a second between them, in turn, so that each reply queued pins a model version of its own
  (the PS queues 32 a connection and 128 MiB over all of them, then drops: issue 47);
- every ``--gather-every`` seconds, from the connection that holds rank 1, a gather of 22,000 empty
  tensors whose reply no worker could read (refused, ``limit``), then one of 20,000 that fits and
  waits (each replaced by the next: issue 47);
- ``--rate`` forged messages a second, in turn: a push, a bye for rank 0 and a heartbeat for rank 0
  from a connection that never said hello (``not_member``), a hello for the live rank 0 without
  its token (``rank_taken``), and from a connection that holds rank 1 (a local user can take a
  free rank): a push naming rank 0 (``not_owner``), an empty push (``empty``) and a gather nested
  1,022 levels deep (``limit``);

and for ``--seconds`` after the flood stopped. It prints (and writes to ``--out``, by default
``bench/results/flood.json``) per phase the median and 90th percentile of the worker's round trip
and the PS's RSS (median and peak, sampled every 0.1 s), the refusals by code and the replies
dropped, and whether the PS crashed (it must still answer, then exit 0 on SIGTERM). The goals:
the PS's RSS under ``--rss-bound-mb`` (512) throughout, the honest round trip within 1.5x idle.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from bench.common import ROOT, commit, machine, write_json
from bench.zmqtools import model, update
from harness.ports import free_port_block
from harness.processes import start, stop
from plug_asgd.protocol.wire import PROTOCOL_VERSION, encode
from plug_asgd.ps import PSConfig, embedded_command
from plug_asgd.worker.client import PSClient

OUT = Path(__file__).resolve().parent / "results" / "flood.json"


def rss_mb(pid: int) -> float:
    """The resident set of process ``pid``, MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _deep_gather() -> list[bytes]:
    """Rank 1's gather of an object nested 1,022 levels (msgpack-python packs 511 at most: spliced in)."""
    mark = "@" * 40
    header = msgpack.packb({"v": PROTOCOL_VERSION, "type": "gather", "tensors": [], "fields": {
        "rid": 1, "rank": 1, "stage": 1, "seq": 0, "kind": "broadcast", "obj": mark}})
    return [header.replace(msgpack.packb(mark), b"\x91" * 1022 + b"\xc0")]


def _gathers() -> list[list[bytes]]:
    """Rank 1's gathers of 22,000 and 20,000 empty tensors: the first's reply would pass the 1 MiB header a worker
    reads (refused), the second's fits (it waits for rank 0)."""
    fields = {"rid": 1, "rank": 1, "stage": 1, "seq": 1, "kind": "all_gather"}
    return [encode("gather", fields, {f"t{i:07d}": np.zeros(0, np.float32) for i in range(count)})
            for count in (22_000, 20_000)]


def flood(address: str, idle: int, rate: float, slow_rate: float, slow_clients: int, gather_every: float) -> None:
    """The flooding process: runs until killed."""
    ctx = zmq.Context.instance()
    ctx.set(zmq.MAX_SOCKETS, idle + 64)

    def dealer(rcvhwm: int = 1000) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.connect(address)
        return sock

    quiet = [dealer() for _ in range(idle)]  # noqa: F841 (held open, silent)
    slow, stranger, member = [dealer(rcvhwm=1) for _ in range(slow_clients)], dealer(), dealer()
    member.send_multipart(encode("hello", {"rid": 0, "rank": 1, "world_size": 2, "stage": 1, "session": "flood",
                                           "mode": "asgd", "training": False}))
    w = dict([next(iter(update("dense").items()))])  # one tensor of a real update
    forged = itertools.cycle([
        (stranger, encode("push", {"rid": 1, "rank": 0, "base_version": 0, "seq": 1, "session": "x"}, w)),
        (stranger, encode("bye", {"rid": 1, "rank": 0, "stage": 1})),
        (stranger, encode("heartbeat", {"rank": 0, "session": "guess", "token": "0" * 32})),
        (stranger, encode("hello", {"rid": 1, "rank": 0, "world_size": 2, "stage": 1, "session": "thief",
                                    "mode": "asgd"})),
        (member, encode("push", {"rid": 1, "rank": 0, "base_version": 0, "seq": 1, "session": "flood"}, w)),
        (member, encode("push", {"rid": 1, "rank": 1, "base_version": 0, "seq": 1, "session": "flood"})),
        (member, _deep_gather()),
    ])
    gathers = itertools.cycle(_gathers() if gather_every > 0 else [])
    start_t, sent, slow_sent, gathers_sent = time.monotonic(), 0, 0, 0
    while True:
        now = time.monotonic() - start_t
        while sent < now * rate:
            sock, frames = next(forged)
            sock.send_multipart(frames)
            sent += 1
        while slow and slow_sent < now * slow_rate:
            slow[slow_sent % len(slow)].send_multipart(encode("pull", {"rid": 1}))
            slow_sent += 1
        while gather_every > 0 and gathers_sent <= now / gather_every:
            member.send_multipart(next(gathers))
            gathers_sent += 1
        for sock in (stranger, member):  # their error replies are read; the slow client's never are
            while sock.poll(0):
                sock.recv_multipart()
        time.sleep(0.001)


def phase(client: PSClient, pid: int, seconds: float, up: dict[str, Any]) -> dict[str, Any]:
    """Back-to-back pushes for ``seconds``: round trip (ms) and the PS's RSS (MB), sampled every 0.1 s."""
    rss: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss.append(rss_mb(pid))
            done.wait(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    times, version, end = [], client.pull().version, time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            t = time.perf_counter()
            version = client.push(version, up).version
            times.append((time.perf_counter() - t) * 1000)
    finally:
        done.set()
        sampler.join()
    times.sort()
    return {"round_trips": len(times), "round_trip_ms_median": round(statistics.median(times), 3),
            "round_trip_ms_p90": round(times[int(0.9 * (len(times) - 1))], 3),
            "rss_mb_median": round(statistics.median(rss), 1), "rss_mb_peak": round(max(rss), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=500, help="idle connections")
    parser.add_argument("--rate", type=float, default=1000.0, help="forged messages a second")
    parser.add_argument("--slow-rate", type=float, default=20.0, help="model requests a second never read")
    parser.add_argument("--slow-clients", type=int, default=8, help="clients that never read (they ask in turn)")
    parser.add_argument("--gather-every", type=float, default=2.0, help="seconds between rank 1's gathers of "
                        "20,000 and 22,000 empty tensors (0: none)")
    parser.add_argument("--rss-bound-mb", type=float, default=512.0, help="the PS's RSS must stay under this")
    parser.add_argument("--seconds", type=float, default=10.0, help="of each phase")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--ps-code", type=Path, help="run the PS from this folder's plug_asgd (another commit's, "
                        "from `git archive`), to compare")
    parser.add_argument("--flood", help=argparse.SUPPRESS)  # the flooding process: the PS's address
    args = parser.parse_args(argv)
    if args.flood:
        flood(args.flood, args.idle, args.rate, args.slow_rate, args.slow_clients, args.gather_every)
        return 0
    address = f"tcp://127.0.0.1:{free_port_block(1)}"
    cmd = embedded_command(PSConfig(bind=address, worker_timeout=60))
    if args.ps_code is not None:  # the command puts this checkout first on sys.path: that one instead
        cmd[2] = cmd[2].replace(repr(str(ROOT)), repr(str(args.ps_code.resolve())))
    ps = start(cmd)
    client = PSClient(address, rank=0, world_size=2, mode="asgd", request_timeout=60)
    flooder = None
    result: dict[str, Any] = {"command": " ".join(["python -m bench.flood", *(argv or sys.argv[1:])]),
                              "commit": commit(), "machine": machine(), "idle": args.idle, "rate": args.rate,
                              "slow_rate": args.slow_rate, "slow_clients": args.slow_clients,
                              "gather_every": args.gather_every, "seconds": args.seconds,
                              "ps_code": str(args.ps_code) if args.ps_code else None}
    try:
        client.hello(1, True, timeout=30)
        client.init(model())
        up = update("dense")
        phase(client, ps.pid, 2.0, up)  # warm-up
        result["before"] = phase(client, ps.pid, args.seconds, up)
        flooder = start([sys.executable, "-m", "bench.flood", "--flood", address, "--idle", str(args.idle),
                         "--rate", str(args.rate), "--slow-rate", str(args.slow_rate),
                         "--slow-clients", str(args.slow_clients), "--gather-every", str(args.gather_every)])
        result["during"] = phase(client, ps.pid, args.seconds, up)
        if flooder.poll() is not None:
            raise RuntimeError(f"the flooding process ended early (exit code {flooder.returncode})")
        stop(flooder)
        flooder = None
        result["after"] = phase(client, ps.pid, args.seconds, up)
        stats = client.stats()
        result.update(refused=stats["refused"], forged_refused=sum(stats["refused"].values()),
                      replies_dropped=stats.get("replies_dropped", {}),
                      replies_queued_peak_mb=round(stats.get("replies_queued_peak", 0) / 2**20, 1),
                      version=stats["version"], workers=stats["workers"])
    finally:
        client.close()
        if flooder is not None:
            stop(flooder)
        ps.terminate()
        try:
            code = ps.wait(30)
        finally:
            stop(ps)
    result["ps_exit_code"] = code
    result["crashes"] = int(code != 0)
    idle = result["before"]["round_trip_ms_median"]
    result["during_over_before"] = round(result["during"]["round_trip_ms_median"] / idle, 3)
    result["after_over_before"] = round(result["after"]["round_trip_ms_median"] / idle, 3)
    peak = max(result[p]["rss_mb_peak"] for p in ("before", "during", "after"))
    result.update(rss_bound_mb=args.rss_bound_mb, rss_mb_peak=peak, rss_within_bound=peak < args.rss_bound_mb,
                  round_trip_within_1_5x=result["during_over_before"] <= 1.5)
    write_json(args.out, result)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
