"""A 2-worker fit on the embedded PS in which something goes wrong, for tests/test_worker_failures.py.

``failing_fit.py OUT PS_PORT [--lost-timeout S] [--raise-on RANK:STEP] [--nan-on RANK:STEP] [--ps-address A,B]``:
Lightning's own launcher (``devices=2``), a linear classifier on generated data,
``AsyncPSStrategy(lost_timeout=S)``. Each rank writes its pid and every finished step to OUT/rank{r}.log, so a
test knows who is who and how far each came. ``--raise-on 1:20``: rank 1's training_step raises at its step 20
(writing ``raising at T``, ``time.time()``, first). ``--nan-on 1:20``: rank 1's loss is NaN from its step 20 on (a
fit that diverges). ``--ps-address A,B``: external shards at A and B instead of the embedded PS.
``--rank0-ps-address A``: rank 0 alone connects to A (within 1.5 s: an address where no PS listens makes it fail
before its stage begins). A rank whose fit fails writes ``failed at T`` (``time.time()``); a rank that began
training writes ``exiting at T`` as its interpreter begins to exit (``atexit``): one killed never does.
"""

import argparse
import atexit
import os
import time
from pathlib import Path

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from plug_asgd import AsyncPSStrategy


class LogsFailure(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_exception(self, trainer, pl_module, exception) -> None:
        with open(self.out / f"rank{trainer.global_rank}.log", "a") as f:
            f.write(f"failed at {time.time()}\n")


class Failing(pl.LightningModule):
    def __init__(self, out: Path, raise_on: tuple[int, int] | None, nan_on: tuple[int, int] | None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)
        self.out, self.raise_on, self.nan_on = out, raise_on, nan_on

    def on_train_start(self) -> None:
        self._log(f"pid {os.getpid()}")
        atexit.register(lambda: self._log(f"exiting at {time.time()}"))

    def training_step(self, batch, batch_idx):
        step = (self.global_rank, self.global_step)
        if self.raise_on == step:
            self._log(f"raising at {time.time()}")
            raise RuntimeError(f"rank {self.global_rank} fails at step {self.global_step} on purpose")
        time.sleep(0.02)
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.layer(x), y)
        if self.nan_on is not None and step[0] == self.nan_on[0] and step[1] >= self.nan_on[1]:
            loss = loss * float("nan")
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._log(f"step {self.global_step}")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def _log(self, line: str) -> None:
        with open(self.out / f"rank{self.global_rank}.log", "a") as f:
            f.write(line + "\n")


def rank_step(text: str | None) -> tuple[int, int] | None:
    return None if text is None else tuple(int(v) for v in text.split(":"))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("ps_port", type=int)
    parser.add_argument("--lost-timeout", type=float, default=60.0, help="seconds to wait for a PS that went away")
    parser.add_argument("--raise-on", default=None)
    parser.add_argument("--nan-on", default=None)
    parser.add_argument("--ps-address", default=None, help="external shards' addresses, comma-separated (the PS is "
                        "then theirs, not embedded)")
    parser.add_argument("--rank0-ps-address", default=None, help="rank 0 alone connects here")
    args = parser.parse_args()
    ps = {"ps_address": args.ps_address.split(",")} if args.ps_address else {"ps_port": args.ps_port}
    if args.rank0_ps_address and os.environ.get("LOCAL_RANK", "0") == "0":  # Lightning's launcher sets it in rank 1
        ps = {"ps_address": args.rank0_ps_address, "connect_timeout": 1.5}
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 2, (4096,), generator=g)
    x = torch.randn(4096, 8, generator=g) + (2 * y[:, None] - 1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(args.out),
                         callbacks=[LogsFailure(args.out)],
                         strategy=AsyncPSStrategy(mode="asgd", lost_timeout=args.lost_timeout, **ps))
    model = Failing(args.out, rank_step(args.raise_on), rank_step(args.nan_on))
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True))


if __name__ == "__main__":
    main()
