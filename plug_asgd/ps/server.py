"""The serving loop: one ZeroMQ ROUTER socket, CURVE authentication, dispatch, error replies.

Requests are answered in the order they are resolved: most at once, a ``sync`` push when its
round completes, a collective when every rank still in the stage has contributed. A request
that breaks the protocol gets an ``error`` reply and a counter; the PS keeps serving and its
tensors are untouched. What each request does lives in the parts this loop holds: the store
(:mod:`plug_asgd.ps.store`), membership, collectives and persistence; the handlers of the requests on
the model itself (init, pull, push) are in :mod:`plug_asgd.ps.model_requests`.

It listens on loopback unless given keys (CURVE, see :mod:`plug_asgd.protocol.security`) or told
``insecure``; a peer refused in the CURVE handshake is counted as ``refused["auth"]``. It ends by
itself on :meth:`ParameterServer.request_stop` (SIGINT/SIGTERM), when the process that started
it dies (``parent_pid``), or once ``expected_workers`` have joined and all have left (or been
lost) for ``linger`` seconds.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from plug_asgd.compressors.heap import keep_freed_memory
from plug_asgd.modes import server_knobs
from plug_asgd.protocol.monitor import monitor_socket, stop_on_drop
from plug_asgd.protocol.security import load_server_keys, load_standby_keys
from plug_asgd.protocol.wire import Local, Message, Tensor, WireError, decode, encode, message_bytes
from plug_asgd.ps import failure
from plug_asgd.ps import limits as bounds
from plug_asgd.ps.config import PSConfig
from plug_asgd.ps.curve_auth import HANDSHAKE_FAILED, authenticate
from plug_asgd.ps.failover import REPLACED_TYPES, STANDBY_TYPES, Failover
from plug_asgd.ps.fast_store import FastStore
from plug_asgd.ps.gathers import Gathers
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.model_requests import ModelRequests
from plug_asgd.ps.persistence import Persistence
from plug_asgd.ps.refusals import check_mode
from plug_asgd.ps.replication import Replication
from plug_asgd.ps.replies import Replies
from plug_asgd.ps.shard_guard import ShardGuard
from plug_asgd.ps.stats import Stats

log = logging.getLogger("plug_asgd.ps")

_TYPES = ("hello", "bye", "attach", "heartbeat", "init", "pull", "push", "gather", "notice", "stats", "standby",
          "replicate", "lead", "ping")


class ParameterServer(ModelRequests, Failover):
    """Serves one central model to the workers of a run, as ``config`` says.

    Args:
        config: the server's options; None: the defaults (loopback, asgd).
        context: the ZeroMQ context to make its socket in; None: a context of its own where it has keys (a ZAP
            handler is one per context), else the process's shared one.

    Raises:
        OSError: where it cannot listen on ``config.bind`` (the port is taken, say).
    """

    def __init__(self, config: PSConfig | None = None, *, context: zmq.Context | None = None) -> None:
        config = config if config is not None else PSConfig()
        load_keys = load_standby_keys if config.standby_of is not None else load_server_keys
        server_keys = load_keys(config.keys) if config.keys is not None else None
        self.config = config
        self.mode = config.mode
        self.knobs = server_knobs(config.mode, {"replicas_to_aggregate": config.replicas_to_aggregate,
                                                "staleness_bound": config.staleness_bound, "outer": config.outer})
        self.limits = config.limits()
        self.stats = Stats()
        self.members = Membership(config.worker_timeout, self.stats, config.world_size or config.expected_workers)
        self.collectives = Gathers(self.members, self.stats, self._send, self._error, record=self.replicate)
        self.store = FastStore(config, self.stats)
        self.shard = ShardGuard(config.shard)  # the partition its workers agree on, when it is one of several
        self.persistence = Persistence(config, self.store, self.members, self.stats, shard=self.shard)
        self._stop = False
        self._init_failover()
        if config.resume is not None:
            self.persistence.resume(config.resume)
            bounds.trim_sessions(self.store.last_seq, self.members.world_size)
        # a ZAP handler is one per context: a keyed PS, or a standby (its record socket's), gets its own unless given
        self._own_ctx = context is None and (server_keys is not None or config.standby_of is not None)
        self._ctx = context or (zmq.Context() if self._own_ctx else zmq.Context.instance())
        self.socket = self._ctx.socket(zmq.ROUTER)
        # written by request_stop: a poll sleeping in serve_forever wakes at once, not at its timeout (200 ms)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        bounds.configure_router(self.socket, self.limits)
        self.store.copy_threshold = self.socket.copy_threshold
        self.replication = Replication(self._ctx, config.failover_timeout, self.limits, server_keys)
        self.replies = Replies(self.socket.copy_threshold)  # queued over all connections, given back as they close
        self.failure = failure.JobFailure()  # a rank's failure, told to the job's other ranks
        self._auth: Any = None
        self._monitor: zmq.Socket | None = None
        if server_keys is not None:
            self._auth, self._monitor = authenticate(self._ctx, self.socket, server_keys)
        else:  # a connection that closes: its queued replies' memory goes back to the system (Replies.closed)
            self._monitor = monitor_socket(self.socket, zmq.EVENT_DISCONNECTED)
        self._unmonitor = stop_on_drop(self, self.socket, self._monitor)  # also where the PS is never closed
        try:
            self.socket.bind(config.bind)
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"the parameter server cannot listen on {config.bind}: {exc} (is another process "
                          "using that port? choose another with --port)") from None
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.keyed = server_keys is not None
        self.start_role(server_keys)  # a standby asks to join; a resumed PS, whether a later epoch leads

    def _on_monitor(self) -> None:
        assert self._monitor is not None
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event & HANDSHAKE_FAILED:
                self.stats.refused["auth"] += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.replies.closed()

    def close(self) -> None:
        """Close the socket and give back what the store holds of workers' memory; the PS serves no more."""
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._monitor is not None:
            self._unmonitor()
            self._monitor = None
        self.close_failover()
        self.socket.close(0)
        self.store.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self._ctx.term()
            self._own_ctx = False

    # -- serving -------------------------------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        """Stop serving after the request in hand (a signal handler: any arguments are ignored).

        Args:
            _: a signal handler's signal number and frame, ignored.
        """
        self._stop = True
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # closed (the PS has stopped), or full: a wake is already pending
            pass

    def serve_forever(self, poll_ms: int = 200, on_tick: Callable[[ParameterServer], None] | None = None,
                      tick_s: float = 0.5) -> int:
        """Serve until told to stop or the run is over; returns an exit code (1: the checkpoint at exit failed).
        ``on_tick(server)`` runs every ``tick_s`` s in the serving thread, between requests (the dashboard's).

        Args:
            poll_ms: the longest wait for a request, in milliseconds, between two checks of liveness and
                housekeeping.
            on_tick: called with the server every ``tick_s`` seconds; None: nothing is.
            tick_s: seconds between two calls of ``on_tick``.
        """
        log.info("parameter server listening on %s, mode %s", self.address, self.mode)
        keep_freed_memory()  # a packed push's decoding reuses the last one's pages (compressors/heap.py)
        poller = zmq.Poller()
        for readable in (self.socket, self._monitor, self.link and self.link.socket, self._wake_r):
            if readable is not None:
                poller.register(readable, zmq.POLLIN)
        next_tick = time.monotonic()
        try:
            while not self._stop:
                if on_tick is not None and time.monotonic() >= next_tick:
                    on_tick(self)
                    next_tick = time.monotonic() + tick_s
                ready = dict(poller.poll(min(poll_ms, int(tick_s * 1000)) if on_tick else poll_ms))
                if self._monitor is not None and self._monitor in ready:
                    self._on_monitor()
                if self.socket in ready:
                    self._drain()
                self.check_liveness()
                self.failover_tick()
                self.persistence.housekeeping()
                self.replies.tick()
                if self._should_exit():
                    break
        finally:
            if self._monitor is not None:
                self._on_monitor()
            self.close()
            code = self.persistence.housekeeping(final=True)  # 1: the last checkpoint could not be written
        log.info("parameter server stopped at version %d", self.store.version)
        return code

    def _drain(self) -> None:
        """Handle every request waiting on the socket."""
        while True:
            self.serve_link()  # a standby's records first, and between two requests of its workers' socket
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.on_frames(frames)

    def _should_exit(self) -> bool:
        if self.config.parent_pid is not None and os.getppid() != self.config.parent_pid:
            if self.failure.linger_until is None:  # rank 0 is gone: its workers hear it (ps/failure.py), then stop
                log.info("the process that started the parameter server is gone; telling the workers, stopping")
                self._job_failed("the process that started this parameter server (rank 0 of the job) is gone")
                self.failure.linger_until = time.monotonic() + failure.FAILED_LINGER_S
            return time.monotonic() >= self.failure.linger_until or not self.members.by_identity
        return self.members.run_over(self.config.expected_workers, self.config.linger)

    def on_frames(self, frames: list[Any]) -> None:
        """Handle one request (identity frame first), and count the time it took (how loaded the PS is).

        Args:
            frames: the frames received on the ROUTER: the sender's identity, then the message's.
        """
        start, start_cpu = time.perf_counter(), time.thread_time()
        kind = self._handle(frames)
        spent, spent_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        stats = self.stats
        stats.busy_s += spent
        stats.busy_cpu_s += spent_cpu
        if kind == "push":
            stats.push_busy_s += spent
            stats.push_busy_cpu_s += spent_cpu

    def _handle(self, frames: list[Any]) -> str | None:
        """Decode, dispatch and answer one request (an error reply for a bad one); returns its type."""
        identity, body = frames[0].bytes, frames[1:]
        self.peer = body[0] if body else None
        self.stats.messages_in += 1
        if self.members.seen(identity):
            self._update_trainers()
        size = message_bytes(body)
        self.stats.bytes_in += size
        rid = kind = None
        try:
            msg = decode(self.screen(body), self.limits)  # a standby's: no tensors (garbage costs no decode)
            rid, kind = bounds.rid(msg.fields), msg.type
            if msg.type != "push" and any(isinstance(t, Local) for t in msg.tensors.values()):
                raise WireError("bad_local", f"a {msg.type!r} message cannot name shared memory: only pushes do")
            if msg.type not in _TYPES:
                raise WireError("unknown_type", f"unknown message type {msg.type!r}")
            if self.role != "primary" and msg.type not in (STANDBY_TYPES if self.role == "standby" else REPLACED_TYPES):
                raise self._not_serving()
            self.check_epoch(msg)
            if msg.type == "push":
                self.stats.push_bytes_in += size
                self.stats.push_messages += 1
            sender = self.members.by_identity.get(identity)
            self.failure.check(sender.session if sender is not None else msg.fields.get("session"), msg.type)
            getattr(self, f"_on_{msg.type}")(identity, rid, msg)
        except WireError as exc:
            self.stats.refused[exc.code] += 1
            self._error(identity, rid if kind is not None else bounds.header_rid(body, self.limits), exc.code,
                        str(exc))
        except Exception as exc:  # a bug must not take the PS down with it
            self.stats.refused["internal"] += 1
            log.error("internal error while serving a request:\n%s", traceback.format_exc())
            self._error(identity, rid, "internal", f"internal error in the parameter server: {exc}")
        return kind

    def _send(self, identity: bytes, rid: Any, msg_type: str, fields: dict[str, Any] | None = None,
              tensors: dict[str, Tensor] | None = None) -> None:
        fields = {**(fields or {}), "rid": rid, "epoch": self.epoch, **self.leadership()}
        self._send_frames(identity, encode(msg_type, fields, tensors))

    def _send_frames(self, identity: bytes, frames: list[Any]) -> int:
        """Send a reply; one to a connection with REPLY_HWM unread replies, or gone, or past the bytes queued over
        all connections (ps/replies.py), is dropped and counted. Returns the bytes sent (0 if dropped)."""
        size = message_bytes(frames)
        ready = self.replies.admit(identity, frames, size, identity in self.members.by_identity)
        if ready is None:
            self.stats.replies_dropped["total"] += 1
            return 0
        try:
            self.socket.send_multipart([identity, *ready], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # Again: its queue is full; EHOSTUNREACH: it is gone (ROUTER_MANDATORY)
            self.stats.replies_dropped["queue_full" if isinstance(exc, zmq.Again) else "gone"] += 1
            return 0
        self.replies.sent(identity, ready, size)
        self.stats.bytes_out += size
        if (worker := self.members.by_identity.get(identity)) is not None:
            self.stats.bytes_out_by_rank[worker.rank] += size
        return size

    def _before_reply(self, identity: bytes) -> None:
        """Before a reply to a worker's request: it may write the memory it lent once it has the answer."""
        sender = self.members.by_identity.get(identity)
        if sender is not None:
            self.store.before_answer(sender.session, self.stats.messages_in)

    def _error(self, identity: bytes, rid: Any, code: str, text: str) -> None:
        self._before_reply(identity)
        self._send(identity, rid, "error", {"code": code, "message": text})

    # -- membership and collectives ------------------------------------------------------------

    def _update_trainers(self) -> None:
        ranks = self.members.trainers()
        if self.replicate_trainers(ranks):  # False: not leading (a standby, or replaced)
            self._resolve(self.store.set_trainers(ranks))

    def check_liveness(self, now: float | None = None) -> list[int]:
        """Declare lost the heartbeating workers silent for ``worker_timeout`` s; returns their ranks.

        Args:
            now: the time to judge silence at, in ``time.time()`` seconds; None: now.
        """
        gone = self.members.check_liveness(now)
        if gone:
            self._update_trainers()
            self.collectives.recheck()
        return gone

    def _on_heartbeat(self, identity: bytes, rid: Any, msg: Message) -> None:
        if self.members.heartbeat(msg):  # no reply: it comes from the worker's heartbeat socket
            self._update_trainers()

    def _on_hello(self, identity: bytes, rid: Any, msg: Message) -> None:
        mode = msg.str_field("mode")
        run = msg.fields.get("run")  # first: a previous Trainer's PS may run another mode, and the worker waits it out
        if self.config.run is not None and run is not None and run != self.config.run:
            raise WireError("run_mismatch", f"this embedded parameter server serves run {self.config.run} of the "
                                            f"process that started it, the worker asked for run {run}: a previous "
                                            "Trainer's PS still answers on this port (it stops once its successor "
                                            "starts), or the ranks made their Trainers in different orders")
        check_mode(self.mode, self.knobs, mode, msg.fields.get("options"))
        held = self.members.claimed()  # a digest or world fixed by hellos alone holds while their workers may
        digest = self.shard.check(msg.fields, self.address, held=held)
        worker, replaced = self.members.hello(identity, msg, self.store.version)
        self.shard.fix(digest, final=self.store.initialized, held=held)  # accepted: only now it may fix a digest
        if replaced is not None:
            self.store.forget(replaced)
        while self.members.forgotten:  # past limits.SESSIONS_PER_RANK: they can push no more
            self.store.last_seq.pop(self.members.forgotten.pop(), None)
        self.collectives.joined(worker.rank, worker.stage)
        self.replicate_member(worker.session)
        self._update_trainers()
        self._send(identity, rid, "welcome", {
            "initialized": self.store.initialized, "version": self.store.version, "mode": self.mode,
            "stop": self.store.stopped, "max_message_bytes": self.limits.max_message_bytes,
            "shm": self.store.segments is not None, "token": worker.token, "pid": os.getpid(),
            "failover_timeout": self.config.failover_timeout,
        })

    def _on_attach(self, identity: bytes, rid: Any, msg: Message) -> None:
        """A worker on this machine offers its push segment (see :mod:`plug_asgd.protocol.push_memory`)."""
        session = msg.str_field("session")
        worker = self.members.by_identity.get(identity)
        if worker is None or worker.session != session:
            raise WireError("bad_field", "attach comes after hello, on the same connection and session")
        size = self.store.attach(session, msg.fields.get("pid"), msg.fields.get("fd"), msg.fields.get("token"))
        self._send(identity, rid, "attached", {"size": size})

    def _on_bye(self, identity: bytes, rid: Any, msg: Message) -> None:
        failed = failure.reason(msg)
        stage = self.members.bye(identity, msg)
        self._update_trainers()
        self.collectives.left(stage)
        if failed is not None:
            self._job_failed(f"the job failed: rank {msg.fields.get('rank')} stopped on {failed}")
        self._send(identity, rid, "ok")

    def _job_failed(self, text: str) -> None:
        """A rank failed: the job's other workers are refused from now on, and their gathers answered, ``text``."""
        sessions = [w.session for w in (*self.members.by_identity.values(), *self.members.lost.values())]
        if failed := self.failure.record(text, sessions):
            log.warning("%s; telling the other workers", text)
            self.collectives.fail(text, failed)

    def _on_gather(self, identity: bytes, rid: Any, msg: Message) -> None:
        self.collectives.gather(identity, rid, msg)

    def _on_notice(self, identity: bytes, rid: Any, msg: Message) -> None:
        self.collectives.notice(identity, rid, msg)

    # -- introspection -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The counters, as plain data (what ``plug-asgd status`` shows)."""
        return {**self.persistence.counters(), **self.collectives.counters(), **self.replies.counters(),
                **self.failover_counters(),
                "job_failed": self.failure.text, "world_fixed": self.members.world_fixed,
                "sessions_kept": len(self.store.last_seq), "replies_dropped": dict(self.stats.replies_dropped)}

    def _on_stats(self, identity: bytes, rid: Any, msg: Message) -> None:
        self._send(identity, rid, "stats", {"stats": self.snapshot()})

