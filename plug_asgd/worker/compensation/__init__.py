"""Staleness compensation: what an asynchronous worker does so that staleness does not act as momentum.

With N workers pushing asynchronously, each update lands on a central model that moved by the others'
updates since the worker's base, which acts as extra momentum (Mitliagkas et al. 2016) on top of the
optimizer's own; with momentum SGD the sum diverges. The remedies (:class:`StalenessCompensation`'s fields:
the scale, corrected at the PS; the look-ahead; the residual kept in the model; momentum masking; Nesterov's
form; hogwild's scaled step; losp's own share of a round), where each acts and why, and what they were
chosen by: docs/momentum.md, "What the library does".

The package's parts: :mod:`~plug_asgd.worker.compensation.remedies` (:class:`StalenessCompensation`, which
remedies, and :func:`resolve`, a mode's), :mod:`~plug_asgd.worker.compensation.compensator` (:class:`Compensator`,
a worker's estimate, look-ahead and masking) and :mod:`~plug_asgd.worker.compensation.optimizers` (what the
remedies know of the optimizers, and their steps scaled or in Nesterov's form).
"""

from plug_asgd.worker.compensation.compensator import Compensator
from plug_asgd.worker.compensation.optimizers import (
    MOMENTUM_STATE_KEYS,
    keeps_momentum,
    momentum_state_known,
    nesterov_form,
    nesterov_form_reaches,
    normalizes_steps,
    scaled_step,
    warn_no_nesterov_form,
    warn_unknown_optimizers,
)
from plug_asgd.worker.compensation.remedies import OFF, StalenessCompensation, resolve

__all__ = ["MOMENTUM_STATE_KEYS", "OFF", "Compensator", "StalenessCompensation", "keeps_momentum",
           "momentum_state_known", "nesterov_form", "nesterov_form_reaches", "normalizes_steps", "resolve",
           "scaled_step", "warn_no_nesterov_form", "warn_unknown_optimizers"]
