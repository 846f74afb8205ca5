"""Repeats the LM recipe's small run of tests/test_lm.py (``LM_SMALL``) in one process, under DDP (2 processes,
gloo) and under asgd (2 workers, the recipe itself), to set ``LM_LOSS_BAR`` from the measured spread:
``python tests/scripts/lm_bar_runs.py --repeats 2 --out DIR`` prints each run's held-out loss (nats per byte) and,
at the end, each kind's min, median and max. ``--one KIND --json FILE`` is one run (what the driver starts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

KINDS = ("single", "ddp", "asgd")


def one_run(kind: str, out: Path) -> None:
    """One run of ``kind``; rank 0 writes the held-out loss and perplexity to ``out``."""
    from tests.test_lm import LM_SMALL

    flags = [*LM_SMALL, "--run-dir", str(out.parent / f"runs-{out.stem}"), "--seed", "0"]
    start = time.monotonic()
    if kind == "asgd":
        from plug_asgd.recipes.lm import main

        summary = main([*flags, "--workers", "2", "--mode", "asgd"])
        if summary is not None:
            out.write_text(json.dumps({"kind": kind, "loss": summary["test_loss"], "ppl": summary["test_ppl"],
                                       "seconds": round(time.monotonic() - start, 1)}))
        return
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    from plug_asgd.recipes.common import seed_everything
    from plug_asgd.recipes.lm import build, build_parser

    args = build_parser().parse_args(flags)
    seed_everything(args.seed)
    model, datamodule = build(args)
    seed_everything(args.seed)
    strategy = DDPStrategy(process_group_backend="gloo") if kind == "ddp" else "auto"
    trainer = pl.Trainer(accelerator="cpu", devices=2 if kind == "ddp" else 1, strategy=strategy, max_epochs=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, datamodule=datamodule)
    results = trainer.test(model, datamodule=datamodule, verbose=False)
    if trainer.is_global_zero:
        out.write_text(json.dumps({"kind": kind, "loss": results[0]["test_loss"], "ppl": results[0]["test_ppl"],
                                   "seconds": round(time.monotonic() - start, 1)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--one", choices=KINDS, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.one is not None:
        one_run(args.one, args.json)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    losses: dict[str, list[float]] = {}
    for i in range(args.repeats):
        for kind in args.kinds.split(","):
            path = args.out / f"{kind}-{i}.json"
            subprocess.run([sys.executable, __file__, "--one", kind, "--json", str(path)], check=True, cwd=ROOT)
            run = json.loads(path.read_text())
            losses.setdefault(kind, []).append(run["loss"])
            print(f"{kind} {i}: loss {run['loss']:.4f} ppl {run['ppl']:.3f} ({run['seconds']} s)", flush=True)
    (args.out / "losses.json").write_text(json.dumps(losses, indent=1))
    for kind, values in losses.items():
        print(f"{kind:>7}  n={len(values)}  min {min(values):.4f}  median {statistics.median(values):.4f}  "
              f"max {max(values):.4f}")


if __name__ == "__main__":
    main()
