"""The training schemes: when a worker pushes, what it sends, and how the PS folds it in.

A mode is an object (:class:`Mode`, e.g. ``SSP(staleness_bound=3)``) with a name in :data:`MODES`;
:func:`get` takes a name, a configured mode or a dict. Its worker half is in :mod:`plug_asgd.modes.base`
(:class:`Mode`, :class:`PushMode`, the registry) and the modules of the modes themselves
(:mod:`~plug_asgd.modes.asynchronous`, :mod:`~plug_asgd.modes.rounds`, :mod:`~plug_asgd.modes.shared_and_elastic`),
its server half (the fold rules) in :mod:`plug_asgd.modes.rules`.
Everything here works on numpy arrays: the PS never imports torch or Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any

from plug_asgd import registry

# the modes register in MODES as their modules are imported, in this (isort's) order: the order of mode_table()
# and of docs/modes.md's table
from plug_asgd.modes.asynchronous import AGN, SSP, AdaComp, Asgd, Downpour, DynSGD
from plug_asgd.modes.base import MODES, Mode, PushMode
from plug_asgd.modes.diloco import DiLoCo, DiLoCoRule
from plug_asgd.modes.diloco_async import AsyncDiLoCo, AsyncDiLoCoRule
from plug_asgd.modes.fold import APPLIED, DROPPED, CentralState, Push, Resolution, all_finite, can_fold_into
from plug_asgd.modes.outer import OuterOptimizer
from plug_asgd.modes.rounds import LOSP, OSP, SAGN, LocalSGD, Sync
from plug_asgd.modes.rules import AdaCompRule, AsgdRule, DynSGDRule, FoldRule, SSPRule, SyncRule
from plug_asgd.modes.shared_and_elastic import EAMSGD, EASGD, Hogwild

__all__ = ["AGN", "APPLIED", "AdaComp", "AdaCompRule", "Asgd", "AsgdRule", "AsyncDiLoCo", "AsyncDiLoCoRule",
           "CentralState", "DROPPED", "DiLoCo", "DiLoCoRule", "Downpour", "DynSGD", "DynSGDRule", "EAMSGD", "EASGD",
           "FoldRule", "Hogwild", "LOSP", "LocalSGD", "MODES", "Mode", "OSP", "OuterOptimizer", "Push", "PushMode",
           "Resolution", "SAGN", "SSP", "SSPRule", "Sync", "SyncRule", "all_finite", "can_fold_into", "get",
           "chosen_knobs", "mode_table", "options_differ", "server_knobs"]

ModeLike = str | Mode | Mapping[str, Any]


def get(mode: ModeLike) -> Mode:
    """The mode ``mode`` stands for: a name of :data:`MODES` (its defaults), a configured instance
    (itself), or a dict ``{"name": ..., **knobs}`` (as a YAML file gives it).

    Args:
        mode: a registered name (``"ssp"``), a configured :class:`Mode`, or a mapping of ``"name"`` and knobs.
    """
    return registry.get(mode, Mode, MODES, "mode")


def server_knobs(mode: ModeLike, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The knobs a PS of ``mode`` folds with (its :meth:`~Mode.server_options`), each of ``given`` that is not None
    in its place, the outer optimizer as its JSON: what a worker's mode and a PS's flags are compared by.

    Args:
        mode: the mode (a name: its defaults).
        given: the PS's flags by name (``replicas_to_aggregate``, ``staleness_bound``, ``outer``); None: none.
    """
    knobs = dict(get(mode).server_options())
    knobs.update({k: v for k, v in (given or {}).items() if k in knobs and v is not None})
    if "outer" in knobs:
        knobs["outer"] = OuterOptimizer.get(knobs["outer"]).to_json()
    return knobs


def chosen_knobs(mode: Mode) -> dict[str, Any]:
    """The knobs of :func:`server_knobs` that ``mode`` sets away from its class's defaults: what a worker asks its
    PS to fold with. The others the PS's flags decide (``serve-ps --staleness-bound 5`` serves ``mode="ssp"``).

    Args:
        mode: the worker's mode.
    """
    defaults = server_knobs(mode.name)
    return {name: value for name, value in server_knobs(mode).items() if value != defaults.get(name)}


def options_differ(mode: str, ps: Mapping[str, Any], worker: Mapping[str, Any]) -> str | None:
    """Why a worker whose mode folds with ``worker``'s knobs cannot train on a PS that folds with ``ps``'s (both
    :func:`server_knobs`), saying what to change; None where they agree on every knob both name.

    Args:
        mode: the mode's name.
        ps: the PS's knobs.
        worker: the worker's mode's knobs, as its hello carries them.
    """
    for name in sorted(ps.keys() & worker.keys()):
        if ps[name] != worker[name]:
            flag = name.replace("_", "-")
            theirs = str(worker[name])[:200]  # a message's field: any size the wire let through
            return (f"this parameter server runs mode {mode!r} with {name}={ps[name]} but the worker's mode has "
                    f"{name}={theirs}: start the PS with --{flag} '{theirs}' or give the mode {name}={ps[name]}")
    return None


def mode_table() -> str:
    """The registered modes as a Markdown table (docs/modes.md's): name, class, knobs with defaults, summary."""
    rows = ["| mode | class | knobs (defaults) | what it does |", "|---|---|---|---|"]
    for name, cls in MODES.items():
        knobs = ", ".join(f"`{f.name}` ({_NONE_MEANS.get(f.name) if f.default is None else repr(f.default)})"
                          for f in fields(cls) if f.default is not MISSING and f.name not in cls.derived_knobs)
        rows.append(f"| `{name}` | `{cls.__name__}` | {knobs or 'none'} | {cls.summary} |")
    return "\n".join(rows) + "\n"


_NONE_MEANS = {"pull_every": "with each push", "replicas_to_aggregate": "every training worker",
               "push_every": "the number of workers"}
