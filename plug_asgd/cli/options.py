"""``serve-ps``'s options as its ``--help`` shows them: in panels, one line of help each, every default shown.

:class:`~plug_asgd.ps.config.PSConfig` declares the PS's options once (their flags, bounds and full help, which
the reference docs quote); what the help shows at 80 columns is kept here, per field: the panel, a short line,
the value's name, the Python argument that sets the same thing (an argument of ``AsyncPSStrategy`` where no
class is named) and, for a default of None, what None means. A field without a line here is shown with its
own help in the "Training" panel (``tests/test_cli.py`` asks for a line).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Annotated, Any, NamedTuple

import typer
from typer.core import TyperCommand, TyperGroup
from typing_extensions import override

from plug_asgd.ps.config import FIELD_TYPES, MODES, PSConfig

TRAINING, NETWORK, CHECKPOINTS, LIMITS, SECURITY, DISPLAY = (
    "Training", "Network", "Checkpoints", "Limits", "Security", "Display")
PANELS = (TRAINING, NETWORK, CHECKPOINTS, LIMITS, SECURITY, DISPLAY)


class Shown(NamedTuple):
    """How one option shows in ``--help``.

    Attributes:
        panel: the panel it is listed in (one of :data:`PANELS`).
        help: one short line.
        metavar: the value's name (``N``, ``S`` for seconds, ``DIR``...); empty for a flag.
        python: the Python argument that sets the same thing: ``ps_threads=`` (of ``AsyncPSStrategy``) or
            ``SSP: staleness_bound=``; empty where there is none.
        default: what a default of None means, shown as the default; empty to show the value itself.
    """

    panel: str
    help: str
    metavar: str = ""
    python: str = ""
    default: str = ""


SHOWN: dict[str, Shown] = {
    # serve-ps's own options (plug_asgd.cli.serving._serve_ps_options)
    "host": Shown(NETWORK, "interface to listen on (0.0.0.0: all of them)", "HOST"),
    "port": Shown(NETWORK, "TCP port to listen on", "PORT"),
    "log_level": Shown(DISPLAY, "the PS's log level (its records go to stderr)", "LEVEL"),
    "quiet": Shown(DISPLAY, "plain lines of counters, no live dashboard (so too where stdout is no terminal)"),
    "log_every": Shown(DISPLAY, "seconds between two plain lines (0: none)", "S"),
    # one per PSConfig field that has a flag
    "mode": Shown(TRAINING, f"training scheme, the workers' too: {', '.join(MODES)}", "NAME", "mode="),
    "expected_workers": Shown(TRAINING, "exit once this many workers have come and gone", "N",
                              default="run until stopped"),
    "linger": Shown(TRAINING, "seconds to wait, the last worker gone, for one to come back", "S"),
    "replicas_to_aggregate": Shown(TRAINING, "sync: updates averaged per round", "N", "Sync: replicas_to_aggregate=",
                                   "every worker"),
    "staleness_bound": Shown(TRAINING, "ssp: pushes a worker may be ahead of the slowest", "N",
                             "SSP: staleness_bound=", "2"),
    "outer": Shown(TRAINING, "diloco: the outer optimizer, a name or the JSON of its fields", "OPT",
                   "DiLoCo: outer=", "nesterov, lr 0.7, momentum 0.9"),
    "max_updates": Shown(LIMITS, "central version at which workers are told to stop", "N", "max_updates=", "none"),
    "checkpoint_dir": Shown(CHECKPOINTS, "write checkpoints of the central state here", "DIR",
                            "PSCheckpoint: dirpath=", "none"),
    "checkpoint_every_updates": Shown(CHECKPOINTS, "updates between two checkpoints", "N",
                                      "PSCheckpoint: every_n_updates=", "none"),
    "checkpoint_every_seconds": Shown(CHECKPOINTS, "seconds between two checkpoints", "S",
                                      "PSCheckpoint: every_n_seconds=", "60 without other rule"),
    "keep": Shown(CHECKPOINTS, "checkpoints kept, the newest", "N", "PSCheckpoint: keep="),
    "resume": Shown(CHECKPOINTS, "start from a checkpoint, or a folder's newest", "PATH", "resume_from=", "none"),
    "run_id": Shown(CHECKPOINTS, "the run named in the checkpoints' file names", "ID",
                    default="new, or the resumed one's"),
    "io_retry_seconds": Shown(CHECKPOINTS, "seconds before a failed disk write is tried again (doubling)", "S"),
    "run_dir": Shown(DISPLAY, "where ps_metrics.jsonl goes", "DIR", "ps_run_dir=", "runs/ps-DATE-TIME"),
    "metrics_every": Shown(DISPLAY, "seconds between two lines of ps_metrics.jsonl", "S"),
    "worker_timeout": Shown(NETWORK, "seconds of silence before a worker is lost", "S", "worker_timeout="),
    "keys": Shown(SECURITY, "CURVE keys: DIR/server of 'plug-asgd keygen DIR' (a standby: DIR/standby)", "DIR",
                  "ps_keys=", "none"),
    "insecure": Shown(SECURITY, "listen beyond 127.0.0.1 WITHOUT keys: anyone can read the model",
                      python="ps_insecure="),
    "max_message_bytes": Shown(LIMITS, "largest request accepted, in bytes", "BYTES", default="2 GiB"),
    "threads": Shown(LIMITS, "threads that fold a large dense update in", "N", "ps_threads="),
    "shm_pushes": Shown(NETWORK, "no pushes through shared memory from this machine's workers",
                        python="shm_pushes=False"),
    "downlink_fraction": Shown(NETWORK, "share of the coordinates a push's reply carries", "X",
                               "downlink_fraction=", "exact replies"),
    "downlink_bound": Shown(NETWORK, "with --downlink-fraction: send any off by more too", "X",
                            "downlink_bound=", "none"),
    "downlink_codec": Shown(NETWORK, "a push's reply: the differences from the worker's copy, coded", "CODEC",
                            "downlink_codec=", "exact replies"),
    "shard": Shown(NETWORK, "hold shard I of N of the model (0/2, then 1/2)", "I/N", default="the whole model"),
    "standby_of": Shown(NETWORK, "be the hot standby of the PS at this address", "ADDR", default="lead from the start"),
    "failover_timeout": Shown(NETWORK, "seconds of the primary's silence before its standby may lead", "S"),
    "standby_window": Shown(NETWORK, "0: each push reaches the standby first; N: its whole state every N pushes",
                            "N"),
}


def help_line(name: str) -> str:
    """The option's help: its line, then the Python argument that sets the same thing, where there is one.

    Args:
        name: a key of :data:`SHOWN`.
    """
    shown = SHOWN[name]
    return f"{shown.help} ({shown.python})" if shown.python else shown.help


def option(name: str, *flags: str, **kwargs: Any) -> Any:
    """The ``typer.Option`` of ``name`` as :data:`SHOWN` has it: its panel, line, metavar and default shown.

    Args:
        name: a key of :data:`SHOWN`.
        *flags: the option's names (``--quiet``, ``-q``); none: typer's, from the parameter's name.
        **kwargs: more of ``typer.Option``'s arguments (``callback``, ``min``...).
    """
    shown = SHOWN[name]
    default: bool | str = shown.default or bool(shown.metavar)  # a flag's default goes without saying
    return typer.Option(*flags, help=help_line(name), rich_help_panel=shown.panel, metavar=shown.metavar or "",
                        show_default=default, **kwargs)


def inverted(field: dataclasses.Field) -> bool:
    """Whether the field is a switch that is on unless ``--no-...`` turns it off (``shm_pushes``).

    Args:
        field: a field of :class:`PSConfig`.
    """
    return FIELD_TYPES[field.name] is bool and field.default is True


def config_parameter(field: dataclasses.Field) -> inspect.Parameter:
    """The ``serve-ps`` option of one PSConfig field: its flag and bounds come from the field, its help from here.

    A switch that is on by default is a flag ``--no-NAME`` (parameter ``no_NAME``: see :func:`config_values`).

    Args:
        field: a field of :class:`PSConfig` that has a flag.
    """
    meta = field.metadata
    check = _checker(field.name)
    name, hint, default = field.name, FIELD_TYPES[field.name], field.default
    flags = meta["flags"]
    if inverted(field):
        name, default, flags = f"no_{field.name}", False, (f"--no-{field.name.replace('_', '-')}",)
        check = _checker(field.name, invert=True)
    bounds = {k: meta[k] for k in ("min", "max") if meta[k] is not None}
    if field.name not in SHOWN:  # a new field: its own help, until it has a line of its own here
        opt = typer.Option(*flags, help=meta["help"], callback=check, rich_help_panel=TRAINING, **bounds)
    else:
        opt = option(field.name, *flags, callback=check, **bounds)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[hint, opt])


def config_values(options: dict[str, Any]) -> dict[str, Any]:
    """``serve-ps``'s PSConfig options as PSConfig's fields: ``no_shm_pushes=True`` is ``shm_pushes=False``.

    Args:
        options: the values of the parameters :func:`config_parameter` made, by name.
    """
    fields = {f.name: f for f in dataclasses.fields(PSConfig)}
    out = {}
    for name, value in options.items():
        if name.startswith("no_") and name[3:] in fields and inverted(fields[name[3:]]):
            out[name[3:]] = not value
        else:
            out[name] = value
    return out


def config_parameters() -> list[inspect.Parameter]:
    """The ``serve-ps`` options of every PSConfig field that has a flag, in the fields' order."""
    return [config_parameter(f) for f in dataclasses.fields(PSConfig) if f.metadata["cli"]]


def by_panel(parameters: list[inspect.Parameter]) -> list[inspect.Parameter]:
    """``parameters`` in the order of their panels in :data:`PANELS` (typer shows the panels as they come).

    Args:
        parameters: typer parameters, each annotated ``Annotated[type, typer.Option(...)]``.
    """
    def rank(parameter: inspect.Parameter) -> int:
        panel = getattr(parameter.annotation.__metadata__[0], "rich_help_panel", None)
        return PANELS.index(panel) if panel in PANELS else len(PANELS)

    return sorted(parameters, key=rank)


def _as_flag(help_option: Any) -> Any:
    """``--help`` shown as a flag, without a ``<bool>`` beside it."""
    if help_option is not None:
        help_option.metavar = ""
    return help_option


class Command(TyperCommand):
    """A typer command whose ``--help`` flag shows as a flag, without a ``<bool>`` beside it."""

    @override
    def get_help_option(self, ctx: Any) -> Any:
        return _as_flag(super().get_help_option(ctx))


class Group(TyperGroup):
    """The typer group of :class:`Command`: its own ``--help`` a flag too."""

    @override
    def get_help_option(self, ctx: Any) -> Any:
        return _as_flag(super().get_help_option(ctx))


def _checker(name: str, *, invert: bool = False) -> Callable[[Any], Any]:
    """The callback that checks a value as PSConfig would, saying why as typer does."""

    def check(value: Any) -> Any:
        try:
            PSConfig.check(name, not value if invert else value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        return value

    return check


def unwrapped(doc: str | None) -> str:
    """A command's help from its docstring: the text before its ``\\f`` line, each paragraph on one line (the
    terminal wraps it), paragraphs apart.

    Args:
        doc: the command's docstring.
    """
    text = inspect.cleandoc(doc or "").partition("\f")[0]
    return "\n\n".join(" ".join(p.split()) for p in text.split("\n\n") if p.strip())
