"""Copying central arrays into a module's tensors, shared by the strategy, the callbacks and checkpoints."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def assign(target: Tensor, array: np.ndarray) -> None:
    """Copy ``array`` into ``target`` in place (parameters keep their identity for the optimizer)."""
    with torch.no_grad():
        if target.device.type == "cpu" and target.dtype != torch.bfloat16:
            target.detach().numpy()[...] = array.reshape(target.shape)
        else:
            target.copy_(torch.tensor(array).reshape(target.shape))
