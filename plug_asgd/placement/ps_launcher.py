"""The embedded parameter server: the PS that global rank 0 of an ``AsyncPSStrategy`` starts in a process of its own.

Its :class:`~plug_asgd.ps.PSConfig` is made from the strategy's arguments and the trainer's
callbacks (:class:`ConfiguresPS`); :class:`EmbeddedPS` starts it, watches it and stops it.
Imports neither Lightning namespace.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from plug_asgd.protocol.security import check_bind
from plug_asgd.ps import PSConfig, embedded_command
from plug_asgd.sharding.client import ShardedClient
from plug_asgd.sharding.config import shard_folder
from plug_asgd.worker.client import PSClient, PSError, PSUnreachableError

if TYPE_CHECKING:
    from plug_asgd.modes import Mode
    from plug_asgd.placement.settings import PSSettings


@runtime_checkable
class ConfiguresPS(Protocol):
    """A callback that sets options of the embedded PS (``PSCheckpoint``: its checkpoint policy)."""

    def ps_options(self) -> dict[str, Any]:
        """The embedded PS's options this callback sets, as :class:`~plug_asgd.ps.PSConfig` fields by name."""
        ...


def configurer(trainer: Any) -> ConfiguresPS | None:
    """The first of ``trainer``'s callbacks that sets options of the embedded PS; None if none does.

    Args:
        trainer: the Trainer whose callbacks are searched (None: no trainer, so none).
    """
    found = [cb for cb in (trainer.callbacks if trainer is not None else []) if isinstance(cb, ConfiguresPS)]
    return found[0] if found else None


def endpoint(ps_address: str | None, ps_port: int | None, main_address: str | None, main_port: int,
             elastic: bool) -> tuple[str, str | None]:
    """The address workers connect to, and the one rank 0 binds (None: an external PS at ``ps_address``).

    Without torch.distributed the cluster's main port is free for the PS (Lightning chose it free),
    except under torchrun (``elastic``), whose agent serves its store there: the PS takes the next one.

    Args:
        ps_address: an external PS's address (returned as it is), or None for the embedded PS.
        ps_port: the embedded PS's port; None: the main port (the next one under torchrun).
        main_address: the cluster's main address, where the embedded PS listens.
        main_port: the cluster's main port.
        elastic: whether torchrun launched the job.
    """
    if ps_address is not None:
        return ps_address, None
    assert main_address is not None
    host = main_address
    port = ps_port or main_port + (1 if elastic else 0)
    return f"tcp://{host}:{port}", f"tcp://{socket.gethostbyname(host)}:{port}"


def endpoints(ps_address: str | Sequence[str] | None, ps_port: int | None, shards: int, main_address: str | None,
              main_port: int, elastic: bool) -> tuple[list[str], list[str] | None]:
    """:func:`endpoint` for each shard: the listed addresses (external shards), or ``shards`` embedded ones on
    consecutive ports from the first's.

    Args:
        ps_address: the external shards' addresses (or one PS's), or None for embedded ones.
        ps_port: the first embedded shard's port (None: as :func:`endpoint` chooses).
        shards: how many embedded shards.
        main_address: the cluster's main address.
        main_port: the cluster's main port.
        elastic: whether torchrun launched the job.
    """
    if ps_address is not None:
        return ([ps_address] if isinstance(ps_address, str) else list(ps_address)), None
    first, bind = endpoint(None, ps_port, main_address, main_port, elastic)
    assert bind is not None
    head, _, port = first.rpartition(":")
    bind_head = bind.rpartition(":")[0]
    ports = [int(port) + i for i in range(shards)]
    return [f"{head}:{p}" for p in ports], [f"{bind_head}:{p}" for p in ports]


def check_placement(address: str, bind: str | None, *, embedded_options: bool, keys: Any, insecure: bool) -> None:
    """Refuses options of the embedded PS (``embedded_options`` true) for an external one (``bind`` None), and
    an embedded PS listening beyond loopback without keys; every rank refuses alike, none waits for a PS.

    Args:
        address: the address workers connect to (named in the message).
        bind: the address the embedded PS would listen on; None: an external PS.
        embedded_options: whether options only an embedded PS takes were given (``PSCheckpoint``, ``resume_from``).
        keys: the CURVE keys folder (None: none).
        insecure: whether the user allowed listening beyond loopback without keys (``ps_insecure``).

    Raises:
        ValueError: embedded options for an external PS; an ``InsecureBindError`` (a ValueError, from
            :func:`~plug_asgd.protocol.security.check_bind`) for a bind beyond loopback without keys or ``insecure``.
    """
    if bind is None and embedded_options:
        raise ValueError(f"the PS at {address} is external: PSCheckpoint and resume_from configure the "
                         "embedded PS only; give the external one `plug-asgd serve-ps --checkpoint-dir DIR` "
                         "or `--resume DIR` instead")
    if bind is not None:
        check_bind(bind, keys is not None, insecure)


def check_placements(addresses: Sequence[str], binds: Sequence[str] | None, *, embedded_options: bool, keys: Any,
                     insecure: bool) -> None:
    """:func:`check_placement` for each shard.

    Args:
        addresses: every shard's address, in order.
        binds: the embedded shards' bind addresses, in the same order; None: external shards.
        embedded_options: whether options only an embedded PS takes were given.
        keys: the CURVE keys folder (None: none).
        insecure: whether the user allowed listening beyond loopback without keys.
    """
    for address, bind in zip(addresses, binds or [None] * len(addresses), strict=True):
        check_placement(address, bind, embedded_options=embedded_options, keys=keys, insecure=insecure)


def ps_config(settings: PSSettings, mode: Mode, run: int | None, bind: str, trainer: Any,
              shard: str | None = None, world_size: int | None = None) -> PSConfig:
    """The embedded PS's config, from the strategy's PS settings and the options of ``trainer``'s
    :class:`ConfiguresPS` callback.

    Args:
        settings: the strategy's PS arguments.
        mode: the training scheme, whose server options the PS takes.
        run: the connection's run number, which the PS checks at hello (None: a PS that takes any).
        bind: the address the PS listens on.
        trainer: the Trainer whose callbacks may configure the PS (None: none).
        shard: ``"I/N"``, one of several embedded shards, whose checkpoints, resume and metrics are those of a
            lone PS in a folder ``shard-I`` of the same place (:func:`~plug_asgd.sharding.config.shard_folder`).
        world_size: the job's worker count, which the PS then takes as fixed: a hello claiming another world is
            refused, so no connection can change it (None: the first accepted hello's).
    """
    checkpoint = configurer(trainer)
    run_dir = settings.ps_run_dir
    if run_dir is None and trainer is not None and trainer.loggers and trainer.log_dir is not None:
        run_dir = os.path.join(trainer.log_dir, "ps")
    options = checkpoint.ps_options() if checkpoint is not None else {}
    if options.get("checkpoint_dir") is not None:
        options["checkpoint_dir"] = shard_folder(options["checkpoint_dir"], shard)
    return PSConfig(bind=bind, mode=mode.name, parent_pid=os.getpid(), run=run, max_updates=settings.max_updates,
                    **mode.server_options(), resume=shard_folder(settings.resume_from, shard),
                    worker_timeout=settings.worker_timeout, run_dir=shard_folder(run_dir, shard),
                    keys=settings.ps_keys, insecure=settings.ps_insecure, threads=settings.ps_threads,
                    **settings.downlink, shard=shard, world_size=world_size,
                    failover_timeout=settings.failover_timeout, **options)


# the variables that set the thread count of the BLAS libraries numpy may use (OpenBLAS, MKL, OpenMP's)
BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


class EmbeddedPS:
    """The embedded PS's processes (one, or one per shard): started from configs, watched while workers wait,
    stopped at exit.

    Args:
        role: what its messages call it (``"parameter server"``; ``"standby"`` for ``ps_standby=True``'s).
    """

    def __init__(self, role: str = "parameter server") -> None:
        self.processes: list[subprocess.Popen] = []
        self.role = role

    @property
    def process(self) -> subprocess.Popen | None:
        """The (first shard's) process; None before it is started."""
        return self.processes[0] if self.processes else None

    def start(self, *configs: PSConfig) -> None:
        """Starts a PS for each config in a fresh interpreter (:func:`~plug_asgd.ps.embedded_command`).

        Its numpy computes on one thread unless the environment says otherwise: the PS's threads are its own
        (``ps_threads``), and the idle threads of a BLAS library spin, on the cores the workers train on.

        Args:
            *configs: one config per process (one PS, or one per shard in shard order).
        """
        env = {**{name: "1" for name in BLAS_THREADS}, **os.environ}
        self.processes = [subprocess.Popen(embedded_command(c), stdin=subprocess.DEVNULL, env=env) for c in configs]

    @property
    def running(self) -> bool:
        """Whether one of them still runs."""
        return any(p.poll() is None for p in self.processes)

    def gone(self) -> str | None:
        """Why a worker must stop waiting for them: one exited; None while they run (or were never started)."""
        for i, process in enumerate(self.processes):
            if process.poll() is not None:
                which = f" (shard {i})" if len(self.processes) > 1 else ""
                return (f"the embedded {self.role}{which} exited with code {process.returncode} before "
                        "answering (its message is above); if the port is taken, pass ps_port=")
        return None

    def wait_for_workers(self, client: PSClient | ShardedClient, seconds: float) -> None:
        """While it runs, waits up to ``seconds`` for every worker to have left it (asked through ``client``).

        Args:
            client: this worker's client, through which the PS's worker count is asked.
            seconds: the longest wait; a PS that does not answer ends it sooner.
        """
        if not self.running:
            return
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if not client.stats(timeout=2.0)["workers"]:
                    break
            except (PSError, PSUnreachableError):
                break
            time.sleep(0.1)

    def stop(self) -> None:
        """Terminates them (killed if one takes over 10 s) and forgets them; nothing if none was started."""
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []
