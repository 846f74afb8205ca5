"""The commands that run a parameter server: ``serve-ps`` (a standalone PS, its live dashboard or lines of counters)
and ``keygen`` (the CURVE keys of a PS that listens beyond loopback).
"""

from __future__ import annotations

import inspect
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from plug_asgd.cli.options import by_panel, config_parameters, config_values, option
from plug_asgd.cli.output import console, fail
from plug_asgd.protocol.security import generate_keys, is_loopback
from plug_asgd.ps import ParameterServer, raise_fd_limit
from plug_asgd.ps.config import PSConfig
from plug_asgd.ps.standby_join import standby_config


def _check_log_level(value: str) -> str:
    level = value.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise typer.BadParameter(f"unknown log level {value!r}; choose one of: DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return level


def _check_log_every(value: float) -> float:
    if value != 0 and not value >= 0.1:
        raise typer.BadParameter(f"must be 0 (no lines) or at least 0.1 seconds, got {value:g}")
    return value


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


def _serve_ps_options(
    *,
    host: Annotated[str, option("host")] = "127.0.0.1",
    port: Annotated[int, option("port", min=1, max=65535)] = 2223,
    log_level: Annotated[str, option("log_level", callback=_check_log_level)] = "INFO",
    quiet: Annotated[bool, option("quiet", "--quiet", "-q")] = False,
    log_every: Annotated[float, option("log_every", callback=_check_log_every)] = 10.0,
) -> None:
    """The options of ``serve-ps`` that are not PS options (where it listens is ``PSConfig.bind``)."""


def serve_ps(*, host: str, port: int, log_level: str, quiet: bool, log_every: float, **options: Any) -> None:
    """Run a standalone parameter server until Ctrl-C / SIGTERM (or until --workers have come and gone).

    Workers reach it with AsyncPSStrategy(ps_address="tcp://HOST:PORT"), or --ps-address on the recipes. On a
    terminal it shows a live dashboard (workers, updates/s, traffic, refusals, staleness); with --quiet or when
    stdout is not a terminal, a plain line of counters every --log-every seconds. Another shell can ask it with
    'plug-asgd status tcp://HOST:PORT'. Beyond 127.0.0.1 it needs --keys (made by 'plug-asgd keygen DIR'), or
    --insecure.

    In parentheses beside an option: the Python argument that sets the same thing, of AsyncPSStrategy (for
    the PS it starts itself) unless another class is named.
    \f

    Args:
        host: the interface to listen on (``0.0.0.0`` or ``*`` for every interface).
        port: the TCP port to listen on.
        log_level: the PS's logging level (its records go to stderr, or above the dashboard).
        quiet: no live dashboard, plain lines of counters only (also where stdout is not a terminal).
        log_every: without the dashboard, seconds between two plain lines of counters (0: none).
        **options: the PS's options, one per ``PSConfig`` field that has a flag (``no_shm_pushes`` for
            ``shm_pushes``: :func:`plug_asgd.cli.options.config_values`).

    Raises:
        Exit: always, when the PS stops (its exit code); with code 2 where the PS cannot start (the port
            in use, a refused option, a bad checkpoint).
    """
    live = not quiet and sys.stdout.isatty() and not console.is_dumb_terminal
    if live:  # log records go through the dashboard's console, above the live view
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=console, show_path=False, markup=False)
        logging.basicConfig(level=log_level, format="%(message)s", handlers=[handler], force=True)
    else:
        logging.basicConfig(level=log_level, stream=sys.stderr, format="[plug_asgd PS %(asctime)s] %(message)s",
                            force=True)
    options = config_values(options)
    options["run_dir"] = options["run_dir"] or Path("runs") / time.strftime("ps-%Y%m%d-%H%M%S")
    try:
        config = PSConfig(bind=_endpoint(host, port), **options)
        if config.standby_of is not None:  # the primary's mode and options, its own address and folders
            config = standby_config(config)
        raise_fd_limit()  # idle connections hold file descriptors: leave room for the checkpoints
        server = ParameterServer(config)
    except (OSError, ValueError) as exc:  # port in use / bad interface, a refused option, a bad checkpoint
        raise fail(str(exc), 2) from None
    workers = config.expected_workers
    extra = f", expecting {workers} worker{'s' if workers != 1 else ''}" if workers else ""
    extra += f", shard {config.shard} of a sharded model" if config.shard else ""
    extra += f", hot standby of {config.standby_of}" if config.standby_of else ""
    security = ("CURVE keys, authorized workers only" if server.keyed else
                "[bold red]no authentication[/]" if config.insecure and not is_loopback(config.bind)
                else "loopback only, no keys")
    console.print(f"[bold green]plug_asgd parameter server[/] listening on [bold]{escape(server.address)}[/], "
                  f"mode [bold]{escape(config.mode)}[/]{extra}, {security} (Ctrl-C to stop)", soft_wrap=True,
                  highlight=False)
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
    if live:
        from plug_asgd.cli.dashboard import Dashboard

        with Dashboard(server.address, console) as dashboard:
            code = server.serve_forever(on_tick=_guarded(dashboard.on_tick), tick_s=0.5)
    elif log_every > 0:
        code = server.serve_forever(on_tick=_guarded(_StatsLines()), tick_s=log_every)
    else:
        code = server.serve_forever()
    if server.join_failed:
        raise fail(server.join_failed, 2)
    raise typer.Exit(code or 0)


# serve-ps's flags: its own, then one per PSConfig field (declared once, in plug_asgd.ps.config)
serve_ps.__signature__ = inspect.Signature(by_panel([  # type: ignore[attr-defined]
    *inspect.signature(_serve_ps_options, eval_str=True).parameters.values(),
    *config_parameters()]))


class _StatsLines:
    """``on_tick`` of a PS without the dashboard: one plain line of counters per tick on stdout."""

    def __init__(self) -> None:
        self.previous: dict[str, Any] | None = None

    def __call__(self, server: ParameterServer) -> None:
        from plug_asgd.cli.dashboard import log_line

        snapshot = server.snapshot()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"[plug_asgd PS {stamp}] {log_line(snapshot, self.previous)}", flush=True)
        self.previous = snapshot


def _guarded(tick: Callable[[Any], None]) -> Callable[[Any], None]:
    """``tick``, made harmless: a first failure (say, stdout closed) is logged and the ticks stop; the PS goes on."""
    failed = False

    def guarded(server: Any) -> None:
        nonlocal failed
        if failed:
            return
        try:
            tick(server)
        except Exception as exc:
            failed = True
            logging.getLogger("plug_asgd.ps").warning("the live counters stopped: %s", exc)

    return guarded


def keygen(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="folder to write the keys into (created; "
                                              "existing keys are never overwritten)", show_default=False)],
) -> None:
    """Make CURVE keys: a keypair for the PS, one for the workers, one for a hot standby, and the PS's lists of
    authorized workers and standbys.

    Copy DIR/server to the PS machine only ('plug-asgd serve-ps --keys DIR/server'), DIR/worker to
    every worker machine ('--ps-keys DIR/worker'; AsyncPSStrategy(ps_keys=...)) and DIR/standby to a hot
    standby's machine only ('serve-ps --standby-of ADDR --keys DIR/standby': it holds the PS's keypair too, as
    it leads once the PS is gone). With an embedded PS, or a shared file system, pass DIR itself to all. The
    *_secret files are readable by you alone. On a folder of keys made before the standby's, it adds DIR/standby
    alone.
    \f

    Args:
        directory: the folder to write the keys into (made where missing; existing keys are never overwritten).

    Raises:
        Exit: with code 2 where the keys cannot be written (they exist already, or the folder cannot be made).
    """
    try:
        files = generate_keys(directory)
    except (OSError, ValueError) as exc:
        raise fail(str(exc), 2) from None
    table = Table(title=f"CURVE keys in {directory}", title_justify="left")
    table.add_column("file", style="cyan", overflow="fold")
    table.add_column("goes to")
    table.add_column("secret")
    rows = [("server_secret", "the PS machine only", "yes (0600)"),
            ("server_public", "the PS machine", "no"),
            ("authorized", "the PS machine: public keys of the workers it admits", "no"),
            ("authorized_standby", "the PS machine: public keys of the standbys it admits", "no"),
            ("worker_secret", "every worker machine", "yes (0600)"),
            ("worker_public", "every worker machine", "no"),
            ("worker_server_public", "every worker machine (the PS's public key)", "no"),
            ("standby_secret", "the standby machine only (DIR/standby: with the PS's keypair)", "yes (0600)"),
            ("standby_public", "the standby machine", "no")]
    for name, where, secret in rows:
        if name in files:  # keys made before the standby's: only the standby's are new
            table.add_row(escape(str(files[name])), escape(where), secret)
    console.print(table)
    console.print(f"PS:      plug-asgd serve-ps --host 0.0.0.0 --keys {escape(str(directory / 'server'))}\n"
                  f"workers: --ps-keys {escape(str(directory / 'worker'))}  (AsyncPSStrategy(ps_keys=...))\n"
                  f"standby: plug-asgd serve-ps --host 0.0.0.0 --standby-of tcp://PS_HOST:2223 "
                  f"--keys {escape(str(directory / 'standby'))}", soft_wrap=True, highlight=False)
