"""DiLoCo on slow links: the language model under DDP, DiLoCo, asynchronous DiLoCo and hivemind, on emulated hosts.

``python -m bench diloco [--quick] [--rates 100,10] [--seeds 3] [--inner-steps 50] [--model small]
[--async-until steps] [--downlink-codec fp16|int8|int4] [--configs ...] [--out DIR]``
(root: it makes network namespaces). Issue 58's targets, measured side by side: ``bench.slowlink``'s machinery (a
:class:`harness.netns.Topology` of a PS host and 2 worker hosts whose links htb caps at each rate in both directions,
so every byte between two hosts crosses two capped links), one process per worker host, the language-model recipe's
ByteGPT (``plug_asgd/recipes/lm.py``) on Debian's ``fortunes`` corpus (``plug_asgd/recipes/lm_data.py``), AdamW at the
recipe's rate with its warmup and then a constant rate, batch 32 windows per worker. The configurations, one launch
each (:data:`CONFIGS`):

- ``ddp``: Lightning's DDP over gloo between the 2 hosts, ``steps`` steps per rank: the reference, whose final
  validation loss is the target loss of the seed;
- ``diloco``: ``AsyncPSStrategy(mode="diloco", inner_steps=H)`` on a ``plug-asgd serve-ps`` on the PS's host
  (Nesterov outer optimizer, lr 0.7, momentum 0.9);
- ``diloco-m05`` and ``diloco-lr1-m05`` (by ``--configs`` only): ``diloco`` with the outer Nesterov at momentum 0.5,
  lr 0.7 and 1.0;
- ``diloco-slow`` and ``async_diloco-slow``: the same, and ``mode="async_diloco"`` (the delayed Nesterov update,
  dynamic local steps), with worker host ``w1`` slowed ``--slow-factor`` times: after each of its steps it sleeps
  ``(factor - 1)`` x the median of its last 31 steps (:class:`bench.train.StepClock`'s proportional straggler), so
  that it stays that many times slower than itself whatever the machine's load does to its steps during a run;
- ``async_diloco-slow-sgd``: ``async_diloco-slow`` with the outer step ``{"name": "sgd", "lr": 1.0, "momentum": 0}``
  on the workers and the PS (``serve-ps --outer``), which does not swing at two workers (``bench async_sim``);
- ``diloco-slow-f2`` and ``async_diloco-slow-sgd-f2`` (by ``--configs`` only): the two beside the slowed host,
  streaming with ``fragments=2``;
- ``async_diloco-slow-m05`` and ``async_diloco-slow-m07`` (by ``--configs`` only): ``async_diloco-slow`` with the
  delayed Nesterov at momentum 0.5 and 0.7 (lr 0.7), without the momentum lookahead;
- ``async_diloco-slow-nolookahead`` (by ``--configs`` only): ``async_diloco-slow`` with
  ``momentum_lookahead=False``: each reply the central model itself;
- ``async_diloco-slow-f2`` (by ``--configs`` only): ``async_diloco-slow`` streaming with ``fragments=2``;
- ``async_diloco-slow-overlap`` and ``diloco-slow-overlap`` (by ``--configs`` only): the two beside the slowed host
  with ``overlap=True``: the whole model's push sent while the inner steps go on;
- ``hivemind``: hivemind 1.1.12's ``Optimizer(use_local_updates=True)`` parameter averaging (its quickstart's
  configuration), with ``target_batch_size`` = DiLoCo's round, 2 x H x 32 samples (``bench.diloco_hivemind``).

Every configuration but DDP trains ``overtrain`` x ``steps`` steps per worker, so that its time to DDP's loss can be
read where it needs more samples than DDP for it (with ``--async-until together``, async_diloco's host beside the
slowed one trains ``--slow-factor`` x as many, so that it does not stop and leave the slowed host alone at the end;
no round of async_diloco waits for the slowed host); its loss at DDP's samples is read where it had trained them (the
central model after round ``steps / H``; hivemind's peer 0 at step ``steps``). The models evaluated: DDP's rank 0
weights every ``snapshot_s`` seconds; the PS's central model at each of its versions, pulled over the PS host's own
loopback by ``bench.diloco_observe``; hivemind's peer 0 every ``snapshot_s`` seconds; each on the same held-out
windows after the launch, on the wall clock from rank 0's start of training. Bytes: each worker host's interface
counters (tx + rx), read each second of the launch (:class:`bench.diloco_launch.LinkMeter`), over the samples the
hosts trained. The tables and the figure are :mod:`bench.diloco_report`'s.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, machine, report_rates
from bench.islands import parse_rates, rate_key
from bench.slowlink import PS_PORT, probe
from harness.netns import Topology, TopologyError

BATCH = 32
SLOW_RANK = 1  # the worker host slowed in the -slow configurations: w1
CONFIGS: dict[str, dict[str, Any]] = {
    "ddp": {"kind": "ddp"},
    "diloco": {"kind": "ps", "mode": "diloco"},
    "diloco-slow": {"kind": "ps", "mode": "diloco", "slow": True},
    # the outer Nesterov at a lower momentum, which at a few rounds ends nearer DDP's loss (bench learning's rows
    # diloco-m05 and diloco-lr1-m05); asked for by --configs only
    "diloco-m05": {"kind": "ps", "mode": "diloco", "outer": {"name": "nesterov", "lr": 0.7, "momentum": 0.5}},
    "diloco-lr1-m05": {"kind": "ps", "mode": "diloco", "outer": {"name": "nesterov", "lr": 1.0, "momentum": 0.5}},
    "async_diloco-slow": {"kind": "ps", "mode": "async_diloco", "slow": True},
    # the outer step that does not swing at two workers (docs/benchmarks.md, "Where async_diloco swings")
    "async_diloco-slow-sgd": {"kind": "ps", "mode": "async_diloco", "slow": True,
                              "outer": {"name": "sgd", "lr": 1.0, "momentum": 0.0}},
    "hivemind": {"kind": "hivemind"},
    # streaming (fragments=2: each half of the model pushed at its staggered step, sent while the inner steps go on),
    # both beside the slowed host; asked for by --configs only
    "diloco-slow-f2": {"kind": "ps", "mode": "diloco", "slow": True, "fragments": 2},
    "async_diloco-slow-sgd-f2": {"kind": "ps", "mode": "async_diloco", "slow": True, "fragments": 2,
                                 "outer": {"name": "sgd", "lr": 1.0, "momentum": 0.0}},
    # the delayed Nesterov at a lower momentum, which over 20 rounds of bench async_sim lags diloco less than the
    # outer SGD; asked for by --configs only
    "async_diloco-slow-m05": {"kind": "ps", "mode": "async_diloco", "slow": True, "momentum_lookahead": False,
                              "outer": {"name": "nesterov", "lr": 0.7, "momentum": 0.5}},
    "async_diloco-slow-m07": {"kind": "ps", "mode": "async_diloco", "slow": True, "momentum_lookahead": False,
                              "outer": {"name": "nesterov", "lr": 0.7, "momentum": 0.7}},
    # each reply the central model itself, not less the momentum step its cycle is expected to take
    "async_diloco-slow-nolookahead": {"kind": "ps", "mode": "async_diloco", "slow": True,
                                      "momentum_lookahead": False},
    "async_diloco-slow-f2": {"kind": "ps", "mode": "async_diloco", "slow": True, "fragments": 2},
    # the whole model's push sent from a thread while the inner steps go on (streaming's exchange, one fragment)
    "async_diloco-slow-overlap": {"kind": "ps", "mode": "async_diloco", "slow": True, "overlap": True},
    "diloco-slow-overlap": {"kind": "ps", "mode": "diloco", "slow": True, "overlap": True},
}
OPT_IN = ("diloco-m05", "diloco-lr1-m05",
          "diloco-slow-f2", "async_diloco-slow-sgd-f2", "async_diloco-slow-m05", "async_diloco-slow-m07",
          "async_diloco-slow-nolookahead", "async_diloco-slow-f2", "async_diloco-slow-overlap", "diloco-slow-overlap")
DEFAULT_CONFIGS = [name for name in CONFIGS if name not in OPT_IN]
# tests/test_lm.py's LM_SMALL: 2 blocks 64 wide (118,528 parameters, 474 kB in float32), windows of 32 bytes
MODEL: dict[str, Any] = {"d_model": 64, "layers": 2, "heads": 4, "max_context": 32, "warmup_steps": 20}
# --model: ``small`` (MODEL), or ``recipe``: the recipe's default width and depth (1,835,136 parameters, 7.3 MB in
# float32), on the same 32-byte windows
MODELS: dict[str, dict[str, Any]] = {
    "small": MODEL, "recipe": {"d_model": 192, "layers": 4, "heads": 6, "max_context": 32, "warmup_steps": 20}}
SIZES: dict[str, dict[str, Any]] = {
    # the test suite's size: one rate, one seed, 40 steps (DDP), 60 (the others) at H = 10
    "quick": {"rates": [100.0], "seeds": 1, "steps": 40, "overtrain": 1.5, "inner_steps": 10, "warmup": 3,
              "snapshot_s": 1.0, "val_windows": 128, "timeout": 240, "probe_s": 1.0, "probe_tries": 1, "model": MODEL},
    # 400 steps of 2 x 32 windows (25,600 samples, 819 kB of text) for DDP, 600 per worker for the others at H = 50
    # (8 rounds at DDP's samples, 12 in all); 512 held-out windows
    "small": {"rates": [100.0, 10.0], "seeds": 3, "steps": 400, "overtrain": 1.5, "inner_steps": 50, "warmup": 5,
              "snapshot_s": 2.0, "val_windows": 512, "timeout": 900, "probe_s": 2.0, "probe_tries": 3, "model": MODEL},
}


def overtrained_steps(size: dict[str, Any]) -> int:
    """The steps per worker of every configuration but DDP: ``overtrain`` x ``steps``, up to a whole round.

    Args:
        size: the size's settings (``steps``, ``overtrain``, ``inner_steps``).
    """
    h = size["inner_steps"]
    return math.ceil(size["steps"] * size["overtrain"] / h) * h


def run_spec(name: str, size: dict[str, Any], seed: int, ps_address: str) -> dict[str, Any]:
    """The spec of configuration ``name``'s launch (read by ``bench.diloco_train`` or ``bench.diloco_hivemind``).

    Args:
        name: a key of :data:`CONFIGS`.
        size: the size's settings.
        seed: the run's seed (the model's initialization, the training windows, their order).
        ps_address: the PS's address on its host.
    """
    from plug_asgd.recipes.lm_data import FORTUNES_DIR

    cfg = CONFIGS[name]
    spec: dict[str, Any] = {
        "name": name, "kind": cfg["kind"], "nodes": 2, "seed": seed, "batch_size": BATCH,
        "max_steps": size["steps"] if cfg["kind"] == "ddp" else overtrained_steps(size),
        "equal_steps": size["steps"], "warmup": size["warmup"], "model": dict(size["model"]),
        "data": {"data_dir": str(Path(os.environ.get("PLUG_ASGD_FORTUNES") or FORTUNES_DIR)),
                 "context": size["model"]["max_context"], "val_windows": size["val_windows"]},
        "snapshot_every_s": None if cfg["kind"] == "ps" else size["snapshot_s"]}
    if cfg["kind"] == "ps":
        spec.update(mode=cfg["mode"], inner_steps=size["inner_steps"], compressor=size.get("compressor", "none"),
                    ps_address=ps_address, outer=cfg.get("outer"), fragments=cfg.get("fragments"),
                    momentum_lookahead=cfg.get("momentum_lookahead"), overlap=cfg.get("overlap"),
                    downlink_codec=size.get("downlink_codec"))
    if cfg["kind"] == "hivemind":
        spec.update(hivemind_target_batch_size=2 * size["inner_steps"] * BATCH,  # DiLoCo's round of samples
                    hivemind_matchmaking_time=size.get("hivemind_matchmaking_time", 3.0),
                    hivemind_averaging_timeout=size.get("hivemind_averaging_timeout", 10.0))
    if cfg.get("slow"):
        spec.update(slow_rank=SLOW_RANK, slow_factor=size["slow_factor"])
        if cfg.get("mode") == "async_diloco" and size.get("async_until") == "together":
            # no round waits for the slowed host: the other trains on while it does, slow_factor x its steps
            fast = 1 - SLOW_RANK
            spec["rank_max_steps"] = {str(fast): math.ceil(spec["max_steps"] * size["slow_factor"])}
    return spec


def parameter_count(model: dict[str, Any]) -> int:
    """ByteGPT's parameters at ``model``'s size (its output head tied to the byte embedding).

    Args:
        model: ByteGPT's size.
    """
    from bench.diloco_train import BenchGPT

    return sum(p.numel() for p in BenchGPT(**model).parameters())


def step_time(model: dict[str, Any], repeats: int = 20, blocks: int = 3) -> float:
    """One training step of ByteGPT (forward, backward, AdamW) at batch 32 on one thread: the lowest of ``blocks``
    medians of ``repeats`` steps. The slowed host's sleep is set from it, so a moment of load on the machine while it
    is measured must not lengthen the sleep: the lowest median is the step alone.

    Args:
        model: ByteGPT's size.
        repeats: steps timed per block, after 5 untimed.
        blocks: the blocks timed.
    """
    import torch
    import torch.nn.functional as F

    from bench.diloco_train import BenchGPT

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gpt = BenchGPT(**model)
        opt = torch.optim.AdamW(gpt.parameters(), lr=1e-3)
        x = torch.randint(0, 256, (BATCH, model["max_context"]))
        medians = []
        for _ in range(blocks):
            times = []
            for i in range(repeats + 5):
                t = time.perf_counter()
                loss = F.cross_entropy(gpt(x), x)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if i >= 5:
                    times.append(time.perf_counter() - t)
            medians.append(statistics.median(times))
    finally:
        torch.set_num_threads(threads)
    return min(medians)


def measure(topo: Topology, name: str, size: dict[str, Any], seed: int, out: Path) -> dict[str, Any]:
    """One configuration at the current rate: its launch, its curve of validation loss against wall time and the
    links' bytes, its samples, samples/s and bytes per sample on each worker host's link.

    Args:
        topo: the emulated hosts, capped at the rate.
        name: a key of :data:`CONFIGS`.
        size: the size's settings.
        seed: the run's seed.
        out: the launch's folder.
    """
    from bench.diloco_launch import WORKER_HOSTS, LinkMeter, launch_hivemind, launch_lightning

    spec = run_spec(name, size, seed, f"tcp://{topo.hosts['ps'].address}:{PS_PORT}")
    launch = launch_hivemind if spec["kind"] == "hivemind" else launch_lightning
    load = [round(x, 2) for x in os.getloadavg()]
    started = time.monotonic()
    with LinkMeter(topo) as meter:
        got = launch(topo, spec, out, size["timeout"])
    result: dict[str, Any] = {"name": name, "seed": seed, **CONFIGS[name], "max_steps": spec["max_steps"],
                              "rank_max_steps": spec.get("rank_max_steps"),
                              "launch_s": round(time.monotonic() - started, 1), "load_average_at_start": load,
                              "wire_bytes": meter.wire()}
    if "error" in got:
        return {**result, "error": got["error"]}
    records = got["records"]
    curve = evaluate(got["snapshots"], spec, records[0]["wall_start"], meter)
    steps = [r["steps"] for r in records]
    hosts = {}
    for rank, host in enumerate(WORKER_HOSTS):
        link = result["wire_bytes"][host]["tx"] + result["wire_bytes"][host]["rx"]
        hosts[host] = {"samples": steps[rank] * BATCH, "bytes": link, "bytes_per_sample": link / (steps[rank] * BATCH)}
    samples = sum(steps) * BATCH
    from bench.train import window

    result.update(steps=steps, samples=samples, curve=curve, final_loss=curve[-1][1], train_s=curve[-1][0],
                  equal_samples_loss=equal_samples_loss(spec, curve), hosts=hosts,
                  bytes_per_sample=sum(h["bytes"] for h in hosts.values()) / samples,
                  samples_per_s=window(records, BATCH)["samples_per_s"],
                  slept_s=[r.get("slept_s") for r in records],
                  step_median_s=[r.get("step_median_s") for r in records],
                  threads_per_process=got["threads_per_process"],
                  comm=[r.get("comm") for r in records],
                  hivemind={**{k: records[0][k] for k in ("config", "hivemind")}, "log": got["hivemind_log"]}
                  if spec["kind"] == "hivemind" else None, local_epochs=[r.get("local_epoch") for r in records])
    return result


def evaluate(snapshots: list[tuple[float, Any, dict[str, Any]]], spec: dict[str, Any], t0: float,
             meter: Any) -> list[list[Any]]:
    """Each snapshot as ``[seconds since t0, validation loss, worker links' bytes by then, its counters]``.

    Args:
        snapshots: ``(wall time, model, counters)`` of the launch.
        spec: the run's spec.
        t0: the wall-clock start of rank 0's training.
        meter: the launch's :class:`bench.diloco_launch.LinkMeter`.
    """
    import torch

    from bench.diloco_launch import held_out, val_loss
    from bench.diloco_train import BenchGPT

    torch.set_num_threads(max(1, os.cpu_count() or 1))  # untimed: after the launch
    x, y = held_out(spec)
    model = BenchGPT(**spec["model"])
    return [[round(max(0.0, when - t0), 3), round(val_loss(model, state, x, y), 5),
             round(meter.worker_bytes_at(when)), info] for when, state, info in snapshots]


def equal_samples_loss(spec: dict[str, Any], curve: list[list[Any]]) -> float | None:
    """The validation loss once the run had trained DDP's samples (2 x ``equal_steps`` x the batch): DDP's at its
    end; DiLoCo's central model after round ``equal_steps / H`` (its pushes applied); hivemind's peer 0 at step
    ``equal_steps``; None for asynchronous DiLoCo (its rounds' lengths vary).

    Args:
        spec: the run's spec.
        curve: its :func:`evaluate` rows.
    """
    if spec["kind"] == "ddp":
        return curve[-1][1]
    if spec["kind"] == "hivemind":
        return next((loss for _, loss, _, info in curve if info.get("steps") == spec["equal_steps"]), None)
    if spec["mode"] != "diloco":
        return None
    pushes = 2 * spec["equal_steps"] // spec["inner_steps"]
    return next((loss for _, loss, _, info in curve if (info.get("pushes_applied") or 0) >= pushes), None)


def run(size: dict[str, Any], rates: list[float], names: list[str], seeds: list[int], out: Path,
        argv: list[str]) -> dict[str, Any]:
    """Every configuration, seed and rate on one topology whose caps change between rates; the JSON, the table and
    the figures rewritten after each launch.

    Args:
        size: the size's settings.
        rates: the link rates, Mbit/s.
        names: the configurations.
        seeds: the seeds.
        out: the results' folder.
        argv: the command line, for the record.
    """
    from bench.diloco_report import write_report

    model = size["model"]
    step_s = step_time(model)
    results: dict[str, Any] = {"machine": machine(), "command": "python -m bench diloco " + " ".join(argv),
                               "batch_size": BATCH, "model": model, "step_s": step_s,
                               "parameters": parameter_count(model),
                               "overtrained_steps": overtrained_steps(size),
                               "size": {k: v for k, v in size.items() if k != "rates"},
                               "configs": {n: CONFIGS[n] for n in names}, "seeds": seeds, "rates": {}}
    started = time.monotonic()
    with Topology(["ps", "w0", "w1"], rates[0]) as topo:
        for rate in rates:
            topo.set_rate(rate)
            key = rate_key(rate)
            entry = results["rates"].setdefault(key, {"rate_mbit": rate, "runs": {n: [] for n in names}})
            entry["probe"] = probe(topo, rate, size["probe_s"], tries=size["probe_tries"])
            print(f"[diloco] {key} Mbit/s: measured {entry['probe']['mbit_per_s']:.1f}", flush=True)
            for seed in seeds:
                for name in names:
                    r = measure(topo, name, size, seed, out / "work" / key / f"seed{seed}" / name)
                    entry["runs"][name].append(r)
                    print(f"[diloco] {key} seed {seed} {name}: " + (r["error"] if "error" in r else
                          f"final loss {r['final_loss']:.4f} at {r['train_s']:.1f} s (at DDP's samples: "
                          f"{r['equal_samples_loss']}), {r['samples_per_s'] or 0:,.0f} samples/s, "
                          f"{r['bytes_per_sample'] / 1e3:.2f} kB per sample, {r['launch_s']} s"), flush=True)
                    results["wall_s"] = round(time.monotonic() - started, 1)
                    write_report(results, out)
    return results


def parser() -> argparse.ArgumentParser:
    """``python -m bench diloco``'s flags."""
    p = argparse.ArgumentParser(prog="python -m bench diloco", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the test suite's size: 100 Mbit/s, one seed, 40 steps")
    p.add_argument("--rates", default=None, help="link rates in Mbit/s, comma-separated (default: quick 100, small "
                   "100,10)")
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: quick 1, small 3)")
    p.add_argument("--steps", type=int, default=None, help="DDP's steps per rank (default: quick 40, small 400)")
    p.add_argument("--overtrain", type=float, default=None,
                   help="the other configurations' steps per worker over DDP's (default 1.5)")
    p.add_argument("--inner-steps", type=int, default=None, help="DiLoCo's H (default: quick 10, small 50)")
    p.add_argument("--model", choices=list(MODELS), default="small",
                   help="ByteGPT's size: small (118,528 parameters) or recipe (the recipe's default width and depth, "
                   "1,835,136), on 32-byte windows (default: small)")
    p.add_argument("--compressor", default="none", help="the codec of DiLoCo's pushes (default: none, float32)")
    p.add_argument("--downlink-codec", choices=["fp16", "int8", "int4"], default=None, help="every PS "
                   "configuration's replies to pushes: differences from each worker's copy, so coded (serve-ps "
                   "--downlink-codec) (default: float32, the model whole)")
    p.add_argument("--slow-factor", type=float, default=2.0, help="how much slower the slowed host's steps are in "
                   "the -slow configurations (default 2)")
    p.add_argument("--async-until", choices=["steps", "together"], default="steps",
                   help="beside the slowed host, async_diloco's other host trains the same steps and stops first "
                   "(steps), or --slow-factor x them, so that both end about together (together) (default: steps)")
    p.add_argument("--hivemind-matchmaking-time", type=float, default=3.0, metavar="S",
                   help="hivemind.Optimizer's matchmaking_time (default: its quickstart's 3 s)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, of {', '.join(CONFIGS)} (default: all but the -f2 ones)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default: bench/results/diloco/SIZE)")
    return p


def settings(args: argparse.Namespace) -> tuple[dict[str, Any], list[float], list[str]]:
    """The size, rates and configurations the flags ask for.

    Args:
        args: the parsed flags.

    Raises:
        ValueError: a flag out of its range, an unknown configuration or codec.
        CorpusNotFoundError: the language model's corpus is not installed (``apt-get install fortunes``).
    """
    name = "quick" if args.quick else "small"
    size = {**SIZES[name], "size": name, "slow_factor": args.slow_factor, "compressor": args.compressor,
            "hivemind_matchmaking_time": args.hivemind_matchmaking_time, "model": MODELS[args.model],
            "async_until": args.async_until, "downlink_codec": args.downlink_codec}
    for key in ("steps", "overtrain", "inner_steps", "seeds"):
        if getattr(args, key) is not None:
            size[key] = getattr(args, key)
    if size["steps"] < 1 or size["seeds"] < 1 or size["inner_steps"] < 1 or size["overtrain"] < 1:
        raise ValueError("--steps, --seeds and --inner-steps: 1 or more; --overtrain: 1.0 or more")
    if size["steps"] % size["inner_steps"] or size["steps"] <= size["warmup"]:
        raise ValueError(f"--steps {size['steps']}: a whole number of rounds of --inner-steps {size['inner_steps']} "
                         "(DiLoCo's loss at DDP's samples is its central model's after round steps / H), and more "
                         f"than the {size['warmup']} warm-up steps")
    if args.slow_factor < 1:
        raise ValueError(f"--slow-factor {args.slow_factor}: 1 (not slowed) or more")
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    rates = parse_rates(args.rates) if args.rates else size["rates"]
    if None in rates:
        raise ValueError(f"--rates {args.rates}: a rate in Mbit/s each (the targets are set on capped links)")
    from plug_asgd import compressors
    from plug_asgd.recipes.lm_data import find_corpus

    compressors.get(args.compressor)  # ValueError: not a codec
    find_corpus(run_spec("ddp", size, 0, "")["data"]["data_dir"])
    return size, rates, names


def main(argv: list[str] | None = None) -> int:
    """``python -m bench diloco``: parse the flags, run, print the table.

    Args:
        argv: the flags; None: the command line's.
    """
    p = parser()
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    from plug_asgd.recipes.lm_data import CorpusNotFoundError

    try:
        size, rates, names = settings(args)
    except (ValueError, CorpusNotFoundError) as exc:
        p.error(str(exc))
    out = args.out or ROOT / "bench" / "results" / "diloco" / size["size"]
    # SIGTERM (a CI timeout, pytest's kill) unwinds like Ctrl-C: the finally blocks stop the processes, delete the hosts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        results = run(size, rates, names, list(range(size["seeds"])), out, argv)
    except TopologyError as exc:
        print(f"[diloco] cannot emulate the hosts: {exc}", file=sys.stderr)
        return 2
    from bench.diloco_report import markdown

    return report_rates("diloco", results, markdown(results), out)


if __name__ == "__main__":
    sys.exit(main())
