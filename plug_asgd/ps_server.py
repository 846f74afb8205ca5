"""The parameter server: central tensors, the mode's fold-in rule, and the serving loop.

One ZeroMQ ROUTER socket serves every worker. Requests are answered in the order they are
resolved: most at once, a ``sync`` push when its round completes, a collective (``gather``,
which carries barriers, broadcasts and metric reductions) when every rank still in the stage
has contributed. A request that breaks the protocol gets an ``error`` reply and a counter;
the PS keeps serving and its tensors are untouched. The PS knows nothing of torch or
Lightning: it holds named float arrays.

Liveness: a worker whose hello announced heartbeats (``PSClient`` sends one every
``heartbeat_s`` from a thread of its own, so a long step does not count as silence) and that
is silent for ``worker_timeout`` seconds is declared lost: no sync round, staleness bound or
collective waits for it any more. If it speaks again (a frozen process resumed, a network cut
healed), it is taken back as it is, and its late pushes meet the mode's rule like any stale
push; a collective it missed is answered from the record of completed ones. A restarted worker
(a new session for the same rank) replaces the lost one and starts from the central model.

Workers on the PS's machine may push through shared memory instead of the socket (see
:mod:`plug_asgd.push_memory`): the PS maps each one's segment once, when it attaches.

It listens on loopback unless given keys (CURVE, see :mod:`plug_asgd.security`) or told
``insecure``; a peer refused in the CURVE handshake is counted as ``refused["auth"]``.

The PS ends by itself: on SIGINT/SIGTERM, when the process that started it dies
(``parent_pid``), or, given ``expected_workers``, once that many workers have joined and
all have left (or been lost) for ``linger`` seconds.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from plug_asgd.checkpoint import CheckpointError, CheckpointPolicy, read_checkpoint, resolve_checkpoint
from plug_asgd.compressors import decode as decode_update
from plug_asgd.modes import APPLIED, CentralState, Push, all_finite, can_fold_into
from plug_asgd.modes import get as get_mode
from plug_asgd.push_memory import AttachedSegments
from plug_asgd.push_memory import available as shm_available
from plug_asgd.security import check_bind, load_server_keys
from plug_asgd.slices import SlicePool
from plug_asgd.wire import (
    DEFAULT_LIMITS,
    FLOAT_DTYPES,
    Limits,
    Local,
    Message,
    Sparse,
    Tensor,
    WireError,
    decode,
    encode,
    message_bytes,
)

log = logging.getLogger("plug_asgd.ps")

DEFAULT_WORKER_TIMEOUT = 20.0  # seconds of silence (no heartbeat, no request) before a worker is lost
COMPLETED_KEPT = 1024  # collectives whose result a worker that comes back late can still get
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def frame_cap(limits: Limits) -> int:
    """ZeroMQ's MAXMSGSIZE for the PS's socket: twice ``limits.max_message_bytes``.

    libzmq applies MAXMSGSIZE to each frame and, above it, drops the sender's connection without
    delivering anything, which the PS could neither answer nor count. So the PS checks
    ``max_message_bytes`` itself, on the whole message once received (an ``error`` reply with
    code ``too_large`` and a counter), and leaves libzmq only the job of bounding memory: a single
    frame above twice the limit cuts the connection (not counted: libzmq reports it as a plain
    disconnect). plug_asgd's client never sends either: it learns the limit in the hello reply and
    refuses a larger request itself, with an error saying so.
    """
    return min(2 * limits.max_message_bytes, (1 << 63) - 1)


@dataclass
class WorkerInfo:
    rank: int
    identity: bytes
    session: str
    stage: int
    training: bool
    last_seen: float
    pushes: int = 0
    heartbeat_s: float | None = None  # announced in hello; None: never declared lost


@dataclass
class Stats:
    """Global counters, as the ``stats`` request returns them."""

    started: float = field(default_factory=time.time)
    messages_in: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    push_bytes_in: int = 0
    push_local_bytes_in: int = 0  # read from workers' shared memory instead of the socket
    pushes_applied: int = 0
    pushes_dropped: int = 0
    pushes_after_stop: int = 0
    push_messages: int = 0  # every push received, whatever became of it
    busy_s: float = 0.0  # wall time the serving thread spent handling requests (taken to answered)
    busy_cpu_s: float = 0.0  # ... of which it ran on a core (less when it waited for one)
    push_busy_s: float = 0.0  # wall time handling pushes
    push_busy_cpu_s: float = 0.0  # ... of which on a core
    copies_on_write: int = 0
    own_replies: int = 0
    weights_pushes: int = 0  # pushes of weights taken as the model (see PSClient.push)
    weights_not_current: int = 0  # ... answered "not_current" instead: nothing folded
    weights_lent: int = 0  # ... kept as the model in the worker's own memory, without a copy (``lend``)
    lent_copies: int = 0  # lent weights copied after all (a model reply, a write in place, a stop)
    workers_lost: int = 0
    workers_back: int = 0
    refused: Counter = field(default_factory=Counter)
    staleness: Counter = field(default_factory=Counter)
    pushes_by_rank: Counter = field(default_factory=Counter)


@dataclass
class _Reply:
    """Where a push's answer goes, and what it should carry (``want``: all, none or unless_own)."""

    identity: bytes
    rid: Any
    want: str
    own_version: int | None = None  # the version this push alone made, when it was folded in exactly


class ParameterServer:
    """Serves one central model to the workers of a run."""

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:2223",
        mode: str = "asgd",
        *,
        replicas_to_aggregate: int | None = None,
        staleness_bound: int | None = None,
        max_updates: int | None = None,
        expected_workers: int | None = None,
        linger: float = 10.0,
        limits: Limits = DEFAULT_LIMITS,
        parent_pid: int | None = None,
        checkpoint: CheckpointPolicy | None = None,
        resume: str | os.PathLike[str] | None = None,
        run_dir: str | os.PathLike[str] | None = None,
        metrics_every: float = 2.0,
        worker_timeout: float = DEFAULT_WORKER_TIMEOUT,
        context: zmq.Context | None = None,
        keys: str | os.PathLike[str] | None = None,
        insecure: bool = False,
        threads: int = 1,
        shm_pushes: bool = True,
    ) -> None:
        """``threads``: how many threads fold a large dense update in (see :mod:`plug_asgd.slices`);
        ``shm_pushes``: whether workers on this machine may push through shared memory."""
        if worker_timeout <= 0:
            raise ValueError(f"worker_timeout must be > 0 seconds, got {worker_timeout}")
        check_bind(bind, keys is not None, insecure)  # before anything is loaded or bound
        server_keys = load_server_keys(keys) if keys is not None else None
        self.spec = get_mode(mode)
        self.mode = mode
        self.rule = self.spec.make_rule({"replicas_to_aggregate": replicas_to_aggregate,
                                         "staleness_bound": staleness_bound})
        if not 1 <= threads <= 256:
            raise ValueError(f"threads must be between 1 and 256, got {threads}")
        self.threads = threads
        self.state = CentralState(tensors={}, pool=SlicePool(threads) if threads > 1 else None)
        self.initialized = False
        self.max_updates = max_updates
        self.expected_workers = expected_workers
        self.linger = linger
        self.limits = limits
        self.parent_pid = parent_pid
        self.world_size: int | None = None
        self.workers: dict[int, WorkerInfo] = {}
        self.worker_timeout = worker_timeout
        self.lost: dict[int, WorkerInfo] = {}  # declared dead; taken back if they speak again
        self.completed: dict[tuple[int, int], tuple[dict[str, Any], dict[str, Tensor]]] = {}
        self._in_flight: list[zmq.MessageTracker] = []
        # central tensors that are still the buffer of the push they came in: (array, frame) by name
        self._frames: dict[str, tuple[np.ndarray, Any]] = {}
        # workers' shared segments (None: pushes come over the socket only), and arrays no reply
        # holds any more, which the next fold out of a shared segment writes into
        self.segments = AttachedSegments(limits.max_message_bytes) if shm_pushes and shm_available() else None
        self._spares: dict[str, np.ndarray] = {}
        # a lone worker's weights kept as the central tensors in its own memory (see _on_push), and its session
        self._lent: dict[str, np.ndarray] = {}
        self._lender: str | None = None
        self._lent_at = -1  # the number of the request (messages_in) that lent them
        self._by_identity: dict[bytes, WorkerInfo] = {}
        self.ever_joined: set[int] = set()
        self.left: dict[int, set[int]] = defaultdict(set)
        self.late: dict[int, set[int]] = defaultdict(set)  # restarted mid-stage: outside its collectives
        self.gathers: dict[tuple[int, int], dict[int, tuple[Any, Message, Any]]] = {}
        self.last_seq: dict[str, int] = {}
        self.stats = Stats()
        self.checkpoint = checkpoint
        self.resumed_from: Path | None = None
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.metrics_every = metrics_every
        self._next_metrics = 0.0
        self._stop = False
        self._empty_since: float | None = None
        if resume is not None:
            self._resume(resume)
        # a ZAP handler is one per context: a keyed PS gets its own unless one is given
        self._own_ctx = context is None and server_keys is not None
        self._ctx = context or (zmq.Context() if self._own_ctx else zmq.Context.instance())
        self.socket = self._ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, frame_cap(limits))
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._auth: Any = None
        self._monitor: zmq.Socket | None = None
        if server_keys is not None:
            self._auth = self._start_authenticator(server_keys)
        try:
            self.socket.bind(bind)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"the parameter server cannot listen on {bind}: {exc} (is another process "
                          "using that port? choose another with --port)") from None
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.keyed = server_keys is not None

    def _start_authenticator(self, keys: Any) -> Any:
        """CURVE on the ROUTER; a ZAP thread accepts only the authorized workers' public keys.

        A peer refused in the handshake (no key, a key not authorized, the wrong server key) never
        reaches the ROUTER, so it never gets a byte of the model; the socket monitor's
        HANDSHAKE_FAILED_* events count it in ``refused["auth"]`` (one per failed handshake: a
        client that retries is counted at each attempt).
        """
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(self._ctx, log=logging.getLogger("plug_asgd.ps.auth"))
        auth.start()
        auth.configure_curve(domain="*", location=str(keys.authorized_dir))
        self.socket.curve_server = True
        self.socket.curve_publickey = keys.public
        self.socket.curve_secretkey = keys.secret
        self._monitor = self.socket.get_monitor_socket(_HANDSHAKE_FAILED)
        return auth

    def _on_monitor(self) -> None:
        assert self._monitor is not None
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event & _HANDSHAKE_FAILED:
                self.stats.refused["auth"] += 1

    def _close_sockets(self) -> None:
        if self._monitor is not None:
            self.socket.disable_monitor()
            self._monitor.close(0)
            self._monitor = None
        self.socket.close(0)
        self._release_lent()  # the final checkpoint saves the PS's own arrays
        if self.segments is not None:
            self.segments.clear()
        if self.state.pool is not None:
            self.state.pool.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._own_ctx:
            self._ctx.term()
            self._own_ctx = False

    # -- serving -------------------------------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        self._stop = True

    def serve_forever(self, poll_ms: int = 200, on_tick: Callable[[ParameterServer], None] | None = None,
                      tick_s: float = 0.5) -> int:
        """Serve until told to stop or until the run is over; returns a process exit code.

        ``on_tick(server)`` runs every ``tick_s`` seconds in the serving thread, between requests,
        so it sees a consistent state (the live dashboard uses it).
        """
        log.info("parameter server listening on %s, mode %s", self.address, self.mode)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
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
                    while True:
                        try:
                            frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_frames(frames)
                self.check_liveness()
                self._housekeeping()
                if self._should_exit():
                    break
        finally:
            if self._monitor is not None:
                self._on_monitor()
            self._close_sockets()
            self._housekeeping(final=True)
        log.info("parameter server stopped at version %d", self.state.version)
        return 0

    def _should_exit(self) -> bool:
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.info("the process that started the parameter server is gone; stopping")
            return True
        if self.expected_workers is None or len(self.ever_joined) < self.expected_workers:
            return False
        if self.workers:
            self._empty_since = None
            return False
        now = time.monotonic()
        if self._empty_since is None:
            self._empty_since = now
        if now - self._empty_since >= self.linger:
            log.info("all %d workers have left; stopping", len(self.ever_joined))
            return True
        return False

    def _on_frames(self, frames: list[Any]) -> None:
        """Handle one request, and count the time it took (``busy_s``: how loaded the PS is)."""
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
        identity = frames[0].bytes
        body = frames[1:]
        self.stats.messages_in += 1
        worker = self._by_identity.get(identity)
        if worker is not None:
            worker.last_seen = time.time()
        else:
            lost = next((w for w in self.lost.values() if w.identity == identity), None)
            if lost is not None:
                self._take_back(lost)
        size = message_bytes(body)
        self.stats.bytes_in += size
        rid = kind = None
        try:
            msg = decode(body, self.limits)
            rid, kind = msg.fields.get("rid"), msg.type
            if msg.type != "push" and any(isinstance(t, Local) for t in msg.tensors.values()):
                raise WireError("bad_local", f"a {msg.type!r} message cannot name shared memory: only pushes do")
            handler = getattr(self, f"_on_{msg.type}", None) if msg.type.isidentifier() else None
            if handler is None:
                raise WireError("unknown_type", f"unknown message type {msg.type!r}")
            if msg.type == "push":
                self.stats.push_bytes_in += size
                self.stats.push_messages += 1
            handler(identity, rid, msg)
        except WireError as exc:
            self.stats.refused[exc.code] += 1
            self._error(identity, rid, exc.code, str(exc))
        except Exception as exc:  # a bug must not take the PS down with it
            self.stats.refused["internal"] += 1
            log.error("internal error while serving a request:\n%s", traceback.format_exc())
            self._error(identity, rid, "internal", f"internal error in the parameter server: {exc}")
        return kind

    def _send(self, identity: bytes, rid: Any, msg_type: str, fields: dict[str, Any] | None = None,
              tensors: dict[str, Tensor] | None = None) -> None:
        frames = encode(msg_type, {**(fields or {}), "rid": rid}, tensors)
        self.stats.bytes_out += message_bytes(frames)
        self.socket.send_multipart([identity, *frames], copy=False)

    def _error(self, identity: bytes, rid: Any, code: str, text: str) -> None:
        self._before_reply(identity)
        self._send(identity, rid, "error", {"code": code, "message": text})

    # -- membership ----------------------------------------------------------------------------

    def _trainers(self) -> frozenset[int]:
        return frozenset(r for r, w in self.workers.items() if w.training)

    def _absent(self, stage: int) -> set[int]:
        """Ranks a collective of ``stage`` does not wait for: those that left it and those lost."""
        return self.left.get(stage, set()) | self.late.get(stage, set()) | set(self.lost)

    def check_liveness(self, now: float | None = None) -> list[int]:
        """Declare lost the heartbeating workers silent for ``worker_timeout`` s; returns their ranks."""
        now = time.time() if now is None else now
        gone = [w for w in self.workers.values()
                if w.heartbeat_s is not None and now - w.last_seen > self.worker_timeout]
        for w in gone:
            del self.workers[w.rank]
            self._by_identity.pop(w.identity, None)
            self.lost[w.rank] = w
            self.stats.workers_lost += 1
            log.warning("rank %d silent for %.1f s (worker_timeout %g s): declared lost; nothing waits for it "
                        "now", w.rank, now - w.last_seen, self.worker_timeout)
        if gone:
            self._update_trainers()
            for key in list(self.gathers):
                self._maybe_finish_gather(key)
        return [w.rank for w in gone]

    def _take_back(self, worker: WorkerInfo) -> None:
        """A lost worker spoke again: it rejoins as it was (its stale pushes meet the mode's rule)."""
        del self.lost[worker.rank]
        silent = time.time() - worker.last_seen
        worker.last_seen = time.time()
        self.workers[worker.rank] = worker
        self._by_identity[worker.identity] = worker
        self.stats.workers_back += 1
        log.warning("rank %d is back after %.1f s of silence", worker.rank, silent)
        self._update_trainers()

    def _on_heartbeat(self, identity: bytes, rid: Any, msg: Message) -> None:
        """From a worker's heartbeat socket (another identity): keeps its main connection alive. No reply."""
        rank = msg.int_field("rank", minimum=0)
        session = msg.str_field("session")
        worker = self.workers.get(rank)
        if worker is not None and worker.session == session:
            worker.last_seen = time.time()
        elif rank in self.lost and self.lost[rank].session == session:
            self._take_back(self.lost[rank])

    def _update_trainers(self) -> None:
        self._writable(in_place=not self.rule.folds_into_update)  # a sync round may complete
        self._resolve(self.rule.set_trainers(self.state, self._trainers()))

    def _on_hello(self, identity: bytes, rid: Any, msg: Message) -> None:
        rank = msg.int_field("rank", minimum=0)
        world_size = msg.int_field("world_size", minimum=1)
        stage = msg.int_field("stage", minimum=0)
        session = msg.str_field("session")
        mode = msg.str_field("mode")
        if mode != self.mode:
            raise WireError("mode_mismatch", f"this parameter server runs mode {self.mode!r} but the worker "
                                             f"asked for {mode!r}: start the PS with --mode {mode} or "
                                             f"give the strategy mode={self.mode!r}")
        if self.world_size is not None and world_size != self.world_size and self.workers:
            raise WireError("world_mismatch", f"worker says world_size={world_size}, the workers already "
                                              f"connected say {self.world_size}")
        if rank >= world_size:
            raise WireError("bad_field", f"rank {rank} is not below world_size {world_size}")
        heartbeat = msg.fields.get("heartbeat_s")
        if heartbeat is not None and (isinstance(heartbeat, bool) or not isinstance(heartbeat, int | float)
                                      or not 0 < heartbeat < 3600):
            raise WireError("bad_field", f"heartbeat_s must be a number of seconds in (0, 3600), got {heartbeat!r}")
        self.world_size = world_size
        previous = self.workers.get(rank)
        if previous is not None:
            self._by_identity.pop(previous.identity, None)  # a reconnected worker has a new identity
        if previous is not None and previous.session != session and self.segments is not None:
            if self._lender == previous.session:
                self._release_lent()
            self.segments.drop(previous.session)
        if previous is None and rank in self.lost:
            previous = self.lost.pop(rank)  # restarted: the new process replaces the lost one
            log.warning("rank %d restarted (a new session) in stage %d: it starts from version %d", rank, stage,
                        self.state.version)
        if previous is not None and previous.session != session and previous.stage == stage:
            # a restarted process in a stage whose collectives the others have begun: it cannot take
            # part in them in step, so it trains alongside and its collectives are its own
            self.late[stage].add(rank)
        worker = WorkerInfo(rank, identity, session, stage, bool(msg.fields.get("training")), time.time(),
                            previous.pushes if previous is not None else 0,
                            float(heartbeat) if heartbeat is not None else None)
        self.workers[rank] = worker
        self._by_identity[identity] = worker
        self.ever_joined.add(rank)
        self.left[stage].discard(rank)
        # a rank in stage s has left every earlier one (what a PS restarted mid-run learns from re-hellos)
        for key in [k for k in self.gathers if k[0] < stage]:
            self.left[key[0]].add(rank)
            self._maybe_finish_gather(key)
        self._update_trainers()
        self._send(identity, rid, "welcome", {
            "initialized": self.initialized, "version": self.state.version, "mode": self.mode,
            "stop": self._stopped(), "max_message_bytes": self.limits.max_message_bytes,
            "shm": self.segments is not None,
        })

    def _on_attach(self, identity: bytes, rid: Any, msg: Message) -> None:
        """A worker on this machine offers its push segment (see :mod:`plug_asgd.push_memory`)."""
        session = msg.str_field("session")
        worker = self._by_identity.get(identity)
        if worker is None or worker.session != session:
            raise WireError("bad_field", "attach comes after hello, on the same connection and session")
        if self.segments is None:
            raise WireError("bad_local", "this parameter server takes pushes over its socket only (it was started "
                                         "with --no-shm-pushes, or this system cannot share sealed memory)")
        size = self.segments.attach(session, msg.fields.get("pid"), msg.fields.get("fd"), msg.fields.get("token"))
        self._send(identity, rid, "attached", {"size": size})

    def _on_bye(self, identity: bytes, rid: Any, msg: Message) -> None:
        rank = msg.int_field("rank", minimum=0)
        stage = msg.int_field("stage", minimum=0)
        worker = self.workers.get(rank)
        if worker is not None and worker.stage == stage:
            del self.workers[rank]
            self._by_identity.pop(worker.identity, None)
        self.lost.pop(rank, None)
        self.left[stage].add(rank)
        self._update_trainers()
        for key in [k for k in self.gathers if k[0] == stage]:
            self._maybe_finish_gather(key)
        if self.world_size is not None and len(self.left[stage]) >= self.world_size:
            del self.left[stage]  # every rank is done with this stage
            self.late.pop(stage, None)
            for key in [k for k in self.completed if k[0] == stage]:
                del self.completed[key]
        self._send(identity, rid, "ok")

    # -- model ---------------------------------------------------------------------------------

    def _stopped(self) -> bool:
        return self.max_updates is not None and self.state.version >= self.max_updates

    def _on_init(self, identity: bytes, rid: Any, msg: Message) -> None:
        accepted = not self.initialized
        if accepted:
            tensors: dict[str, np.ndarray] = {}
            for name, t in msg.tensors.items():
                if not isinstance(t, np.ndarray) or t.dtype.name not in FLOAT_DTYPES:
                    raise WireError("bad_tensor", f"tensor {name!r}: the central model holds dense float tensors")
                if not all_finite(t):
                    raise WireError("not_finite", f"tensor {name!r} holds NaN or Inf")
                tensors[name] = np.array(t, copy=True)
            if not tensors:
                raise WireError("bad_tensor", "init carries no tensors")
            self.state.tensors = tensors
            self.initialized = True
            log.info("central model initialised by rank %s: %d tensors, %d values", msg.fields.get("rank"),
                     len(tensors), sum(t.size for t in tensors.values()))
        self._send(identity, rid, "init_ok", {"accepted": accepted, "version": self.state.version})

    def _require_init(self) -> None:
        if not self.initialized:
            raise WireError("not_initialized", "the central model is not initialised yet: a worker sends it first")

    def _on_pull(self, identity: bytes, rid: Any, msg: Message) -> None:
        self._require_init()
        self._send_model(identity, rid, {"status": "pulled"})

    def _received_frames(self) -> dict[str, Any]:
        """The central tensors that are still the received buffers they were folded into, as frames."""
        tensors = self.state.tensors
        return {name: frame for name, (array, frame) in self._frames.items() if tensors.get(name) is array}

    def _send_model(self, identity: bytes, rid: Any, fields: dict[str, Any], with_tensors: bool = True) -> None:
        fields = {**fields, "version": self.state.version, "stop": self._stopped()}
        if not with_tensors:
            self._before_reply(identity)
            self._send(identity, rid, "model", fields)
            return
        self._release_lent()  # a reply in flight must not read memory its worker may write again
        reuse = self._received_frames()
        frames = encode("model", {**fields, "rid": rid}, self.state.tensors, reuse=reuse)
        self.stats.bytes_out += message_bytes(frames)
        # Received frames are resent as they are (pyzmq shares their memory); the PS's own arrays go
        # out zero-copy and are tracked, so that _writable knows when they are free again.
        # (pyzmq copies buffers below its copy_threshold: those need no tracking either)
        threshold = self.socket.copy_threshold
        parts = [f if isinstance(f, zmq.Frame) or memoryview(f).nbytes < threshold else zmq.Frame(f, track=True)
                 for f in frames]
        self.socket.send_multipart([identity, *parts], copy=False)
        self._in_flight += [p.tracker for p in parts if isinstance(p, zmq.Frame) and p.tracker is not None]

    def _before_reply(self, identity: bytes) -> None:
        """Before answering a worker's push or pull (but the push that lent, as it is handled): give back what it lent.

        It may write that memory as soon as it has the answer, so the PS stops using it first.
        """
        if self._lender is not None and self.stats.messages_in != self._lent_at:
            sender = self._by_identity.get(identity)
            if sender is not None and sender.session == self._lender:
                self._release_lent()

    def _release_lent(self) -> set[str]:
        """Give a worker back the memory it lent (see ``lend`` in :meth:`_on_push`), copying what is still central.

        Returns the names of those copies: fresh arrays that no reply has sent.
        """
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
        """Whether ZeroMQ may still be reading a reply sent zero-copy from the PS's own arrays."""
        self._in_flight = [t for t in self._in_flight if not t.done]
        return bool(self._in_flight)

    def _writable(self, in_place: bool = True) -> None:
        """Call before the central tensors change; ``in_place``: whether they may be written in place.

        Model replies go out zero-copy: ZeroMQ's I/O thread may still be reading the arrays when
        the next update arrives. Folding into them then would send a worker half of one version
        and half of the next. While a reply is in flight, the PS folds into fresh copies instead
        (copy-on-write); the frames keep the old arrays alive until they are sent. A central tensor
        that is a received buffer (see ``modes._fold_all``) cannot be tracked once resent, so it is
        copied before any write in place. Folds into the push's own buffers write nothing in place.
        """
        in_flight = self._replies_in_flight()
        if not in_place:
            return
        fresh = self._release_lent()  # copied just now: no reply in flight reads them
        received = self._received_frames()
        if in_flight or received:
            stale = {name for name in self.state.tensors if (in_flight and name not in fresh) or name in received}
            self.state.tensors = {name: t.copy() if name in stale else t for name, t in self.state.tensors.items()}
            self._in_flight = []
            self._frames = {}
            self.stats.copies_on_write += bool(stale)

    def _decode_update(self, update: dict[str, Tensor]) -> dict[str, Tensor]:
        """What each compressor sent, decoded into the central tensor's dtype (not yet checked for NaN/Inf)."""
        out: dict[str, Tensor] = {}
        for name, t in update.items():
            central = self.state.tensors.get(name)
            if central is None:
                raise WireError("unknown_tensor", f"the central model has no tensor {name!r}")
            if tuple(t.shape) != central.shape:
                raise WireError("bad_tensor", f"tensor {name!r}: got shape {list(t.shape)}, the central model "
                                              f"holds {central.dtype.name}{list(central.shape)}")
            out[name] = decode_update(t, central.dtype, shape=central.shape)
        return out

    @staticmethod
    def _check_finite(update: dict[str, Tensor]) -> None:
        for name, t in update.items():
            if not all_finite(t.values if isinstance(t, Sparse) else t):
                raise WireError("not_finite", f"update refused: tensor {name!r} holds NaN or Inf (has the worker's "
                                              "training diverged? lower the learning rate)")

    def _on_push(self, identity: bytes, rid: Any, msg: Message) -> None:
        self._require_init()
        rank = msg.int_field("rank", minimum=0)
        base = msg.int_field("base_version", minimum=0)
        seq = msg.int_field("seq", minimum=0)
        session = msg.str_field("session")
        if base > self.state.version:
            if self.resumed_from is None:
                raise WireError("bad_field", f"base_version {base} is ahead of the central version "
                                             f"{self.state.version}")
            base = self.state.version  # based on updates this PS lost in its crash: fold in as fresh
        if seq <= self.last_seq.get(session, -1):
            raise WireError("duplicate", f"push {seq} of this worker was already received")
        sent, local_bytes = self._local_tensors(session, msg.tensors)
        update = self._decode_update(sent)
        model = msg.fields.get("model", True)
        want_model = model is not False
        weights = msg.fields.get("weights", False)
        if not isinstance(weights, bool):  # (1 == True: a membership test would let 1 through)
            raise WireError("bad_field", f"field 'weights' must be true or false, got {weights!r:.40}")
        lend = msg.fields.get("lend", False)
        if not isinstance(lend, bool):  # (1 == True: a membership test would let 1 through)
            raise WireError("bad_field", f"field 'lend' must be true or false, got {lend!r:.40}")
        staleness = self.state.version - base
        # Exactly base + this update once folded: nothing else folded in since the base, dense values used as
        # sent. Not after a resume: versions made before the crash and after it share numbers, not contents.
        exact = (staleness == 0 and self.resumed_from is None and self.rule.folds_into_update
                 and all(isinstance(u, np.ndarray) and u is sent[n] for n, u in update.items()))
        if weights and not exact and not self._stopped():
            # The model moved on since the worker's base, or this mode folds otherwise: folding
            # ``weights - base`` would need that base, which only the worker has. It pushes that.
            self.last_seq[session] = seq
            self.stats.weights_not_current += 1
            self._send_model(identity, rid, {"status": "not_current"}, False)
            return
        # Where a rule that folds writes the new central tensors (``modes._fold_all``): into the
        # update's own received buffers, or, for an update read from shared memory (or weights in
        # read-only frames), into spare arrays of the PS; the rule checks the results. Any other
        # update is checked here, before a fold writes in place, and one read from shared memory
        # is copied first. Weights that their worker lends (all of the model, in its shared memory)
        # become the central tensors as they are, checked, without a copy: the worker leaves them
        # alone until this PS has answered its next push or pull, and the PS gives them back by
        # then (``_release_lent``: a copy only if they are still the model).
        lends = (weights and lend and exact and update.keys() == self.state.tensors.keys()
                 and all(isinstance(msg.tensors[n], Local) for n in update))
        out = None
        if lends:
            out = update
        elif self.rule.folds_into_update:
            if all(can_fold_into(u, self.state.tensors[n]) for n, u in update.items()):
                out = update
            elif (local_bytes or weights) and all(isinstance(u, np.ndarray) for u in update.values()):
                out = self._spare_buffers(update)
        if out is None and local_bytes:  # still views of the worker's memory: the PS's own copies
            update = {n: np.array(u) if u is sent[n] and isinstance(msg.tensors[n], Local) else u
                      for n, u in update.items()}
        if self._stopped():
            self._check_finite(update)
            self.last_seq[session] = seq
            self.stats.pushes_after_stop += 1
            self._send_model(identity, rid, {"status": "stopped"}, want_model)
            return
        if out is None:
            self._check_finite(update)
        self._writable(in_place=out is None)
        token = _Reply(identity, rid, "none" if model is False else "unless_own" if model == "unless_own" else "all")
        # the arrays a fold into spares replaces (lent weights replace them too) are the next fold's spares
        recycle = lends or (out is not None and out is not update)
        before = dict(self.state.tensors) if recycle else {}
        resolutions = self.rule.push(self.state, Push(token, rank, base, update, out, replace=weights))
        self.stats.weights_pushes += weights
        if lends and all(self.state.tensors[n] is u for n, u in update.items()):
            self._lent, self._lender, self._lent_at = dict(update), session, self.stats.messages_in
            self.stats.weights_lent += 1
        if exact:
            token.own_version = self.state.version
        self.last_seq[session] = seq
        self.stats.push_local_bytes_in += local_bytes
        self.stats.staleness[staleness] += 1
        self.stats.pushes_by_rank[rank] += 1
        if rank in self.workers:
            self.workers[rank].pushes += 1
        if out is update and not lends:  # folded into the frames it came in: the replies resend those frames
            for name, array in update.items():
                if self.state.tensors.get(name) is array and msg.tensors.get(name) is array:
                    self._frames[name] = (array, msg.frames[name])
        elif recycle:
            self._recycle(before)
        self._resolve(resolutions)

    def _local_tensors(self, session: str, tensors: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """``tensors`` with each :class:`Local` reference read from ``session``'s segment, and their bytes."""
        if not any(isinstance(t, Local) for t in tensors.values()):
            return tensors, 0
        if self.segments is None:
            raise WireError("bad_local", "this parameter server takes pushes over its socket only: push the "
                                         "update's bytes")
        out, nbytes = {}, 0
        for name, t in tensors.items():
            if isinstance(t, Local):
                t = self.segments.resolve(session, t)
                nbytes += t.nbytes
            out[name] = t
        return out, nbytes

    def _spare_buffers(self, update: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
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

    def _resolve(self, resolutions: list[tuple[Any, str]]) -> None:
        for token, status in resolutions:
            if status == APPLIED:
                self.stats.pushes_applied += 1
            else:
                self.stats.pushes_dropped += 1
            if status == APPLIED and token.want == "unless_own" and token.own_version == self.state.version:
                # nothing but this push changed the model since the worker's base: it can add its
                # update to its base itself (same float additions, same bits); the model stays here
                self.stats.own_replies += 1
                self._send_model(token.identity, token.rid, {"status": status, "own": True}, False)
            else:
                self._send_model(token.identity, token.rid, {"status": status},
                                 token.want != "none" or status != APPLIED)

    # -- collectives ---------------------------------------------------------------------------

    def _on_gather(self, identity: bytes, rid: Any, msg: Message) -> None:
        rank = msg.int_field("rank", minimum=0)
        stage = msg.int_field("stage", minimum=0)
        seq = msg.int_field("seq", minimum=0)
        if rank in self.left.get(stage, ()):
            raise WireError("bad_field", f"rank {rank} has already left stage {stage}")
        key = (stage, seq)
        if key in self.completed:  # it was lost while the others held this collective: their result
            fields, tensors = self.completed[key]
            self._send(identity, rid, "gathered", fields, tensors)
            return
        if rank in self.late.get(stage, ()):
            self._send(identity, rid, "gathered", {"ranks": [rank], "objs": [msg.fields.get("obj")]},
                       {f"{rank}/{n}": t for n, t in msg.tensors.items()})
            return
        entries = self.gathers.setdefault(key, {})
        kind = str(msg.fields.get("kind", ""))
        other = next(((r, e[1].fields.get("kind", "")) for r, e in entries.items()
                      if r != rank and e[1].fields.get("kind", "").split(":")[0] != kind.split(":")[0]), None)
        if other is not None:
            del self.gathers[key]
            text = (f"collective mismatch: rank {rank} called {kind or '?'} where rank {other[0]} called "
                    f"{other[1] or '?'} (collective {seq} of stage {stage}). Every rank must reach the same "
                    "collectives in the same order; note that trainer.log_dir is a broadcast")
            self.stats.refused["collective_mismatch"] += 1
            for ident, _, their_rid in entries.values():
                self._error(ident, their_rid, "collective_mismatch", text)
            raise WireError("collective_mismatch", text)
        # a contribution sent again (after a reconnection) replaces the first: the reply goes to the latest
        entries[rank] = (identity, msg, rid)
        self._maybe_finish_gather(key)

    def _maybe_finish_gather(self, key: tuple[int, int]) -> None:
        entries = self.gathers.get(key)
        if entries is None or self.world_size is None:
            return
        absent = self._absent(key[0]) - set(entries)
        if len(entries) < self.world_size - len(absent):
            return
        del self.gathers[key]
        ranks = sorted(entries)
        tensors = {f"{r}/{name}": t for r in ranks for name, t in entries[r][1].tensors.items()}
        fields = {"ranks": ranks, "objs": [entries[r][1].fields.get("obj") for r in ranks]}
        self.completed[key] = (fields, tensors)
        while len(self.completed) > COMPLETED_KEPT:
            del self.completed[next(iter(self.completed))]
        for r in ranks:
            identity, _, rid = entries[r]
            self._send(identity, rid, "gathered", fields, tensors)

    # -- persistence ---------------------------------------------------------------------------

    def _housekeeping(self, final: bool = False) -> None:
        """Checkpoint and metrics line when due (and at exit), between requests, in the serving thread."""
        policy, version = self.checkpoint, self.state.version
        if policy is not None and self.initialized and (policy.due(version) or (final and policy.unsaved(version))):
            self.save_checkpoint()
        if self.run_dir is not None and (final or time.monotonic() >= self._next_metrics):
            self._next_metrics = time.monotonic() + self.metrics_every
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with open(self.run_dir / "ps_metrics.jsonl", "a") as f:
                f.write(json.dumps({"time": round(time.time(), 3), **self.snapshot()}) + "\n")

    def save_checkpoint(self) -> Path:
        """Write the central state now: tensors, version, dedupe table, mode state, counters."""
        assert self.checkpoint is not None
        rule_fields, rule_arrays = self.rule.state()
        s = self.stats
        # stage membership is not saved: it belongs to a run, and a resumed PS may serve a new one
        fields = {
            "mode": self.mode, "version": self.state.version, "world_size": self.world_size,
            "last_seq": self.last_seq,
            "rule": rule_fields, "saved_at": time.time(),
            "stats": {"pushes_applied": s.pushes_applied, "pushes_dropped": s.pushes_dropped,
                      "push_bytes_in": s.push_bytes_in, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
                      "staleness": {str(k): v for k, v in s.staleness.items()},
                      "pushes_by_rank": {str(k): v for k, v in s.pushes_by_rank.items()}},
        }
        tensors = {f"model/{n}": t for n, t in self.state.tensors.items()}
        tensors.update((f"rule/{n}", a) for n, a in rule_arrays.items())
        path = self.checkpoint.save(self.state.version, fields, tensors)
        log.info("checkpoint %s written (version %d)", path, self.state.version)
        return path

    def _resume(self, where: str | os.PathLike[str]) -> None:
        path = resolve_checkpoint(where)
        msg = read_checkpoint(path)
        f = msg.fields
        if f.get("mode") != self.mode:
            raise CheckpointError(f"{path} was written by a PS in mode {f.get('mode')!r}; this one runs "
                                  f"{self.mode!r}: resume with --mode {f.get('mode')}")
        tensors = {n[len("model/"):]: t for n, t in msg.tensors.items() if n.startswith("model/")}
        if not tensors or any(not isinstance(t, np.ndarray) or t.dtype.name not in FLOAT_DTYPES
                              for t in tensors.values()):
            raise CheckpointError(f"{path} holds no dense float central model")
        tensors = {n: np.array(t) for n, t in tensors.items()}
        self.state = CentralState(tensors=tensors, version=int(f["version"]), pool=self.state.pool)
        self.initialized = True
        self.world_size = f.get("world_size")
        self.last_seq = {str(k): int(v) for k, v in f.get("last_seq", {}).items()}
        self.rule.restore(f.get("rule", {}), {n[len("rule/"):]: t for n, t in msg.tensors.items()
                                               if n.startswith("rule/")})
        st = f.get("stats", {})
        for name in ("pushes_applied", "pushes_dropped", "push_bytes_in", "bytes_in", "bytes_out"):
            setattr(self.stats, name, int(st.get(name, 0)))
        self.stats.staleness.update({int(k): v for k, v in st.get("staleness", {}).items()})
        self.stats.pushes_by_rank.update({int(k): v for k, v in st.get("pushes_by_rank", {}).items()})
        if self.checkpoint is not None:
            self.checkpoint.saved_version(self.state.version)
        self.resumed_from = path
        log.info("resumed from %s at version %d", path, self.state.version)

    # -- introspection -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The counters, as plain data (what ``plug-asgd status`` shows)."""
        s = self.stats
        elapsed = max(1e-9, time.time() - s.started)
        return {
            "mode": self.mode, "version": self.state.version, "initialized": self.initialized,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "max_updates": self.max_updates, "world_size": self.world_size,
            "workers": sorted(self.workers), "trainers": len(self._trainers()),
            "worker_details": [
                {"rank": w.rank, "stage": w.stage, "training": w.training, "pushes": w.pushes,
                 "last_seen_s": round(time.time() - w.last_seen, 3), "lost": w.rank in self.lost}
                for w in sorted([*self.workers.values(), *self.lost.values()], key=lambda w: w.rank)
            ],
            "uptime_s": round(elapsed, 3), "updates_per_s": round(self.state.version / elapsed, 3),
            "busy_s": round(s.busy_s, 6), "busy_cpu_s": round(s.busy_cpu_s, 6),
            "busy_fraction": round(min(1.0, s.busy_s / elapsed), 4), "push_messages": s.push_messages,
            "push_busy_s": round(s.push_busy_s, 6), "push_busy_cpu_s": round(s.push_busy_cpu_s, 6),
            "messages_in": s.messages_in, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
            "push_bytes_in": s.push_bytes_in, "push_local_bytes_in": s.push_local_bytes_in,
            "shm_segments": len(self.segments) if self.segments is not None else None,
            "pushes_applied": s.pushes_applied,
            "pushes_dropped": s.pushes_dropped, "pushes_after_stop": s.pushes_after_stop,
            "copies_on_write": s.copies_on_write, "own_replies": s.own_replies,
            "weights_pushes": s.weights_pushes, "weights_not_current": s.weights_not_current,
            "weights_lent": s.weights_lent, "lent_copies": s.lent_copies, "threads": self.threads,
            "worker_timeout_s": self.worker_timeout,
            "lost": sorted(self.lost), "workers_lost": s.workers_lost, "workers_back": s.workers_back,
            "refused": dict(s.refused), "staleness": {str(k): v for k, v in sorted(s.staleness.items())},
            "pushes_by_rank": {str(k): v for k, v in sorted(s.pushes_by_rank.items())},
        }

    def _on_stats(self, identity: bytes, rid: Any, msg: Message) -> None:
        self._send(identity, rid, "stats", {"stats": self.snapshot()})


def serve(bind: str, mode: str, **options: Any) -> int:
    """Run a parameter server in this process until it ends; SIGINT and SIGTERM stop it cleanly."""
    server = ParameterServer(bind, mode, **options)
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
    return server.serve_forever()


_BARE_PACKAGE = (
    "import sys, types; pkg = types.ModuleType('plug_asgd'); pkg.__path__ = [{path!r}]; "
    "sys.modules['plug_asgd'] = pkg; from plug_asgd.ps_server import main; sys.exit(main())"
)


def embedded_command(bind: str, mode: str, **options: Any) -> list[str]:
    """The command that runs a PS in a fresh interpreter, as rank 0 starts the embedded one.

    ``options`` are :func:`main`'s flags (``max_updates=5`` -> ``--max-updates 5``, ``insecure=True``
    -> ``--insecure``; None and False are left out). It imports this module without running
    ``plug_asgd/__init__`` (which registers the
    strategy with Lightning): the PS never imports Lightning, and starts in 0.2 s, not 3.
    """
    code = _BARE_PACKAGE.format(path=os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-c", code, "--bind", bind, "--mode", mode]
    for name, value in options.items():
        if value is True:  # a flag (insecure)
            cmd.append(f"--{name.replace('_', '-')}")
        elif value is not None and value is not False:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    return cmd


def main(argv: list[str] | None = None) -> int:
    """Entry point of the embedded PS process (see :func:`embedded_command`)."""
    parser = argparse.ArgumentParser(description="plug_asgd parameter server (embedded)")
    parser.add_argument("--bind", required=True)
    parser.add_argument("--mode", default="asgd")
    parser.add_argument("--replicas-to-aggregate", type=int)
    parser.add_argument("--staleness-bound", type=int)
    parser.add_argument("--max-updates", type=int)
    parser.add_argument("--parent-pid", type=int)
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--checkpoint-every-updates", type=int)
    parser.add_argument("--checkpoint-every-seconds", type=float)
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--resume")
    parser.add_argument("--run-dir")
    parser.add_argument("--worker-timeout", type=float, default=DEFAULT_WORKER_TIMEOUT)
    parser.add_argument("--keys", help="CURVE keys (see plug-asgd keygen): required beyond loopback")
    parser.add_argument("--insecure", action="store_true", help="listen beyond loopback without keys")
    parser.add_argument("--max-message-bytes", type=int)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-shm-pushes", dest="shm_pushes", action="store_false")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("PLUG_ASGD_LOG", "WARNING"), stream=sys.stderr,
                        format="[plug_asgd PS %(asctime)s] %(message)s")
    try:
        policy = None
        if args.checkpoint_dir:
            policy = CheckpointPolicy(Path(args.checkpoint_dir), args.checkpoint_every_updates,
                                      args.checkpoint_every_seconds, args.keep)
        return serve(args.bind, args.mode, replicas_to_aggregate=args.replicas_to_aggregate,
                     staleness_bound=args.staleness_bound,
                     max_updates=args.max_updates, parent_pid=args.parent_pid, checkpoint=policy,
                     resume=args.resume, run_dir=args.run_dir, worker_timeout=args.worker_timeout,
                     keys=args.keys, insecure=args.insecure, threads=args.threads, shm_pushes=args.shm_pushes,
                     limits=(Limits(max_message_bytes=args.max_message_bytes) if args.max_message_bytes
                             else DEFAULT_LIMITS))
    except (OSError, ValueError) as exc:
        print(f"plug_asgd parameter server: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
