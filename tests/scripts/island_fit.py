"""One node of a job whose islands of ranks each trade with the PS as one worker (``AsyncPSStrategy(island=...)``).

``--nodes 1 --devices 4 --island 2``: two islands of two processes on this machine (Lightning's launcher starts
them); run on emulated hosts by tests/scripts/island_launch.py for ``--nodes 2``. ``--modes asgd,sync,...`` trains
one fresh model under each mode in turn, in the same processes (each fit's PS on its own port: ``--ps-port`` + the
fit's place), and writes OUT/MODE/rank{r}.json: the rank's island, its steps, whether its island's weights agreed
bit for bit at the start of each batch (gathered from every rank of the island, not assumed), a digest of its final
weights, its counters, the PS's counters (leaders), and the test accuracy of the central model.
``--modes "asgd;diloco:inner_steps=5,fragments=2"``: a mode's knobs after its name, between commas (``;`` between
the modes then).
``--modes ddp`` trains under Lightning's DDP instead, for comparison.
``--kill-at K``: the rank given by ``--kill-rank`` SIGKILLs itself after its K-th step.
"""

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    import numpy as np
    import pytorch_lightning as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from plug_asgd import AsyncPSStrategy, CommunicationMonitor, PSCheckpoint, Supervisor
    from plug_asgd.recipes.common import mode_and_codec


class BNNet(pl.LightningModule):
    """A small net with BatchNorm (buffers that each rank's batches move apart) and momentum SGD."""

    def __init__(self, nesterov: bool = False, width: int = 32) -> None:
        super().__init__()
        self.nesterov = nesterov  # (eamsgd's workers take Nesterov's momentum)
        self.net = nn.Sequential(nn.Linear(8, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 2))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=self.nesterov)


def loader(n: int, seed: int, shuffle: bool) -> DataLoader:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, 8)) * 3 + 2).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 4).astype(np.int64)
    return DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=32, shuffle=shuffle)


def digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        if not t.is_floating_point():  # (BatchNorm's count of batches is each rank's own)
            continue
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Watch(pl.Callback):
    """Checks, on every rank at the start of every batch, that its island holds the same weights (a collective of
    the island), and kills the rank ``kill_rank`` after its ``kill_at``-th step."""

    def __init__(self, kill_rank: int, kill_at: int | None) -> None:
        self.agree: list[bool] = []
        self.kill_rank, self.kill_at = kill_rank, kill_at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if hasattr(trainer.strategy, "island_weights_agree"):
            self.agree.append(trainer.strategy.island_weights_agree())

    def on_train_batch_end(self, trainer, *_):
        if trainer.global_rank == self.kill_rank and trainer.global_step == self.kill_at:
            ended(trainer.global_rank, "killed")
            os.kill(os.getpid(), signal.SIGKILL)


ENDS: Path | None = None  # OUT/ends.jsonl: when each rank ended, and how


def ended(rank: int, how: str) -> None:
    if ENDS is not None:
        with open(ENDS, "a") as f:
            f.write(json.dumps({"rank": rank, "at": time.time(), "how": how}) + "\n")


def folder(mode: str) -> str:
    """A mode's results folder in a launch of several: its name, and its knobs where given
    (``diloco:inner_steps=6,fragments=2`` -> ``diloco-inner_steps6-fragments2``)."""
    name, _, knobs = mode.partition(":")
    return "-".join([name, *(kv.replace("=", "") for kv in knobs.split(",") if kv)])


def train(mode: str, args: argparse.Namespace, port: int | None, out: Path) -> None:
    pl.seed_everything(0, verbose=False)
    model = BNNet(nesterov=mode.startswith("eamsgd"), width=args.width)
    name, _, knobs = mode.partition(":")  # "diloco:inner_steps=5": a mode's knobs after its name
    given = {k: int(v) for k, v in (kv.split("=") for kv in knobs.split(",") if kv)}
    mode_obj, codec = (mode_and_codec(name, args.compressor, compression=0.1, **given) if mode != "ddp"
                       else (None, None))
    extra = {"ps_insecure": True, "shm_pushes": False} if args.nodes > 1 else {}
    if args.ps_shards:
        extra["ps_shards"] = args.ps_shards
    strategy = "ddp" if mode == "ddp" else AsyncPSStrategy(
        mode=mode_obj, compressor=codec, island=args.island, ps_port=port, worker_timeout=args.worker_timeout,
        connect_timeout=60, request_timeout=120, **extra)
    watch = Watch(args.kill_rank, args.kill_at)
    callbacks: list[pl.Callback] = [watch]
    fit_options: dict = {}
    if args.features:  # the callbacks, validation and a resumed fit
        callbacks += [Supervisor(loader(256, 2, False), every_n_updates=8, dirpath=out / "supervisor"),
                      PSCheckpoint(out / "ps_ckpt", every_n_updates=8),
                      CommunicationMonitor(every_n_steps=4, dirpath=out / "comm")]
        fit_options["val_dataloaders"] = loader(128, 3, False)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.nodes, strategy=strategy,
                         max_epochs=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         max_time=args.max_time, val_check_interval=max(1, args.steps // 2) if args.features else None,
                         num_sanity_val_steps=0)
    train_data = loader(32 * args.devices * args.nodes * args.steps * 2, 0, True)
    trainer.fit(model, train_data, **fit_options)
    if args.features:  # Lightning's checkpoint of the central model, then a second fit resumed from it
        trainer.save_checkpoint(out / "last.ckpt")
        first_steps = trainer.global_step
        resumed = pl.Trainer(accelerator="cpu", devices=args.devices, num_nodes=args.nodes,
                             strategy=AsyncPSStrategy(mode=mode_obj, compressor=codec, island=args.island,
                                                      ps_port=None if port is None else port + 5, **extra),
                             max_epochs=2, max_steps=first_steps + 4, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[watch],
                             num_sanity_val_steps=0)
        resumed.fit(model, train_data, ckpt_path=out / "last.ckpt")
        trainer, strategy = resumed, resumed.strategy
    after_fit = digest(model)
    ddp = mode == "ddp"
    leader = not ddp and strategy.island_leader
    ps = None if ddp else strategy.ps_stats()  # (an island's other ranks: what their leader saw as it left)
    comm = {} if ddp else strategy.comm_stats()
    results = trainer.test(model, loader(512, 1, False), verbose=False)
    out.mkdir(parents=True, exist_ok=True)
    record = {"rank": trainer.global_rank, "island": comm.get("island"), "leader": leader, "steps": trainer.global_step,
              "agree": watch.agree, "digest": after_fit, "comm": comm, "test_acc": results[0]["test_acc"],
              "ps": None if ps is None else {k: ps.get(k) for k in ("version", "pushes_by_rank", "world_size",
                                                                       "workers", "trainers", "pushes_applied",
                                                                       "shards")}}
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, default=str))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="asgd")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--island", default="2")
    parser.add_argument("--compressor", default="none")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ps-port", type=int, default=None)
    parser.add_argument("--worker-timeout", type=float, default=30.0)
    parser.add_argument("--kill-rank", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--width", type=int, default=32, help="the hidden layer's width (its size sets a push's)")
    parser.add_argument("--ps-shards", type=int, default=None)
    parser.add_argument("--max-time", default=None, help="Lightning's max_time, DD:HH:MM:SS")
    parser.add_argument("--features", action="store_true",
                        help="Supervisor, PSCheckpoint, CommunicationMonitor, validation, then a fit resumed from "
                             "Lightning's checkpoint")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.island = int(args.island) if args.island.isdigit() else args.island
    global ENDS
    args.out.mkdir(parents=True, exist_ok=True)
    ENDS = args.out / "ends.jsonl"
    rank = int(os.environ.get("NODE_RANK", 0)) * args.devices + int(os.environ.get("LOCAL_RANK", 0))
    modes = args.modes.split(";") if ";" in args.modes or ":" in args.modes else args.modes.split(",")
    try:
        for i, mode in enumerate(modes):
            port = None if args.ps_port is None else args.ps_port + 10 * i
            train(mode, args, port, args.out / folder(mode) if len(modes) > 1 else args.out)
    except BaseException as exc:
        ended(rank, f"{type(exc).__name__}: {exc}")
        raise
    ended(rank, "done")
    # DDP's default group, which Lightning leaves to the interpreter's exit: its gloo threads torn down there aborted
    # a rank once in a fresh-clone suite run ("terminate called without an active exception", exit -6, the ddp
    # reference of test_an_island_alone_trains_the_bits_of_ddp); ended here, before the exit
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
