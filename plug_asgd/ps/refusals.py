"""What the PS refuses of a model or an update before any of it is kept: tensors that are not dense floats, NaN
and Inf."""

from __future__ import annotations

import numpy as np

from plug_asgd.modes import all_finite
from plug_asgd.protocol.wire import FLOAT_DTYPES, Sparse, Tensor, WireError


def check_model(tensors: dict[str, Tensor]) -> None:
    """Refuse an initial model the central model cannot be.

    Args:
        tensors: the model, by name.

    Raises:
        WireError: ``bad_tensor`` for no tensors or one not a dense float array; ``not_finite`` for NaN/Inf.
    """
    for name, t in tensors.items():
        if not isinstance(t, np.ndarray) or t.dtype.name not in FLOAT_DTYPES:
            raise WireError("bad_tensor", f"tensor {name!r}: the central model holds dense float tensors")
        if not all_finite(t):
            raise WireError("not_finite", f"tensor {name!r} holds NaN or Inf")
    if not tensors:
        raise WireError("bad_tensor", "init carries no tensors")


def check_finite(update: dict[str, Tensor]) -> None:
    """Refuse an update with NaN or Inf, before any of it is folded in.

    Args:
        update: the decoded update, by name.

    Raises:
        WireError: ``not_finite``, where a tensor holds NaN or Inf.
    """
    for name, t in update.items():
        if not all_finite(t.values if isinstance(t, Sparse) else t):
            raise WireError("not_finite", f"update refused: tensor {name!r} holds NaN or Inf (has the worker's "
                                          "training diverged? lower the learning rate)")
