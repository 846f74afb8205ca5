"""What the staleness remedies know of the user's optimizers, and what they do to their steps: whose steps are
normalized (no scale for them), which keep momentum and whether masking can find it, and a step scaled (hogwild's) or
taken in Nesterov's form (the momentum's own look-ahead).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

MOMENTUM_STATE_KEYS = ("momentum_buffer", "exp_avg")


# optimizers that divide their step by a running magnitude of the gradient: however stale the model, a step
# stays about ``lr`` per coordinate, so the scale is left out for them (it only slowed Adam: docs/momentum.md)
_NORMALIZED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
               torch.optim.SparseAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta)


def normalizes_steps(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s steps are normalized (Adam and its kin, RMSprop, Adagrad, or any with ``betas``).

    Args:
        optimizer: one of the LightningModule's optimizers.
    """
    return isinstance(optimizer, _NORMALIZED) or "betas" in optimizer.defaults


def keeps_momentum(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` may carry momentum: any group with ``momentum`` > 0, or one without the key at all
    (an optimizer of unknown kind is assumed to). Plain SGD (``momentum=0``) does not.

    Args:
        optimizer: one of the LightningModule's optimizers.
    """
    return any(group.get("momentum", 1.0) or group.get("nesterov") for group in optimizer.param_groups)


def momentum_state_known(optimizer: torch.optim.Optimizer) -> bool:
    """Whether masking can find ``optimizer``'s momentum: torch's own, or one configured with the usual names.

    Args:
        optimizer: one of the LightningModule's optimizers.
    """
    if type(optimizer).__module__.startswith("torch.optim"):
        return True
    return "momentum" in optimizer.defaults or "betas" in optimizer.defaults


@contextmanager
def scaled_step(optimizer: torch.optim.Optimizer, factor: float) -> Iterator[None]:
    """Every param group's ``lr`` times ``factor`` during the block: a step scaled without touching its state.

    Args:
        optimizer: the optimizer whose step the block takes; its learning rates are restored after it.
        factor: what the learning rates are multiplied by (1.0: left as they are).
    """
    if factor == 1.0:
        yield
        return
    saved = [group.get("lr") for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, saved, strict=True):
        if isinstance(lr, (int, float)):
            group["lr"] = lr * factor
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            if lr is not None:
                group["lr"] = lr


def warn_unknown_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Say which optimizers masking cannot reach: their sparse updates get the state-free remedies only.

    Args:
        optimizers: the LightningModule's optimizers; one warning for each that masking cannot reach.
    """
    for optimizer in optimizers:
        if not momentum_state_known(optimizer):
            warnings.warn(f"plug_asgd: {type(optimizer).__name__} keeps no momentum under the names plug_asgd knows "
                          f"({', '.join(MOMENTUM_STATE_KEYS)}): its sparse updates are scaled and looked ahead, but "
                          "its momentum is not masked where they were sent", stacklevel=2)


def nesterov_form_reaches(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s momentum, if any, is one :func:`nesterov_form` takes: torch's SGD (or a subclass)
    whose every group with momentum is heavy ball without dampening or Nesterov's already, or none to take (no
    momentum; steps normalized, as Adam's, which the form leaves as they are).

    Args:
        optimizer: one of the LightningModule's optimizers.
    """
    if isinstance(optimizer, torch.optim.SGD):
        return all(not g.get("momentum") or g.get("nesterov") or not g.get("dampening")
                   for g in optimizer.param_groups)
    return normalizes_steps(optimizer) or not keeps_momentum(optimizer)


def warn_no_nesterov_form(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """Say which optimizers keep a momentum that :func:`nesterov_form` cannot take: their steps go as they are.

    Args:
        optimizers: the LightningModule's optimizers; one warning for each that the form cannot take.
    """
    for optimizer in optimizers:
        if not nesterov_form_reaches(optimizer):
            what = ("dampens its momentum, which plug_asgd's Nesterov's form does not take"
                    if isinstance(optimizer, torch.optim.SGD) else
                    "may keep a momentum that plug_asgd takes in Nesterov's form only for torch.optim.SGD")
            warnings.warn(f"plug_asgd: {type(optimizer).__name__} {what}: its steps are taken as they are (scaled "
                          "where the mode scales), which with momentum at large learning rates may cost accuracy",
                          stacklevel=2)


def _heavy_ball_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The param groups of a torch SGD whose step is ``lr * momentum_buffer``: heavy ball, no dampening (with
    ``maximize`` too: its buffer gathers the negated gradients, and the step is the same)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return []
    return [g for g in optimizer.param_groups if g.get("momentum") and not g.get("nesterov") and not g.get("dampening")]


@contextmanager
def nesterov_form(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """The block's heavy-ball steps taken in Nesterov's form: each parameter moved by ``lr * mu`` times its
    momentum's change on top, which makes ``lr * (d + mu * buf)`` of the step ``lr * buf``. The look-ahead of
    the momentum itself: a stale gradient, as under asynchrony, then moves the model as Nesterov's would.

    Args:
        optimizer: the optimizer whose step the block takes; only torch SGD's heavy-ball groups change.
    """
    groups = _heavy_ball_groups(optimizer)
    if not groups:
        yield
        return
    before: list[tuple[Tensor, Tensor | None, float, float]] = []
    for group in groups:
        for p in group["params"]:
            buf = optimizer.state.get(p, {}).get("momentum_buffer")
            before.append((p, buf.clone() if isinstance(buf, Tensor) else None, group["lr"], group["momentum"]))
    yield
    with torch.no_grad():
        for p, old, lr, mu in before:
            buf = optimizer.state.get(p, {}).get("momentum_buffer")
            if not isinstance(buf, Tensor) or p.grad is None:
                continue
            if old is None:  # the step made the buffer: its change is all of it
                p.sub_(buf, alpha=lr * mu)
            else:  # the snapshot becomes -(the change), in place: no second copy of the buffers per step
                p.add_(old.sub_(buf), alpha=lr * mu)
