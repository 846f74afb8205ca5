"""One launch of Lightning worker processes that runs a sequence of training configurations.

``python -m bench.train --spec SPEC.json --out DIR``. Every rank runs the same sequence of
runs (a fresh Trainer each; Lightning launches the other ranks once, at the first Trainer,
by re-running this module), so several strategies are compared in the same processes,
alternated, without paying the interpreter and import start-up for each. A run is one of:

- ``single``: plain Lightning on one device (``strategy="auto"``), for ``workers == 1``;
- ``ddp``: Lightning's DDP over gloo (``accelerator="cpu"``);
- ``asgd``: ``AsyncPSStrategy(mode=...)`` with its embedded PS on a port of its own above
  ``MASTER_PORT`` (the main port stays free for DDP's store; :func:`ps_port`); ``ps_shards``
  makes it a sharded PS of that many embedded shards, on as many ports; ``options`` holds any
  other keyword arguments of the strategy (``bits``, ``rank``, ...).

``optimizer``, ``lr`` and ``momentum`` of a run go to the recipe CNN (default: Adam, 1e-3). A run with
``"model": "lm"`` trains the language-model recipe's ByteGPT on the fortunes corpus instead (its keys:
:mod:`bench.train_lm`). A run with ``test`` tests the model the strategy tests (the PS's central model under
AsyncPSStrategy) and keeps its ``test_loss`` and ``test_acc``.

Measured on each rank by :class:`StepClock`: the wall-clock end of every training step (after
``warmup`` steps), forward+backward time, and, on rank 0 where asked, snapshots of the weights
every ``snapshot_every_s`` seconds of training (the time taken by a snapshot is subtracted from
the clock), evaluated on the test set after the fit; with ``snapshot_central``, beside each, rank 0's
copy of the central model as of its last reply (:func:`central_weights`). The straggler is a sleep at the end of
each step of rank ``slow_rank``, of one of two kinds:

- ``slow_sleep_s``, fixed: the runner sets it to ``(factor - 1) x`` the compute time of one step measured once,
  alone, before the launch, so that DDP and asgd are slowed by the same amount (a sleep proportional to the step's
  own time would also scale DDP's all-reduce, which runs inside its backward pass, and asgd's exchange, which runs
  in every step);
- ``slow_factor``, proportional: from its third step, ``(factor - 1) x`` the median of the rank's last
  :data:`RECENT_STEPS` steps (``bench diloco``, whose slowed runs are DiLoCo's: one step in H exchanges, which the
  median leaves out). The host stays ``factor`` x slower than itself when the machine's load changes its steps
  during a run, where a fixed sleep measured at the start would slow it more or less than that.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    import numpy as np
    import pytorch_lightning as pl
    import torch

    from bench.common import ports_needed, ps_push_ms
    from plug_asgd.recipes.common import mode_and_codec
    from plug_asgd.recipes.data import Arrays
    from plug_asgd.recipes.mnist import MnistCNN, MnistDataModule
    from plug_asgd.strategy import AsyncPSStrategy
    from plug_asgd.worker.client import PSError


RECENT_STEPS = 31  # the proportional straggler's window: its median leaves out a DiLoCo round's exchange (1 step in H)


class StepClock(pl.Callback):
    def __init__(self, run: dict[str, Any], rank: int) -> None:
        self.run = run
        self.rank = rank
        self.warmup = int(run.get("warmup", 3))
        slowed = run.get("slow_rank") == rank
        self.pause = float(run.get("slow_sleep_s") or 0.0) if slowed else 0.0
        # a straggler as slow as its own steps: (factor - 1) x the median of its recent steps (bench diloco)
        self.stretch = float(run.get("slow_factor") or 1.0) - 1.0 if slowed else 0.0
        self.step_times: list[float] = []  # each step's time before its sleep: compute, and any exchange in it
        self.time_limit = run.get("time_limit_s")
        self.snapshot_every = run.get("snapshot_every_s") if rank == 0 else None
        self.steps = 0
        self.step_ends: list[float] = []  # time.time() of each step end after the warm-up
        self.window_start: float | None = None
        self.compute: list[float] = []
        self.slept = 0.0
        self.excluded = 0.0
        self.fit_start = 0.0
        self.snapshots: list[tuple[float, dict[str, torch.Tensor]]] = []
        self.central = bool(self.snapshot_every and run.get("snapshot_central"))
        self.central_snapshots: list[tuple[float, dict[str, torch.Tensor]]] = []
        self._next_snapshot = 0.0
        self._t0 = 0.0

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.fit_start = time.perf_counter()
        if self.snapshot_every:
            self._snapshot(trainer, module)
            self._next_snapshot = self.snapshot_every

    def _clock(self) -> float:
        return time.perf_counter() - self.fit_start - self.excluded

    def _snapshot(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        t = time.perf_counter()
        at = self._clock()
        self.snapshots.append((at, {k: v.detach().clone() for k, v in module.state_dict().items()}))
        central = central_weights(trainer, module) if self.central else None
        if central is not None:
            self.central_snapshots.append((at, central))
        self.excluded += time.perf_counter() - t

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self._fb = time.perf_counter() - self._t0

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        fb = getattr(self, "_fb", 0.0)
        self.compute.append(fb)
        self.step_times.append(time.perf_counter() - self._t0)
        pause = self.pause
        if self.stretch and len(self.step_times) >= 3:  # (from the third step: fewer would be the first's, set-up)
            pause = self.stretch * statistics.median(self.step_times[-RECENT_STEPS:])
        if pause:
            time.sleep(pause)
            self.slept += pause
        self.steps += 1
        now = time.time()
        if self.steps == self.warmup:
            self.window_start = now
        elif self.steps > self.warmup:
            self.step_ends.append(now)
        if self.snapshot_every and self._clock() >= self._next_snapshot:
            self._snapshot(trainer, module)
            self._next_snapshot = self._clock() + self.snapshot_every
        if self.time_limit and self.window_start is not None and now - self.window_start >= self.time_limit:
            trainer.should_stop = True  # asgd-family runs only: their ranks stop independently

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if self.snapshot_every:
            self._snapshot(trainer, module)

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "steps": self.steps, "window_start": self.window_start,
                "step_ends": self.step_ends, "compute_median_s": float(np.median(self.compute)) if self.compute else 0,
                "step_median_s": float(np.median(self.step_times)) if self.step_times else 0, "slept_s": self.slept}


def central_weights(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, torch.Tensor] | None:
    """Rank 0's copy of the central model as of its last reply, as a state dict: the model the PS client holds
    to patch delta replies into (exact, bit for bit), which is what validation, test and checkpoints load; a
    worker's own weights carry its codec's residual and its look-ahead besides. None where the client holds
    no exact copy (no delta replies, a sharded PS, approximate replies, before the first reply)."""
    client = getattr(getattr(trainer.strategy, "connection", None), "client", None)
    held = getattr(client, "held", None)
    if held is None or not held.exact or held.version < 0 or not held.tensors:
        return None
    central = held.tensors  # arrays a reply handed out are never written afterwards
    return {k: torch.from_numpy(np.array(central[k], copy=True)).reshape(v.shape) if k in central
            else v.detach().clone() for k, v in module.state_dict().items()}


def ps_port(runs: list[dict[str, Any]], index: int) -> int:
    """Run ``index``'s first PS port: above ``MASTER_PORT`` and every port an earlier run of the launch took."""
    return int(os.environ["MASTER_PORT"]) + 1 + ports_needed(runs[:index])


def make_strategy(run: dict[str, Any], index: int, runs: list[dict[str, Any]]) -> Any:
    kind = run["kind"]
    if kind == "single":
        return "auto"
    if kind == "ddp":
        from pytorch_lightning.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo")
    port = ps_port(runs, index)
    # "options": the strategy's own arguments, and knobs of the mode or the codec
    options = run.get("options", {})
    own = {k: v for k, v in options.items() if k in inspect.signature(AsyncPSStrategy).parameters}
    knobs = {"overlap": run.get("overlap"), **{k: v for k, v in options.items() if k not in own}}
    mode, codec = mode_and_codec(run.get("mode", "asgd"), run.get("compressor", "none"),
                                 compression=run.get("compression"), **knobs)
    return AsyncPSStrategy(mode=mode, compressor=codec, ps_port=port, shm_pushes=run.get("shm_pushes", True),
                           ps_shards=run.get("ps_shards"), **own)


def evaluate(state: dict[str, torch.Tensor], test_x: torch.Tensor, test_y: torch.Tensor) -> float:
    model = MnistCNN()
    model.load_state_dict(state)
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, len(test_x), 1000):
            correct += int((model(test_x[i:i + 1000]).argmax(1) == test_y[i:i + 1000]).sum())
    return correct / len(test_x)


def window(records: list[dict[str, Any]], batch: int) -> dict[str, Any]:
    """Samples/s of all ranks over the window in which every rank was past its warm-up and still training."""
    starts = [r["window_start"] for r in records if r["window_start"] is not None]
    if len(starts) < len(records) or any(not r["step_ends"] for r in records):
        return {"samples_per_s": None, "window_s": None, "steps_in_window": None}
    start = max(starts)
    end = min(r["step_ends"][-1] for r in records)
    steps = [sum(1 for t in r["step_ends"] if start < t <= end) for r in records]
    span = end - start
    rank0 = records[0]
    r0_span = rank0["step_ends"][-1] - rank0["window_start"]
    ends = [rank0["window_start"], *rank0["step_ends"]]
    return {"samples_per_s": sum(steps) * batch / span if span > 0 else None, "window_s": span,
            "steps_in_window": steps, "step_time_s": r0_span / len(rank0["step_ends"]),
            "step_time_median_s": float(np.median(np.diff(ends)))}


class _LoadedOnce(MnistDataModule):
    """The recipe's data module, reading the IDX files once per process: a launch trains many runs."""

    _arrays: dict[Path, Arrays] = {}

    def load_arrays(self) -> Arrays:
        if self.data_dir not in self._arrays:
            self._arrays[self.data_dir] = super().load_arrays()
        return self._arrays[self.data_dir]


def model_and_data(spec: dict[str, Any], run: dict[str, Any], seed: int) -> tuple[pl.LightningModule, Any]:
    """The run's model and data: the recipe CNN on Fashion-MNIST, or with ``"model": "lm"`` the language-model
    recipe's ByteGPT on the fortunes corpus (:mod:`bench.train_lm`)."""
    if run.get("model", "cnn") == "lm":
        from bench.train_lm import lm_model_and_data

        return lm_model_and_data(run, seed)
    dm = _LoadedOnce(spec["data_dir"], batch_size=run["batch_size"], train_subset=run.get("train_subset"),
                     test_subset=run.get("test_subset", spec.get("test_subset")), download=False, seed=seed)
    return MnistCNN(**{k: run[k] for k in ("optimizer", "lr", "momentum") if k in run}), dm


def _exchange_records(out: Path, index: int, rank: int, workers: int, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Write this rank's record and read every rank's: a test after a fit that diverged on any rank would wait for
    that rank forever, so every rank must know."""
    tmp = out / f"run{index}_rank{rank}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(out / f"run{index}_rank{rank}.json")  # atomic: the other ranks poll for this file and read it
    records = []
    deadline = time.monotonic() + 900
    for r in range(workers):
        path = out / f"run{index}_rank{r}.json"
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        records.append(json.loads(path.read_text()))
    return records


def _wait_for_rank0(out: Path, index: int) -> None:
    """Rank 0 evaluates its snapshots after the fit: a rank that went on at once would send the next run's first
    request to a PS that rank 0 has not started yet, and time out."""
    done = out / f"run{index}_done"
    deadline = time.monotonic() + 900
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def _ps_fields(ps: dict[str, Any]) -> dict[str, Any]:
    """The PS's counters a result keeps."""
    fields = dict(push_bytes=ps["push_bytes_in"], push_local_bytes=ps["push_local_bytes_in"],
                  bytes_in=ps["bytes_in"], bytes_out=ps["bytes_out"], model_bytes_out=ps.get("model_bytes_out"),
                  delta_replies=ps.get("delta_replies"), own_replies=ps.get("own_replies"),
                  model_replies=ps.get("model_replies"), approx_replies=ps.get("approx_replies"),
                  pushes=ps["pushes_applied"] + ps["pushes_dropped"],
                  pushes_applied=ps["pushes_applied"], ps_version=ps["version"],
                  ps_world_size=ps.get("world_size"), pushes_by_rank=ps.get("pushes_by_rank"),
                  weights_pushes=ps["weights_pushes"], weights_not_current=ps["weights_not_current"],
                  weights_lent=ps["weights_lent"], lent_copies=ps["lent_copies"], staleness=ps.get("staleness"),
                  ps_push_ms=ps_push_ms(ps))
    if "shards" in ps:  # a sharded PS: the counters above are shard 0's but the traffic, summed over shards
        fields["shards"] = [{k: s.get(k) for k in ("version", "pushes_applied", "pushes_dropped", "push_bytes_in",
                                                   "push_local_bytes_in", "bytes_in", "bytes_out",
                                                   "delta_replies", "own_replies")} for s in ps["shards"]]
    return fields


def _curves(clock: StepClock, dm: MnistDataModule) -> dict[str, Any]:
    """Rank 0's snapshots evaluated on the test set, untimed, after the fit: a rank pinned to a core
    (bench.slowlink's hosts) may use them all meanwhile."""
    dm.setup("test")
    test_x, test_y = dm.test_set.tensors
    pinned = os.sched_getaffinity(0) if hasattr(os, "sched_setaffinity") else None
    if pinned is not None:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    curves = {"curve": [(round(t, 3), evaluate(s, test_x, test_y)) for t, s in clock.snapshots]}
    if clock.central_snapshots:
        curves["central_curve"] = [(round(t, 3), evaluate(s, test_x, test_y)) for t, s in clock.central_snapshots]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if pinned is not None:
        os.sched_setaffinity(0, pinned)
    return curves


def run_one(spec: dict[str, Any], run: dict[str, Any], index: int, out: Path) -> dict[str, Any] | None:
    """Train run ``index`` of the launch on this rank; rank 0 returns its result (the others None).

    Args:
        spec: the launch's spec (``workers``, ``nodes``, ``data_dir``, ``test_subset``, ``runs``).
        run: the run's settings.
        index: its place in ``spec["runs"]`` (its files, its PS port).
        out: the launch's folder.

    Raises:
        PSError: a PS error other than a training that diverged (``not_finite``).
    """
    workers = spec["workers"]
    # "nodes": one launch per machine (bench.slowlink: a process per network namespace, NODE_RANK set by it)
    nodes = spec.get("nodes", 1)
    devices = workers // nodes
    seed = run.get("seed", spec.get("seed", 0))  # the model's initialization and the training subset
    pl.seed_everything(seed, workers=True, verbose=False)
    model, dm = model_and_data(spec, run, seed)
    strategy = make_strategy(run, index, spec["runs"])
    clock = StepClock(run, int(os.environ.get("NODE_RANK", "0")) * devices + int(os.environ.get("LOCAL_RANK", "0")))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, num_nodes=nodes, strategy=strategy,
                         max_epochs=run.get("epochs", 1),
                         max_steps=run.get("max_steps", -1), limit_val_batches=0, num_sanity_val_steps=0,
                         max_time={"seconds": run["max_time_s"]} if run.get("max_time_s") else None,
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=False, callbacks=[clock])
    diverged, fit_start = None, time.monotonic()
    try:
        trainer.fit(model, datamodule=dm)
    except PSError as exc:  # a run whose training diverged is a result, not the end of the launch
        if exc.code != "not_finite":
            raise
        diverged = str(exc)
    fit_s = time.monotonic() - fit_start
    rank = trainer.global_rank
    comm = strategy.comm_stats() if isinstance(strategy, AsyncPSStrategy) else None
    records = _exchange_records(out, index, rank, workers, {**clock.record(), "diverged": diverged, "comm": comm})
    failed = any(r.get("diverged") for r in records)
    # (with islands, a rank other than its island's leader has no PS of its own to ask)
    ps = strategy.ps_stats() if isinstance(strategy, AsyncPSStrategy) and strategy.island_leader and not failed \
        else None
    tested = trainer.test(model, datamodule=dm, verbose=False)[0] if run.get("test") and not failed else {}
    if run["kind"] == "ddp" and torch.distributed.is_initialized():
        # Once a process group exists, Lightning broadcasts a SIGTERM flag over it at every training step
        # (training_epoch_loop._broadcast_sigterm_tensor): the asgd runs after this one would be in lockstep.
        torch.distributed.destroy_process_group()
    if rank != 0:
        _wait_for_rank0(out, index)
        return None
    result = {**run, "index": index, "workers": workers, **window(records, run["batch_size"]),
              "test_acc": tested.get("test_acc"), "test_loss": tested.get("test_loss"), "diverged": failed,
              "fit_s": round(fit_s, 3),
              "ranks": [{k: v for k, v in r.items() if k != "step_ends"} | {"steps_after_warmup": len(r["step_ends"])}
                        for r in records]}
    if ps is not None:
        result.update(_ps_fields(ps))
    if clock.snapshots:
        result.update(_curves(clock, dm))
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for i, run in enumerate(spec["runs"]):
        result = run_one(spec, run, i, args.out)
        if result is not None:
            results.append(result)
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
            (args.out / f"run{i}_done").touch()
            print(f"bench.train: run {i} {run.get('name')} done", flush=True)


if __name__ == "__main__":
    main()
