"""Staleness compensation: what an asynchronous worker does so that staleness does not act as momentum.

With N workers pushing asynchronously, each update lands on a central model that moved by the others'
updates since the worker's base, which acts as extra momentum (Mitliagkas et al. 2016) on top of the
optimizer's own; with momentum SGD the sum diverges. The remedies (:class:`StalenessCompensation`'s fields:
the scale, corrected at the PS; the look-ahead; the residual kept in the model; momentum masking; Nesterov's
form; hogwild's scaled step; losp's own share of a round), where each acts and why, and what they were
chosen by: docs/momentum.md, "What the library does".
"""

from __future__ import annotations

import statistics
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from plug_asgd.worker.staging import Staging

MOMENTUM_STATE_KEYS = ("momentum_buffer", "exp_avg")


@dataclass(frozen=True)
class StalenessCompensation:
    """Which remedies an asynchronous worker applies; ``window`` pushes make its staleness estimate.

    ``AsyncPSStrategy(staleness_compensation=False)`` turns all off (the seeds' plain fold).

    Args:
        scale: each update is pushed scaled by ``1 / (1 + s)``, ``s`` the worker's staleness estimate (left out
            for optimizers whose steps are normalized, as Adam's).
        lookahead: the model a reply brings is put ``s`` versions ahead, along the central model's last move.
        local_residual: what a sparse codec has not sent yet stays in the worker's model, not only in the codec.
        mask_momentum: the optimizer's momentum is zeroed at the coordinates a sparse update just sent.
        window: how many of the worker's last applied pushes its staleness estimate (their median) is made of.
        correct: the PS rescales a push for its own staleness where that is larger than the estimate, where an
            optimizer keeps momentum.
        nesterov: heavy-ball momentum SGD steps are taken in Nesterov's form while the updates are stale.

    Raises:
        ValueError: where ``window`` is not an int of at least 1.

    Example:
        >>> from plug_asgd import AsyncPSStrategy, StalenessCompensation
        >>> compensation = StalenessCompensation(mask_momentum=False, window=8)
        >>> strategy = AsyncPSStrategy("asgd", staleness_compensation=compensation)  # connects to nothing yet
        >>> strategy.staleness_compensation == compensation
        True
        >>> StalenessCompensation(window=0)
        Traceback (most recent call last):
        ...
        ValueError: window must be an int >= 1, got 0

        The strategy then goes to a Trainer as usual: ``Trainer(strategy=strategy)``.
    """

    scale: bool = True
    lookahead: bool = True
    local_residual: bool = True
    mask_momentum: bool = True
    window: int = 16
    # the PS rescales each push for its own staleness where that is larger than the estimate (``scaled_for``);
    # only where an optimizer keeps momentum: without it a push staler than estimated is no risk, and the
    # correction only slowed training (docs/momentum.md)
    correct: bool = True
    # heavy-ball momentum SGD steps taken in Nesterov's form while the worker's updates are stale: the momentum's
    # own look-ahead, the dynamics of SGD(nesterov=True); beside the look-ahead only where the worker scales its
    # updates too (docs/momentum.md)
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")

    @property
    def active(self) -> bool:
        """Whether any remedy is on (``window`` and ``correct`` alone do nothing)."""
        return self.scale or self.lookahead or self.local_residual or self.mask_momentum or self.nesterov


OFF = StalenessCompensation(scale=False, lookahead=False, local_residual=False, mask_momentum=False, nesterov=False)


def resolve(value: StalenessCompensation | Mapping[str, Any] | bool | None, mode: str,
            kind: str) -> StalenessCompensation:
    """The compensation for ``mode``, by its ``Mode.compensate`` (``kind``: full, unscaled, step, round or none).

    None or True: the mode's default; False: off; an instance (or the dict of its fields, as a YAML
    file gives it): as given, refused for a mode that has no staleness to compensate.

    Args:
        value: what the strategy was given as ``staleness_compensation``.
        mode: the mode's name, for the error messages.
        kind: the mode's ``Mode.compensate``: which remedies its workers can apply.

    Raises:
        ValueError: where a dict holds a field the class lacks, or the remedies asked for do not go with the
            mode (a shared model takes only a scaled step in Nesterov's form; synchronous rounds only a scale;
            a mode without stale updates none).
        TypeError: where ``value`` is none of the accepted kinds.
    """
    if value is False:
        return OFF
    if isinstance(value, Mapping):
        try:
            value = StalenessCompensation(**value)
        except TypeError as exc:
            raise ValueError(f"staleness_compensation: {exc} (fields: scale, lookahead, local_residual, "
                             "mask_momentum, window, correct, nesterov)") from None
    if isinstance(value, StalenessCompensation):
        if kind == "step" and (value.lookahead or value.local_residual or value.mask_momentum):
            raise ValueError(f"mode={mode!r} shares one model and pushes nothing: only its step can be scaled and "
                             "taken in Nesterov's form (StalenessCompensation(scale=True, lookahead=False, "
                             "local_residual=False, mask_momentum=False, nesterov=True))")
        if kind == "round" and value.active and value != replace(OFF, scale=True, window=value.window,
                                                                 correct=value.correct):
            raise ValueError(f"mode={mode!r} averages synchronous rounds, each landing a round late: only its rounds "
                             "can be scaled (StalenessCompensation(scale=True, lookahead=False, local_residual=False, "
                             "mask_momentum=False, nesterov=False))")
        if kind == "none" and value.active:
            raise ValueError(f"staleness_compensation does not go with mode={mode!r}: its workers do not fold "
                             "stale updates into the central model (use staleness_compensation=False or leave it)")
        if kind == "round":  # a round's average is one version: nothing for the PS to correct
            return replace(value, correct=False)
        return value if kind in ("full", "step") else replace(value, scale=False)
    if value is None or value is True:
        if kind == "none":
            return OFF
        if kind == "step":
            return replace(OFF, scale=True, nesterov=True)
        if kind == "round":
            return replace(OFF, scale=True, correct=False)
        return StalenessCompensation(scale=kind == "full")
    raise TypeError(f"staleness_compensation must be a bool, None, a StalenessCompensation or a dict of its "
                    f"fields, got {value!r}")


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


class Compensator:
    """A worker's compensation state: its staleness estimate and the central model of its last reply.

    Args:
        config: the remedies to apply, as :func:`resolve` gave them.
        prior_staleness: the staleness assumed until a push has been applied (the number of other workers).
        scale: whether updates are scaled; None: as ``config`` says (False for one-step pushes of normalized
            steps).
    """

    def __init__(self, config: StalenessCompensation, prior_staleness: float, scale: bool | None = None) -> None:
        self.config = config
        self.scale = config.scale if scale is None else scale  # False for one-step pushes of normalized steps
        self.prior = float(prior_staleness)
        self.recent: deque[int] = deque(maxlen=config.window)
        self._previous: dict[str, np.ndarray] = {}  # the central arrays of the last reply
        self._previous_version: int | None = None
        self.masked = 0  # momentum coordinates zeroed so far

    @property
    def staleness(self) -> float:
        """Median staleness of this worker's last ``window`` applied pushes (the prior before any).

        The median, not the mean: a lone worker raced once, or a worker stalled once, keeps its
        typical staleness (and a lone worker its unscaled, exact pushes).
        """
        return float(statistics.median(self.recent)) if self.recent else self.prior

    def observe(self, staleness: int) -> None:
        """Count the staleness one of this worker's pushes was applied with into the estimate.

        Args:
            staleness: the central versions the push's base was behind when the PS applied it.
        """
        self.recent.append(int(staleness))

    def update_scale(self) -> float:
        """The factor the next update is pushed with."""
        return 1.0 / (1.0 + self.staleness) if self.scale else 1.0

    def forget(self) -> None:
        """A new stage (or a model loaded from elsewhere): no velocity to extrapolate from."""
        self._previous.clear()
        self._previous_version = None

    def load(self, tensors: Mapping[str, Tensor], central: Mapping[str, np.ndarray], version: int,
             lookahead: bool = True, pending: Callable[[str], np.ndarray | None] | None = None,
             staging: Staging | None = None) -> bool:
        """Put ``central`` (version ``version``) into ``tensors``, ``staleness`` versions ahead where
        ``lookahead``, plus ``pending(name)``, the codec's residual, where the config keeps it local.

        A float32 CPU tensor is written in place; the others (a GPU's) are computed on the host and
        put in one batch through ``staging`` (the exchange's, whose pinned buffers are kept).
        Returns True where the model put is the central one itself.

        Args:
            tensors: the worker's parameters and buffers, by name, to overwrite.
            central: the central model of the reply, by the same names; kept (not copied) for the next look-ahead.
            version: the central version of ``central``.
            lookahead: whether this load may look ahead (where the config does too).
            pending: the codec's residual of a tensor not yet sent (None: none), added where the config keeps it
                local.
            staging: the exchange's staging, whose pinned buffers take what is not written in place (None: a
                new one).
        """
        previous, since = self._previous, self._previous_version
        ahead = self.staleness if self.config.lookahead and lookahead else 0.0
        step = ahead / (version - since) if since is not None and version > since and ahead > 0 else 0.0
        exact = step == 0.0
        values: dict[str, np.ndarray] = {}  # what the tensors not written in place get
        with torch.no_grad():
            for name, t in tensors.items():
                c = np.asarray(central[name]).reshape(t.shape)
                prev = previous.get(name)
                if not (step and prev is not None and prev.shape == c.shape):
                    prev = None
                residual = pending(name) if pending is not None and self.config.local_residual else None
                if residual is not None:
                    exact = False
                value = _put(t, c, prev, step, residual)
                if value is not None:
                    values[name] = value
                if self.config.lookahead:
                    previous[name] = c  # the reply's own array: it is never written, so no copy is needed
        if values:
            (staging or Staging()).load({n: tensors[n] for n in values}, values)
        self._previous_version = version if self.config.lookahead else None
        return exact

    def mask(self, optimizers: Iterable[torch.optim.Optimizer], param: Tensor, indices: np.ndarray) -> None:
        """Zero ``param``'s momentum in every optimizer at the flat ``indices`` just sent.

        Args:
            optimizers: the LightningModule's optimizers; those that hold no state for ``param`` are skipped.
            param: the parameter whose update was sent.
            indices: the flat indices of the coordinates sent.
        """
        if not self.config.mask_momentum or indices.size == 0:
            return
        index = None
        for optimizer in optimizers:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key in MOMENTUM_STATE_KEYS:
                buf = state.get(key)
                if isinstance(buf, Tensor) and buf.shape == param.shape:
                    if index is None:
                        index = torch.from_numpy(indices).to(buf.device)
                    buf.view(-1)[index] = 0
                    self.masked += int(index.numel())


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


def _put(t: Tensor, c: np.ndarray, prev: np.ndarray | None, step: float,
         residual: np.ndarray | None) -> np.ndarray | None:
    """``c + step * (c - prev) + residual`` (terms left out where None): written into ``t`` in at most 4
    passes, no allocation, for a float32 CPU tensor (None returned); else returned as float32 values for
    the caller to put into ``t``, all tensors in one batch."""
    if t.device.type == "cpu" and t.dtype == torch.float32:
        out = t.detach().numpy()
        if prev is None:
            np.copyto(out, c, casting="same_kind")
        else:
            np.subtract(c, prev, out=out)
            out *= np.float32(step)
            out += c
        if residual is not None:
            out += np.asarray(residual).reshape(out.shape)
        return None
    value = np.array(c, dtype=np.float32)  # a writable copy: reply buffers are read-only
    if prev is not None:
        value += (value - np.asarray(prev, dtype=np.float32)) * np.float32(step)
    if residual is not None:
        value += np.asarray(residual, dtype=np.float32).reshape(value.shape)
    return value


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
