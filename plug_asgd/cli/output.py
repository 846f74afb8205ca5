"""Where the ``plug-asgd`` command writes: its two consoles (stdout and stderr), and an error said in red with the exit
code to raise (:func:`fail`).
"""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int) -> typer.Exit:
    """Print ``message`` in red on stderr (one line, not wrapped) and return the Exit to raise.

    Args:
        message: what went wrong, as the user reads it.
        code: the exit code of the Exit returned.
    """
    err_console.print(f"[bold red]error:[/] [red]{escape(message)}[/]", soft_wrap=True, highlight=False)
    return typer.Exit(code)
