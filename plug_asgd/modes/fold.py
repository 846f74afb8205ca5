"""Folding a push into the central tensors: what the fold rules share (the central state, a push, the fold
itself in place or out of place, split over threads, with its check for NaN and Inf)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from plug_asgd.compressors import native
from plug_asgd.compressors.decoding import Undecoded
from plug_asgd.modes.slices import SlicePool
from plug_asgd.protocol.wire import Sparse, Tensor, WireError

APPLIED = "applied"
DROPPED = "dropped"


@dataclass
class CentralState:
    """The central model: named float tensors and the number of updates folded in so far.

    Attributes:
        tensors: the central tensors by name, written by the fold rules (in place, or replaced by ``Push.out``).
        version: the updates folded in so far; a push is based on one of them.
        pool: the threads a large tensor's fold is split over; None: folds run in the calling thread.
    """

    tensors: dict[str, np.ndarray]
    version: int = 0
    pool: SlicePool | None = field(default=None, repr=False, compare=False)  # threads for large folds


@dataclass
class Push:
    """One worker update, based on central version ``base_version``. ``token`` is opaque to rules.

    Attributes:
        token: what the PS answers the push by; a rule hands it back in its resolutions.
        rank: the pushing worker's global rank.
        base_version: the central version the worker's update is based on.
        update: the decoded tensors by name (dense arrays or Sparse), deltas unless ``replace``.
        out: where a folding rule writes each new central tensor, out of place; None: into the central tensors.
        replace: whether ``update`` holds weights to take as they are, not a delta.
        scale: what the PS multiplies the push by besides its rule's own scaling (1: nothing).
        scaled_by_worker: whether the worker scaled the update for its staleness itself.
        session: the pushing worker's session, by which a push sent again finds the one a rule still holds.
    """

    token: Any
    rank: int
    base_version: int
    update: dict[str, Tensor]
    # Where a rule that folds (``FoldRule.folds_into_update``) writes each new central tensor, out
    # of place: buffers nothing else holds (the push's own received buffers, or spare buffers of
    # the PS), which become the central tensors; for weights (``replace``), ``update`` itself, even
    # read-only (a worker's lent memory): checked, never written. None: the rule folds into the
    # central tensors.
    out: dict[str, np.ndarray] | None = None
    # ``update`` holds a worker's weights, not a delta, and the push is based on the current version:
    # folding means taking them as they are (``w - base`` added to ``base``, without its rounding).
    # Only with ``out`` and a scale of 1; the PS sends no other such push to a rule.
    replace: bool = False
    # What the PS multiplies this push by besides its rule's own scaling: ``(1 + e) / (1 + max(e, staleness))``
    # where the worker scaled its update for an estimated staleness ``e`` (``scaled_for``, ``FoldRule.corrects``),
    # so that an update staler than estimated lands scaled for its own staleness; 1 otherwise.
    scale: float = 1.0
    # The worker scaled the update for its staleness (it said ``scaled_for``): ``scale`` finishes that, and a rule
    # that scales by staleness itself (dynsgd's) scales it no further.
    scaled_by_worker: bool = False
    session: str | None = None


Resolution = tuple[Any, str]  # (token, APPLIED | DROPPED)


def _add_into(target: np.ndarray, update: Tensor, scale: float | np.ndarray = 1.0) -> None:
    """``target += scale * update`` in place, for a dense or a sparse update."""
    if isinstance(update, Sparse):
        values = (update.values * scale).astype(target.dtype, copy=False)
        if not native.scatter_add(target, update.indices, values):  # one C loop where it can, the same additions
            flat = target.reshape(-1)
            flat[update.indices] += values
    elif np.isscalar(scale) and scale == 1.0:
        target += update
    else:
        target += update * scale


def can_fold_into(update: Tensor, target: np.ndarray) -> bool:
    """Whether ``update`` can take the fold of ``target``: a writable dense array of its dtype and shape.

    Args:
        update: a push's tensor, as decoded.
        target: the central tensor it is folded into.
    """
    return (isinstance(update, np.ndarray) and update.dtype == target.dtype and update.shape == target.shape
            and update.flags.writeable)


def all_finite(array: np.ndarray) -> bool:
    """No NaN or Inf in ``array``, in one pass that allocates nothing, where the data allows.

    ``x . x`` is a sum of non-negative squares: NaN or Inf anywhere makes it NaN or Inf, and no
    cancellation can hide one. It is finite, so every value is, unless a square or the sum
    overflows (values beyond about 1e19); the exact elementwise test then decides.

    Args:
        array: the values checked, of any shape and float dtype.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return _finite(array.reshape(-1))


def _finite(flat: np.ndarray) -> bool:
    """:func:`all_finite` of a 1-d array, for callers that silenced numpy's overflow warnings already."""
    if flat.dtype in _DOT_DTYPES and flat.size and np.isfinite(np.dot(flat, flat)):
        return True
    return bool(np.isfinite(flat).all())


_DOT_DTYPES = (np.float32, np.float64)


def _quiet(fold: Callable[[slice], bool]) -> Callable[[slice], bool]:
    """``fold`` with overflow warnings off in whatever thread runs it (numpy's error state is per thread)."""
    def run(part: slice) -> bool:
        with np.errstate(over="ignore"):
            return fold(part)
    return run


def _fold_all(state: CentralState, push: Push, scale: float = 1.0) -> None:
    """``central += scale * update`` for each tensor of ``push``: in place, or into ``push.out``.

    Folding out of place (``push.out``) makes each new central tensor another array: the old
    one is never written, so a reply still being sent from it needs no copy, and when the
    buffers are the push's own the PS can answer with the very frames the update came in. IEEE
    addition commutes, so both ways give the same bits. The PS does not check such an update for
    NaN/Inf beforehand: the results are checked here instead, while still in cache, and none is
    kept unless all are finite (a finite central tensor plus a finite update is finite unless the
    sum overflows, which is refused as well). Checking what is kept, not what was sent, also
    holds for an update read from a worker's shared memory, which its worker could still write.
    A push of weights (``push.replace``) is copied into ``push.out`` and checked the same way, or,
    where ``push.out`` is the update itself (weights a worker lends, see ``PSClient.push``), only
    checked: nothing is written.
    """
    scale = scale * push.scale
    if push.replace and (push.out is None or scale != 1.0):
        raise ValueError("a push of weights is taken as it is, out of place and unscaled")
    if push.out is None:
        for name, update in push.update.items():
            _add_into(state.tensors[name], update, scale)
        return
    with np.errstate(over="ignore"):  # an overflow is refused below; pool threads quiet it themselves
        _fold_out_of_place(state, push, scale)
    state.tensors.update(push.out)


def _fold_out_of_place(state: CentralState, push: Push, scale: float) -> None:
    """Called with numpy's overflow warnings off (``_fold_all``); pool threads turn them off themselves."""
    assert push.out is not None
    pool = state.pool
    for name, update in push.update.items():
        out, central = push.out[name], state.tensors[name]
        if isinstance(update, Undecoded):  # a packed tensor folded in its codec's pass, or else decoded here
            split = pool is not None and central.size >= pool.min_split  # (the pass is one thread's)
            finite = None if split or push.replace else update.fold(central, out, scale)
            if finite is not None:
                _refuse_unless(finite, name)
                continue
            update = update.decoded()
        copy = out is not update
        # weights taken where they are (lent, possibly read-only) are checked, and nothing is written
        fits = can_fold_into(out, central) if copy or not push.replace else out.dtype == central.dtype
        if not (isinstance(update, np.ndarray) and update.shape == central.shape and fits):
            raise ValueError(f"tensor {name!r} cannot be folded out of place")
        if push.replace and update.dtype != central.dtype:
            raise ValueError(f"tensor {name!r}: weights of another dtype than the central tensor's")
        u, c, o = update.reshape(-1), central.reshape(-1), out.reshape(-1)

        def fold(part: slice | None, u: np.ndarray = u, c: np.ndarray = c, o: np.ndarray = o,
                 copy: bool = copy) -> bool:
            """The fold of ``part`` (None: the whole tensor, without slicing: small tensors are mostly Python)."""
            if part is not None:
                u, c, o = u[part], c[part], o[part]
            if push.replace:
                if copy:
                    np.copyto(o, u)
            elif (checked := native.add_finite(u, c, o, scale)) is not None:  # both in one pass where it can
                return checked
            elif scale != 1.0:
                np.multiply(u, scale, out=o)
                np.add(o, c, out=o)
            else:
                np.add(u, c, out=o)
            return _finite(o)

        finite = all(pool.map(_quiet(fold), u.size)) if pool is not None and u.size >= pool.min_split else fold(None)
        _refuse_unless(finite, name)


def _refuse_unless(finite: bool, name: str) -> None:
    """Refuse the push (nothing kept) where tensor ``name``'s fold wrote a value that is not finite."""
    if not finite:
        raise WireError("not_finite", f"update refused: tensor {name!r} holds NaN or Inf, or would overflow "
                                      "the central tensor (has the worker's training diverged? lower the "
                                      "learning rate)")
