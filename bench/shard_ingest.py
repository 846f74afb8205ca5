"""Sharded PS ingest: dense pushes/s of 1 and 2 shards, each shard on an emulated host behind its own link.

``python -m bench.shard_ingest [--quick] [--out DIR]`` (root: it makes network namespaces).

**What runs.** Each PS shard is a real ``plug-asgd serve-ps`` (``--shard I/N`` with 2 shards, none with
1), mode asgd, on a host of its own (a :class:`harness.netns.Topology` namespace) whose link is capped by
htb at ``--rate`` Mbit/s (1 Gbit/s) in both directions. The pushing clients are real workers' clients,
one process per host: :func:`plug_asgd.sharding.config.connect` gives a
:class:`~plug_asgd.sharding.client.ShardedClient`
over the shards (a ``PSClient`` for one PS, as the strategy does), each push the recipe CNN's 1,199,882
float32 values as a dense update, asked back ``want_model="unless_own"`` as a worker asks (a push raced
by another worker's comes back with the model, which for a dense update is every value again). The
clients' links are not capped (the veth runs at what the cores give it: see ``probe``), so what bounds
the run is the shards' links: with one shard its single link carries every push in and every reply
out; with two, each shard's link carries its half of each.

**What is counted.** ``pushes_per_s``: pushes answered "applied" by every shard (each folded on every
shard), counted from the clients' reply times in a window after a warm-up, over the window's length.
``link_mbit``: the bytes each shard's interface received (pushes in) and sent (replies out) in that
window, frames included, per second. Over the whole phase, each shard's received bytes are checked
against its ``pushes_applied`` x its pieces' bytes (``Partition.loads``), and its sent bytes against its
own ``bytes_out`` counter. ``link_bound_per_s``: the pushes/s the measured link rate (``probe``, a TCP
transfer client -> shard) allows, each push and its reply carrying the largest shard's pieces.

Also, with ``local`` (the full size): the same clients and shards as processes on this one machine over
loopback, no caps; there the machine's cores bound it (the table says how many).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine, summary, write_json
from bench.zmqtools import CNN_PARAMETERS, CNN_SHAPES, model, update
from harness.netns import Topology, TopologyError
from harness.ports import free_port_block
from harness.processes import child_env, start, stop
from plug_asgd.protocol.partition import Partition

PS_PORT = 2223  # each shard is its own host: a fixed port clashes with nothing
TARGET = 1.8  # issue 21: aggregate dense ingest of 2 shards over 1, each behind a 1 Gbit/s link
SIZES: dict[str, dict[str, Any]] = {
    # the test suite's size: one repetition of 1 and 2 shards, 3 s windows; no probe, no local run
    "quick": {"clients": 4, "warmup_s": 1.5, "window_s": 3.0, "reps": 1, "probe": False, "local": False,
              "start_s": 4.0},
    "full": {"clients": 4, "warmup_s": 3.0, "window_s": 15.0, "reps": 3, "probe": True, "local": True,
             "start_s": 5.0},
}


def piece_bytes(shards: int) -> list[int]:
    """float32 bytes of each shard's pieces of the CNN (one shard: the whole model)."""
    return [4 * load for load in Partition(CNN_SHAPES, shards).loads]


# -- the processes on the hosts -----------------------------------------------------------------------

def client_main(addresses: list[str], rank: int, clients: int, until: float, out: Path) -> None:
    """One pushing worker: hello, rank 0 initialises, pull; push the same dense update until ``until``; bye.

    Writes the time of every reply (``time.time()``, the clock every namespace shares) and its status."""
    from plug_asgd.sharding.config import connect

    client = connect(addresses, CNN_SHAPES, rank=rank, world_size=clients, mode="asgd", request_timeout=60.0)
    times: list[float] = []
    statuses: Counter[str] = Counter()
    own = 0
    try:
        client.hello(1, True, timeout=60.0)
        if rank == 0:
            client.init(model())
        reply = client.pull_once_initialized(60.0)
        if reply is None:
            raise SystemExit("the PS was not initialised within 60 s")
        up = update("dense", seed=rank + 1)
        while time.time() < until:
            reply = client.push(reply.version, up, want_model="unless_own")
            times.append(time.time())
            statuses[reply.status] += 1
            own += reply.own
        counters = client.counters.as_dict()
        client.bye(1)
    finally:
        client.close()
    write_json(out, {"rank": rank, "times": times, "statuses": dict(statuses), "own_replies": own,
                     "counters": counters})


def stats_main(addresses: list[str]) -> None:
    """Print each PS's counters (a bystander's stats request), as one JSON list."""
    from plug_asgd.worker.client import PSClient

    each = []
    for address in addresses:
        client = PSClient(address, rank=0, world_size=1, mode="", request_timeout=30.0, heartbeat_s=None)
        try:
            each.append(client.stats(timeout=30.0))
        finally:
            client.close()
    print(json.dumps(each))


# -- one phase: N shards, K clients ---------------------------------------------------------------------

def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread) the processes ``pids`` have used so far; 0 for one gone."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def machine_busy() -> tuple[float, float]:
    """(busy, all) CPU seconds of the whole machine so far, every core: softirq (the links' work) is busy."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(values) - idle) / tick, sum(values) / tick


class Place:
    """Where the processes of a phase run: emulated hosts (a Topology), or this machine over loopback."""

    def __init__(self, topo: Topology | None, clients: int) -> None:
        self.topo = topo
        self.clients = clients
        self.base_port = None if topo is not None else free_port_block(4)

    def shard(self, i: int) -> tuple[list[str], str, int]:
        """(command prefix, host, port) of shard ``i``."""
        if self.topo is None:
            assert self.base_port is not None
            return [], "127.0.0.1", self.base_port + i
        h = self.topo.hosts[f"s{i}"]
        return h.prefix, h.address, PS_PORT

    def client(self, rank: int) -> list[str]:
        return [] if self.topo is None else self.topo.hosts[f"c{rank}"].prefix

    def counters(self) -> dict[str, dict[str, int]] | None:
        return None if self.topo is None else self.topo.counters()


def run_phase(place: Place, shards: int, size: dict[str, Any], work: Path) -> dict[str, Any]:
    """Shards up, clients pushing until a common deadline, counters read around a window, everything stopped."""
    work.mkdir(parents=True, exist_ok=True)
    env = child_env(OMP_NUM_THREADS="1")
    ps_procs: list[subprocess.Popen] = []
    client_procs: list[subprocess.Popen] = []
    addresses = []
    try:
        for i in range(shards):
            prefix, host, port = place.shard(i)
            addresses.append(f"tcp://{host}:{port}")
            cmd = [*prefix, sys.executable, "-m", "plug_asgd.cli.app", "serve-ps", "--host", host, "--port", str(port),
                   "--mode", "asgd", "--quiet", "--log-every", "0", "--run-dir", str(work / f"ps{i}"),
                   *(["--insecure"] if place.topo is not None else []),
                   *(["--shard", f"{i}/{shards}"] if shards > 1 else [])]
            ps_procs.append(start(cmd, env=env, log=work / f"ps{i}.log"))
        before = place.counters()
        begin = time.time()
        window_start = begin + size["start_s"] + size["warmup_s"]
        window_end = window_start + size["window_s"]
        until = window_end + 0.5
        for rank in range(place.clients):
            cmd = [*place.client(rank), sys.executable, "-m", "bench.shard_ingest", "client", "--addresses",
                   ",".join(addresses), "--rank", str(rank), "--clients", str(place.clients), "--until", str(until),
                   "--out", str(work / f"client{rank}.json")]
            client_procs.append(start(cmd, env=env, log=work / f"client{rank}.log"))
        pids = {"ps": [p.pid for p in ps_procs], "clients": [p.pid for p in client_procs]}
        time.sleep(max(0.0, window_start - time.time()))
        t0, c0 = time.time(), place.counters()
        cpu0 = {k: cpu_seconds(v) for k, v in pids.items()}, machine_busy(), os.getloadavg()[0]
        time.sleep(max(0.0, window_end - time.time()))
        t1, c1 = time.time(), place.counters()
        cpu1 = {k: cpu_seconds(v) for k, v in pids.items()}, machine_busy()
        codes = []
        for p in client_procs:
            try:
                codes.append(p.wait(timeout=max(5.0, until - time.time() + 90)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        after = place.counters()
        stats_cmd = [*place.client(0), sys.executable, "-m", "bench.shard_ingest", "stats", "--addresses",
                     ",".join(addresses)]
        done = subprocess.run(stats_cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    finally:
        for p in client_procs:
            stop(p, grace=2.0)
        for p in ps_procs:
            stop(p, grace=5.0)
    if any(c != 0 for c in codes) or done.returncode != 0:
        return {"shards": shards, "error": f"client exit codes {codes} (None: still running), stats exit code "
                                           f"{done.returncode} {done.stderr[-500:]}; logs in {work}"}
    ps_stats = json.loads(done.stdout)
    clients = [json.loads((work / f"client{r}.json").read_text()) for r in range(place.clients)]
    result = summarize(shards, clients, ps_stats, (t0, c0), (t1, c1), before, after,
                       late=[c["rank"] for c in clients if not c["times"] or c["times"][0] > t0])
    # what the cores did in the window: ours (PS processes, clients), the whole machine's (the links' kernel work
    # and anything else running), and the load average as it began
    window = t1 - t0
    busy, total = cpu1[1][0] - cpu0[1][0], cpu1[1][1] - cpu0[1][1]
    result["cpu"] = {"cores": os.cpu_count(), "load_average_at_window": round(cpu0[2], 2),
                     "machine_busy_fraction": round(busy / total, 3) if total > 0 else None,
                     **{f"{k}_cores": round((cpu1[0][k] - cpu0[0][k]) / window, 3) for k in pids}}
    if result["pushes_in_window"]:
        result["cpu"]["client_ms_per_push"] = round(1000 * (cpu1[0]["clients"] - cpu0[0]["clients"])
                                                    / result["pushes_in_window"], 2)
    return result


def summarize(shards: int, clients: list[dict], ps_stats: list[dict], first: tuple[float, Any],
              last: tuple[float, Any], before: Any, after: Any, late: list[int]) -> dict[str, Any]:
    """The phase's figures from the clients' reply times, the PSes' counters and the links' counters."""
    (t0, c0), (t1, c1) = first, last
    window = t1 - t0
    in_window = sum(1 for c in clients for t in c["times"] if t0 <= t < t1)
    pieces = piece_bytes(shards)
    result: dict[str, Any] = {
        "shards": shards, "clients": len(clients), "window_s": round(window, 3), "pushes_in_window": in_window,
        "pushes_per_s": round(in_window / window, 2), "clients_late": late,
        "pushes": sum(len(c["times"]) for c in clients),
        "statuses": dict(sum((Counter(c["statuses"]) for c in clients), Counter())),
        "own_replies": sum(c["own_replies"] for c in clients),
        "piece_bytes": pieces,
        "ps": [{k: s.get(k) for k in ("version", "pushes_applied", "bytes_in", "bytes_out", "push_bytes_in",
                                      "model_bytes_out", "model_replies", "delta_replies", "own_replies",
                                      "busy_fraction", "busy_cpu_s", "uptime_s", "workers")} for s in ps_stats],
    }
    if c0 is not None:
        result["link_mbit"] = {f"s{i}": {"in": round((c1[f"s{i}"]["rx"] - c0[f"s{i}"]["rx"]) * 8 / window / 1e6, 1),
                                         "out": round((c1[f"s{i}"]["tx"] - c0[f"s{i}"]["tx"]) * 8 / window / 1e6, 1)}
                               for i in range(shards)}
        result["link_bytes_phase"] = {f"s{i}": {"in": after[f"s{i}"]["rx"] - before[f"s{i}"]["rx"],
                                                "out": after[f"s{i}"]["tx"] - before[f"s{i}"]["tx"]}
                                      for i in range(shards)}
        # what each link carried against what its pushes and the PS's replies account for
        result["link_in_over_pushes"] = [
            round(result["link_bytes_phase"][f"s{i}"]["in"] / ((ps_stats[i]["pushes_applied"] + 1) * pieces[i]), 4)
            for i in range(shards)]
        result["link_out_over_ps_bytes_out"] = [
            round(result["link_bytes_phase"][f"s{i}"]["out"] / ps_stats[i]["bytes_out"], 4) for i in range(shards)]
    return result


# -- the runs ----------------------------------------------------------------------------------------------

def probe(topo: Topology, size: dict[str, Any]) -> dict[str, Any]:
    """TCP transfers: client -> shard (through the shard's capped link), and client -> client (no cap)."""
    capped = topo.measure("c0", "s0", int(125e6 * 2))
    out = {"client_to_shard": capped}
    if size["probe"]:
        out["client_to_client"] = topo.measure("c0", "c1", int(2e9))
    return out


def run(size: dict[str, Any], rate: float, out: Path) -> dict[str, Any]:
    """Alternated phases of 1 and 2 shards on emulated hosts, then (``local``) on this machine alone."""
    command = "python -m bench.shard_ingest " + " ".join(sys.argv[1:])
    clients = size["clients"]
    results: dict[str, Any] = {"machine": machine(), "command": command, "rate_mbit": rate, "size": size,
                               "parameters": CNN_PARAMETERS, "model_bytes": 4 * CNN_PARAMETERS,
                               "piece_bytes": {str(n): piece_bytes(n) for n in (1, 2)}, "hosts": {}, "local": {}}
    started = time.monotonic()
    names = ["s0", "s1", *(f"c{r}" for r in range(clients))]
    with Topology(names, None, host_rates={"s0": rate, "s1": rate}, leaf=size.get("leaf")) as topo:
        results["probe"] = probe(topo, size)
        print(f"[shard_ingest] probe: {json.dumps(results['probe'])}", flush=True)
        place = Place(topo, clients)
        for rep in range(size["reps"]):
            for shards in ((1, 2) if rep % 2 == 0 else (2, 1)):
                r = run_phase(place, shards, size, out / "work" / f"hosts-{shards}-{rep}")
                results["hosts"].setdefault(str(shards), []).append(r)
                print(f"[shard_ingest] hosts, {shards} shard(s), rep {rep}: " + (r.get("error") or
                      f"{r['pushes_per_s']} pushes/s, links {r.get('link_mbit')}"), flush=True)
                write_json(out / "results.json", results)
    if size["local"]:
        place = Place(None, clients)
        for rep in range(size["reps"]):
            for shards in ((1, 2) if rep % 2 == 0 else (2, 1)):
                r = run_phase(place, shards, size, out / "work" / f"local-{shards}-{rep}")
                results["local"].setdefault(str(shards), []).append(r)
                print(f"[shard_ingest] one host, {shards} shard(s), rep {rep}: "
                      + (r.get("error") or f"{r['pushes_per_s']} pushes/s"), flush=True)
                write_json(out / "results.json", results)
    results["wall_s"] = round(time.monotonic() - started, 1)
    results["summary"] = {where: ratio(results[where]) for where in ("hosts", "local") if results[where]}
    bound = results["probe"]["client_to_shard"]["bytes"] / results["probe"]["client_to_shard"]["seconds"]
    results["link_bound_per_s"] = {str(n): round(bound / max(piece_bytes(n)), 2) for n in (1, 2)}
    write_json(out / "results.json", results)
    (out / "results.md").write_text(report(results))
    return results


def ratio(phases: dict[str, list[dict]]) -> dict[str, Any]:
    """pushes/s of each shard count (median, spread) and of 2 over 1, repetition by repetition."""
    rates = {n: [r.get("pushes_per_s") for r in phases.get(n, [])] for n in ("1", "2")}
    pairs = [b / a for a, b in zip(rates["1"], rates["2"], strict=False) if a and b]
    return {"pushes_per_s": {n: summary(v) for n, v in rates.items()}, "two_over_one": summary(pairs)}


def _fmt(s: dict[str, Any], digits: int = 1) -> str:
    if not s["n"]:
        return "no result"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f} .. {s['max']:.{digits}f}], {s['n']}"


def report(results: dict[str, Any]) -> str:
    """The markdown table of a run (results.md)."""
    m = results["machine"]
    lines = [f"# Sharded PS ingest (`{results['command']}`)", "",
             f"{m['date']}, commit {m['commit']}, {m['cpu_count']} cores ({m['cpu_model']}), "
             f"{results['wall_s']} s. Dense pushes of {results['parameters']:,} float32 values "
             f"({results['model_bytes']:,} bytes), asgd, {results['size']['clients']} client processes, each "
             f"window {results['size']['window_s']} s after a {results['size']['warmup_s']} s warm-up.", "",
             "| where | shards | pushes/s (median [min .. max], reps) | each shard's link in / out, Mbit/s "
             "(first rep) | link bound, pushes/s | 2 shards / 1 |", "|---|---|---|---|---|---|"]
    probe_mbit = results["probe"]["client_to_shard"]["mbit_per_s"]
    for where, label in (("hosts", f"emulated hosts, each shard behind {results['rate_mbit']:g} Mbit/s "
                                   f"(measured {probe_mbit:.0f}), clients uncapped"),
                         ("local", f"one host, loopback, no caps ({m['cpu_count']} cores)")):
        if where not in results["summary"]:
            continue
        s = results["summary"][where]
        for n in ("1", "2"):
            first = next((r for r in results[where].get(n, []) if "error" not in r), {})
            links = "; ".join(f"{k} {v['in']:.0f} / {v['out']:.0f}" for k, v in first.get("link_mbit", {}).items())
            bound = results["link_bound_per_s"][n] if where == "hosts" else "-"
            ratio_text = (f"**{_fmt(s['two_over_one'], 2)}**" + (f" (target >= {TARGET})" if where == "hosts" else "")
                          if n == "2" else "")
            lines.append(f"| {label if n == '1' else ''} | {n} | {_fmt(s['pushes_per_s'][n])} | {links or '-'} | "
                         f"{bound} | {ratio_text} |")
    probe_text = "; ".join(f"{k.replace('_', ' ')}: {v['mbit_per_s']:.0f} Mbit/s" for k, v in results["probe"].items())
    lines += ["", f"TCP probes (payload): {probe_text}. Link bound: the measured client -> shard rate over the "
              "largest shard's piece bytes (a push in and its reply out each carry them; the link is full duplex).",
              "Counted: pushes answered 'applied' by every shard, by their clients' reply times inside the window; "
              "link Mbit/s from each shard host's interface counters over the same window (frames included).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["client"]:
        p = argparse.ArgumentParser(prog="python -m bench.shard_ingest client")
        p.add_argument("--addresses", required=True)
        p.add_argument("--rank", type=int, required=True)
        p.add_argument("--clients", type=int, required=True)
        p.add_argument("--until", type=float, required=True)
        p.add_argument("--out", type=Path, required=True)
        a = p.parse_args(argv[1:])
        client_main(a.addresses.split(","), a.rank, a.clients, a.until, a.out)
        return 0
    if argv[:1] == ["stats"]:
        p = argparse.ArgumentParser(prog="python -m bench.shard_ingest stats")
        p.add_argument("--addresses", required=True)
        stats_main(p.parse_args(argv[1:]).addresses.split(","))
        return 0
    parser = argparse.ArgumentParser(prog="python -m bench.shard_ingest", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the test suite's size: one repetition, 3 s windows")
    parser.add_argument("--rate", type=float, default=1000.0, help="each shard's link, Mbit/s (default 1000)")
    parser.add_argument("--clients", type=int, default=None, help="pushing client processes (default 4)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of 1 and 2 shards (default: quick 1, "
                        "full 3)")
    parser.add_argument("--no-local", action="store_true", help="skip the one-host run without caps")
    parser.add_argument("--leaf", default=None, help="the qdisc under each link's htb class, e.g. 'pfifo limit 50' "
                        "(default: htb's own, a FIFO of the interface's txqueuelen packets)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: runs/shard_ingest[-quick])")
    args = parser.parse_args(argv)
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.clients:
        size["clients"] = args.clients
    if args.reps:
        size["reps"] = args.reps
    if args.no_local:
        size["local"] = False
    if args.leaf:
        size["leaf"] = args.leaf
    out = args.out or ROOT / "runs" / ("shard_ingest-quick" if args.quick else "shard_ingest")
    # SIGTERM (a CI timeout, pytest's kill) unwinds like Ctrl-C: the finally blocks stop the processes, delete the hosts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        results = run(size, args.rate, out)
    except TopologyError as exc:
        print(f"[shard_ingest] cannot emulate the hosts: {exc}", file=sys.stderr)
        return 2
    failed = [f"{w} {n}" for w in ("hosts", "local") for n, rs in results[w].items() for r in rs if "error" in r]
    print(f"[shard_ingest] results in {out} ({results['wall_s']:.0f} s)" + (f"; failed: {failed}" if failed else ""))
    if results["summary"].get("hosts"):
        print(f"[shard_ingest] 2 shards / 1 on emulated hosts: {_fmt(results['summary']['hosts']['two_over_one'], 2)}"
              f" (target >= {TARGET})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
