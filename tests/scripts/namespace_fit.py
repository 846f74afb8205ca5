"""Two 2-worker fits on the embedded PS, with the three callbacks, under one Lightning namespace only.

``namespace_fit.py NAMESPACE PS_PORT OUT [HOW ...]``: NAMESPACE is ``lightning`` (``import
lightning as L``) or ``pytorch_lightning``. plug_asgd is imported before Lightning, so the
strategy names are registered when Lightning is. HOW ``name`` (the default, with ``object``) names
the strategy (``strategy="async_ps"``); ``object`` passes ``AsyncPSStrategy(ps_port=PS_PORT)``
(the first fit's PS serves until the end). Rank 0 writes OUT/HOW/result.json.
"""

import importlib
import json
import sys
import time
from pathlib import Path

import plug_asgd
from plug_asgd.startup import gc_paused

namespace, ps_port, root = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    L = importlib.import_module(namespace)  # lightning or pytorch_lightning, and nothing of the other
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from plug_asgd import AsyncPSStrategy, CommunicationMonitor, PSCheckpoint, Supervisor


def blobs(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + (2 * y[:, None] - 1) * 1.5
    return TensorDataset(x, y)


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        time.sleep(0.03)  # long enough a fit for the Supervisor's thread to evaluate during it
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(how: str, strategy, out: Path) -> None:
    callbacks = [Supervisor(DataLoader(blobs(256, 1), batch_size=64), every_n_updates=10, dirpath=out / "sup"),
                 PSCheckpoint(out / "ckpt", every_n_updates=20), CommunicationMonitor(every_n_steps=10,
                                                                                      dirpath=out / "comm")]
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=2, strategy=strategy, callbacks=callbacks,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(out))
    model = Classifier()
    trainer.fit(model, DataLoader(blobs(512, 0), batch_size=16))
    metrics = trainer.test(model, DataLoader(blobs(256, 1), batch_size=64), verbose=False)
    other = {"lightning": "pytorch_lightning", "pytorch_lightning": "lightning"}[namespace]
    if trainer.is_global_zero:
        (out / "result.json").write_text(json.dumps({
            "strategy": f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__name__}",
            "callbacks": sorted(f"{type(c).__module__}.{type(c).__name__}" for c in callbacks),
            "is_plug_asgd": isinstance(trainer.strategy, plug_asgd.AsyncPSStrategy)
            and all(isinstance(c, (Supervisor, PSCheckpoint, CommunicationMonitor)) for c in callbacks),
            "other_namespace_imported": other in sys.modules,
            "ps_version": trainer.strategy.ps_stats()["version"],
            "test_acc": metrics[0]["test_acc"],
            "supervised": len(callbacks[0].records),
        }))


if __name__ == "__main__":
    for how in sys.argv[4:] or ["name", "object"]:
        fit(how, "async_ps" if how == "name" else AsyncPSStrategy(mode="asgd", ps_port=ps_port), root / how)
