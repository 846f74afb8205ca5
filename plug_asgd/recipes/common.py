"""What every recipe shares: the strategy flags, and train-then-test with a summary of the run."""

from __future__ import annotations

import argparse
import inspect
import json
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from plug_asgd import compressors, modes
from plug_asgd.callbacks import CommunicationMonitor, PSCheckpoint, Supervisor
from plug_asgd.compressors import COMPRESSORS, SPARSE_VALUES, Codec
from plug_asgd.modes import MODES, Mode
from plug_asgd.ps.config import ps_argument
from plug_asgd.recipes.idx import DatasetNotFoundError
from plug_asgd.sharding.per_node import PER_NODE
from plug_asgd.strategy import AsyncPSStrategy

DEFAULT_WORKERS = 2
# --accelerator: Lightning's names that the recipes take (one worker per device; MPS and TPUs are not offered)
ACCELERATORS = ("cpu", "gpu", "cuda", "auto")


def add_strategy_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags of AsyncPSStrategy and of the run, spelled the same by every recipe and the CLI.

    Args:
        parser: the parser the flags are added to, and which is returned.
    """
    add_device_arguments(parser)
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (launched by torchrun/SLURM)")
    schemes = "; ".join(f"{name}: {cls.summary}" for name, cls in MODES.items())
    parser.add_argument("--mode", choices=sorted(MODES), default="asgd",
                        help=f"training scheme (default: asgd): {schemes}")
    parser.add_argument("--compression", type=float, default=None,
                        help="adacomp, topk, randomk: fraction of each layer's update sent per push (default: 0.01; "
                             "randomk's, left unset, is raised for a fit of fewer than 1,000 pushes per worker)")
    parser.add_argument("--compressor", choices=sorted(COMPRESSORS), default="none",
                        help="how pushed updates are encoded (default: none); topk/randomk use --compression")
    parser.add_argument("--sparse-values", dest="values", choices=SPARSE_VALUES, default=None,
                        help="adacomp: dtype of the values sent (float16: 4 bytes per coordinate, not 6)")
    parser.add_argument("--bits", type=int, default=None, help="qsgd: bits per coordinate (default: 8)")
    parser.add_argument("--rank", type=int, default=None, help="powersgd: rank (default: 4)")
    parser.add_argument("--push-every", type=int, default=None,
                        help="local steps between pushes (default: the mode's; 1 for asgd)")
    parser.add_argument("--pull-every", type=int, default=None, help="local steps between pulls (default: at push)")
    parser.add_argument("--tau", type=int, default=None, help="easgd/eamsgd: steps between elastic exchanges")
    parser.add_argument("--alpha", type=float, default=None, help="easgd/eamsgd: elastic step (default 0.5)")
    _add_diloco_and_islands(parser)
    ps_argument(parser, "staleness_bound")
    ps_argument(parser, "replicas_to_aggregate")
    ps_argument(parser, "max_updates")
    parser.add_argument("--no-staleness-compensation", action="store_true",
                        help="fold stale updates in as they are (by default the asynchronous modes scale them, look "
                             "ahead and keep codec residuals local: see docs/momentum.md)")
    parser.add_argument("--ps-address", default=None,
                        help="tcp://host:port of a PS started with `plug-asgd serve-ps` (default: embedded PS); "
                             "a sharded PS's shards comma-separated, in the order of their --shard")
    parser.add_argument("--ps-shards", type=_shard_count, default=None, metavar="N|per-node",
                        help="embedded PS processes, each holding a share of the model (default: 1); per-node: one "
                             "on each node of a multi-node job (--num-nodes), started by its local rank 0")
    parser.add_argument("--ps-standby", action="store_true",
                        help="node 1's local rank 0 runs a hot standby of the embedded PS, which leads if node 0's "
                             "PS is gone (needs --num-nodes 2 or more)")
    ps_argument(parser, "failover_timeout")
    ps_argument(parser, "worker_timeout")
    ps_argument(parser, "downlink_fraction")
    ps_argument(parser, "downlink_bound")
    ps_argument(parser, "downlink_codec")
    parser.add_argument("--ps-keys", type=Path, default=None,
                        help="CURVE keys of `plug-asgd keygen DIR`: DIR (embedded PS) or DIR/worker (external PS)")
    ps_argument(parser, "insecure", "--ps-insecure")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per worker (default: 1)")
    parser.add_argument("--max-steps", type=int, default=-1, help="local steps per worker (default: no limit)")
    parser.add_argument("--no-val", action="store_true", help="skip validation during training")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the model's initialization, the subsets, the shuffles and dropout (default: 0)")
    parser.add_argument("--run-dir", type=Path, default=Path("runs"), help="logs and metrics (default: runs/)")
    parser.add_argument("--metrics-json", type=Path, default=None, help="write the run's summary here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--supervise-every", type=int, default=None, metavar="N",
                        help="evaluate the central model on the test set every N PS updates while training")
    ps_argument(parser, "checkpoint_dir")
    ps_argument(parser, "checkpoint_every_updates", "--checkpoint-every")
    ps_argument(parser, "resume")
    parser.add_argument("--comm-monitor", type=int, default=None, metavar="N",
                        help="record each worker's steps, bytes, times and staleness every N local steps")
    return parser


def add_device_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``--workers``, ``--accelerator`` and ``--devices``: what each worker trains on, and how many on this machine.

    Args:
        parser: the parser the flags are added to, and which is returned.
    """
    parser.add_argument("--workers", type=_positive, default=None, metavar="N",
                        help=f"worker processes on this machine, one per device: CPU processes, or GPUs with "
                             f"--accelerator gpu (default: {DEFAULT_WORKERS})")
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="cpu",
                        help="what each worker trains on (default: cpu); gpu or cuda: one GPU per worker; auto: "
                             "GPUs where torch sees one, else CPU")
    parser.add_argument("--devices", type=_positive, default=None, metavar="N",
                        help="Lightning's name for --workers (Trainer(devices=N)): the GPU count with --accelerator "
                             "gpu; give one of the two")
    return parser


def mode_and_codec(mode: str, compressor: str = "none", *, compression: float | None = None,
                   **knobs: Any) -> tuple[Mode, Codec]:
    """The mode and codec named, each built with the knobs it takes (None: left at its default).

    ``compression`` is adacomp's fraction, else the codec's (topk, randomk), else unused; any other
    knob that neither takes is refused.

    Args:
        mode: the mode's name, a key of :data:`plug_asgd.modes.MODES`.
        compressor: the codec's name, a key of :data:`plug_asgd.compressors.COMPRESSORS`.
        compression: the share of coordinates sent (``--compression``); None: the default.
        **knobs: the other knobs by name (``bits``, ``push_every``...), a value of None leaving the default.

    Raises:
        ValueError: where a knob given applies to neither the mode nor the codec.
    """
    mode_knobs = {f.name for f in fields(modes.get(mode))}
    codec_knobs = set(inspect.signature(type(compressors.get(compressor))).parameters)
    given = {k: v for k, v in knobs.items() if v is not None}
    if compression is not None and "fraction" in mode_knobs | codec_knobs:
        given["fraction"] = compression
    unknown = sorted(set(given) - mode_knobs - codec_knobs)
    if unknown:
        raise ValueError(f"{', '.join(unknown)} does not apply to mode={mode!r} with compressor={compressor!r}")
    return (modes.get({"name": mode, **{k: v for k, v in given.items() if k in mode_knobs}}),
            compressors.get({"name": compressor, **{k: v for k, v in given.items() if k in codec_knobs - mode_knobs}}))


def _add_diloco_and_islands(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--inner-steps", type=int, default=None,
                        help="diloco/async_diloco: local steps between two exchanges (default 100)")
    parser.add_argument("--outer", default=None, metavar="OPT",
                        help="diloco/async_diloco: the outer optimizer, nesterov, sgd or adam, or the JSON of its "
                             "fields (default: nesterov, lr 0.7, momentum 0.9)")
    parser.add_argument("--fragments", type=int, default=None,
                        help="diloco/async_diloco: the model's parts, each synced at a staggered step (default 1)")
    parser.add_argument("--overlap", action="store_const", const=True, default=None,
                        help="send each push from a thread while the next steps compute, its reply merged when it "
                             "came (asgd and the other push modes; diloco/async_diloco with one fragment)")
    parser.add_argument("--no-momentum-lookahead", dest="momentum_lookahead", action="store_const", const=False,
                        default=None, help="async_diloco: answer each push with the central model itself, not less "
                                           "the outer momentum step its cycle is expected to take")
    parser.add_argument("--island", type=_island, default="auto", metavar="K|node|auto",
                        help="consecutive local ranks that train as one worker of the PS (1: every device; node: "
                             "each node; default auto: the node on several nodes, 1 on one)")


def _island(value: str) -> int | str:
    """``--island``: a number of ranks, ``node`` or ``auto``."""
    return int(value) if value.isdigit() else value


def make_strategy(args: argparse.Namespace) -> AsyncPSStrategy:
    """The AsyncPSStrategy the parsed flags of :func:`add_strategy_arguments` ask for.

    Args:
        args: the parsed command line.
    """
    mode, codec = mode_and_codec(args.mode, args.compressor, compression=args.compression, values=args.values,
                                 bits=args.bits, rank=args.rank, push_every=args.push_every,
                                 pull_every=args.pull_every, tau=args.tau, alpha=args.alpha,
                                 staleness_bound=args.staleness_bound,
                                 replicas_to_aggregate=args.replicas_to_aggregate, inner_steps=args.inner_steps,
                                 outer=args.outer, fragments=args.fragments, overlap=args.overlap,
                                 momentum_lookahead=args.momentum_lookahead)
    return AsyncPSStrategy(mode=mode, compressor=codec, max_updates=args.max_updates,
                           ps_address=_addresses(args.ps_address), ps_shards=args.ps_shards,
                           resume_from=args.resume, ps_keys=args.ps_keys,
                           ps_insecure=args.ps_insecure, worker_timeout=args.worker_timeout,
                           downlink_fraction=args.downlink_fraction, downlink_bound=args.downlink_bound,
                           downlink_codec=args.downlink_codec,
                           ps_standby=args.ps_standby, failover_timeout=args.failover_timeout,
                           staleness_compensation=False if args.no_staleness_compensation else None,
                           island=args.island)


def trainer_devices(args: argparse.Namespace) -> dict[str, Any]:
    """The Trainer's ``accelerator``, ``devices`` and ``num_nodes`` the flags ask for, checked against this machine.

    ``--workers`` and ``--devices`` are one number under two names: this machine's workers, one per device (a
    CPU process each, or a GPU each); 2 where neither is given. ``auto`` is resolved here: gpu where torch sees
    a CUDA GPU, else cpu.

    Args:
        args: the parsed command line.

    Raises:
        ValueError: where ``--workers`` and ``--devices`` differ, or a GPU is asked for and torch sees none, or
            fewer than the workers asked for.
    """
    if args.workers is not None and args.devices is not None and args.workers != args.devices:
        raise ValueError(f"--workers {args.workers} and --devices {args.devices} both count this machine's workers "
                         "(one per device): give one of them")
    devices = args.devices or args.workers or DEFAULT_WORKERS
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if accelerator in ("gpu", "cuda"):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found == 0:
            raise ValueError(f"--accelerator {args.accelerator}: torch {torch.__version__} sees no CUDA GPU on this "
                             "machine (a CPU-only torch, no driver, or CUDA_VISIBLE_DEVICES empty); leave "
                             "--accelerator out to train on CPU")
        if devices > found:
            raise ValueError(f"--accelerator {args.accelerator} with {devices} workers asks for {devices} GPUs, and "
                             f"this machine has {found}: pass --devices {found} (one worker per GPU)")
    return {"accelerator": accelerator, "devices": devices, "num_nodes": args.num_nodes}


def _positive(text: str) -> int:
    """``--workers``, ``--devices``: a count of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _shard_count(text: str) -> int | str:
    """``--ps-shards``: a count, or ``per-node`` (``per_node`` taken too)."""
    if text.replace("-", "_") == PER_NODE:
        return PER_NODE
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of shards or per-node, got {text!r}") from None


def _addresses(text: str | None) -> str | list[str] | None:
    """``--ps-address``: one address, or a sharded PS's as a list."""
    return text.split(",") if text is not None and "," in text else text


def make_callbacks(args: argparse.Namespace, datamodule: pl.LightningDataModule) -> list[pl.Callback]:
    """The callbacks the flags ask for; the Supervisor evaluates on the data module's test set.

    Args:
        args: the parsed command line.
        datamodule: the recipe's data module (set up for testing where a Supervisor is asked for).
    """
    callbacks: list[pl.Callback] = []
    if args.supervise_every is not None:
        datamodule.setup("test")
        callbacks.append(Supervisor(datamodule.test_dataloader(), every_n_updates=args.supervise_every))
    if args.checkpoint_dir is not None:
        callbacks.append(PSCheckpoint(args.checkpoint_dir, every_n_updates=args.checkpoint_every))
    if args.comm_monitor is not None:
        callbacks.append(CommunicationMonitor(every_n_steps=args.comm_monitor))
    return callbacks


def seed_everything(seed: int) -> None:
    """Seeds every generator (Python's, numpy's, torch's, the loaders' workers'), as ``--seed`` promises: a recipe
    calls it before it builds its model, whose initialization (rank 0's, which the PS takes) is then the seed's.

    Args:
        seed: the run's seed.
    """
    pl.seed_everything(seed, workers=True, verbose=False)


def train_and_test(name: str, model: pl.LightningModule, datamodule: pl.LightningDataModule,
                   args: argparse.Namespace) -> dict[str, Any] | None:
    """Fit under AsyncPSStrategy, test the central model; rank 0 prints and returns the summary.

    Args:
        name: the recipe's name, for the logs and the summary.
        model: the LightningModule trained.
        datamodule: its data.
        args: the parsed command line (:func:`add_strategy_arguments` and the recipe's own flags).

    Raises:
        SystemExit: where the strategy or the Trainer refuses a flag, the GPUs asked for are not there, or the
            dataset is missing: the error, without a traceback.
    """
    seed_everything(args.seed)  # again: what the model's construction drew is not the fit's
    try:  # a flag the strategy refuses, a GPU that is not there: say so as argparse would, no traceback
        devices = trainer_devices(args)
        strategy = make_strategy(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    try:  # find (or download) the data here, before any worker starts, rather than fail in each of them
        datamodule.prepare_data()
    except DatasetNotFoundError as exc:
        raise SystemExit(f"error: {exc}") from None
    try:
        trainer = pl.Trainer(
            **devices, strategy=strategy,
            max_epochs=args.epochs, max_steps=args.max_steps,
            limit_val_batches=0 if args.no_val else None, num_sanity_val_steps=0,
            logger=CSVLogger(args.run_dir, name=f"{name}-{args.mode}"), enable_checkpointing=False,
            callbacks=make_callbacks(args, datamodule),
            enable_model_summary=False, enable_progress_bar=not args.quiet,
        )
    except MisconfigurationException as exc:  # Lightning's word on the devices, the precision...
        raise SystemExit(f"error: {exc}") from None
    start = time.monotonic()
    trainer.fit(model, datamodule=datamodule)
    fit_seconds = time.monotonic() - start
    results = trainer.test(model, datamodule=datamodule, verbose=False)
    ps = strategy.ps_stats()
    if not trainer.is_global_zero:
        return None
    summary = {
        "recipe": name, "mode": args.mode, "workers": devices["devices"] * args.num_nodes,
        "compression": getattr(strategy.mode, "fraction", None),
        "test_acc": results[0].get("test_acc"), "test_loss": results[0].get("test_loss"),
        "ps_version": ps["version"], "pushes_applied": ps["pushes_applied"], "pushes_dropped": ps["pushes_dropped"],
        "push_bytes": ps["push_bytes_in"], "push_local_bytes": ps.get("push_local_bytes_in", 0),
        "ps_bytes_in": ps["bytes_in"], "ps_bytes_out": ps["bytes_out"],
        "fit_seconds": round(fit_seconds, 3), "log_dir": trainer.log_dir,
    }
    lm = ""
    if "test_ppl" in results[0]:  # a language model's: its loss per byte and perplexity besides
        summary["test_ppl"] = results[0]["test_ppl"]
        lm = f", loss {summary['test_loss']:.4f} nats/byte, perplexity {summary['test_ppl']:.3f}"
    local = summary["push_local_bytes"]
    shared = f" + {local / 1e6:.2f} MB through shared memory" if local else ""
    print(f"central model test accuracy: {summary['test_acc']:.4f}{lm}  (mode {args.mode}, "
          f"{summary['workers']} workers, PS version {ps['version']}, {ps['push_bytes_in'] / 1e6:.2f} MB pushed"
          f"{shared}, fit {fit_seconds:.1f} s)", flush=True)
    if args.metrics_json is not None:
        args.metrics_json.parent.mkdir(parents=True, exist_ok=True)
        args.metrics_json.write_text(json.dumps(summary, indent=2) + "\n")
    return summary
