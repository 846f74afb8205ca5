"""Each Hogwild worker writes only its own slot of one parameter; OUT/rank{r}.json says what it ends with."""

import argparse
import json
from pathlib import Path

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from plug_asgd import AsyncPSStrategy


class Slots(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.seen = 0.0
        self.mapped: set[str] = set()

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.w[self.global_rank] += 1  # no lock, no push: straight into the shared model
        self.seen = max(self.seen, float(self.w[1 - self.global_rank]))
        if not self.mapped:  # the shared file this worker trains in, as the kernel sees it (it stays mapped)
            with open("/proc/self/maps") as maps:
                self.mapped = {line.split(maxsplit=5)[-1].strip() for line in maps if "plug_asgd_hogwild_" in line}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    model = Slots()
    strategy = AsyncPSStrategy(mode="hogwild")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(TensorDataset(torch.zeros(400, 1)), batch_size=5))  # 40 steps each
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "w": model.w.tolist(), "seen_other": model.seen, "ps": strategy.ps_stats()["version"],
        "pushed": strategy.ps_stats()["push_bytes_in"], "mapped": sorted(model.mapped)}))


if __name__ == "__main__":
    main()
