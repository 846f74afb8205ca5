"""A worker's compensation state (:class:`Compensator`): its staleness estimate and the scale of its next update,
the central model of a reply put ahead along the central model's last move (with the codec's residual kept in the
model), and the optimizers' momentum masked where a sparse update was sent.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch
from torch import Tensor

from plug_asgd.worker.compensation.optimizers import MOMENTUM_STATE_KEYS
from plug_asgd.worker.compensation.remedies import StalenessCompensation
from plug_asgd.worker.staging import Staging

NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)  # momentum masked through numpy on the CPU


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
                    if buf.device.type == "cpu" and buf.dtype in NUMPY_FLOATS and buf.is_contiguous():
                        # numpy's assignment: no torch op, so none of torch's threads, from whichever thread masks
                        buf.detach().numpy().reshape(-1)[indices] = 0
                    else:
                        if index is None:
                            index = torch.from_numpy(indices).to(buf.device)
                        buf.view(-1)[index] = 0
                    self.masked += int(indices.size)


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
