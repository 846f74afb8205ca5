"""A module's tensors that the PS holds (:func:`synced_tensors`), and copying one tensor to or from a numpy array:
the CPU path of :mod:`plug_asgd.worker.staging` (which the exchanges use for the whole model), and what the
collectives and the callbacks use for their one-off tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor


def to_numpy(t: Tensor) -> np.ndarray:
    """``t``'s values as a numpy array on the CPU (bfloat16, which numpy lacks, as float32).

    Args:
        t: the tensor to read, on any device; it is detached, never changed.
    """
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.cpu().numpy()


def assign(target: Tensor, array: np.ndarray) -> None:
    """Copy ``array`` into ``target`` in place (parameters keep their identity for the optimizer).

    Args:
        target: the parameter or buffer to overwrite, on any device.
        array: its new values, of ``target``'s number of elements (reshaped to ``target``'s shape).
    """
    with torch.no_grad():
        if target.device.type == "cpu" and target.dtype != torch.bfloat16:
            target.detach().numpy()[...] = array.reshape(target.shape)
        else:
            target.copy_(torch.tensor(array).reshape(target.shape))


def synced_tensors(module: Any) -> dict[str, Tensor]:
    """``module``'s floating-point parameters and buffers (BatchNorm statistics): what the PS holds.

    Args:
        module: the ``torch.nn.Module`` being trained (the LightningModule).
    """
    assert module is not None
    tensors = {n: p for n, p in module.named_parameters() if p.is_floating_point()}
    tensors.update((n, b) for n, b in module.named_buffers() if b.is_floating_point())
    return tensors
