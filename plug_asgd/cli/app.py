"""The ``plug-asgd`` command: run a parameter server, train a recipe, inspect a running PS, plot runs.

``plug-asgd serve-ps``   a standalone parameter server for workers started elsewhere
                         (``--ps-address tcp://host:port`` on the recipes, ``ps_address=`` on the strategy);
``plug-asgd train mnist`` a ready-made recipe, every flag after its name passed to the recipe unchanged;
``plug-asgd status ADDRESS`` the counters of a running PS, as a table (of every shard, given several; live with
                         ``--watch``);
``plug-asgd keygen DIR``  CURVE keys for a PS that listens beyond loopback (``serve-ps --keys``);
``plug-asgd plot RUN... --out PNG`` learning curves of finished runs (their supervisor.jsonl);
``plug-asgd --version``   the package's version (``plug_asgd.__version__``, its one place).

How the help shows (panels, one line per option, the Python argument beside each) is kept in
:mod:`plug_asgd.cli.options`; each command's help is its docstring, unwrapped for the terminal to wrap.

Only typer, rich and the standard library are imported at module level besides the PS and its
client (neither imports torch or Lightning); a recipe, which imports Lightning, is imported when
``train`` runs, the dashboard when ``serve-ps`` or ``status`` shows it, matplotlib when ``plot`` draws.
(``import plug_asgd`` itself imports Lightning through the package ``__init__``.)
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from plug_asgd import __version__
from plug_asgd.cli.options import Command, Group, by_panel, config_parameters, config_values, option, unwrapped
from plug_asgd.protocol.security import generate_keys, is_loopback
from plug_asgd.ps import ParameterServer, raise_fd_limit
from plug_asgd.ps.config import PSConfig

# name -> (module whose ``main(argv)`` runs it, one-line description)
RECIPES: dict[str, tuple[str, str]] = {
    "mnist": ("plug_asgd.recipes.mnist", "the Keras mnist_cnn on MNIST / Fashion-MNIST IDX files"),
    "cifar10": ("plug_asgd.recipes.cifar10", "a CNN, AlexNet or ResNet-18 on the CIFAR-10 python batches"),
}

# A command's docstring is its --help text up to its line ``\f`` (where click and typer cut it); the Args: and
# Raises: below that line are for readers of the code.
app = typer.Typer(
    help="Asynchronous and compressed parameter-server SGD for PyTorch Lightning.",
    no_args_is_help=True,
    add_completion=False,
    cls=Group,
)

console = Console()
err_console = Console(stderr=True)


def _print_version(value: bool) -> None:
    if value:
        print(f"plug-asgd {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True, metavar="",
                                          help="print the version and exit")] = False,
) -> None:
    """Asynchronous and compressed parameter-server SGD for PyTorch Lightning."""


def _fail(message: str, code: int) -> typer.Exit:
    """Print ``message`` in red on stderr (one line, not wrapped) and return the Exit to raise."""
    err_console.print(f"[bold red]error:[/] [red]{escape(message)}[/]", soft_wrap=True, highlight=False)
    return typer.Exit(code)


def _check_log_level(value: str) -> str:
    level = value.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise typer.BadParameter(f"unknown log level {value!r}; choose one of: DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return level


def _check_positive(value: float) -> float:
    if not value > 0:
        raise typer.BadParameter(f"must be positive, got {value:g}")
    return value


def _check_watch(value: float | None) -> float | None:
    if value is not None and not value >= 0.1:
        raise typer.BadParameter(f"must be at least 0.1 seconds, got {value:g}")
    return value


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
        raise_fd_limit()  # idle connections hold file descriptors: leave room for the checkpoints
        server = ParameterServer(config)
    except (OSError, ValueError) as exc:  # port in use / bad interface, a refused option, a bad checkpoint
        raise _fail(str(exc), 2) from None
    workers = config.expected_workers
    extra = f", expecting {workers} worker{'s' if workers != 1 else ''}" if workers else ""
    extra += f", shard {config.shard} of a sharded model" if config.shard else ""
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
    raise typer.Exit(code or 0)


# serve-ps's flags: its own, then one per PSConfig field (declared once, in plug_asgd.ps.config)
serve_ps.__signature__ = inspect.Signature(by_panel([  # type: ignore[attr-defined]
    *inspect.signature(_serve_ps_options, eval_str=True).parameters.values(),
    *config_parameters()]))
app.command("serve-ps")(serve_ps)


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


@app.command()
def keygen(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="folder to write the keys into (created; "
                                              "existing keys are never overwritten)", show_default=False)],
) -> None:
    """Make CURVE keys: a keypair for the PS, one for the workers, and the PS's list of authorized workers.

    Copy DIR/server to the PS machine only ('plug-asgd serve-ps --keys DIR/server') and DIR/worker to
    every worker machine ('--ps-keys DIR/worker'; AsyncPSStrategy(ps_keys=...)). With an embedded PS,
    or a shared file system, pass DIR itself to both. The *_secret files are readable by you alone.
    \f

    Args:
        directory: the folder to write the keys into (made where missing; existing keys are never overwritten).

    Raises:
        Exit: with code 2 where the keys cannot be written (they exist already, or the folder cannot be made).
    """
    try:
        files = generate_keys(directory)
    except (OSError, ValueError) as exc:
        raise _fail(str(exc), 2) from None
    table = Table(title=f"CURVE keys in {directory}", title_justify="left")
    table.add_column("file", style="cyan", overflow="fold")
    table.add_column("goes to")
    table.add_column("secret")
    rows = [(files["server_secret"], "the PS machine only", "yes (0600)"),
            (files["server_public"], "the PS machine", "no"),
            (files["authorized"], "the PS machine: public keys of the workers it admits", "no"),
            (files["worker_secret"], "every worker machine", "yes (0600)"),
            (files["worker_public"], "every worker machine", "no"),
            (files["worker_server_public"], "every worker machine (the PS's public key)", "no")]
    for path, where, secret in rows:
        table.add_row(escape(str(path)), escape(where), secret)
    console.print(table)
    console.print(f"PS:      plug-asgd serve-ps --host 0.0.0.0 --keys {escape(str(directory / 'server'))}\n"
                  f"workers: --ps-keys {escape(str(directory / 'worker'))}  (AsyncPSStrategy(ps_keys=...))",
                  soft_wrap=True, highlight=False)


def _recipes_text() -> str:
    return ", ".join(RECIPES)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,
)
def train(
    ctx: typer.Context,
    recipe: Annotated[str | None, typer.Argument(metavar="RECIPE", show_default=False,
                                                 help=f"recipe to run: {_recipes_text()}; 'plug-asgd train RECIPE "
                                                 "--help' shows its flags")] = None,
) -> None:
    """Train a ready-made recipe (mnist, cifar10); every argument after RECIPE goes to the recipe unchanged.

    Lightning starts the other worker processes by re-running this same command line.
    \f

    Args:
        ctx: the command's context; its extra arguments (everything after RECIPE) go to the recipe.
        recipe: the recipe's name (a key of ``RECIPES``); None, ``--help`` or ``-h`` to list the recipes.

    Raises:
        Exit: with code 0 after the help asked for, or 2 where RECIPE is missing or unknown.
    """
    args = list(ctx.args)
    if recipe is None or recipe in ("--help", "-h"):
        console.print(ctx.get_help(), highlight=False)
        for name, (_, summary) in RECIPES.items():
            console.print(f"  [bold]{name}[/]  {escape(summary)}", soft_wrap=True, highlight=False)
        if recipe is None:
            raise _fail(f"missing RECIPE; available recipes: {_recipes_text()}", 2)
        raise typer.Exit(0)
    if recipe not in RECIPES:
        raise _fail(f"unknown recipe {recipe!r}; available recipes: {_recipes_text()}", 2)
    module = importlib.import_module(RECIPES[recipe][0])
    module.main(args)


@app.command()
def status(
    addresses: Annotated[list[str], typer.Argument(metavar="ADDRESS", help="the PS's address, e.g. "
                                                   "tcp://127.0.0.1:2223 (tcp:// may be left out); a sharded PS's "
                                                   "shards' addresses, in order, for one table of them all",
                                                   show_default=False)],
    timeout: Annotated[float, typer.Option(callback=_check_positive, metavar="S",
                                           help="seconds to wait for the PS's answer")] = 5.0,
    as_json: Annotated[bool, typer.Option("--json", metavar="", help="print the counters as JSON instead of a "
                                          "table (a list, one per shard, for several addresses)")] = False,
    keys: Annotated[Path | None, typer.Option(metavar="DIR", help="worker CURVE keys (DIR/worker of 'plug-asgd "
                                              "keygen'), for a PS started with --keys")] = None,
    watch: Annotated[float | None, typer.Option("--watch", "-w", metavar="SECONDS", callback=_check_watch,
                                                help="a live view redrawn every SECONDS seconds until Ctrl-C: the "
                                                "dashboard serve-ps shows, or for several shards a column per "
                                                "shard and the totals", show_default=False)] = None,
) -> None:
    """Show the counters of a running parameter server (version, workers, traffic, staleness...); of every
    shard of a sharded PS, side by side, given their addresses; live with --watch.
    \f

    Args:
        addresses: the PS's endpoint, or a sharded PS's shards' endpoints in shard order (``tcp://`` may be
            left out).
        timeout: seconds to wait for each PS's answer.
        as_json: print the counters as JSON (a list, one per shard, for several addresses) instead of a table.
        keys: the worker CURVE keys folder, for a PS started with ``--keys``; None for a PS without keys.
        watch: seconds between redraws of a live view until Ctrl-C; None for the counters once.

    Raises:
        Exit: with code 2 where ``--watch`` and ``--json`` are both given; with code 1 or 2 where a PS does
            not answer or cannot be asked (see :func:`plug_asgd.cli.status.ask`).
    """
    from plug_asgd.cli import status as ps_status

    addresses = [a if "://" in a else f"tcp://{a}" for a in addresses]
    if watch is not None and as_json:
        raise _fail("--watch draws a live view: it takes no --json (run status --json in a loop instead)", 2)
    each = [_stats(address, timeout, keys) for address in addresses]  # one that does not answer ends it here
    if watch is not None:
        ps_status.watch(addresses, each, timeout, keys, watch, console, err_console)
    elif as_json:
        print(json.dumps(each[0] if len(each) == 1 else each, indent=2, sort_keys=True))
    elif len(each) == 1:
        console.print(ps_status.stats_table(addresses[0], each[0]))
    else:
        from plug_asgd.cli.dashboard import human_bytes
        from plug_asgd.cli.shard_status import order_problems, sharded_table

        console.print(sharded_table(addresses, each, human_bytes))
        for problem in order_problems(addresses, each):
            err_console.print(f"[bold yellow]warning:[/] {escape(problem)}", soft_wrap=True, highlight=False)


def _stats(address: str, timeout: float, keys: Path | None) -> dict[str, Any]:
    """One PS's counters, asked as a bystander; exits 1 (unreachable, refused) or 2 (bad address, keys)."""
    from plug_asgd.cli.status import StatusError, ask

    try:
        return ask(address, timeout, keys)
    except StatusError as exc:
        raise _fail(str(exc), exc.code) from None


@app.command()
def plot(
    runs: Annotated[list[Path], typer.Argument(metavar="RUN", show_default=False,
                                               help="a supervisor.jsonl, or a directory searched for them")],
    out: Annotated[Path, typer.Option("--out", "-o", help="the image to write (PNG)", show_default=False)],
    label: Annotated[list[str] | None, typer.Option("--label", help="a curve's name, once per curve in order "
                                                    "(default: each run's directory name)", show_default=False)]
    = None,
) -> None:
    """Plot test accuracy against wall time and against bytes pushed, one curve per run.
    \f

    Args:
        runs: the runs: supervisor.jsonl files, or directories searched for them.
        out: the image file to write (PNG unless its suffix names another format).
        label: one curve name per supervisor.jsonl found, in order; None for each run's directory name.

    Raises:
        Exit: with code 2 where matplotlib is missing, a run cannot be read, or the image cannot be written.
    """
    from plug_asgd.cli import plot as plotting

    try:
        plotting.require_matplotlib()
    except plotting.MatplotlibMissing as exc:
        raise _fail(str(exc), 2) from None
    try:
        path = plotting.plot_runs(runs, out, labels=label or None)
    except (plotting.RunError, OSError, ValueError) as exc:
        raise _fail(str(exc), 2) from None
    console.print(f"wrote [bold]{escape(str(path))}[/]", soft_wrap=True, highlight=False)


# each command's help is its docstring's, each paragraph one line that the terminal wraps
for _command in app.registered_commands:
    _command.help = unwrapped(_command.callback.__doc__)
    _command.cls = Command  # --help without a <bool> beside it

if __name__ == "__main__":
    app()
