"""The ``plug-asgd`` command: run a parameter server, train a recipe, inspect a running PS, plot runs.

``plug-asgd serve-ps``   a standalone parameter server for workers started elsewhere
                         (``--ps-address tcp://host:port`` on the recipes, ``ps_address=`` on the strategy);
``plug-asgd train mnist`` a ready-made recipe, every flag after its name passed to the recipe unchanged;
``plug-asgd status ADDRESS`` the counters of a running PS, as a table (of every shard, given several; live with
                         ``--watch``);
``plug-asgd keygen DIR``  CURVE keys for a PS that listens beyond loopback (``serve-ps --keys``);
``plug-asgd plot RUN... --out PNG`` learning curves of finished runs (their supervisor.jsonl);
``plug-asgd --version``   the package's version (``plug_asgd.__version__``, its one place).

This module makes the app of the commands, which are written by group: :mod:`plug_asgd.cli.serving` (``serve-ps``,
``keygen``), :mod:`plug_asgd.cli.training` (``train``) and :mod:`plug_asgd.cli.reporting` (``status``, ``plot``);
:mod:`plug_asgd.cli.output` holds the consoles they write to. How the help shows (panels, one line per option, the
Python argument beside each) is kept in :mod:`plug_asgd.cli.options`; each command's help is its docstring,
unwrapped for the terminal to wrap.

Only typer, rich and the standard library are imported at module level besides the PS and its
client (neither imports torch or Lightning); a recipe, which imports Lightning, is imported when
``train`` runs, the dashboard when ``serve-ps`` or ``status`` shows it, matplotlib when ``plot`` draws.
(``import plug_asgd`` imports neither: its public names load on first use.)
"""

from __future__ import annotations

from typing import Annotated

import typer

from plug_asgd import __version__
from plug_asgd.cli.options import Command, Group, unwrapped
from plug_asgd.cli.reporting import plot, status
from plug_asgd.cli.serving import keygen, serve_ps
from plug_asgd.cli.training import CONTEXT_SETTINGS, train

# A command's docstring is its --help text up to its line ``\f`` (where click and typer cut it); the Args: and
# Raises: below that line are for readers of the code.
app = typer.Typer(
    help="Asynchronous and compressed parameter-server SGD for PyTorch Lightning.",
    no_args_is_help=True,
    add_completion=False,
    cls=Group,
)


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


# the commands, in the order --help lists them
app.command("serve-ps")(serve_ps)
app.command()(keygen)
app.command(context_settings=CONTEXT_SETTINGS, add_help_option=False)(train)
app.command()(status)
app.command()(plot)

# each command's help is its docstring's, each paragraph one line that the terminal wraps
for _command in app.registered_commands:
    _command.help = unwrapped(_command.callback.__doc__)
    _command.cls = Command  # --help without a <bool> beside it

if __name__ == "__main__":
    app()
