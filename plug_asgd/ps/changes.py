"""What changed in the central model since a version: so that a reply carries only what its worker lacks.

A worker that keeps the central model of the version it last received says so in its request
(``have: [model_id, version]``, :func:`parse_have`). Where every update folded in since touched
a few coordinates (AdaComp's, or any sparse codec's, in the modes whose rule changes nothing
else), the PS answers with those coordinates' current values only: the union of the touched
indices, not a sum of deltas, so the worker's copy becomes the central model bit for bit. A
tensor that a dense update touched, or whose touched coordinates cost more on the wire than
the tensor itself, goes whole; one that nothing touched is left out.

The log is bounded (``max_versions`` entries, ``max_indices`` recorded indices in all); a base
older than what it still holds gets the whole model, as does a base from another model
(``model_id`` changes with every init and resume: versions of two models share numbers, not
contents).
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable
from typing import Any

import numpy as np

from plug_asgd.protocol.wire import Sparse, Tensor, WireError, sparse_wire_bytes

MODEL_ID_CHARS = 32  # a uuid4's hex


def parse_have(value: Any, field: str = "have") -> tuple[str, int] | None:
    """A request's ``have`` (or ``held``) field: absent (None), or ``[model_id, version]`` (else refused).

    Args:
        value: the field as it came in the request, or None where the request has no such field.
        field: the field's name, for the error message.

    Raises:
        WireError: ``bad_field``, where the value is not a list of a model id of at most ``MODEL_ID_CHARS``
            characters and a version >= 0.
    """
    if value is None:
        return None
    if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and len(value[0]) <= MODEL_ID_CHARS
            and isinstance(value[1], int) and not isinstance(value[1], bool) and value[1] >= 0):
        return value[0], value[1]
    raise WireError("bad_field", f"field {field!r} must be [model id (at most {MODEL_ID_CHARS} characters), "
                                 f"version >= 0], got {value!r:.80}")


class ChangeLog:
    """The coordinates each recent version changed, per tensor (None: all of it).

    Args:
        max_versions: how many versions' changes it keeps at most; an older base gets the whole model.
        max_indices: how many recorded indices it keeps at most, all versions together (its memory bound).
    """

    def __init__(self, max_versions: int = 1024, max_indices: int = 4_000_000) -> None:
        self.max_versions = max_versions
        self.max_indices = max_indices
        self.model_id = ""
        self.since = 0  # the oldest version a delta can start from
        self.entries: deque[tuple[int, dict[str, np.ndarray | None]]] = deque()
        self.indices = 0  # recorded in entries, in all

    def reset(self, version: int) -> None:
        """A model the workers cannot hold yet (init, resume): deltas start from ``version`` of a new id.

        Args:
            version: the central version of the new model.
        """
        self.model_id = uuid.uuid4().hex
        self.everything(version)

    def everything(self, version: int) -> None:
        """Version ``version`` may have changed any coordinate (a dense update, a synchronous round).

        Args:
            version: the central version from which deltas start again.
        """
        self.since = version
        self.entries.clear()
        self.indices = 0

    def record(self, version: int, update: dict[str, Tensor]) -> None:
        """``version`` was made by folding ``update`` in, and nothing else (``FoldRule.changes_only_pushed``).

        Args:
            version: the central version the fold made.
            update: the update folded in, by tensor name; a sparse tensor's indices are what it touched.
        """
        if not self.model_id:
            return
        if not any(isinstance(u, Sparse) for u in update.values()):
            self.everything(version)  # a dense update of every tensor it names: the common case, kept cheap
            return
        self._append(version, {name: u.indices if isinstance(u, Sparse) else None for name, u in update.items()})

    def tensors(self, version: int, names: Iterable[str]) -> None:
        """``version`` changed the tensors ``names`` (any of their coordinates) and no other: a round of streaming
        DiLoCo's fragments (``FoldRule.changed``). A worker holding an earlier version is sent those whole.

        Args:
            version: the central version the change made.
            names: the tensors it changed.
        """
        if self.model_id:
            self._append(version, dict.fromkeys(names))

    def _append(self, version: int, touched: dict[str, np.ndarray | None]) -> None:
        """Log ``version``'s changes, dropping the oldest entries beyond the bounds."""
        self.entries.append((version, touched))
        self.indices += sum(t.size for t in touched.values() if t is not None)
        while self.entries and (len(self.entries) > self.max_versions or self.indices > self.max_indices):
            old, dropped = self.entries.popleft()
            self.indices -= sum(t.size for t in dropped.values() if t is not None)
            self.since = old

    def delta(self, have: tuple[str, int] | None, version: int,
              tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray | Sparse] | None:
        """What a worker holding ``have`` lacks of ``tensors`` (version ``version``); None: all of it.

        Args:
            have: the ``[model_id, version]`` the worker says it holds, or None where it holds none.
            version: the central version ``tensors`` are at.
            tensors: the central tensors, by name.
        """
        if have is None or have[0] != self.model_id or not self.since <= have[1] <= version:
            return None
        touched: dict[str, list[np.ndarray] | None] = {}
        for v, entry in self.entries:
            if v <= have[1]:
                continue
            for name, idx in entry.items():
                if idx is None:
                    touched[name] = None
                elif (seen := touched.setdefault(name, [])) is not None:
                    seen.append(idx)
        out: dict[str, np.ndarray | Sparse] = {}
        for name, parts in touched.items():
            central = tensors[name]
            if parts is not None:
                idx = parts[0] if len(parts) == 1 else _union(parts, central.size)
                if sparse_wire_bytes(central.size, idx.size, central.itemsize) < central.nbytes:
                    out[name] = Sparse(indices=idx, values=central.reshape(-1)[idx], shape=central.shape)
                    continue
            out[name] = central
        return out


def _union(parts: list[np.ndarray], size: int) -> np.ndarray:
    """The sorted union of index arrays of one tensor of ``size`` coordinates."""
    total = sum(p.size for p in parts)
    if total * 8 < size:  # few: merge them. Each part is sorted, so a stable sort (timsort) merges its runs in
        # linear time, where np.unique's sort does not
        merged = np.concatenate(parts)
        merged.sort(kind="stable")
        keep = np.empty(merged.size, dtype=bool)
        keep[:1] = True
        np.not_equal(merged[1:], merged[:-1], out=keep[1:])
        return merged[keep]
    mask = np.zeros(size, dtype=bool)
    for p in parts:
        mask[p] = True
    return np.flatnonzero(mask)
