"""``timed_fit.py OUT PS_PORT SECONDS``: 2 workers under asgd stopped by ``Trainer(max_time=SECONDS)``.

Rank 1 sleeps 0.2 s a batch, rank 0 0.01 s. Each rank writes OUT/rank{r}.json: its optimizer steps
and the seconds from the start of its training to its end.
"""

import json
import sys
import time
from pathlib import Path

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from plug_asgd import AsyncPSStrategy


class Timed(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def on_train_start(self) -> None:
        self.started = time.monotonic()

    def training_step(self, batch, batch_idx):
        time.sleep(0.2 if self.global_rank == 1 else 0.01)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.layer(x), y)

    def on_train_end(self) -> None:
        out = Path(sys.argv[1]) / f"rank{self.global_rank}.json"
        out.write_text(json.dumps({"steps": self.global_step, "train_s": time.monotonic() - self.started}))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(100_000, 8, generator=g), torch.randint(0, 2, (100_000,), generator=g))
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_time={"seconds": float(sys.argv[3])}, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=AsyncPSStrategy(mode="asgd", ps_port=int(sys.argv[2])))
    trainer.fit(Timed(), DataLoader(data, batch_size=16))
