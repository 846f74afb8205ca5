"""Slow links: time to accuracy and bytes per sample of every scheme, on emulated hosts.

``python -m bench.slowlink [--quick] [--rates 1000,100,20] [--configs ddp,asgd,...] --out DIR`` (root:
it makes network namespaces). The PS and 2 workers are hosts of a :class:`harness.netns.Topology`
whose links are capped at each rate in both directions, so each worker's traffic to the PS or to
the other worker crosses two capped links. The workers are a 2-node Lightning job, one process
per host (``NODE_RANK``, ``MASTER_ADDR`` = worker 0's address), as on a cluster; the asgd-family
runs reach a ``plug-asgd serve-ps`` on the PS's host (``shm_pushes=False``: no shared memory
between hosts), DDP runs gloo over the same links, hivemind's peers run on the worker hosts
(``bench.slowlink_hivemind``, in ``.venv-hivemind``), the one process runs alone. Each
configuration is a launch of ``bench.train`` (one run: its ``StepClock`` snapshots rank 0's
weights, and for our modes the central model rank 0 last received, which validation, test and
checkpoints load; each evaluated after the fit, its time to the target reported). Bytes are read
from every host's interface counters before and after each launch, the same wire measure for all;
the strategy's own counters are reported beside.

``--cores-per-host N`` pins each worker host to N cores of its own (``taskset``), and the one process to
N cores too, so that every host computes as fast as the one process, as on machines of one kind; the
PS's host gets the cores left, or shares them all when none are (2 cores, N = 1: it floats over both).
Without it the hosts share the machine's cores, and the one process has them all.

``--push-cost`` and ``--push-timing CONFIG`` measure where a push's time goes, without emulated hosts (no root):
one overlapped AdaComp push piece by piece in this process, and 2 racing workers' pushes over loopback
(:mod:`bench.slowlink_pushes`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import FASHION, ROOT, machine, write_json
from bench.runner import ADACOMP_191, first_time_at
from harness.netns import DEVICE, Topology, TopologyError
from harness.processes import child_env, start, stop

TARGET = 0.88
BATCH = 32
MASTER_PORT = 29500  # each host is its own namespace: fixed ports cannot clash with anything else
PS_PORT = 2223
HIVEMIND_PYTHON = ROOT / ".venv-hivemind" / "bin" / "python"

# adacomp at 0.33% with overlap, pushing every 2 or 4 local steps (``push_every``): the exchange's CPU (the update's
# choice, the merge of a reply, the PS's fold), which shares the cores with training, spent once for that many
# steps; measured against a push a step in bench/results (later to 88%), so named, not swept
PUSH_EVERY_VARIANTS: dict[str, dict[str, Any]] = {
    f"adacomp-0.0033-overlap-every{n}": {"kind": "asgd", "mode": "adacomp", "compression": ADACOMP_191,
                                         "overlap": True, "options": {"push_every": n}} for n in (2, 4)}

# name: the bench.train run (kind, mode, compressor), or hivemind's own peers
CONFIGS: dict[str, dict[str, Any]] = {
    "single": {"kind": "single"},
    "ddp": {"kind": "ddp"},
    "asgd": {"kind": "asgd", "mode": "asgd"},
    "adacomp": {"kind": "asgd", "mode": "adacomp"},
    # AdaComp at the fraction of benchmark 4's 191x (ADACOMP_191), and that with a compressed downlink:
    # the PS answers with the 1% of each tensor where the worker is furthest off (``serve-ps --downlink-fraction``)
    "adacomp-0.0033": {"kind": "asgd", "mode": "adacomp", "compression": ADACOMP_191},
    "adacomp-0.0033-down": {"kind": "asgd", "mode": "adacomp", "compression": ADACOMP_191,
                            "ps_args": ["--downlink-fraction", "0.01"]},
    # and with each push sent from a thread while the next step computes (``overlap=True``): the reply's wait,
    # the link's time and the PS's, off the worker's own core
    "adacomp-0.0033-overlap": {"kind": "asgd", "mode": "adacomp", "compression": ADACOMP_191, "overlap": True},
    **PUSH_EVERY_VARIANTS,
    "topk": {"kind": "asgd", "mode": "asgd", "compressor": "topk"},
    "powersgd": {"kind": "asgd", "mode": "asgd", "compressor": "powersgd"},
    # a low-rank update changes every coordinate, so a reply of what changed is the whole model: here the PS
    # answers with the 1% of each tensor where the worker is furthest off, as adacomp-0.0033-down's
    "powersgd-down": {"kind": "asgd", "mode": "asgd", "compressor": "powersgd",
                      "ps_args": ["--downlink-fraction", "0.01"]},
    "localsgd": {"kind": "asgd", "mode": "localsgd"},
    "hivemind": {"kind": "hivemind"},
    # the PS with a hot standby on a host of its own (``serve-ps --standby-of``): every change goes to it first
    "asgd-standby": {"kind": "asgd", "mode": "asgd", "standby": True},
    "adacomp-0.0033-standby": {"kind": "asgd", "mode": "adacomp", "compression": ADACOMP_191, "standby": True},
    # the same with a window: the PS answers at once and sends the standby its whole state every 8 pushes
    # (``--standby-window 8``), which a failover may lose
    "asgd-standby-window": {"kind": "asgd", "mode": "asgd", "standby": True, "ps_args": ["--standby-window", "8"]},
    "asgd-standby-window32": {"kind": "asgd", "mode": "asgd", "standby": True, "ps_args": ["--standby-window", "32"]},
}
SIZES: dict[str, dict[str, Any]] = {
    # under a minute on 2 cores (the test suite's size): one rate, the schemes that cross a link, each run 200
    # steps or 6 s
    "quick": {"rates": [100.0], "configs": ["ddp", "asgd", "adacomp"], "epochs": 1, "max_steps": 200,
              "time_limit_s": 6.0, "snapshot_s": 2.0, "test_subset": 1000, "train_subset": None, "timeout": 150,
              "probe_s": 1.0},
    "full": {"rates": [1000.0, 100.0, 20.0], "epochs": 3, "max_steps": 100_000,
             "configs": [name for name in CONFIGS if name not in PUSH_EVERY_VARIANTS],
             "time_limit_s": 240.0, "snapshot_s": 5.0, "test_subset": 5000, "train_subset": None, "timeout": 600,
             "probe_s": 2.0},
}


def model_bytes() -> int:
    """float32 bytes of the recipe CNN's parameters: what a dense push, a reply or DDP's all-reduce carries."""
    from plug_asgd.recipes.mnist import MnistCNN

    return 4 * sum(p.numel() for p in MnistCNN().parameters())


def ddp_bytes_per_sample(workers: int = 2) -> float:
    """What each worker sends per sample under DDP's ring all-reduce: 2 (n-1)/n model bytes per step, over the batch."""
    return 2 * model_bytes() * (workers - 1) / workers / BATCH


def _run_spec(name: str, size: dict[str, Any], ps_address: str) -> dict[str, Any]:
    """The bench.train run of configuration ``name``: stopped by time or steps, whichever comes first."""
    cfg = CONFIGS[name]
    run: dict[str, Any] = {"bench": "slowlink", "name": name, "batch_size": BATCH, "epochs": size["epochs"],
                           "max_steps": size["max_steps"], "snapshot_every_s": size["snapshot_s"],
                           "test_subset": size["test_subset"], "train_subset": size["train_subset"],
                           **{k: v for k, v in cfg.items() if k != "ps_args"}}
    if cfg["kind"] == "ddp":  # Lightning's Timer: rank 0 decides, and every rank stops at the same step
        run["max_time_s"] = size["time_limit_s"]
    else:  # each rank stops by itself (StepClock), as asynchronous workers do
        run["time_limit_s"] = size["time_limit_s"]
    if cfg["kind"] == "asgd":
        run["shm_pushes"] = False
        # beside rank 0's weights (its residual and look-ahead in them), the central model it last received
        run["snapshot_central"] = True
        # no CURVE keys between emulated hosts: encryption would cost CPU that no other scheme pays
        run["options"] = {**cfg.get("options", {}), "ps_address": ps_address, "ps_insecure": True}
    return run


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Exit codes of ``procs`` (None: still running at the deadline, then stopped)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def host_cores(size: dict[str, Any], rank: int | None) -> list[int] | None:
    """The cores worker host ``rank`` is pinned to (None: the PS's host), or None when hosts are not pinned.

    The one process runs on worker 0's host, so it gets worker 0's cores.
    """
    n = size.get("cores_per_host")
    if not n:
        return None
    count = os.cpu_count() or 1
    if rank is not None:
        if (rank + 1) * n > count:
            raise ValueError(f"--cores-per-host {n}: worker host {rank} needs cores up to {(rank + 1) * n - 1}, "
                             f"this machine has {count}; ask for at most {count // 2}")
        return list(range(rank * n, (rank + 1) * n))
    left = list(range(2 * n, count))
    return left or None  # no core left: the PS's host floats over them all


def pinned(prefix: list[str], cores: list[int] | None) -> list[str]:
    """``prefix`` with a ``taskset`` that keeps the command (and its children) on ``cores``."""
    return prefix if cores is None else [*prefix, "taskset", "-c", ",".join(map(str, cores))]


def launch_lightning(topo: Topology, name: str, size: dict[str, Any], out: Path) -> dict[str, Any]:
    """One ``bench.train`` run, one process per worker host (and a PS on its host for the asgd family)."""
    cfg = CONFIGS[name]
    ps_host = topo.hosts["ps"]
    workers = 1 if cfg["kind"] == "single" else 2
    spec = {"workers": workers, "nodes": workers, "data_dir": str(FASHION), "test_subset": size["test_subset"],
            "runs": [_run_spec(name, size, f"tcp://{ps_host.address}:{PS_PORT}")]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    procs: list[subprocess.Popen] = []
    ps = standby = None
    try:
        if cfg["kind"] == "asgd":
            ps = start([*pinned(ps_host.prefix, host_cores(size, None)), sys.executable, "-m", "plug_asgd.cli.app",
                        "serve-ps", "--host", ps_host.address, "--port", str(PS_PORT), "--mode", cfg["mode"],
                        "--workers", "2", "--linger", "1", "--insecure", "--quiet", "--log-every", "0",
                        *cfg.get("ps_args", [])],
                       log=out / "ps.log")
        if cfg.get("standby"):
            standby = _start_standby(topo, size, out)
        threads = size.get("cores_per_host") or max(1, (os.cpu_count() or 1) // workers)
        for rank in range(workers):
            host = topo.hosts[f"w{rank}"]
            prefix = pinned(host.prefix, host_cores(size, rank))
            env = child_env(OMP_NUM_THREADS=str(threads), MASTER_ADDR=topo.hosts["w0"].address,
                            MASTER_PORT=str(MASTER_PORT), NODE_RANK=str(rank), WORLD_SIZE=str(workers),
                            GLOO_SOCKET_IFNAME=DEVICE)
            procs.append(start([*prefix, sys.executable, "-m", "bench.train", "--spec", str(out / "spec.json"),
                                "--out", str(out / "train")], env=env, log=out / f"rank{rank}.log"))
        codes = _wait(procs, size["timeout"])
    finally:
        for p in procs:
            stop(p)
        for server in (ps, standby):
            if server is not None:
                stop(server, grace=3.0)
    path = out / "train" / "results.json"
    results = json.loads(path.read_text()) if path.exists() else []
    if not results or any(c != 0 for c in codes):
        # Lightning ends a rank that got SIGTERM with exit code 0: say so, a missing result is not a success
        signalled = [r for r in range(workers) if None not in codes
                     and "Received SIGTERM" in (out / f"rank{r}.log").read_text()]
        outside = f", ranks {signalled} got a SIGTERM from outside" if signalled else ""
        return {"error": f"no result: exit codes {codes} (None: stopped after {size['timeout']} s){outside}; "
                         f"logs in {out}"}
    r = results[0]
    comm = [rank.get("comm") or {} for rank in r["ranks"]]
    return {"curve": r.get("curve", []), "central_curve": r.get("central_curve"),
            "steps": [rank["steps"] for rank in r["ranks"]],
            "samples_per_s": r.get("samples_per_s"), "threads_per_process": threads,
            "cores": {f"w{rank}": host_cores(size, rank) for rank in range(workers)} | {"ps": host_cores(size, None)},
            "strategy_bytes_up": sum(c.get("bytes_up", 0) for c in comm) if any(comm) else None,
            "strategy_bytes_down": sum(c.get("bytes_down", 0) for c in comm) if any(comm) else None,
            "push_bytes": r.get("push_bytes"), "pushes": r.get("pushes")}


def _start_standby(topo: Topology, size: dict[str, Any], out: Path) -> subprocess.Popen:
    """A hot standby of the PS, on host ``sb``, once it holds the PS's state (its log says so)."""
    sb = topo.hosts["sb"]
    log = out / "standby.log"
    proc = start([*pinned(sb.prefix, host_cores(size, None)), sys.executable, "-m", "plug_asgd.cli.app", "serve-ps",
                  "--host", sb.address, "--port", str(PS_PORT), "--insecure", "--quiet", "--log-every", "0",
                  "--standby-of", f"tcp://{topo.hosts['ps'].address}:{PS_PORT}"], log=log)
    deadline = time.monotonic() + 60
    while "holding the primary's state" not in (log.read_text() if log.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the standby did not join: see {log}")
        time.sleep(0.2)
    return proc


def launch_hivemind(topo: Topology, size: dict[str, Any], out: Path) -> dict[str, Any]:
    """Two ``bench.slowlink_hivemind`` peers, one per worker host; peer 0's snapshots evaluated here."""
    if not HIVEMIND_PYTHON.exists():
        return {"error": f"{HIVEMIND_PYTHON} not found: python3.11 -m venv .venv-hivemind && .venv-hivemind/bin/pip "
                         "install -c constraints.txt torch==2.13.0 hivemind==1.1.12 pytorch-lightning==2.6.6"}
    out.mkdir(parents=True, exist_ok=True)
    peers_file = out / "peers.json"
    for stale in (peers_file, out / "ready0", out / "ready1"):
        stale.unlink(missing_ok=True)
    procs = []
    try:
        for rank in range(2):
            host = topo.hosts[f"w{rank}"]
            cmd = [*pinned(host.prefix, host_cores(size, rank)), str(HIVEMIND_PYTHON), "-m", "bench.slowlink_hivemind",
                   "--peer", str(rank), "--address", host.address, "--peers-file", str(peers_file),
                   "--data-dir", str(FASHION),
                   "--out", str(out), "--epochs", str(size["epochs"]), "--max-steps", str(size["max_steps"]),
                   "--time-limit", str(size["time_limit_s"]), "--snapshot-every", str(size["snapshot_s"])]
            if size["train_subset"]:
                cmd += ["--train-subset", str(size["train_subset"])]
            threads = size.get("cores_per_host") or 1
            procs.append(start(cmd, env=child_env(OMP_NUM_THREADS=str(threads)), log=out / f"peer{rank}.log"))
        codes = _wait(procs, size["timeout"])
    finally:
        for p in procs:
            stop(p)
    records = [out / f"peer{r}.json" for r in range(2)]
    if not all(p.exists() for p in records) or not (out / "snapshots.pt").exists():
        return {"error": f"exit codes {codes} (None: stopped after {size['timeout']} s); logs in {out}"}
    peers = [json.loads(p.read_text()) for p in records]
    return {"curve": evaluate_snapshots(out / "snapshots.pt", size["test_subset"]),
            "steps": [p["steps"] for p in peers], "hivemind_config": peers[0]["config"],
            "hivemind_version": peers[0]["hivemind"], "local_epochs": [p["local_epoch"] for p in peers],
            "exit_codes": codes, "threads_per_process": size.get("cores_per_host") or 1,
            "cores": {f"w{rank}": host_cores(size, rank) for rank in range(2)}}


def evaluate_snapshots(path: Path, test_subset: int | None) -> list[tuple[float, float]]:
    """Test accuracy of each (time, weights) snapshot, on the test subset bench.train evaluates on."""
    import torch

    from bench.train import evaluate
    from plug_asgd.recipes.mnist import MnistDataModule

    dm = MnistDataModule(FASHION, batch_size=BATCH, test_subset=test_subset, download=False)
    dm.setup("test")
    x, y = dm.test_set.tensors
    return [(round(t, 3), evaluate(state, x, y)) for t, state in torch.load(path)]


def run_config(topo: Topology, name: str, size: dict[str, Any], out: Path) -> dict[str, Any]:
    """One configuration on the current link rate: its curve, time to target, bytes per sample."""
    load = [round(x, 2) for x in os.getloadavg()]  # other work on the machine slows every scheme's compute
    before = topo.counters()
    started = time.monotonic()
    if CONFIGS[name]["kind"] == "hivemind":
        got = launch_hivemind(topo, size, out)
    else:
        got = launch_lightning(topo, name, size, out)
    after = topo.counters()
    wire = {h: {"up": after[h]["tx"] - before[h]["tx"], "down": after[h]["rx"] - before[h]["rx"]} for h in after}
    result: dict[str, Any] = {"name": name, **CONFIGS[name], "launch_s": round(time.monotonic() - started, 1),
                              "load_average_at_start": load, "wire_bytes": wire, **got}
    if "error" in got:
        return result
    samples = sum(got["steps"]) * BATCH
    workers = [h for h in wire if h.startswith("w")]
    curve = got["curve"]
    result.update(samples=samples,
                  up_per_sample=sum(wire[h]["up"] for h in workers) / samples,
                  down_per_sample=sum(wire[h]["down"] for h in workers) / samples,
                  time_to_target_s=first_time_at(curve, TARGET), final_acc=curve[-1][1] if curve else None,
                  best_acc=max((a for _, a in curve), default=None), train_s=curve[-1][0] if curve else None)
    central = got.get("central_curve")
    if central:  # the model validation, test and checkpoints load: the PS's, as rank 0 last received it
        result.update(central_time_to_target_s=first_time_at(central, TARGET),
                      central_best_acc=max(a for _, a in central))
    if got.get("strategy_bytes_up") is not None:
        result["strategy_up_per_sample"] = got["strategy_bytes_up"] / samples
        result["strategy_down_per_sample"] = got["strategy_bytes_down"] / samples
    return result


PROBE_TRIES = 3


def probe(topo: Topology, rate: float, seconds: float, tries: int = PROBE_TRIES) -> dict[str, Any]:
    """The link's real rate (payload): the fastest of ``tries`` TCP transfers worker 0 -> PS of about ``seconds``.

    The fastest, since a busy machine (a test beside it, a core shared) can only slow a transfer down, never
    carry it past the htb cap; every try is kept in ``tries_mbit``.
    """
    nbytes = int(max(2e6, rate * 1e6 / 8 * seconds))
    got = [topo.measure("w0", "ps", nbytes) for _ in range(tries)]
    best = max(got, key=lambda g: g["mbit_per_s"])
    return {**best, "tries_mbit": [round(g["mbit_per_s"], 2) for g in got], "htb_mbit": rate}


def run(size: dict[str, Any], rates: list[float], names: list[str], out: Path, merge: bool = False) -> dict[str, Any]:
    """Every configuration at every rate, one topology whose caps change between rates.

    ``merge``: keep the other runs of the results.json in ``out`` (made at the same size), replace these.
    """
    command = "python -m bench.slowlink " + " ".join(sys.argv[1:])
    results: dict[str, Any] = {"machine": machine(), "command": command,
                               "target_acc": TARGET, "batch_size": BATCH, "model_bytes": model_bytes(),
                               "ddp_formula_up_per_sample": ddp_bytes_per_sample(),
                               "size": {k: v for k, v in size.items() if k not in ("rates", "configs")},
                               "rates": {}}
    if merge and (out / "results.json").exists():
        old = json.loads((out / "results.json").read_text())
        if old["size"] != results["size"]:
            raise ValueError(f"--merge: {out / 'results.json'} was made at another size: {old['size']}")
        results["rates"] = old["rates"]
        results["earlier"] = old.get("earlier", []) + [{k: old[k] for k in ("command", "machine", "wall_s")
                                                         if k in old}]
    started = time.monotonic()
    hosts = ["ps", "w0", "w1", *(["sb"] if any(CONFIGS[n].get("standby") for n in names) else [])]
    with Topology(hosts, rates[0]) as topo:
        for rate in rates:
            topo.set_rate(rate)
            key = f"{rate:g}"
            entry = results["rates"].setdefault(key, {"runs": {}})
            entry["probe"] = probe(topo, rate, size["probe_s"])
            print(f"[slowlink] {key} Mbit/s: measured {entry['probe']['mbit_per_s']:.1f}", flush=True)
            for name in names:
                r = run_config(topo, name, size, out / "work" / f"{key}mbit" / name)
                r.update(command=command, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
                entry["runs"][name] = r
                print(f"[slowlink] {key} Mbit/s {name}: " + (r["error"] if "error" in r else
                      f"final acc {r['final_acc']}, to {TARGET:g}: {r['time_to_target_s']} s (central: "
                      f"{r.get('central_time_to_target_s', '-')} s), up/down {r['up_per_sample'] / 1e3:.1f}/"
                      f"{r['down_per_sample'] / 1e3:.1f} kB per sample, {r['launch_s']} s"), flush=True)
                write_json(out / "results.json", results)
    results["wall_s"] = round(time.monotonic() - started, 1)
    write_json(out / "results.json", results)
    from bench.slowlink_report import write_report

    write_report(results, out)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.slowlink", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the CI size: one rate, 3 schemes, under a minute")
    parser.add_argument("--rates", default=None, help="link rates in Mbit/s, comma-separated (default: the size's)")
    parser.add_argument("--configs", default=None, help=f"comma-separated, of {', '.join(CONFIGS)} "
                        "(default: the size's)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds of training per run (default: the size's, 6 quick, 240 full)")
    parser.add_argument("--snapshot-every", type=float, default=None, metavar="S",
                        help="seconds between two snapshots of rank 0's weights (default: the size's, 2 quick, 5 "
                             "full); a time to accuracy is the first snapshot at the target, so up to S late")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: runs/slowlink[-quick])")
    parser.add_argument("--cores-per-host", type=int, default=None, metavar="N",
                        help="pin each worker host, and the one process, to N cores of its own (taskset); the PS's "
                             "host gets the cores left, or floats over all (default: the hosts share every core)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other runs of the results.json already in --out (rerun some only)")
    where = parser.add_argument_group("where a push's time goes (bench.slowlink_pushes; no emulated hosts)")
    where.add_argument("--push-cost", action="store_true",
                       help="an overlapped AdaComp push's CPU on its worker, piece by piece, in this process")
    where.add_argument("--pushes", type=int, default=400, help="--push-cost: pushes timed (default 400)")
    where.add_argument("--fraction", type=float, default=ADACOMP_191,
                       help=f"--push-cost: adacomp's fraction (default {ADACOMP_191:g})")
    where.add_argument("--seed", type=int, default=0, help="--push-cost's seed")
    where.add_argument("--push-timing", default=None, metavar="CONFIG",
                       help="2 workers of CONFIG (asgd, adacomp, adacomp-0.0033, ...) over loopback for --time-limit "
                            "seconds (default 20), the pieces of their pushes timed (--out default: "
                            "runs/slowlink-push-timing)")
    args = parser.parse_args(argv)
    if args.push_cost:
        from bench.slowlink_pushes import PUSH_COST_WARMUP, push_cost

        if args.pushes <= PUSH_COST_WARMUP:
            parser.error(f"--pushes {args.pushes}: more than the {PUSH_COST_WARMUP} warm-up pushes, please")
        return push_cost(args.pushes, args.fraction, args.seed)
    if args.push_timing is not None:
        cfg = CONFIGS.get(args.push_timing, {})
        if cfg.get("kind") != "asgd" or "ps_args" in cfg:
            parser.error(f"--push-timing {args.push_timing}: choose one of the embedded PS's configurations, "
                         + ", ".join(n for n, c in CONFIGS.items() if c["kind"] == "asgd" and "ps_args" not in c))
        if not (FASHION / "train-images-idx3-ubyte.gz").exists():
            parser.error(f"needs Fashion-MNIST in {FASHION}: apt-get install dataset-fashion-mnist")
        from bench.slowlink_pushes import push_timing

        return push_timing(cfg, args.push_timing, args.time_limit or 20.0,
                           args.out or ROOT / "runs" / "slowlink-push-timing")
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.time_limit:
        size.update(time_limit_s=args.time_limit, timeout=max(size["timeout"], args.time_limit * 2 + 90))
    if args.snapshot_every is not None:
        if not args.snapshot_every > 0:
            parser.error(f"--snapshot-every {args.snapshot_every}: must be above 0 seconds")
        size["snapshot_s"] = args.snapshot_every
    if args.cores_per_host is not None:
        if args.cores_per_host < 1:
            parser.error(f"--cores-per-host {args.cores_per_host}: a host needs at least 1 core")
        size["cores_per_host"] = args.cores_per_host
        try:
            host_cores(size, 1)  # the last worker host's cores: refused where the machine has too few
        except ValueError as exc:
            parser.error(str(exc))
    rates = [float(r) for r in args.rates.split(",")] if args.rates else size["rates"]
    names = args.configs.split(",") if args.configs else size["configs"]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        parser.error(f"needs Fashion-MNIST in {FASHION}: apt-get install dataset-fashion-mnist")
    out = args.out or ROOT / "runs" / ("slowlink-quick" if args.quick else "slowlink")
    # SIGTERM (a CI timeout, pytest's kill) unwinds like Ctrl-C: the finally blocks stop the processes, delete the hosts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        results = run(size, rates, names, out, merge=args.merge)
    except TopologyError as exc:
        print(f"[slowlink] cannot emulate the hosts: {exc}", file=sys.stderr)
        return 2
    failed = [f"{rate} {n}" for rate, r in results["rates"].items() for n, x in r["runs"].items() if "error" in x]
    print(f"[slowlink] results in {out} ({results['wall_s']:.0f} s)" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
