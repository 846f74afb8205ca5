"""Islands: a node as one worker, against per-device workers and DDP, on 2 emulated hosts of 2 processes each.

``python -m bench islands [--quick] [--rates 100,none] [--seeds N] [--configs asgd,asgd-islands,ddp] [--out DIR]``
(root: it makes network namespaces). bench.slowlink's machinery with two processes per host: a
:class:`harness.netns.Topology` of a PS host and 2 worker hosts whose links htb caps at each rate in both directions
(``none``: no cap, the veths at their own speed: no link in the way, the same hosts and processes), and on the worker
hosts a 2-node Lightning job of ``devices=2`` (Lightning's launcher starts each node's second process inside the
host's namespace, re-running the command), so 4 ranks, ranks 0 and 1 on host ``w0``, 2 and 3 on ``w1``. The
configurations, one launch of ``bench.train`` each, the recipe CNN with its default optimizer (Adam, lr 1e-3) and
batch 32 per rank in all three:

- ``asgd``: ``AsyncPSStrategy(mode="asgd", island=1)``: every process a worker of its own, 4 workers of a
  ``plug-asgd serve-ps`` on the PS's host (the old behaviour);
- ``asgd-islands``: the same with ``island="node"``: a node's 2 processes all-reduce their gradients inside the host
  (gloo over its loopback) and only the leader pushes to the PS, which sees 2 workers;
- ``ddp``: Lightning's DDP over gloo, 4 ranks, whose all-reduce crosses the same links.

Every rank trains ``max_steps`` steps (no time limit), so every configuration trains the same samples; then rank 0
evaluates on the test set the central model it last received (the asgd family: what validation, test and checkpoints
load) or its own weights (DDP). Per launch: samples/s, all 4 ranks' samples over the window in which all were past
their warm-up and still training (``bench.train``'s window); each worker host's bytes, tx + rx of its interface's
counters read before and after the launch, over the samples that host's 2 ranks trained; the strategy's own count of
its bytes beside them, and the PS's workers and pushes per worker as the PS counted them. Seeds alternate the three
configurations (seed i: asgd, asgd-islands, ddp at each rate), and the ratios islands / per-device pair the two runs
of a seed and rate.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import FASHION, ROOT, machine, report_rates, spread, summary, write_json
from bench.slowlink import BATCH, MASTER_PORT, PS_PORT, _wait, model_bytes, probe
from harness.netns import DEVICE, Topology, TopologyError
from harness.processes import child_env, start, stop

NODES = 2  # worker hosts
DEVICES = 2  # processes per worker host
RANKS = NODES * DEVICES

CONFIGS: dict[str, dict[str, Any]] = {
    "asgd": {"kind": "asgd", "mode": "asgd", "options": {"island": 1}, "ps_workers": RANKS},
    "asgd-islands": {"kind": "asgd", "mode": "asgd", "options": {"island": "node"}, "ps_workers": NODES},
    "ddp": {"kind": "ddp"},
}
LABELS = {"asgd": "asgd, per device (island=1)", "asgd-islands": "asgd, islands of 2 (island='node')",
          "ddp": "DDP (gloo, 4 ranks)"}
# the targets: at a capped rate, islands / per-device samples/s and bytes per sample on each worker host's
# link; uncapped, the samples/s ratio; at every rate, the accuracy (mean over seeds) against per-device and DDP
TARGET_SPEEDUP_CAPPED = 1.8
TARGET_BYTES_CAPPED = 0.55
TARGET_SPEED_UNCAPPED = 0.9
TARGET_ACC_POINTS = 1.0

SIZES: dict[str, dict[str, Any]] = {
    # the test suite's size: one rate, one seed, 8 steps a rank (the window after 2 warm-up steps)
    "quick": {"rates": [100.0], "seeds": 1, "max_steps": 8, "warmup": 2, "test_subset": 1000, "timeout": 150,
              "probe_s": 1.0, "probe_tries": 1},
    # 400 steps a rank: 51,200 samples, 0.85 of an epoch of Fashion-MNIST, the whole test set
    "full": {"rates": [100.0, None], "seeds": 3, "max_steps": 400, "warmup": 5, "test_subset": None, "timeout": 2400,
             "probe_s": 2.0, "probe_tries": 3},
}


def rate_key(rate: float | None) -> str:
    """The results' key of a link rate: its Mbit/s, or ``uncapped``."""
    return "uncapped" if rate is None else f"{rate:g}"


def parse_rates(text: str) -> list[float | None]:
    """``100,none`` -> [100.0, None] (``none``: no cap)."""
    return [None if r.strip().lower() in ("none", "uncapped") else float(r) for r in text.split(",")]


def run_spec(name: str, size: dict[str, Any], seed: int, ps_address: str) -> dict[str, Any]:
    """The bench.train run of configuration ``name``: ``max_steps`` steps on every rank, snapshots of rank 0's
    weights (and the central model it holds) at the start and the end of the fit only."""
    cfg = CONFIGS[name]
    run: dict[str, Any] = {"bench": "islands", "name": name, "kind": cfg["kind"], "batch_size": BATCH,
                           "epochs": 1000, "max_steps": size["max_steps"], "warmup": size["warmup"], "seed": seed,
                           "snapshot_every_s": 1e9, "test_subset": size["test_subset"], "train_subset": None}
    if cfg["kind"] == "asgd":
        run.update(mode=cfg["mode"], shm_pushes=False, snapshot_central=True,
                   options={**cfg["options"], "ps_address": ps_address, "ps_insecure": True})
    return run


def launch(topo: Topology, name: str, size: dict[str, Any], seed: int, out: Path) -> dict[str, Any]:
    """One bench.train launch of configuration ``name``: a node of 2 processes on each worker host, and for the
    asgd family a ``serve-ps`` on the PS's host that exits once its workers have come and gone."""
    cfg = CONFIGS[name]
    ps_host = topo.hosts["ps"]
    spec = {"workers": RANKS, "nodes": NODES, "data_dir": str(FASHION), "test_subset": size["test_subset"],
            "runs": [run_spec(name, size, seed, f"tcp://{ps_host.address}:{PS_PORT}")]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    threads = max(1, (os.cpu_count() or 1) // RANKS)
    procs = []
    ps = None
    codes: list[int | None] = []
    try:
        if cfg["kind"] == "asgd":
            ps = start([*ps_host.prefix, sys.executable, "-m", "plug_asgd.cli.app", "serve-ps", "--host",
                        ps_host.address, "--port", str(PS_PORT), "--mode", cfg["mode"], "--workers",
                        str(cfg["ps_workers"]), "--linger", "1", "--insecure", "--quiet", "--log-every", "0"],
                       log=out / "ps.log")
        for node in range(NODES):
            host = topo.hosts[f"w{node}"]
            env = child_env(OMP_NUM_THREADS=str(threads), MASTER_ADDR=topo.hosts["w0"].address,
                            MASTER_PORT=str(MASTER_PORT), NODE_RANK=str(node), WORLD_SIZE=str(RANKS),
                            GLOO_SOCKET_IFNAME=DEVICE)
            procs.append(start([*host.prefix, sys.executable, "-m", "bench.train", "--spec", str(out / "spec.json"),
                                "--out", str(out / "train")], env=env, log=out / f"node{node}.log"))
        codes = _wait(procs, size["timeout"])
    finally:
        for p in procs:
            stop(p)
        if ps is not None:
            stop(ps, grace=3.0)
    path = out / "train" / "results.json"
    results = json.loads(path.read_text()) if path.exists() else []
    if not results or any(c != 0 for c in codes):
        return {"error": f"no result: exit codes {codes} (None: stopped after {size['timeout']} s); logs in {out}"}
    return {**results[0], "threads_per_process": threads}


def measure(topo: Topology, name: str, size: dict[str, Any], seed: int, out: Path) -> dict[str, Any]:
    """One configuration at the current rate: samples/s, each host's bytes per sample from its interface's
    counters, the strategy's own count beside them, the PS's workers, the accuracy at the end."""
    load = [round(x, 2) for x in os.getloadavg()]
    before = topo.counters()
    started = time.monotonic()
    got = launch(topo, name, size, seed, out)
    after = topo.counters()
    wire = {h: {"tx": after[h]["tx"] - before[h]["tx"], "rx": after[h]["rx"] - before[h]["rx"]} for h in after}
    result: dict[str, Any] = {"name": name, "seed": seed, **CONFIGS[name],
                              "launch_s": round(time.monotonic() - started, 1), "load_average_at_start": load,
                              "wire_bytes": wire}
    if "error" in got:
        return {**result, "error": got["error"]}
    ranks = got["ranks"]
    steps = [r["steps"] for r in ranks]
    comm = [r.get("comm") or {} for r in ranks]
    ps_family = CONFIGS[name]["kind"] == "asgd"
    hosts = {}
    for node in range(NODES):  # ranks node * DEVICES ... are this host's (Lightning's global ranks)
        mine = range(node * DEVICES, (node + 1) * DEVICES)
        samples = sum(steps[r] for r in mine) * BATCH
        link = wire[f"w{node}"]["tx"] + wire[f"w{node}"]["rx"]
        # the strategy's own count of what its ranks sent to and got from the PS (an island's leader: all of it)
        strategy = sum((comm[r].get("bytes_up") or 0) + (comm[r].get("bytes_down") or 0) for r in mine)
        hosts[f"w{node}"] = {"samples": samples, "bytes": link, "bytes_per_sample": link / samples,
                             "strategy_bytes": strategy if ps_family else None,
                             "pushes": sum(comm[r].get("pushes") or 0 for r in mine) if ps_family else None}
    samples = sum(steps) * BATCH
    central = got.get("central_curve") or []
    curve = got.get("curve") or []
    # the model at the end: the central one rank 0 last received (asgd family), rank 0's own (DDP)
    acc = central[-1][1] if central else (curve[-1][1] if curve else None)
    result.update(samples=samples, steps=steps, samples_per_s=got.get("samples_per_s"), window_s=got.get("window_s"),
                  steps_in_window=got.get("steps_in_window"), hosts=hosts,
                  ps_bytes_per_sample=(wire["ps"]["tx"] + wire["ps"]["rx"]) / samples, acc=acc,
                  acc_of="central" if central else "rank 0", rank0_acc=curve[-1][1] if curve else None,
                  threads_per_process=got["threads_per_process"],
                  comm=comm, ps_world_size=got.get("ps_world_size"), pushes_by_rank=got.get("pushes_by_rank"),
                  ps_pushes=got.get("pushes"), ps_push_bytes=got.get("push_bytes"))
    return result


def bytes_per_sample(run: dict[str, Any]) -> float:
    """The busier worker host's link bytes (tx + rx) per sample it trained."""
    return max(h["bytes_per_sample"] for h in run["hosts"].values())


def summarize(runs: dict[str, list[dict[str, Any]]], capped: bool) -> dict[str, Any]:
    """Per configuration the spread over seeds; islands / per-device paired by seed; accuracies against both."""
    ok = {n: [r for r in rs if "error" not in r] for n, rs in runs.items()}
    out: dict[str, Any] = {"configs": {}}
    for name, rs in ok.items():
        out["configs"][name] = {
            "samples_per_s": summary([r["samples_per_s"] for r in rs]),
            **{f"{h}_bytes_per_sample": summary([r["hosts"][h]["bytes_per_sample"] for r in rs])
               for h in ("w0", "w1")},
            "acc_mean": statistics.fmean(r["acc"] for r in rs) if rs and all(r["acc"] is not None for r in rs)
            else None,
            "acc": [r["acc"] for r in rs], "ps_world_size": [r.get("ps_world_size") for r in rs]}
    by_seed = {n: {r["seed"]: r for r in rs} for n, rs in ok.items()}
    if "asgd" in by_seed and "asgd-islands" in by_seed:
        pairs = [(by_seed["asgd"][s], by_seed["asgd-islands"][s]) for s in by_seed["asgd"]
                 if s in by_seed["asgd-islands"]]
        speed = summary([i["samples_per_s"] / a["samples_per_s"] for a, i in pairs
                         if a["samples_per_s"] and i["samples_per_s"]])
        link = summary([bytes_per_sample(i) / bytes_per_sample(a) for a, i in pairs])
        out["islands_over_per_device"] = {"samples_per_s": speed, "bytes_per_sample": link}
        target = TARGET_SPEEDUP_CAPPED if capped else TARGET_SPEED_UNCAPPED
        out["targets"] = {"samples_per_s": {"target": target, "met": speed["median"] is not None
                                            and speed["median"] >= target}}
        if capped:
            out["targets"]["bytes_per_sample"] = {"target": TARGET_BYTES_CAPPED, "met": link["median"] is not None
                                                  and link["median"] <= TARGET_BYTES_CAPPED}
    islands = out["configs"].get("asgd-islands", {}).get("acc_mean")
    for other in ("asgd", "ddp"):
        theirs = out["configs"].get(other, {}).get("acc_mean")
        if islands is not None and theirs is not None:
            points = 100 * (islands - theirs)
            out[f"acc_points_islands_minus_{other}"] = points
            out.setdefault("targets", {})[f"acc_against_{other}"] = {"target": TARGET_ACC_POINTS,
                                                                     "met": abs(points) <= TARGET_ACC_POINTS}
    return out


def _met(targets: dict[str, Any], key: str) -> str:
    t = targets.get(key)
    return "" if t is None else (" (target met)" if t["met"] else " (target missed)")


def markdown(results: dict[str, Any]) -> str:
    """results.md: a table per rate, then the ratios islands / per-device and the accuracies against the targets."""
    m, size = results["machine"], results["size"]
    lines = ["# Islands: a node as one worker", "",
             f"`{results['command']}`: {m['date']}, commit {m.get('commit')}, {m['cpu_count']} CPUs "
             f"({m['cpu_model']}), torch {m['torch']}; {results.get('wall_s', '?')} s.", "",
             "2 worker hosts of 2 processes each and the PS on a third (network namespaces, each link capped both "
             "ways by htb, or not at all: `uncapped`); the recipe CNN on Fashion-MNIST, Adam 1e-3, batch "
             f"{results['batch_size']} per rank, {size['max_steps']} steps on each of the 4 ranks "
             f"({size['max_steps'] * RANKS * results['batch_size']:,} samples) in every configuration; accuracy on "
             f"{size['test_subset'] or 'all 10,000'} test images of the model at the end (the central model rank 0 "
             "last received; DDP: rank 0's). samples/s: all ranks' samples over the window in which every rank "
             f"was past its {size['warmup']} warm-up steps; kB/sample: the host's interface, tx + rx, over the launch, "
             "over the samples its 2 ranks trained. Median [min .. max] over seeds; accuracy: the mean over seeds "
             "(each seed's in brackets).", ""]
    for key, entry in results["rates"].items():
        p = entry.get("probe")
        capped = p is not None
        lines += [f"## {key} Mbit/s (htb); a TCP transfer w0 -> ps measured {p['mbit_per_s']:.1f} Mbit/s" if capped
                  else "## uncapped (no htb: the veths at their own speed)", "",
                  "| configuration | PS workers | samples/s | w0 kB/sample | w1 kB/sample | accuracy |",
                  "|---|---|---|---|---|---|"]
        s = entry.get("summary", {"configs": {}})
        for name, runs in entry["runs"].items():
            failed = [r for r in runs if "error" in r]
            c = s["configs"].get(name)
            if c is None or not c["acc"]:
                lines.append(f"| {LABELS[name]} | error: {failed[0]['error'] if failed else '?'} | | | | |")
                continue
            workers = sorted({w for w in c["ps_world_size"] if w is not None}) or ["-"]
            acc = "n/a" if c["acc_mean"] is None else (
                f"{100 * c['acc_mean']:.2f}% (" + ", ".join(f"{100 * a:.2f}" for a in c["acc"]) + ")")
            lines.append(f"| {LABELS[name]} | {', '.join(map(str, workers))} | {spread(c['samples_per_s'], ',.0f')} "
                         f"| {spread(c['w0_bytes_per_sample'], '.1f', 1e3)} "
                         f"| {spread(c['w1_bytes_per_sample'], '.1f', 1e3)} | {acc} |"
                         + (f" ({len(failed)} failed)" if failed else ""))
        lines.append("")
        ratio = s.get("islands_over_per_device")
        targets = s.get("targets", {})
        if ratio:
            target = TARGET_SPEEDUP_CAPPED if capped else TARGET_SPEED_UNCAPPED
            lines.append(f"- islands / per-device samples/s: **{spread(ratio['samples_per_s'], '.2f')}** "
                         f"(target >= {target}){_met(targets, 'samples_per_s')}")
            lines.append("- islands / per-device bytes per sample on the busier worker host's link: "
                         f"**{spread(ratio['bytes_per_sample'], '.2f')}**"
                         + (f" (target <= {TARGET_BYTES_CAPPED}){_met(targets, 'bytes_per_sample')}" if capped else ""))
        for other in ("asgd", "ddp"):
            points = s.get(f"acc_points_islands_minus_{other}")
            if points is not None:
                lines.append(f"- accuracy, islands - {LABELS[other]}: {points:+.2f} points "
                             f"(target within {TARGET_ACC_POINTS:g}){_met(targets, f'acc_against_{other}')}")
        lines.append("")
    return "\n".join(lines)


def run(size: dict[str, Any], rates: list[float | None], names: list[str], seeds: list[int], out: Path,
        argv: list[str]) -> dict[str, Any]:
    """Every configuration, seed and rate on one topology whose caps change between rates; the JSON and the table
    are rewritten after each launch."""
    command = "python -m bench islands " + " ".join(argv)
    results: dict[str, Any] = {"machine": machine(), "command": command, "batch_size": BATCH,
                               "model_bytes": model_bytes(), "size": {k: v for k, v in size.items() if k != "rates"},
                               "configs": {n: CONFIGS[n] for n in names}, "seeds": seeds, "rates": {}}
    started = time.monotonic()
    with Topology(["ps", "w0", "w1"], rates[0]) as topo:
        for rate in rates:
            topo.set_rate(rate)
            key = rate_key(rate)
            entry = results["rates"].setdefault(key, {"rate_mbit": rate, "runs": {n: [] for n in names}})
            if rate is not None:
                entry["probe"] = probe(topo, rate, size["probe_s"], tries=size["probe_tries"])
                print(f"[islands] {key} Mbit/s: measured {entry['probe']['mbit_per_s']:.1f}", flush=True)
            for seed in seeds:
                for name in names:
                    r = measure(topo, name, size, seed, out / "work" / key / f"seed{seed}" / name)
                    entry["runs"][name].append(r)
                    print(f"[islands] {key} seed {seed} {name}: " + (r["error"] if "error" in r else
                          f"{r['samples_per_s'] or 0:,.0f} samples/s, w0/w1 "
                          f"{r['hosts']['w0']['bytes_per_sample'] / 1e3:.1f}/"
                          f"{r['hosts']['w1']['bytes_per_sample'] / 1e3:.1f} kB per sample, PS workers "
                          f"{r['ps_world_size']}, acc {r['acc']}, {r['launch_s']} s"), flush=True)
                    entry["summary"] = summarize(entry["runs"], capped=rate is not None)
                    results["wall_s"] = round(time.monotonic() - started, 1)
                    write_json(out / "results.json", results)
                    (out / "results.md").write_text(markdown(results))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench islands", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the test suite's size: 100 Mbit/s, one seed, 8 steps")
    parser.add_argument("--rates", default=None, help="link rates in Mbit/s, comma-separated, 'none' for no cap "
                        "(default: quick 100, full 100,none)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: quick 1, full 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps of each rank (default: quick 8, full 400)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: runs/islands[-quick])")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.steps is not None:
        if args.steps <= size["warmup"]:
            parser.error(f"--steps {args.steps}: more than the {size['warmup']} warm-up steps, please")
        size["max_steps"] = args.steps
    if args.seeds is not None:
        if args.seeds < 1:
            parser.error("--seeds: 1 or more")
        size["seeds"] = args.seeds
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    rates = parse_rates(args.rates) if args.rates else size["rates"]
    if not (FASHION / "train-images-idx3-ubyte.gz").exists():
        parser.error(f"needs Fashion-MNIST in {FASHION}: apt-get install dataset-fashion-mnist")
    out = args.out or ROOT / "runs" / ("islands-quick" if args.quick else "islands")
    # SIGTERM (a CI timeout, pytest's kill) unwinds like Ctrl-C: the finally blocks stop the processes, delete the hosts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        results = run(size, rates, names, list(range(size["seeds"])), out, argv)
    except TopologyError as exc:
        print(f"[islands] cannot emulate the hosts: {exc}", file=sys.stderr)
        return 2
    return report_rates("islands", results, markdown(results), out)


if __name__ == "__main__":
    sys.exit(main())
