"""The store the PS runs: the reference's bits, without the copies that measurably cost.

Four ways of not copying (what each saved: ``docs/design.md``, "The parameter server", and
``bench/results/NOTES.md``):

- a dense push is folded into its own received buffers, and replies resend those very frames;
- the model goes out zero-copy from the store's own arrays; a write while such a reply may still
  be read copies first (copy-on-write, the frames tracked; pyzmq copies small frames anyway);
- a push read from a worker's shared memory is folded into spare arrays of the store's own, the
  replaced ones becoming the next spares;
- a lone worker's weights in its shared memory are kept as the model where they lie (lent) until
  that worker is next answered.

``tests/test_store.py`` holds it to :class:`~plug_asgd.ps.reference_store.ReferenceStore`'s bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zmq
from typing_extensions import override

from plug_asgd.compressors.decoding import Undecoded
from plug_asgd.modes import can_fold_into
from plug_asgd.protocol.wire import Local, Sparse, Tensor, encode
from plug_asgd.ps.config import PSConfig
from plug_asgd.ps.stats import Stats
from plug_asgd.ps.store import Store
from plug_asgd.ps.store_records import PushIn


class FastStore(Store):
    """Lends, reuses received frames and spare arrays, and copies on write only while a reply may read; folds a
    packed push into spare arrays without writing its decoding (:class:`Undecoded`).

    Args:
        config: the server's options (as :class:`~plug_asgd.ps.store.Store` reads them).
        stats: the counters it adds to; None: counters of its own.
        copy_threshold: the socket's; pyzmq copies smaller frames itself, so those are not tracked.
    """

    folds_packed = True

    def __init__(self, config: PSConfig, stats: Stats | None = None, copy_threshold: int = zmq.COPY_THRESHOLD) -> None:
        super().__init__(config, stats)
        self.copy_threshold = copy_threshold
        self._in_flight: list[zmq.MessageTracker] = []  # replies sent zero-copy from the store's arrays
        self._frames: dict[str, tuple[np.ndarray, Any]] = {}  # central tensors that are a push's received frame
        self._spares: dict[str, np.ndarray] = {}  # arrays no reply holds, which the next fold may write into
        self._lent: dict[str, np.ndarray] = {}  # a worker's weights kept as the model in its own memory
        self._lender: str | None = None  # ... its session
        self._lent_at = -1  # ... the request that lent them

    def resent_frames(self) -> dict[str, Any]:
        """The central tensors that are still the received frames they were folded into: replies resend them."""
        tensors = self.state.tensors
        return {name: frame for name, (array, frame) in self._frames.items() if tensors.get(name) is array}

    def _encode_reply(self, fields: dict[str, Any], tensors: dict[str, Tensor],
                      fresh: frozenset[str] = frozenset()) -> list[Any]:
        reuse = {name: frame for name, frame in self.resent_frames().items() if name not in fresh}
        frames = encode("model", fields, tensors, reuse=reuse)
        # received frames go out as they are (pyzmq shares their memory); the store's own arrays go out
        # zero-copy and tracked, so that a write knows when they are free again; a delta's sparse frames
        # are gathered copies that nothing writes, as are the fresh arrays of a reply ahead
        owned = [False]  # the header; then per tensor: a dense one is the store's array, a sparse one 3 copies
        for name, t in tensors.items():
            owned += [False] * 3 if isinstance(t, Sparse) else [name not in fresh]
        parts = [f if not mine or isinstance(f, zmq.Frame) or memoryview(f).nbytes < self.copy_threshold
                 else zmq.Frame(f, track=True, copy=False) for f, mine in zip(frames, owned, strict=True)]
        self._in_flight += [p.tracker for p in parts if isinstance(p, zmq.Frame) and p.tracker is not None]
        return parts

    @override
    def release(self, session: str | None = None) -> None:
        if self._lender is not None and (session is None or session == self._lender):
            self._release_lent()

    @override
    def before_answer(self, session: str, request: int) -> None:
        if request != self._lent_at:
            self.release(session)

    def _release_lent(self) -> set[str]:
        """Stop using lent memory, copying what is still central; the names of those copies (no reply sent them)."""
        if not self._lent:
            return set()
        tensors = self.state.tensors
        kept = {name for name, array in self._lent.items() if tensors.get(name) is array}
        for name in kept:
            tensors[name] = np.array(tensors[name])
        self.stats.lent_copies += bool(kept)
        self._lent, self._lender, self._lent_at = {}, None, -1
        return kept

    def _replies_in_flight(self) -> bool:
        """Whether ZeroMQ may still be reading a reply sent zero-copy from the store's own arrays."""
        self._in_flight = [t for t in self._in_flight if not t.done]
        return bool(self._in_flight)

    def _before_write(self, in_place: bool) -> None:
        """Copy-on-write: while a reply may read the central arrays, or one is a frame already resent (which
        cannot be tracked), a write in place goes to fresh copies. Folds out of place write nothing in place."""
        in_flight = self._replies_in_flight()
        if not in_place:
            return
        fresh = self._release_lent()  # copied just now: no reply in flight reads them
        received = self.resent_frames()
        if in_flight or received:
            stale = {name for name in self.state.tensors if (in_flight and name not in fresh) or name in received}
            self.state.tensors = {name: t.copy() if name in stale else t for name, t in self.state.tensors.items()}
            self._in_flight = []
            self._frames = {}
            self.stats.copies_on_write += bool(stale)

    def _place(self, push: PushIn, update: dict[str, Tensor], exact: bool,
               local_bytes: int) -> tuple[dict[str, Tensor], dict[str, np.ndarray] | None, bool]:
        """Weights a worker lends (all of the model, in its shared memory) become the model as they are,
        checked, without a copy. A rule that folds writes into the update's own received buffers or, for an
        update read from shared memory (or weights in read-only frames), into spare arrays; anything else
        read from shared memory is copied."""
        tensors = self.state.tensors
        lends = (push.weights and push.lend and exact and update.keys() == tensors.keys()
                 and all(isinstance(push.tensors[n], Local) for n in update))
        out = None
        undecoded = any(isinstance(u, Undecoded) for u in update.values())
        if lends:
            out = update
        elif self.rule.folds_into_update:
            if all(can_fold_into(u, tensors[n]) for n, u in update.items()):
                out = update
            elif ((local_bytes or push.weights or undecoded)
                  and all(isinstance(u, (np.ndarray, Undecoded)) for u in update.values())):
                out = self._spare_buffers(update)
        if out is None and undecoded:  # (not where spares are had: they are, for a rule that folds)
            update = {n: u.decoded() if isinstance(u, Undecoded) else u for n, u in update.items()}
        if out is None and local_bytes:  # still views of the worker's memory: the store's own copies
            update = {n: np.array(u) if isinstance(push.tensors[n], Local) else u for n, u in update.items()}
        return update, out, bool(lends)

    def _after_fold(self, push: PushIn, update: dict[str, Tensor], out: dict[str, np.ndarray] | None, lends: bool,
                    before: dict[str, np.ndarray]) -> None:
        tensors = self.state.tensors
        if lends and all(tensors[n] is u for n, u in update.items()):
            self._lent, self._lender, self._lent_at = dict(update), push.session, push.request  # type: ignore[arg-type]
            self.stats.weights_lent += 1
        if out is update and not lends:  # folded into the frames it came in: replies resend those frames
            for name, array in update.items():
                if tensors.get(name) is array and push.tensors.get(name) is array:
                    self._frames[name] = (array, push.frames[name])
        elif lends or out is not None:  # the arrays a fold into spares (or a lend) replaced are the next spares
            self._recycle(before)

    def _spare_buffers(self, update: dict[str, Tensor | Undecoded]) -> dict[str, np.ndarray] | None:
        """Arrays like the central ones to fold ``update`` into; None if a tensor cannot be (dtype, shape)."""
        out = {}
        for name, u in update.items():
            central = self.state.tensors[name]
            if u.dtype != central.dtype or u.shape != central.shape:
                return None
            spare = self._spares.pop(name, None)
            fits = spare is not None and spare.shape == central.shape and spare.dtype == central.dtype
            out[name] = spare if fits else np.empty_like(central)
        return out

    def _recycle(self, before: dict[str, np.ndarray]) -> None:
        """Keep the central arrays a fold out of place replaced as spares, unless a reply may still read them."""
        if self._replies_in_flight():
            return
        received = {id(array) for array, _ in self._frames.values()}
        for name, old in before.items():
            # (a lent tensor is read-only: never a spare)
            if self.state.tensors.get(name) is not old and id(old) not in received and old.flags.writeable:
                self._spares[name] = old
