"""LightningCLI choosing the strategy: ``cli_fit.py fit --trainer.strategy=NAME ...`` or ``--config FILE.yaml``.

The model and data are feature_fit.py's. Each rank writes $FEATURE_OUT/rank{r}.json: the strategy's
class and mode as the CLI built them, and the steps trained.
"""

import json
import os
from pathlib import Path

from plug_asgd.startup import gc_paused

with gc_paused():  # torch and Lightning imported without the collector's passes (plug_asgd.startup)
    from feature_fit import Blobs, Net
    from pytorch_lightning.cli import LightningCLI

    import plug_asgd  # noqa: F401 (registers the strategy names with Lightning)


class Recorded(Net):
    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        Path(os.environ["FEATURE_OUT"], f"rank{self.global_rank}.json").write_text(json.dumps({
            "strategy": type(strategy).__name__, "mode": strategy.mode.config(), "global_step": self.global_step,
            "world_size": self.trainer.world_size}))


if __name__ == "__main__":
    LightningCLI(Recorded, Blobs)
