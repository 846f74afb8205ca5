"""The ``train`` command: a ready-made recipe, every argument after its name passed to the recipe unchanged."""

from __future__ import annotations

import importlib
from typing import Annotated

import typer
from rich.markup import escape

from plug_asgd.cli.output import console, fail
from plug_asgd.startup import gc_paused

# name -> (module whose ``main(argv)`` runs it, one-line description)
RECIPES: dict[str, tuple[str, str]] = {
    "mnist": ("plug_asgd.recipes.mnist", "the Keras mnist_cnn on MNIST / Fashion-MNIST IDX files"),
    "cifar10": ("plug_asgd.recipes.cifar10", "a CNN, AlexNet or ResNet-18 on the CIFAR-10 python batches"),
    "lm": ("plug_asgd.recipes.lm", "a byte-level GPT on Debian's fortune cookies (the fortunes package)"),
}
# what ``train`` is registered with (plug_asgd.cli.app): every argument after RECIPE, options too, is the recipe's
CONTEXT_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True, "allow_interspersed_args": False}


def _recipes_text() -> str:
    return ", ".join(RECIPES)


def train(
    ctx: typer.Context,
    recipe: Annotated[str | None, typer.Argument(metavar="RECIPE", show_default=False,
                                                 help=f"recipe to run: {_recipes_text()}; 'plug-asgd train RECIPE "
                                                 "--help' shows its flags")] = None,
) -> None:
    """Train a ready-made recipe (mnist, cifar10, lm); every argument after RECIPE goes to the recipe unchanged.

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
            raise fail(f"missing RECIPE; available recipes: {_recipes_text()}", 2)
        raise typer.Exit(0)
    if recipe not in RECIPES:
        raise fail(f"unknown recipe {recipe!r}; available recipes: {_recipes_text()}", 2)
    with gc_paused():  # the recipe imports torch and Lightning (plug_asgd.startup)
        module = importlib.import_module(RECIPES[recipe][0])
    module.main(args)
