"""PSClient: one worker's connection to the parameter server, and the protocol it speaks.

Requests travel through :class:`~plug_asgd.worker.transport.Transport` (timeouts, reconnection,
heartbeats, byte counters). Pushes carry a sequence number, so one that the PS had already
applied before a reconnection is refused as a duplicate and never counted twice.

What a model reply carries, and how it is read into the model the client holds, is
:mod:`plug_asgd.worker.model_reply`'s.

On the PS's machine the client can push through shared memory (:meth:`PSClient.push_buffers`,
:mod:`plug_asgd.protocol.push_memory`); should the PS lose the segment (a restart), the push is sent again
as bytes, and so are all later ones.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import zmq

from plug_asgd.protocol import push_memory
from plug_asgd.protocol.wire import DEFAULT_LIMITS, Limits, Tensor
from plug_asgd.worker.held_model import HeldModel
from plug_asgd.worker.model_reply import ModelReply, model_reply, with_have
from plug_asgd.worker.notices import Notices
from plug_asgd.worker.transport import DEFAULT_HEARTBEAT_S, CommCounters, PSError, PSUnreachableError, Transport

__all__ = ["DEFAULT_HEARTBEAT_S", "CommCounters", "HeldModel", "PSClient", "PSError", "PSUnreachableError"]

log = logging.getLogger("plug_asgd.worker.client")


class PSClient(Transport):
    """Requests to one parameter server, with timeouts that end in a clear error, never a hang.

    Args:
        address: the PS's ZeroMQ address (``tcp://host:port``).
        rank: this worker's rank.
        world_size: the number of workers in the run, which hello tells the PS.
        mode: the name of the training mode, which the PS checks against its own.
        request_timeout: seconds a request may wait for its reply before :class:`PSUnreachableError`.
        lost_timeout: seconds a dropped connection may stay away before a waiting request gives up.
        heartbeat_s: seconds between heartbeats once the worker has said hello; None: no heartbeats.
        limits: the largest messages accepted from the PS.
        context: the ZeroMQ context to make sockets in (None: the process's shared one).
        keys: the worker's CURVE keys (``DIR/worker`` or ``DIR`` of ``plug-asgd keygen``), for a keyed PS.
        delta_replies: keep the last central model received, and ask the PS for only what changed since
            (see :class:`HeldModel`); off, every model reply carries the whole model.
        run: sent in hello, so that an embedded PS of another run on the same port (a previous Trainer's, not
            yet stopped) refuses this worker instead of training it; hello asks again until the run's own PS
            answers. None: any PS.
        mode_options: the knobs the worker's mode sets away from its defaults (:func:`plug_asgd.modes.chosen_knobs`),
            sent in hello, so that a PS started with others (``serve-ps --outer`` or ``--staleness-bound`` left out)
            refuses this worker instead of folding its pushes by them. None: not checked.
    """

    takes_weights = True  # a push may carry the worker's weights (push(weights=True)); a sharded PS's may not

    def __init__(
        self,
        address: str,
        *,
        rank: int,
        world_size: int,
        mode: str,
        request_timeout: float = 600.0,
        lost_timeout: float = 60.0,
        heartbeat_s: float | None = DEFAULT_HEARTBEAT_S,
        limits: Limits = DEFAULT_LIMITS,
        context: zmq.Context | None = None,
        keys: str | os.PathLike[str] | None = None,
        delta_replies: bool = True,
        run: int | None = None,
        mode_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(address, rank=rank, request_timeout=request_timeout, lost_timeout=lost_timeout,
                         heartbeat_s=heartbeat_s, limits=limits, context=context, keys=keys)
        self.world_size = world_size
        self.mode = mode
        self._seq = itertools.count(1)
        self.shm_offered = False  # the PS takes pushes through shared memory (its hello reply says)
        self._segment: push_memory.PushSegment | None = None
        self._notices: Notices | None = None
        self._notices_at = address
        self.held = HeldModel() if delta_replies else None
        # on one shard of a sharded PS: {shards, shard, digest} of the worker's partition, in hello and init
        self.partition: dict[str, Any] | None = None
        self.run = run
        self.mode_options = mode_options

    def close(self) -> None:
        """Close the notices' socket and the transport, then give up the shared push segment."""
        if not self._closed:
            if self._notices is not None:
                self._notices.close()
            super().close()
            if self._segment is not None:
                self._segment.close()  # the buffers stay mapped while the worker holds them

    def notices(self) -> Notices:
        """This worker's broadcasts inside the training loop, answered without waiting
        (:mod:`plug_asgd.worker.notices`)."""
        if self._notices is not None and self._notices_at != self.address:  # moved to a standby that leads now
            self._notices.close()
            self._notices = None
        if self._notices is None:
            self._notices = Notices(self.side_socket(hwm=16), self.rank, self.session, self.token, self.limits)
            self._notices_at = self.address
        self._notices.token = self.token  # the rank's proof, which a hello after a reconnection may have renewed
        return self._notices

    # -- protocol ------------------------------------------------------------------------------

    def hello(self, stage: int, training: bool, *, timeout: float | None = None,
              alive: Callable[[], str | None] | None = None) -> dict[str, Any]:
        """Join (or rejoin) the run as this rank. The PS's token is kept and sent with every later hello
        and heartbeat: it proves this is the worker that holds the rank. A rank still held by a live
        worker (a restarted process whose predecessor is not yet declared lost), a world size held by
        workers of another (``world_held``: a PS without a fixed world, whose first hello claimed
        another, until those workers are declared lost), or a PS of another run (``run_mismatch``), is
        asked again every half second until ``timeout``.

        Args:
            stage: the number of the Lightning stage being joined.
            training: whether the stage is a fit (the worker trains) rather than an evaluation.
            timeout: seconds to keep asking; None: the client's ``request_timeout``.
            alive: says why the PS cannot answer (its process died), or None while it may.

        Returns:
            The fields of the PS's hello reply.
        """
        fields = {"rank": self.rank, "world_size": self.world_size, "stage": stage, "training": training,
                  "mode": self.mode, "session": self.session, "heartbeat_s": self.heartbeat_s}
        if self.token is not None:
            fields["token"] = self.token
        if self.partition is not None:
            fields["partition"] = self.partition
        if self.run is not None:
            fields["run"] = self.run
        if self.mode_options is not None:
            fields["options"] = self.mode_options
        deadline = time.monotonic() + (self.request_timeout if timeout is None else timeout)
        while True:
            try:
                reply = self.request("hello", fields, timeout=max(0.001, deadline - time.monotonic()), alive=alive)
                break
            except PSError as exc:
                if exc.code not in ("rank_taken", "world_held", "run_mismatch") or time.monotonic() + 0.5 > deadline:
                    raise
                log.info("rank %d: %s; asking again", self.rank, exc)
                time.sleep(0.5)
        token = reply.fields.get("token")
        self.token = token if isinstance(token, str) else None
        self._hello_fields = {**fields, "token": self.token} if self.token else fields
        self._start_heartbeat()
        limit = reply.fields.get("max_message_bytes")
        self.max_message_bytes = limit if isinstance(limit, int) and limit > 0 else None
        self.shm_offered = reply.fields.get("shm") is True
        return reply.fields

    def push_buffers(self, shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, np.ndarray] | None:
        """Buffers (name -> shape, dtype) that :meth:`push` hands the PS through shared memory, not the socket.

        None where the PS cannot take them: it is on another machine, runs as another user, does
        not offer it, or this system has no sealed shared memory (Linux's memfd). An update made in
        these buffers must not change until its push has been answered; another array is sent as
        bytes, as always.

        Args:
            shapes: per tensor name, the shape and numpy dtype of the buffer to hold its update.
        """
        if not (self.shm_offered and push_memory.available()):
            return None
        try:
            segment = push_memory.PushSegment(shapes)
        except OSError as exc:
            log.info("pushing over the socket: cannot get shared memory for the updates (%s)", exc)
            return None
        if self.max_message_bytes is not None and segment.size > self.max_message_bytes:
            segment.close()
            return None
        try:
            self.request("attach", {"session": self.session, "pid": os.getpid(), "fd": segment.fd,
                                    "token": segment.token})
        except PSError as exc:
            segment.close()
            log.info("pushing over the socket: the parameter server cannot map this worker's memory (%s)", exc)
            return None
        self._segment = segment
        return segment.buffers

    @property
    def shares_memory(self) -> bool:
        """Whether the PS maps this client's :meth:`push_buffers` (until it loses them, in a restart)."""
        return self._segment is not None

    def init(self, tensors: Mapping[str, np.ndarray]) -> bool:
        """Offer this worker's tensors as the initial central model; False if another came first.

        Taken, they are the central model this client holds (copied): the next pull carries only what
        changed since.

        Args:
            tensors: this worker's model by name (parameters and floating-point buffers).
        """
        fields = {"rank": self.rank, **({"partition": self.partition} if self.partition is not None else {})}
        reply = self.request("init", fields, tensors)
        accepted = bool(reply.fields.get("accepted"))
        if accepted and self.held is not None:
            self.held.keep(reply.fields.get("model_id"), int(reply.fields.get("version", 0)),
                           {n: np.array(t, copy=True) for n, t in tensors.items()})
        return accepted

    def pull_once_initialized(self, within: float) -> ModelReply | None:
        """The central model as soon as a worker has sent it, waiting at most ``within`` seconds; None after.

        What a worker that need not initialise does first: its own model, sent while another's is on
        its way, would be bytes the PS refuses (the model's size on every link at every start).

        Args:
            within: seconds to wait for another worker's initial model.
        """
        deadline = time.monotonic() + within
        while True:
            try:
                return self.pull()
            except PSError as exc:
                if exc.code != "not_initialized":
                    raise
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def pull(self) -> ModelReply:
        """The central model; as this rank once it said hello, else as a bystander (a Supervisor, a test)."""
        fields = {"rank": self.rank} if self._hello_fields is not None else {}
        return model_reply(self.request("pull", with_have(fields, self.held)), self.held, self.counters, "pull")

    def push(self, base_version: int, update: Mapping[str, Tensor],
             want_model: bool | Literal["unless_own", "pushed"] = True,
             while_waiting: Callable[[], None] | None = None, weights: bool = False,
             lend: bool = False, scaled_for: float | None = None, ahead: bool = False,
             rate: float | None = None) -> ModelReply:
        """Push an update; the reply carries the central model unless ``want_model`` is False.

        ``"unless_own"``: no tensors either when the PS folded the update into a model that nothing
        else had changed since ``base_version``, as ``base + decoded update`` (``reply.own``). The
        worker then makes the central model itself, with the same decoding and float additions as
        the PS (:meth:`HeldModel.add`): the same bits, without the model's bytes on the wire. The PS
        decides, and answers with the model otherwise.

        ``"pushed"``: the reply carries the central tensors the push carried, and no others (``reply.part``):
        streaming's fragment needs no more. Whole, they leave the held model as it was; from a downlink codec,
        they are its differences from the PS's copy, added to those tensors of the held model.

        ``while_waiting`` runs once the push is sent, while the PS folds it (see :meth:`request`);
        not again if the push has to be sent a second time.

        ``weights``: ``update`` holds the worker's weights ``w``, not ``w - base``. If nothing else
        changed the model since ``base_version`` (a lone worker), the PS takes them as its model:
        ``base + (w - base)`` without the rounding of that sum, and without the two passes over
        the model that computing it takes on each side. Otherwise it folds nothing and answers
        ``status == "not_current"``: push ``w - base`` instead. Dense tensors of the central dtype,
        in modes whose PS folds ``w += delta`` (asgd, dynsgd, ssp); other modes answer "not_current".

        ``lend`` (with ``weights`` held in :meth:`push_buffers`): the PS may keep these very
        buffers as its model, checked but not copied, until it has answered this client's next
        push or pull. Do not write them before that answer: the next push of weights goes from
        another set of buffers (the strategy keeps two and swaps them). The PS keeps them only if
        it took them as its model, and copies them first if it must send or change the model
        meanwhile.

        ``scaled_for``: the update was scaled by ``1 / (1 + scaled_for)`` for that staleness (an
        estimate); the PS multiplies it by ``(1 + scaled_for) / (1 + max(scaled_for, s))``, ``s``
        the staleness it lands with: a push staler than its estimate is folded in scaled for its
        own. Modes whose PS folds each push as it arrives (asgd, adacomp, downpour, dynsgd, ssp, ...; dynsgd's
        PS then scales it no further); sync's rounds refuse it (``bad_field``).

        Args:
            base_version: the central version the update was computed from.
            update: the update by tensor name (dense or sparse, as the codec encoded it), or the weights.
            want_model: whether the reply carries the central model: True, False, ``"unless_own"`` or ``"pushed"``.
            while_waiting: work to run once the push is sent, while the PS folds it.
            weights: ``update`` holds the worker's weights, not a difference.
            lend: the PS may keep the pushed weight buffers as its model until its next answer to this client.
            scaled_for: the staleness the update was scaled for; None: not scaled.
            ahead: ask for the central model less the step the PS's rule anticipates before this worker pushes
                again (async_diloco's ``momentum_lookahead``): the reply says ``ahead`` where it carries that, and the
                client then holds no central model until its next reply (with ``"pushed"``, it keeps the one it held),
                unless the PS keeps the model ahead as its copy of this client's (a downlink codec).
            rate: the local steps per second this worker makes (async_diloco's ``dynamic_steps``): the reply then says
                its pace, those over the fastest training worker's (``ModelReply.pace``); None: say none.

        Raises:
            ValueError: where ``want_model`` is none of True, False, ``"unless_own"`` and ``"pushed"``.
        """
        if want_model not in (True, False, "unless_own", "pushed"):
            raise ValueError(f"want_model must be True, False, 'unless_own' or 'pushed', got {want_model!r}")
        fields = {"rank": self.rank, "base_version": base_version, "seq": next(self._seq),
                  "session": self.session, "model": want_model}
        if weights:
            fields["weights"] = True
        if lend:
            fields["lend"] = True
        if scaled_for is not None:
            fields["scaled_for"] = float(scaled_for)
        if ahead:
            fields["ahead"] = True
        if rate is not None:
            fields["rate"] = float(rate)
        if want_model is not False:  # (a push that wants its own tensors gets differences from a downlink codec only)
            fields = with_have(fields, self.held)
        try:
            return self._send_push(fields, update, while_waiting)
        except PSError as exc:
            if exc.code != "duplicate":
                raise
            # sent twice around a reconnection and applied the first time: take the model as it is now
            self.counters.replies["duplicate"] += 1
            reply = self.pull()
            return ModelReply(reply.version, "duplicate", reply.stop, reply.tensors)

    def _send_push(self, fields: dict[str, Any], update: Mapping[str, Tensor],
                   while_waiting: Callable[[], None] | None) -> ModelReply:
        """One push, its tensors in shared memory where they lie in the segment (over the socket if the PS lost it)."""
        local = None
        if self._segment is not None:
            local = {n: o for n, t in update.items() if (o := self._segment.offset(t)) is not None} or None
        try:
            sent = self.request("push", fields, update, local=local, while_waiting=while_waiting)
            reply = model_reply(sent, self.held, self.counters, "push")
        except PSError as exc:
            if exc.code != "bad_local" or not local:
                raise
            log.warning("the parameter server no longer maps this worker's memory (%s); pushing over the socket "
                        "from now on", exc)
            self._segment = local = None
            reply = model_reply(self.request("push", fields, update), self.held, self.counters, "push")
        self.counters.own_replies += reply.own
        if reply.status == "not_current":  # sent, but neither folded nor dropped: the PS read nothing
            self.counters.pushes -= 1
            self.counters.weights_not_current += 1
            if local:
                self.counters.push_local_bytes_up -= sum(np.asarray(update[n]).nbytes for n in local)
        return reply

    def gather(self, stage: int, seq: int, obj: Any = None, tensors: Mapping[str, np.ndarray] | None = None,
               kind: str = "") -> list[tuple[int, Any, dict[str, np.ndarray]]]:
        """Contribute to collective ``seq`` of ``stage``; returns every rank's (rank, obj, tensors).

        ``kind`` ("barrier:NAME", "broadcast", ...) lets the PS refuse ranks that disagree on what
        this collective is, instead of pairing one rank's broadcast with another's barrier.

        Args:
            stage: the number of the Lightning stage the collective belongs to.
            seq: the collective's place among the stage's collectives (the same on every rank).
            obj: this rank's msgpack data for it (None: none).
            tensors: this rank's arrays for it, by name (None: none).
            kind: what the collective is, which every rank must agree on.
        """
        fields = {"rank": self.rank, "stage": stage, "seq": seq, "obj": obj, "kind": kind}
        reply = self.request("gather", fields, tensors)
        out = []
        for r, o in zip(reply.fields["ranks"], reply.fields["objs"], strict=True):
            prefix = f"{r}/"
            out.append((r, o, {k[len(prefix):]: v for k, v in reply.tensors.items() if k.startswith(prefix)}))
        return out

    def bye(self, stage: int, timeout: float = 5.0, failed: str | None = None) -> None:
        """Leave ``stage``: the PS no longer counts this connection as the rank's (a later pull is a bystander's,
        and a reconnection says no hello) until :meth:`hello` again.

        Args:
            stage: the number of the stage being left.
            timeout: seconds to wait for the PS's answer.
            failed: what the stage ended on, where it failed (the PS then stops the job's other workers, saying
                this); None: it ended well.
        """
        fields = {"rank": self.rank, "stage": stage} if failed is None else {
            "rank": self.rank, "stage": stage, "failed": failed, "session": self.session}
        self.request("bye", fields, timeout=timeout)
        self._hello_fields = None

    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        """The PS's statistics (versions, pushes, staleness, ...), as its ``stats`` reply carries them.

        Args:
            timeout: seconds to wait for the reply; None: the client's ``request_timeout``.
        """
        return dict(self.request("stats", timeout=timeout).fields["stats"])
