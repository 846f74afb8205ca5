"""What the PS refuses before any of it is kept: a hello of another mode, or of this mode with other knobs than the
PS folds with; of a model or an update, tensors that are not dense floats, NaN and Inf."""

from __future__ import annotations

from typing import Any

import numpy as np

from plug_asgd.modes import all_finite, options_differ
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


def check_mode(mode: str, knobs: dict[str, Any], asked: str, options: Any) -> None:
    """Refuse a hello whose worker trains another mode, or this mode with other knobs than this PS folds with.

    Args:
        mode: this PS's mode.
        knobs: the knobs it folds with (:func:`plug_asgd.modes.server_knobs`).
        asked: the mode the worker's hello names.
        options: the knobs its hello carries (None: an earlier client's, not checked).

    Raises:
        WireError: ``mode_mismatch`` or ``options_mismatch``, saying which flag to give.
    """
    if asked != mode:
        raise WireError("mode_mismatch", f"this parameter server runs mode {mode!r} but the worker asked for "
                                         f"{asked!r}: start the PS with --mode {asked} or give the strategy "
                                         f"mode={mode!r}")
    differ = options_differ(mode, knobs, options) if isinstance(options, dict) else None
    if differ is not None:
        raise WireError("options_mismatch", differ)
