"""Every option of a parameter server, in one dataclass: ``serve-ps``'s flags, the embedded PS's
command line, the recipes and the strategy are all made from :class:`PSConfig`.

Each field's metadata holds its help text and bounds; :meth:`PSConfig.check` applies them (and the
few rules between fields), and ``plug_asgd.cli.app`` turns the same metadata into typer options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plug_asgd.compressors.reply_codecs import CODECS as DOWNLINK_CODECS
from plug_asgd.modes import MODES
from plug_asgd.modes import get as get_mode
from plug_asgd.protocol.checkpoint import CheckpointPolicy, check_run_id
from plug_asgd.protocol.partition import parse_shard
from plug_asgd.protocol.security import check_bind
from plug_asgd.protocol.wire import DEFAULT_LIMITS, Limits

DEFAULT_WORKER_TIMEOUT = 20.0  # seconds of silence (no heartbeat, no request) before a worker is lost


def _option(default: Any, help: str = "", *, min: float | None = None, max: float | None = None,
            flags: tuple[str, ...] = (), cli: bool = True) -> Any:
    """A field with its help text, its bounds and its flag names (``cli=False``: no ``serve-ps`` flag)."""
    return field(default=default, metadata={"help": help, "min": min, "max": max, "flags": flags, "cli": cli})


_PATHS = ("checkpoint_dir", "resume", "run_dir", "keys")


@dataclass(frozen=True)
class PSConfig:
    """What a parameter server is told at start; checked when made, so a bad option fails at once.

    Each field's help text (its ``serve-ps`` flag's) says more; in short:

    Attributes:
        bind: the ZeroMQ endpoint to listen on; beyond loopback it needs ``keys`` or ``insecure``.
        mode: the training scheme (a name of :data:`plug_asgd.modes.MODES`); workers must ask for the same one.
        expected_workers: once that many workers have joined and all have left for ``linger`` s, the PS exits;
            None: it runs until stopped.
        linger: seconds to wait, after the last expected worker has left, for one to come back.
        replicas_to_aggregate: ``sync``: updates averaged per round; None: every training worker's.
        staleness_bound: ``ssp``: pushes a worker may be ahead of the slowest; None: the mode's default.
        outer: ``diloco``: the outer optimizer (``OuterOptimizer.get`` takes it); None: the mode's default.
        max_updates: the central version at which workers are told to stop; None: no such version.
        checkpoint_dir: where checkpoints of the central state are written; None: none are.
        checkpoint_every_updates: central updates between two checkpoints; None: not counted in updates.
        checkpoint_every_seconds: seconds between two checkpoints; None: the policy's default.
        keep: how many checkpoints of the run are kept (the newest).
        resume: a checkpoint, or a folder of them, to start from; None: start empty.
        run_id: the run the checkpoints belong to (in their names); None: a new one, or the resumed one's.
        run_dir: where ``ps_metrics.jsonl`` goes; None: a new ``runs/ps-DATE-TIME``.
        metrics_every: seconds between two lines of ``ps_metrics.jsonl``.
        io_retry_seconds: seconds before a failed checkpoint or metrics write is tried again (doubled after each
            failure in a row).
        worker_timeout: seconds without a heartbeat after which a worker is declared lost.
        keys: the PS's CURVE key folder (``plug-asgd keygen``); None: no encryption nor authentication.
        insecure: listen beyond loopback without keys (anyone who reaches the port can read and write the model).
        max_message_bytes: the largest request accepted, in bytes; None: the wire's default.
        threads: threads that fold a large dense update in, each on a slice.
        shm_pushes: let workers on this machine push dense updates through shared memory.
        downlink_fraction: the share of each tensor's coordinates a push's reply carries; None: exact replies.
        downlink_bound: with ``downlink_fraction``: also send every coordinate off by more than this; None: no
            such bound.
        downlink_codec: a push's reply carries every difference from the worker's copy so coded (``fp16``,
            ``int8``, ``int4``); None: exact replies (or ``downlink_fraction``'s).
        shard: ``"I/N"``: this PS holds shard I of N of a sharded model; None: the whole model.
        parent_pid: stop once the process of this pid is no longer the parent; None: never for that reason.
        run: refuse a hello that names another run (the embedded PS's); None: accept any.
        standby_of: the primary's address, where this PS is its hot standby; None: it leads from the start.
        failover_timeout: seconds of the primary's silence before its standby may lead, and the standby's
            acknowledgement timeout.
        standby_window: 0: every change reaches the standby before the primary answers; N: the primary sends its
            whole state every N pushes without waiting (a failover may lose the pushes since the last one held).
        world_size: the run's world size, fixed from the start (the embedded PS's, which the strategy knows); None:
            ``expected_workers`` if given, else the first accepted hello's.

    Raises:
        ValueError: where a field is out of its bounds, checkpoint intervals are given without ``checkpoint_dir``,
            or ``world_size`` and ``expected_workers`` differ; an
            :class:`~plug_asgd.protocol.security.InsecureBindError` where ``bind`` reaches beyond loopback without
            ``keys`` nor ``insecure``.
    """

    bind: str = _option("tcp://127.0.0.1:2223", "the endpoint to listen on (serve-ps: --host and --port)",
                        cli=False)
    mode: str = _option("asgd", f"training scheme: {', '.join(MODES)}; workers must ask for the same one")
    expected_workers: int | None = _option(
        None, "expected workers: once that many have joined and all have left for --linger seconds, the PS "
        "exits by itself (default: run until Ctrl-C / SIGTERM)", min=1, flags=("--workers",))
    linger: float = _option(10.0, "seconds to wait, after the last of --workers has left, for a worker to come "
                            "back", min=0.0)
    replicas_to_aggregate: int | None = _option(None, "sync: updates averaged per round (default: every "
                                                "training worker)", min=1)
    staleness_bound: int | None = _option(None, "ssp: pushes a worker may be ahead of the slowest (default 2)",
                                          min=0)
    outer: str | None = _option(None, "diloco: the outer optimizer, a name (nesterov, sgd, adam) or the JSON of its "
                                "fields (default: nesterov, lr 0.7, momentum 0.9)")
    max_updates: int | None = _option(None, "central version at which workers are told to stop", min=1)
    checkpoint_dir: Path | None = _option(None, "write checkpoints of the central state here (atomically; the "
                                          "newest --keep are kept)")
    checkpoint_every_updates: int | None = _option(None, "updates between checkpoints", min=1)
    checkpoint_every_seconds: float | None = _option(None, "seconds between checkpoints (default: 60 if no "
                                                     "other rule)", min=0.001)
    keep: int = _option(3, "checkpoints kept", min=1)
    resume: Path | None = _option(None, "start from this checkpoint, or the newest of this folder's run (--run-id "
                                  "if it holds several): a corrupt file named is refused, a corrupt newest one "
                                  "of a folder is skipped for the next, saying so")
    run_id: str | None = _option(None, "the run this PS's checkpoints belong to (in their names; letters, digits, "
                                 "'_.-'); default: a new one, or with --resume the resumed checkpoint's. Without "
                                 "--resume, a --checkpoint-dir holding other runs' files is refused unless this is "
                                 "given (each run's files are then kept and pruned apart)")
    run_dir: Path | None = _option(None, "where ps_metrics.jsonl (the counters, every --metrics-every s) goes "
                                   "[default: runs/ps-DATE-TIME]")
    metrics_every: float = _option(2.0, "seconds between two lines of ps_metrics.jsonl", min=0.01)
    io_retry_seconds: float = _option(2.0, "seconds before a failed checkpoint or metrics write (full or read-only "
                                      "disk, no file descriptor left: counted, the PS serves on) is tried again, "
                                      "doubled after each failure in a row up to 300 s; a checkpoint is also tried "
                                      "at each point of --checkpoint-every-*", min=0.01)
    worker_timeout: float = _option(DEFAULT_WORKER_TIMEOUT, "seconds without a heartbeat after which a worker "
                                    "is declared lost and nothing waits for it any more; it is taken back if "
                                    "it speaks again", min=0.1)
    keys: Path | None = _option(None, "CURVE keys of the PS (DIR/server of 'plug-asgd keygen DIR'): encrypts "
                                "traffic and admits only the authorized workers; required to listen beyond "
                                "127.0.0.1")
    insecure: bool = _option(False, "listen beyond 127.0.0.1 WITHOUT keys: anyone who reaches the port can read "
                             "and overwrite the model", flags=("--insecure",))
    max_message_bytes: int | None = _option(None, "largest request accepted, in bytes; a larger one is refused "
                                            "with code too_large [default: 2 GiB]", min=1)
    threads: int = _option(1, "threads that fold each large dense update in (asgd, dynsgd, ssp and the modes "
                           "built on them), each on a slice; requests are still served one at a time, in order",
                           min=1, max=256)
    shm_pushes: bool = _option(True, "let workers on this machine (Linux, the same user) push dense updates "
                               "through shared memory instead of the socket")
    downlink_fraction: float | None = _option(
        None, "answer each push with only this share of each tensor's coordinates, those where the worker's copy "
        "is furthest from the central model (error feedback kept per worker; pulls stay exact) [default: exact "
        "replies only]", min=1e-6, max=1.0)
    downlink_bound: float | None = _option(None, "with --downlink-fraction: also send every coordinate off by more "
                                           "than this, so that no worker's copy is further from the central model",
                                           min=0.0)
    downlink_codec: str | None = _option(
        None, "answer each push with the difference between the central model and the worker's copy in fp16, or in "
        "levels of 8 or 4 bits with one scale per tensor (int8, int4): a half, a quarter or an eighth of float32's "
        "bytes where every coordinate changed, as a DiLoCo round changes them; error feedback kept per worker; "
        "pulls stay exact [default: exact replies only]")
    shard: str | None = _option(None, "this PS holds shard I of N of a sharded model (I/N, counted from 0: one PS "
                                "started with 0/2, another with 1/2); the workers list every shard's address, in "
                                "order, and must spread the model over as many [default: the whole model]")
    parent_pid: int | None = _option(None, "stop when the process of this pid is no longer the parent",
                                     min=1, cli=False)
    run: int | None = _option(None, "refuse a hello that names another run: an embedded PS serves the run-th "
                              "strategy that connected in its process, which every rank counts alike", min=1,
                              cli=False)
    standby_of: str | None = _option(None, "run as the hot standby of the parameter server at this address "
                                     "(tcp://HOST:PORT): hold a copy of its state, kept current before each of its "
                                     "changes, and lead when the workers cannot reach it (the primary's options "
                                     "apply: mode, limits, checkpoints)")
    failover_timeout: float = _option(3.0, "seconds of silence from the primary after which its standby may lead "
                                      "(when a worker cannot reach the primary either), and a standby that does "
                                      "not acknowledge is dropped", min=0.2, max=3600.0)
    standby_window: int = _option(0, "0: every change reaches the standby before the primary answers (nothing "
                                  "acknowledged is lost); N: the primary answers at once and sends the standby its "
                                  "whole state every N pushes, without waiting (a failover may lose the pushes "
                                  "folded since the last state the standby holds)", min=0, max=1 << 20)
    world_size: int | None = _option(None, "the run's world size, fixed from the start: a hello claiming another is "
                                     "refused (the embedded PS is given the strategy's) [default: --workers, else the "
                                     "first accepted hello's]", min=1, max=1 << 14, cli=False)

    def __post_init__(self) -> None:
        for name in _PATHS:  # paths arrive as str from JSON and from callers: hold them as Path
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        for f in dataclasses.fields(self):
            self.check(f.name, getattr(self, f.name))
        if None not in (self.world_size, self.expected_workers) and self.world_size != self.expected_workers:
            raise ValueError(f"world_size {self.world_size} and expected_workers (--workers) {self.expected_workers} "
                             "differ: give one, or the same")
        if self.checkpoint_dir is None and (self.checkpoint_every_updates or self.checkpoint_every_seconds):
            raise ValueError("checkpoint_every_updates / checkpoint_every_seconds (--checkpoint-every-*) need "
                             "checkpoint_dir (--checkpoint-dir): say where the checkpoints go")
        self.check_downlink(self.downlink_fraction, self.downlink_codec)
        if self.standby_of is not None and self.resume is not None:
            raise ValueError("a standby (--standby-of) takes its state from its primary: it cannot be given --resume")
        check_bind(self.bind, self.keys is not None, self.insecure)

    @classmethod
    def check(cls, name: str, value: Any) -> Any:
        """``value`` if field ``name`` may hold it, else a ValueError that says what it may hold.

        Args:
            name: the name of a field of :class:`PSConfig`.
            value: the value to check for it.

        Raises:
            ValueError: where a number is out of the field's bounds (and as the mode, run id and shard
                parsers raise for theirs).
        """
        meta = _FIELDS[name].metadata
        if name == "mode":
            get_mode(value)  # the error lists the modes
        elif name == "run_id" and value is not None:
            check_run_id(value)
        elif name == "shard" and value is not None:
            parse_shard(value)
        elif name == "downlink_codec" and value is not None and value not in DOWNLINK_CODECS:
            raise ValueError(f"downlink_codec must be one of {list(DOWNLINK_CODECS)}, got {value!r}")
        elif value is not None and not isinstance(value, bool) and isinstance(value, int | float):
            low, high = meta["min"], meta["max"]
            if (low is not None and value < low) or (high is not None and value > high):
                bounds = f"between {low:g} and {high:g}" if high is not None else f">= {low:g}"
                raise ValueError(f"{name} must be {bounds}, got {value:g}")
        return value

    @staticmethod
    def check_downlink(fraction: float | None, codec: str | None) -> None:
        """Refuse a downlink fraction beside a downlink codec: two ways to answer a push.

        Args:
            fraction: ``downlink_fraction``, or None.
            codec: ``downlink_codec``, or None.

        Raises:
            ValueError: where both are given.
        """
        if fraction is not None and codec is not None:
            raise ValueError("downlink_fraction (--downlink-fraction) and downlink_codec (--downlink-codec) are two "
                             "ways to answer a push: give one")

    def limits(self) -> Limits:
        """The wire's limits for this PS's requests."""
        if self.max_message_bytes is None:
            return DEFAULT_LIMITS
        return Limits(max_message_bytes=self.max_message_bytes)

    def checkpoint_policy(self) -> CheckpointPolicy | None:
        """When and where checkpoints are written; None without ``checkpoint_dir``."""
        if self.checkpoint_dir is None:
            return None
        return CheckpointPolicy(self.checkpoint_dir, self.checkpoint_every_updates, self.checkpoint_every_seconds,
                                self.keep)

    def to_json(self) -> str:
        """The fields that differ from their defaults, as one JSON object (the embedded PS's ``--config``)."""
        changed = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default}
        return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in changed.items()}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PSConfig:
        """The config :meth:`to_json` wrote; unknown names are refused, naming the known ones.

        Args:
            text: a JSON object of field names and values.

        Raises:
            ValueError: where ``text`` is not JSON, not an object, or names an unknown field (and as
                :class:`PSConfig` raises for a bad value).
        """
        try:
            values = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"the PS's --config is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError("the PS's --config must be a JSON object of PSConfig fields")
        unknown = set(values) - set(_FIELDS)
        if unknown:
            raise ValueError(f"unknown PS option(s) {', '.join(sorted(unknown))}; known: {', '.join(_FIELDS)}")
        return cls(**values)


_FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(PSConfig)}
FIELD_TYPES: dict[str, Any] = typing.get_type_hints(PSConfig)


def ps_argument(parser: argparse.ArgumentParser, name: str, flag: str | None = None) -> None:
    """Add the flag of PSConfig field ``name`` to an argparse parser (the recipes' PS options): its type,
    default, help and bounds come from the field; ``flag`` replaces ``--name-with-dashes``.

    Args:
        parser: the parser to add the flag to.
        name: the name of a field of :class:`PSConfig`.
        flag: the flag's name; None: ``--`` and the field's name with dashes.
    """
    f = _FIELDS[name]
    flag = flag or "--" + name.replace("_", "-")
    hint = FIELD_TYPES[name]
    if hint is bool:
        parser.add_argument(flag, action="store_true", help=f.metadata["help"])
        return
    if isinstance(hint, types.UnionType):  # X | None
        hint = next(t for t in typing.get_args(hint) if t is not type(None))

    def convert(text: str) -> Any:
        try:
            return PSConfig.check(name, hint(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    default = "" if f.default is None else f" (default: {f.default})"
    parser.add_argument(flag, type=convert, default=f.default, metavar=hint.__name__.upper(),
                        help=f.metadata["help"] + default)
