"""A worker on a GPU against plain Lightning on it: ResNet-18, one worker, then four sharing the GPU.

    PYTHONPATH=. python -m bench gpu [--steps N] [--rounds N] [--sharing N] [--out FILE] [--device cpu --quick]

The recipes' ``ResNet18Cifar`` (11.2M parameters), synthetic CIFAR-shaped data in a pinned DataLoader,
batch 256, SGD lr 0.05 momentum 0.9, ``Trainer(accelerator="gpu", devices=1)``: samples per second from the
median step after 20 warm-up steps, each configuration over plain Lightning's of the same round
(:mod:`bench.step_timing`), in fp32 and bf16-mixed, and at batch 1024. Then four single-device nodes of one
Lightning job on this machine (``NODE_RANK`` 0-3, each on ``cuda:0``) under asgd and AdaComp, their summed
samples per second over four plain Lightning processes side by side on the same GPU at the same time (the
GPU's time-slicing is the ceiling there). Targets: one worker asgd, AdaComp and asgd + topk at least 0.90,
sync 0.85; four workers at least 0.85. ``--device cpu --quick`` runs the same code on a small model and a
few steps, to check it here; its figures mean nothing (the test suite's check shares the CPU among 2 processes,
``--sharing 2``: the same code as 4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from bench.step_timing import fit_steps, quiet, rounds
    from harness.ports import free_port_block
    from plug_asgd import AdaComp, AsyncPSStrategy
    from plug_asgd.recipes.cifar10_models import ResNet18Cifar

TARGETS = {"asgd": 0.90, "adacomp": 0.90, "adacomp-0.0033-overlap": 0.90, "asgd+topk": 0.90, "sync": 0.85,
           "4 workers asgd": 0.85, "4 workers adacomp": 0.85}
WORKERS = 4


class Synthetic(Dataset):
    """CIFAR-shaped images and labels, made once (the loader's cost is a real one's: collation, pinning)."""

    def __init__(self, count: int, size: int = 32) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(count, 3, size, size, generator=generator)
        self.y = torch.randint(0, 10, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Classifier(pl.LightningModule):
    def __init__(self, small: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(16, 10)) if small else ResNet18Cifar()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def one_worker(precision: str, batch: int) -> dict[str, Any]:
    """The strategies of one worker at ``precision`` and ``batch``."""
    configs: dict[str, Any] = {
        "plain": lambda: "auto",
        "asgd": lambda: AsyncPSStrategy(mode="asgd"),
    }
    if precision == "32-true" and batch == 256:
        configs.update({
            "asgd ps_shards=4": lambda: AsyncPSStrategy(mode="asgd", ps_shards=4),
            "adacomp": lambda: AsyncPSStrategy(mode="adacomp"),
            "adacomp-0.0033-overlap": lambda: AsyncPSStrategy(mode=AdaComp(fraction=0.0033, overlap=True)),
            "asgd+topk": lambda: AsyncPSStrategy(mode="asgd", compressor="topk"),
            "sync": lambda: AsyncPSStrategy(mode="sync"),
        })
    return configs


def shared_gpu(mode: str, steps: int, batch: int, args: argparse.Namespace) -> float:
    """Summed samples/s of ``args.sharing`` processes at once on the device: nodes of one job (``mode``), or
    plain Lightning processes side by side (``"plain"``)."""
    port = free_port_block(args.sharing + 2)  # DDP's store, then the embedded PS
    out = Path(args.work) / f"shared-{mode}"
    out.mkdir(parents=True, exist_ok=True)
    processes = []
    for rank in range(args.sharing):
        path = os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        if mode != "plain":  # a node of one job (the plain processes know nothing of each other)
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK=str(rank), LOCAL_RANK="0",
                       WORLD_SIZE=str(args.sharing))
        command = [sys.executable, "-m", "bench.gpu", "--node", mode, "--steps", str(steps), "--batch", str(batch),
                   "--device", args.device, "--sharing", str(args.sharing), "--out", str(out / f"{rank}.json")] + (
                       ["--quick"] if args.quick else [])
        processes.append(subprocess.Popen(command, env=env))
    deadline = time.monotonic() + 600
    for p in processes:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    if any(p.returncode for p in processes):
        raise RuntimeError(f"a process of the shared-GPU run ({mode}) failed: {[p.returncode for p in processes]}")
    return sum(json.loads((out / f"{rank}.json").read_text())["samples_per_s"] for rank in range(args.sharing))


def node(args: argparse.Namespace) -> int:
    """One process of :func:`shared_gpu`: a node of an ``args.sharing``-node job (or a plain fit), its samples/s
    written out."""
    quiet()
    strategy: Any = "auto"
    num_nodes = 1
    if args.node != "plain":
        strategy, num_nodes = AsyncPSStrategy(mode=args.node), args.sharing
    loader = DataLoader(Synthetic(args.batch * 8, 32), batch_size=args.batch, pin_memory=args.device != "cpu",
                        shuffle=True)
    seconds, _ = fit_steps(lambda: Classifier(args.quick), loader, strategy, args.steps, warmup=20 if not args.quick
                           else 3, trainer_kwargs={"accelerator": args.device, "devices": 1, "num_nodes": num_nodes,
                                                   "max_epochs": 1000})
    Path(args.out).write_text(json.dumps({"samples_per_s": args.batch / seconds}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="steps timed per fit (default 60; quick 5)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the one-worker configurations (default 2)")
    parser.add_argument("--device", default="gpu", help="gpu (the benchmark) or cpu (a check of its code)")
    parser.add_argument("--quick", action="store_true", help="a small model and few steps: a check, not figures")
    parser.add_argument("--out", type=Path, help="where to write the results as JSON")
    parser.add_argument("--work", default="runs/bench-gpu", help="the shared-GPU processes' files")
    parser.add_argument("--sharing", type=int, default=WORKERS,
                        help=f"processes sharing the device at once (default {WORKERS}; the targets are for {WORKERS})")
    parser.add_argument("--node", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.node:
        return node(args)
    if args.device == "gpu" and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: this benchmark measures one (--device cpu --quick checks its code)")
    quiet()
    # the fits' embedded PS listens on ports from Lightning's main port: a block nothing else holds
    os.environ.setdefault("MASTER_PORT", str(free_port_block(8)))
    steps = args.steps or (5 if args.quick else 60)
    warmup = 3 if args.quick else 20
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if args.device == "gpu" else "cpu"}
    for precision, batch in (("32-true", 256), ("bf16-mixed", 256), ("32-true", 1024)):
        size = batch if not args.quick else 8
        loader = DataLoader(Synthetic(size * (warmup + steps + 4)), batch_size=size,
                            pin_memory=args.device != "cpu", shuffle=True)

        def fit(strategy: Any, loader: DataLoader = loader, precision: str = precision) -> tuple[float, dict]:
            return fit_steps(lambda: Classifier(args.quick), loader, strategy, steps, warmup,
                             {"accelerator": args.device, "devices": 1, "precision": precision})

        table = rounds(one_worker(precision, batch), fit, args.rounds)
        results[f"{precision}, batch {batch}"] = {
            name: {**r, "samples_per_s": size / (r["ms_per_step_median"] / 1e3)} for name, r in table.items()}
    size = 256 if not args.quick else 8
    plain = shared_gpu("plain", steps, size, args)
    shared = {"plain": plain}
    for mode in ("asgd", "adacomp"):
        shared[mode] = shared_gpu(mode, steps, size, args)
    results[f"{args.sharing} workers sharing the device"] = {name: {"samples_per_s": s, "ratio": s / plain}
                                               for name, s in shared.items()}
    _report(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0


def _report(results: dict[str, Any]) -> None:
    print(f"\n{results['device']}: samples/s and their ratio to plain Lightning's")
    for section, table in results.items():
        if section == "device":
            continue
        print(f"\n{section}")
        for name, r in table.items():
            # one worker: the median over rounds of plain's step time over this one's; shared: the sums' ratio
            ratio = 1 / r["ratio_median"] if "ratio_median" in r else r["ratio"]
            key = f"4 workers {name}" if section.startswith("4 workers") else name
            target = TARGETS.get(key) if section.startswith(("32-true, batch 256", "4 workers")) else None
            mark = "" if target is None else f"  >= {target:.2f} {'ok' if ratio >= target else 'MISSED'}"
            print(f"  {name:28s} {r['samples_per_s']:10.0f} {ratio:7.3f}{mark}")


if __name__ == "__main__":
    sys.exit(main())
