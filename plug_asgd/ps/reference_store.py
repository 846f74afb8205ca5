"""The reference store: it copies every update, every model before a write, every reply, and never lends or reuses a
buffer. The plain meaning, against which ``tests/test_store.py`` checks :class:`~plug_asgd.ps.fast_store.FastStore`
bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from plug_asgd.protocol.wire import Tensor, encode
from plug_asgd.ps.store import Store
from plug_asgd.ps.store_records import PushIn


class ReferenceStore(Store):
    """The plain store: it copies every update, every model before a write, every reply; it never lends or
    reuses a buffer. Slower, and the definition of what :class:`FastStore` must compute."""

    def _place(self, push: PushIn, update: dict[str, Tensor], exact: bool,
               local_bytes: int) -> tuple[dict[str, Tensor], dict[str, np.ndarray] | None, bool]:
        own = {n: np.array(u) if isinstance(u, np.ndarray) else u for n, u in update.items()}
        if push.weights:  # taken as they are: copied into fresh arrays by the rule, and checked there
            return own, {n: np.empty_like(self.state.tensors[n]) for n in own}, False
        return own, None, False

    def _before_write(self, in_place: bool) -> None:
        if in_place:
            self.state.tensors = {n: t.copy() for n, t in self.state.tensors.items()}
            self.stats.copies_on_write += 1

    def _after_fold(self, push: PushIn, update: dict[str, Tensor], out: dict[str, np.ndarray] | None, lends: bool,
                    before: dict[str, np.ndarray]) -> None:
        pass

    def _encode_reply(self, fields: dict[str, Any], tensors: dict[str, Tensor],
                      fresh: frozenset[str] = frozenset()) -> list[Any]:
        return encode("model", fields, {n: t.copy() if isinstance(t, np.ndarray) else t for n, t in tensors.items()})
