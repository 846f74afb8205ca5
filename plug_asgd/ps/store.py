"""The central store: the tensors, their version, the mode's fold, and who owns every buffer.

:class:`Store` does what every store must (check and decode a push, decide whether weights can be
taken, stop at ``max_updates``, fold through the mode's rule from :mod:`plug_asgd.modes`); its two
kinds differ only in where buffers come from and who may still read them:
:class:`~plug_asgd.ps.reference_store.ReferenceStore` always copies (the plain meaning, against which
``tests/test_store.py`` checks :class:`~plug_asgd.ps.fast_store.FastStore` bit for bit). What a push
brings in and what comes out are the records of :mod:`plug_asgd.ps.store_records`.
Neither store needs a socket.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from plug_asgd.compressors import decode as decode_update
from plug_asgd.compressors.decoding import Undecoded
from plug_asgd.modes import CentralState, FoldRule, Push, Resolution
from plug_asgd.modes import get as get_mode
from plug_asgd.modes.slices import SlicePool
from plug_asgd.protocol.push_memory import AttachedSegments, read_locals
from plug_asgd.protocol.push_memory import available as shm_available
from plug_asgd.protocol.wire import Tensor, WireError
from plug_asgd.ps.changes import ChangeLog
from plug_asgd.ps.config import PSConfig
from plug_asgd.ps.downlink import make_downlink
from plug_asgd.ps.refusals import check_finite, check_model
from plug_asgd.ps.stats import Stats
from plug_asgd.ps.store_records import FOLDED, MAX_SEQ_STEP, NOT_CURRENT, STOPPED, Folded, PushIn, Snapshot


class Store(ABC):
    """The central model and its fold; ``fold`` takes a push, ``reply_payload`` makes a model reply.

    Args:
        config: the server's options (mode and its options, threads, max updates, shared memory, downlink).
        stats: the counters it adds to; None: counters of its own.
    """

    folds_packed = False  # whether its ``_place`` gives an update left Undecoded arrays to fold into

    def __init__(self, config: PSConfig, stats: Stats | None = None) -> None:
        self.rule: FoldRule = get_mode(config.mode).make_rule(
            {"replicas_to_aggregate": config.replicas_to_aggregate, "staleness_bound": config.staleness_bound,
             "outer": config.outer})
        pool = SlicePool(config.threads) if config.threads > 1 else None
        self.state = CentralState(tensors={}, pool=pool)
        self.initialized = False
        self.resumed = False  # versions before a resume and after it share numbers, not contents
        self.max_updates = config.max_updates
        self.last_seq: dict[str, int] = {}  # the last push number of each session: a push sent again is refused
        self.stats = stats if stats is not None else Stats()
        use_shm = config.shm_pushes and shm_available()
        self.segments = AttachedSegments(config.limits().max_message_bytes) if use_shm else None
        self.changes = ChangeLog()  # what each version changed: replies carry only what a worker lacks
        self.downlink = make_downlink(config.downlink_fraction, config.downlink_bound, config.downlink_codec)

    @property
    def version(self) -> int:
        """The number of updates folded in so far (across a resume)."""
        return self.state.version

    @property
    def stopped(self) -> bool:
        """Whether the run reached ``max_updates``: pushes are then answered, not folded."""
        return self.max_updates is not None and self.state.version >= self.max_updates

    # -- life ----------------------------------------------------------------------------------

    def init(self, tensors: dict[str, Tensor]) -> bool:
        """Take the first worker's model (copied); False if the model is set already.

        Args:
            tensors: the model, by name.

        Raises:
            WireError: as :func:`check_model`.
        """
        if self.initialized:
            return False
        check_model(tensors)
        self.state.tensors = {name: np.array(t, copy=True) for name, t in tensors.items()}
        self.initialized = True
        self.changes.reset(self.state.version)
        return True

    def snapshot(self) -> Snapshot:
        """The state to checkpoint, read in place."""
        fields, arrays = self.rule.state()
        return Snapshot(self.state.version, dict(self.state.tensors), dict(self.last_seq), fields, arrays)

    def restore(self, snap: Snapshot) -> None:
        """Start from a checkpoint's state (copied).

        Args:
            snap: the state the checkpoint holds.
        """
        self.state = CentralState(tensors={n: np.array(t) for n, t in snap.tensors.items()}, version=snap.version,
                                  pool=self.state.pool)
        self.last_seq = dict(snap.last_seq)
        self.rule.restore(snap.rule_fields, snap.rule_arrays)
        self.initialized = True
        self.resumed = True
        self.changes.reset(snap.version)

    def attach(self, session: str, pid: object, fd: object, token: object) -> int:
        """Map ``session``'s push segment (see :mod:`plug_asgd.protocol.push_memory`); its size.

        Args:
            session: the session of the worker that offers it.
            pid: the worker's process id, as the request gave it.
            fd: the segment's file descriptor in that process, as the request gave it.
            token: the segment's token, as the request gave it.

        Raises:
            WireError: ``bad_local``, where this store takes pushes over the socket only.
        """
        if self.segments is None:
            raise WireError("bad_local", "this parameter server takes pushes over its socket only (it was started "
                                         "with --no-shm-pushes, or this system cannot share sealed memory)")
        return self.segments.attach(session, pid, fd, token)

    def forget(self, session: str) -> None:
        """``session`` is replaced by another process: give back what it lent, unmap its segment.

        Args:
            session: the replaced session.
        """
        self.release(session)
        if self.segments is not None:
            self.segments.drop(session)

    def close(self) -> None:
        """Give every worker's memory back (the final checkpoint then reads the store's own arrays)."""
        self.release()
        if self.segments is not None:
            self.segments.clear()
        if self.state.pool is not None:
            self.state.pool.close()

    def set_trainers(self, ranks: frozenset[int]) -> list[Resolution]:
        """Workers began or stopped training: a waiting push may now be resolved (a sync round may fold).

        Args:
            ranks: the ranks training now.
        """
        self._before_write(in_place=not self.rule.folds_into_update)
        version = self.state.version
        resolutions = self.rule.set_trainers(self.state, ranks)
        self._log_changes(version)  # a round completed: it may have changed anything
        return resolutions

    def require_init(self) -> None:
        """Refuse to serve the model before a worker has sent it.

        Raises:
            WireError: ``not_initialized``, before an init.
        """
        if not self.initialized:
            raise WireError("not_initialized", "the central model is not initialised yet: a worker sends it first")

    # -- a push --------------------------------------------------------------------------------

    def adopt(self, session: str, seq: int, token: Any) -> bool:
        """Answer ``token`` when the rule resolves this push, received again (``duplicate``) while it holds it (a
        round not complete); False where it does not (resolved: the worker takes the current model).

        Args:
            session: the pushing worker's session.
            seq: the push's number, which must be the session's last.
            token: what the push sent again is to be answered by.
        """
        return self.last_seq.get(session) == seq and self.rule.adopt(session, token)

    def fold(self, push: PushIn) -> Folded:
        """Check ``push`` and hand it to the mode's rule; a WireError says why it is refused (nothing changed).

        Args:
            push: the push as received.

        Raises:
            WireError: ``bad_field`` for a base ahead of the central version; ``duplicate`` for a push received
                already; ``seq_gap`` for a number more than :data:`MAX_SEQ_STEP` past its session's last (and the
                refusals of its decoding and checks).
        """
        self.require_init()
        base = push.base_version
        if base > self.state.version:
            if not self.resumed:
                raise WireError("bad_field", f"base_version {base} is ahead of the central version "
                                             f"{self.state.version}")
            base = self.state.version  # based on updates this PS lost in its crash: fold in as fresh
        last = self.last_seq.get(push.session)
        if last is not None and push.seq <= last:
            raise WireError("duplicate", f"push {push.seq} of this worker was already received")
        if push.seq > (last or 0) + MAX_SEQ_STEP:
            raise WireError("seq_gap", f"push number {push.seq} is more than {MAX_SEQ_STEP} past this session's last "
                                       f"({last or 0}): a worker numbers its pushes one after another")
        staleness = self.state.version - base
        correction = self._correction(push.scaled_for, staleness)  # refused before anything is read
        sent, local_bytes = read_locals(self.segments, push.session, push.tensors)
        # a store that folds into spare arrays folds a packed tensor as it is (Undecoded), never writing its decoding
        update = self._decode(sent, defer=self.folds_packed and self.rule.folds_into_update and not self.stopped)
        fresh = staleness == 0 and correction == 1.0 and not self.resumed
        # Exactly base + this update once folded: nothing else folded in since the base, dense values used as sent.
        exact = fresh and self.rule.folds_into_update and all(
            isinstance(u, np.ndarray) and u is sent[n] for n, u in update.items())
        # The worker can make the new model itself, base + what it sent decoded as here (the same float additions):
        # it is answered "own" if it asks (codecs too; not where the downlink tracks what each worker holds)
        own = exact or (fresh and not push.weights and self.downlink is None
                        and all(self.rule.adds_exactly(u) for u in update.values()))
        if self.stopped:
            check_finite(update)
            self.last_seq[push.session] = push.seq
            self.stats.pushes_after_stop += 1
            return Folded(STOPPED)
        if push.weights and not exact:
            # the model moved on since the worker's base, or this mode folds otherwise: folding
            # ``weights - base`` would need that base, which only the worker has; it pushes that
            self.last_seq[push.session] = push.seq
            self.stats.weights_not_current += 1
            return Folded(NOT_CURRENT)
        update, out, lends = self._place(push, update, exact, local_bytes)
        if out is None:
            check_finite(update)
        self._before_write(in_place=out is None)
        before, version = dict(self.state.tensors), self.state.version
        resolutions = self.rule.push(self.state, Push(push.token, push.rank, base, update, out,
                                                      replace=push.weights, scale=correction,
                                                      scaled_by_worker=push.scaled_for is not None,
                                                      session=push.session))
        self._log_changes(version, update)
        self.last_seq[push.session] = push.seq
        self.stats.weights_pushes += push.weights
        self.stats.push_local_bytes_in += local_bytes
        self._after_fold(push, update, out, lends, before)
        return Folded(FOLDED, resolutions, self.state.version if own else None, staleness, local_bytes)

    def _log_changes(self, version: int, update: dict[str, Tensor] | None = None) -> None:
        """What the rule changed since ``version`` into the change log: a push's coordinates, where the rule changes
        nothing but what a push names; the tensors it names (streaming DiLoCo's fragments: ``FoldRule.changed``);
        else everything."""
        if self.state.version == version:
            return
        one = self.state.version == version + 1
        if one and update is not None and self.rule.changes_only_pushed:
            self.changes.record(self.state.version, update)
        elif one and (changed := self.rule.changed()) is not None:
            self.changes.tensors(self.state.version, changed)
        else:
            self.changes.everything(self.state.version)

    def _correction(self, scaled_for: float | None, staleness: int) -> float:
        """``(1 + scaled_for) / (1 + max(scaled_for, staleness))``: a worker's update, scaled by ``1 / (1 +
        estimate)``, lands scaled for its own staleness where that is larger. The worker's estimate (a median
        over its recent pushes) lags where the workers' pace changes (one starts late, stalls, or is
        descheduled on a loaded machine): such pushes folded at the lagging scale gave the heavy tail of
        docs/momentum.md. Never scaled back up: in downpour a push that lands with staleness 0 is not alone
        (the others are between their pushes), and folding it unscaled trained worse."""
        if scaled_for is None:
            return 1.0
        if not self.rule.corrects:
            raise WireError("bad_field", "field 'scaled_for': this mode's PS averages rounds (leave the field out)")
        return (1.0 + scaled_for) / (1.0 + max(scaled_for, staleness))

    def read_local(self, session: str, tensors: dict[str, Any]) -> dict[str, Any]:
        """``tensors`` with each :class:`Local` reference read (as a view) from ``session``'s segment.

        Args:
            session: the pushing worker's session.
            tensors: the push's tensors.

        Raises:
            WireError: ``bad_local`` where this store maps no segment, or the reference is out of it.
        """
        return read_locals(self.segments, session, tensors)[0]

    def _decode(self, update: dict[str, Tensor], defer: bool) -> dict[str, Tensor | Undecoded]:
        """What each compressor sent, decoded into the central tensor's dtype (not yet checked for NaN/Inf); a
        packed tensor left :class:`Undecoded` where ``defer``."""
        out: dict[str, Tensor | Undecoded] = {}
        for name, t in update.items():
            central = self.state.tensors.get(name)
            if central is None:
                raise WireError("unknown_tensor", f"the central model has no tensor {name!r}")
            if tuple(t.shape) != central.shape:
                raise WireError("bad_tensor", f"tensor {name!r}: got shape {list(t.shape)}, the central model "
                                              f"holds {central.dtype.name}{list(central.shape)}")
            out[name] = decode_update(t, central.dtype, shape=central.shape, defer=defer)
        return out

    # -- where buffers come from: what the two stores do differently ---------------------------

    @abstractmethod
    def _place(self, push: PushIn, update: dict[str, Tensor], exact: bool,
               local_bytes: int) -> tuple[dict[str, Tensor], dict[str, np.ndarray] | None, bool]:
        """The update to fold (nothing in it a worker may write), where the rule writes (``Push.out``), and
        whether the store keeps the pushed weights where they lie (lends)."""

    @abstractmethod
    def _before_write(self, in_place: bool) -> None:
        """Called before the central tensors change; ``in_place``: whether the rule writes into them."""

    @abstractmethod
    def _after_fold(self, push: PushIn, update: dict[str, Tensor], out: dict[str, np.ndarray] | None, lends: bool,
                    before: dict[str, np.ndarray]) -> None:
        """The fold is done: note what the new central tensors are made of (``before``: the old ones)."""

    def reply_payload(self, fields: dict[str, Any], have: tuple[str, int] | None = None, *, rank: int | None = None,
                      held: tuple[str, int] | None = None, push: bool = False, ahead: bool = False,
                      only: frozenset[str] | None = None) -> list[Any]:
        """The frames of a ``model`` reply with ``fields`` and the central tensors, ready to send zero-copy.

        Only what the worker lacks, where that is less (``delta``): the changes since the central version it holds
        (``have``, ``ps/changes.py``), or, with a downlink, the differences from the copy it holds (``held``,
        ``ps/downlink.py``), of which a reply to a ``push`` carries the largest, or every one coded, to add
        (``approx``, ``add``). A push that asks to be ``ahead`` gets the central model less the step its rule
        anticipates (:meth:`~plug_asgd.modes.rules.FoldRule.ahead`), marked ``ahead``: the downlink's copy with a
        codec, else no model named; one that wants ``only`` the tensors it carried (a fragment), those (``part``).

        Args:
            fields: the reply's header fields.
            have: the ``[model_id, version]`` of the central model the worker holds, or None.
            rank: the worker's rank, if a member; None: not one (no downlink copy is kept for it).
            held: the ``[model_id, version]`` of the downlink copy the worker holds, or None.
            push: whether the reply answers a push (which may be approximate).
            ahead: whether the push asked for the model its rule anticipates.
            only: the tensors the push carried, where it wants those only; None: the model.
        """
        self.release()  # a reply in flight must not read memory its worker may write again
        model_id, version = self.changes.model_id, self.state.version
        steps = self.rule.ahead(only) if push and ahead else {}  # (only the tensors the reply carries)
        central = self.state.tensors if not steps and only is None else {
            n: t - steps[n] if n in steps else t for n, t in self.state.tensors.items() if only is None or n in only}
        downlink = self.downlink if rank is not None else None
        adds = downlink is not None and downlink.adds  # its copy of the worker's may be the model ahead
        self.stats.model_replies += 1
        self.stats.ahead_replies += bool(steps)
        self.stats.part_replies += only is not None
        fields = {**fields, **({"ahead": True} if steps else {}), **({"part": True} if only is not None else {})}
        if (only is not None or steps) and not adds:
            return self._encode_reply(fields, central, fresh=frozenset(steps))
        asks = downlink is not None and (held is not None or push)
        tensors = downlink.reply(rank, held or have, model_id, version, central,  # type: ignore[union-attr,arg-type]
                                 exact=not push) if asks else None
        from_downlink = tensors is not None  # the downlink brought its copy of the worker's model up to date
        if only is not None and not from_downlink:  # a part whole: what the worker holds, and its copy, stay
            return self._encode_reply(fields, central, fresh=frozenset(steps))
        fields["model_id"] = model_id
        if push and (from_downlink or steps):  # (a model ahead, whole: the copy the downlink keeps from now on)
            fields["approx"] = True
            self.stats.approx_replies += 1
        if tensors is None and not steps:
            tensors = self.changes.delta(have, version, central)
        fresh = frozenset(steps)
        if tensors is None:
            tensors = dict(central)
        else:
            fields["delta"] = True
            self.stats.delta_replies += 1
            if adds and push and from_downlink:  # differences to add, each a new array
                fields["add"], fresh = True, frozenset(tensors)
        if downlink is not None and not from_downlink:
            downlink.holds(rank, model_id, version, central)  # type: ignore[arg-type]  # it holds this now (or ahead)
        return self._encode_reply(fields, tensors, fresh=fresh)

    @abstractmethod
    def _encode_reply(self, fields: dict[str, Any], tensors: dict[str, Tensor],
                      fresh: frozenset[str] = frozenset()) -> list[Any]:
        """A ``model`` reply's frames: ``tensors`` central arrays or gathers of them, ``fresh`` ones new (ahead)."""

    def release(self, session: str | None = None) -> None:  # noqa: B027 (a hook: only a lending store lends)
        """Stop using memory a worker lent (``session``'s only, if given), copying what is still the model.

        Args:
            session: the session whose lent memory to stop using; None: any.
        """

    def before_answer(self, session: str, request: int) -> None:  # noqa: B027 (a hook, as release)
        """Called before ``session`` is answered in request number ``request``: once it has the answer, the
        worker may write the memory it lent, unless it lent it in this very request.

        Args:
            session: the session about to be answered.
            request: the number of the request being answered.
        """
