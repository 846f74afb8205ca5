"""A LightningModule with BatchNorm and a per-step LR scheduler, trained under AsyncPSStrategy.

Each rank writes what it ends with to OUT/rank{r}.json, for tests/test_training.py to compare.
The data are generated here on purpose: this script tests the strategy's mechanics, not a model.
``--modes asgd,sync --ps-ports P1,P2`` trains one fresh model under each mode in turn, in the same
processes (each with its embedded PS on its own port), and writes OUT/MODE/rank{r}.json.
"""

import argparse
import json
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

    from plug_asgd import AsyncPSStrategy
    from plug_asgd.recipes.common import mode_and_codec

# osp: rank 1 sleeps this long before its 5th step (batch 4 of epoch 0), so that rank 0's 5th push, whose round
# waits for rank 1's, is held at least about as long while rank 0's next step computes (tests/test_training.py)
HOLD_AT, HOLD_S = 4, 1.0


class BNNet(pl.LightningModule):
    def __init__(self, hold: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
        self.hold = hold

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and self.trainer.is_last_batch and self.current_epoch == 1:
            time.sleep(1.5)  # a slow last step: the others must wait for it before taking the final model
        if self.hold and self.global_rank == 1 and self.current_epoch == 0 and batch_idx == HOLD_AT:
            time.sleep(HOLD_S)
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def loader(n: int, seed: int, shuffle: bool) -> DataLoader:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, 8)) * 3 + 2).astype(np.float32)  # mean 2, var 9: BN statistics must move
    y = (x[:, 0] + x[:, 1] > 4).astype(np.int64)
    return DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=32, shuffle=shuffle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="asgd")
    parser.add_argument("--modes", default=None, help="comma-separated: one fit each, results in OUT/MODE/")
    parser.add_argument("--ps-ports", default=None, help="with --modes: the embedded PS's port of each fit")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--start-method", default="popen")
    args = parser.parse_args()
    if args.modes is None:
        train(args.mode, None, args.out, args.start_method)
        return
    for mode, port in zip(args.modes.split(","), args.ps_ports.split(","), strict=True):
        train(mode, int(port), args.out / mode, args.start_method)


def train(mode: str, ps_port: int | None, out_dir: Path, start_method: str) -> None:
    pl.seed_everything(0, verbose=False)
    model = BNNet(hold=mode == "osp")
    mode_obj, _ = mode_and_codec(mode, compression=0.1)  # adacomp sends 10%
    strategy = AsyncPSStrategy(mode=mode_obj, start_method=start_method, ps_port=ps_port)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader(1280, 0, True))
    after_fit = float(sum(p.double().sum() for p in model.parameters()))  # what fit leaves in the module
    threads = torch.get_num_threads()
    results = trainer.test(model, loader(512, 1, False), verbose=False)
    if start_method != "popen":
        # Lightning's multiprocessing launcher trains in child processes and hands rank 0's results
        # back to this one; the per-rank checks below need the popen launcher's own ranks.
        (out_dir / "parent.json").parent.mkdir(parents=True, exist_ok=True)
        (out_dir / "parent.json").write_text(json.dumps({"test_acc": results[0]["test_acc"]}))
        return
    bn = model.net[1]
    out = {
        "rank": trainer.global_rank,
        "steps": trainer.global_step,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "bn_mean": bn.running_mean.tolist(),
        "bn_var": bn.running_var.tolist(),
        "param_sum": float(sum(p.double().sum() for p in model.parameters())),
        "param_sum_after_fit": after_fit,
        "test_acc": results[0]["test_acc"],
        "ps_version": strategy.ps_stats()["version"],
        "threads": threads,
        "comm": strategy.comm_stats(),
        "hold": [HOLD_AT, HOLD_S] if model.hold else None,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
