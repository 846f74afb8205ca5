"""One worker on CUDA: plain Lightning or AsyncPSStrategy, 10 epochs of the recipe CNN on a learnable synthetic set.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=. python -m bench.gpu_smoke 1 plain   # or asgd, adacomp, adacomp-overlap

Deterministic (``Trainer(deterministic=True)``), so two runs of one mode give the same bits; prints
the central model's loss and accuracy on 512 of its training samples (a check that it trains, not a
held-out score) and the fit's wall time. Plain Lightning samples with a
``RandomSampler`` and the strategy with DDP's ``DistributedSampler``, so the two are not the same
bits. Needs a GPU (none on the project's own machines).
"""

import sys
import time

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from plug_asgd import AdaComp, AsyncPSStrategy
    from plug_asgd.recipes.mnist import MnistCNN


class WhereItTrains(pl.Callback):
    """Where the weights lie during the first step, and how often the strategy's staging allocated pinned
    buffers: after the fit Lightning moves the module back to the CPU, so its device then says nothing."""

    def __init__(self) -> None:
        self.device = "not seen"
        self.staging = "no staging (plain Lightning)"

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if trainer.global_step <= 1:
            self.device = str(next(pl_module.parameters()).device)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        staging = getattr(getattr(trainer.strategy, "_exchange", None), "staging", None)
        if staging is not None:
            self.staging = f"pinned={staging.pin} allocations={staging.allocations}"


def main(devices: int, mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 1, 28, 28, generator=g)
    w = torch.randn(28 * 28, 10, generator=g)
    y = (x.flatten(1) @ w).argmax(1)  # a learnable labelling
    train = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    test = DataLoader(TensorDataset(x[:512], y[:512]), batch_size=256)
    pl.seed_everything(0, verbose=False)
    model = MnistCNN(optimizer="sgd", lr=0.05, momentum=0.9)
    # adacomp-overlap: each push sent from a thread while the next step computes, its reply merged later,
    # so the staged copies of one push and the next step's kernels are in flight together
    chosen = AdaComp(overlap=True) if mode == "adacomp-overlap" else mode
    strategy = "auto" if mode == "plain" else AsyncPSStrategy(mode=chosen)
    where = WhereItTrains()
    trainer = pl.Trainer(accelerator="gpu", devices=devices, strategy=strategy, max_epochs=10, callbacks=[where],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, deterministic=True)
    t = time.time()
    trainer.fit(model, train)
    out = trainer.test(model, test, verbose=False)
    if trainer.is_global_zero:
        print(f"GPU CHECK devices={devices} mode={mode} trained on {where.device}, {where.staging}, "
              f"test={out} fit_s={time.time() - t:.1f} cuda={torch.cuda.get_device_name(0)}", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_smoke needs a CUDA GPU")
    main(int(sys.argv[1]), sys.argv[2])
