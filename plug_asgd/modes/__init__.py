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
           "mode_table"]

ModeLike = str | Mode | Mapping[str, Any]


def get(mode: ModeLike) -> Mode:
    """The mode ``mode`` stands for: a name of :data:`MODES` (its defaults), a configured instance
    (itself), or a dict ``{"name": ..., **knobs}`` (as a YAML file gives it).

    Args:
        mode: a registered name (``"ssp"``), a configured :class:`Mode`, or a mapping of ``"name"`` and knobs.
    """
    return registry.get(mode, Mode, MODES, "mode")


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
