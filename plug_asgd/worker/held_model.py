"""The central model a worker's client holds, brought up to date with only what changed (delta replies)."""

from __future__ import annotations

from typing import Any

import numpy as np

from plug_asgd.compressors import native
from plug_asgd.compressors.reply_codecs import decode_difference
from plug_asgd.protocol.wire import Packed, Sparse, Tensor
from plug_asgd.worker.errors import PSError


class HeldModel:
    """The last central model a client received, which the PS may bring up to date with only what changed.

    A worker that trains with a sparse codec (AdaComp, top-k, random-k) changes a few coordinates per
    push; once the PS knows the worker holds version ``v`` of its model (``have``), it answers with the
    current values of the coordinates changed since, or with the tensors that changed whole
    (``plug_asgd.ps.changes``). The patched arrays are the central model of the reply's version, bit for
    bit. An array a reply returned is never written afterwards (a change goes into a copy), so a caller
    may keep it, as the staleness compensation keeps the last central model; nor is one :meth:`lend` gave
    out, by a reply. The rest are written in place: a worker whose pushes are answered "own" (:meth:`add`)
    copies nothing per push.
    """

    def __init__(self) -> None:
        self.model_id: str | None = None
        self.version = -1
        self.tensors: dict[str, np.ndarray] = {}
        self.exact = True  # the central model of ``version``, not a copy near it (approximate replies)
        self._returned: set[str] = set()  # arrays a reply returned: never written again
        self._lent: set[str] = set()  # arrays lend() gave out: written by add() only

    @property
    def have(self) -> tuple[str, int] | None:
        """``(model_id, version)`` of the model held, which a request tells the PS; None: none held yet."""
        return (self.model_id, self.version) if self.model_id is not None else None

    def keep(self, model_id: Any, version: int, tensors: dict[str, np.ndarray], exact: bool = True) -> None:
        """A whole model arrived (the received arrays are kept as they are: no copy).

        Args:
            model_id: the PS's name for its model, sent with the reply; anything but a non-empty string (a PS
                that does not send deltas) drops what is held, so that no request asks for a delta.
            version: the central version of ``tensors``.
            tensors: the central model, by name; never written afterwards (a change goes into a copy).
            exact: whether ``tensors`` are the central model of ``version``; False: a copy the PS keeps of this
                client's (its downlink's), such as a model ahead.
        """
        self.exact = exact
        self._returned, self._lent = set(tensors), set()
        if isinstance(model_id, str) and model_id:
            self.model_id, self.version, self.tensors = model_id, version, dict(tensors)
        else:  # a PS that does not send deltas
            self.model_id, self.version, self.tensors = None, -1, {}

    def patch(self, delta: dict[str, Tensor], version: int, exact: bool = True,
              add: bool = False) -> dict[str, np.ndarray]:
        """Apply what changed (sparse: current values at the changed coordinates; dense: whole tensors, or with
        ``add`` differences to add); not ``exact``: only the largest differences were sent, or coded differences.
        Returns the model as read-only views.

        Args:
            delta: what changed since the version held, by tensor name; tensors not named are unchanged.
            version: the central version the patched model is (or, not ``exact``, is near).
            exact: whether the patched model is the central model of ``version`` bit for bit.
            add: whether each tensor is a difference to add, dense or coded, decoded and added as the PS adds it
                to its copy (``plug_asgd.compressors.reply_codecs``): the two copies stay equal, bit for bit.

        Raises:
            PSError: ``bad_reply``, where ``delta`` names a tensor not held or of another shape, or a difference
                this client cannot read (a coded one to set); what is held is dropped first, so that the next
                request asks for the whole model.
        """
        added: dict[str, np.ndarray] = {}
        for name, part in delta.items():
            held = self.tensors.get(name)
            fits = held is not None and tuple(part.shape) == held.shape
            problem = None if fits else "which this client does not hold"
            if fits and not add and isinstance(part, Packed):
                problem = "coded, which comes only as a difference to add"
            elif fits and add:
                try:
                    added[name] = decode_difference(part, held.dtype)  # type: ignore[union-attr]
                except ValueError as exc:
                    problem = f"which this client cannot read ({exc})"
            if problem is not None:
                self.keep(None, -1, {})  # all or nothing: the next request asks for the whole model
                raise PSError("bad_reply", f"the parameter server sent a change of tensor {name!r} of shape "
                                           f"{tuple(part.shape)}, {problem}")
        for name, part in delta.items():
            if add:
                self.tensors[name] = np.add(self.tensors[name], added[name])
            elif isinstance(part, Sparse):
                self._writable(name, self._returned | self._lent).reshape(-1)[part.indices] = part.values
            else:
                self.tensors[name] = np.asarray(part)
        self.version, self.exact = version, exact
        self._returned, self._lent = set(self.tensors), set()
        out = {}
        for name, array in self.tensors.items():
            view = array.view()
            view.flags.writeable = False
            out[name] = view
        return out

    def lend(self) -> dict[str, np.ndarray]:
        """The arrays as they are now, for a worker to read while its push is answered: a reply writes copies
        from now on, so these stay the model of this version unless the worker itself :meth:`add` s to them."""
        self._lent = set(self.tensors)
        return dict(self.tensors)

    def add(self, update: dict[str, np.ndarray | Sparse], version: int) -> None:
        """The PS answered "own": its model is this one plus ``update``, decoded as it decoded it
        (:func:`plug_asgd.compressors.decode`), added with the same float operations: the same bits. In place
        (lent arrays too), but into copies of arrays a reply returned.

        Args:
            update: this worker's pushed update as the PS decoded it, by tensor name (sparse or dense).
            version: the central version after the PS applied it.
        """
        for name, part in update.items():
            held = self._writable(name, self._returned)
            if isinstance(part, Sparse):
                if not native.scatter_add(held, part.indices, part.values):  # as the PS folds it (modes/fold.py)
                    held.reshape(-1)[part.indices] += part.values
            else:
                np.add(held, part, out=held)
        self.version = version

    def adopt(self, made: dict[str, np.ndarray], version: int) -> None:
        """The PS answered "own", and ``made`` holds its model, each array the held one plus the update as
        :meth:`add` would add it (made beforehand, as a worker's guess of the reply makes it): kept as they are,
        in place of the arrays held, which are not written.

        Args:
            made: the new central arrays by tensor name, of the held arrays' shapes; tensors not named are unchanged.
            version: the central version after the PS applied the update.

        Raises:
            ValueError: where ``made`` names a tensor not held, or gives one of another shape or dtype.
        """
        for name, array in made.items():
            held = self.tensors.get(name)
            if held is None or array.shape != held.shape or array.dtype != held.dtype:
                raise ValueError(f"tensor {name!r}: made {array.dtype}{list(array.shape)} for "
                                 f"{'nothing held' if held is None else f'{held.dtype}{list(held.shape)}'}")
        for name, array in made.items():
            self.tensors[name] = array
            self._returned.discard(name)
            self._lent.discard(name)
        self.version = version

    def _writable(self, name: str, kept: set[str]) -> np.ndarray:
        """``name``'s array to write, copied first where it is among ``kept`` (or a read-only received frame)."""
        array = self.tensors[name]
        if name in kept or not array.flags.writeable:
            array = self.tensors[name] = np.array(array, copy=True)
            self._returned.discard(name)
            self._lent.discard(name)
        return array
