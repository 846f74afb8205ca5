"""How a standby joins its primary: it asks for the primary's options, starts with them, then asks to be taken.

``serve-ps --standby-of ADDR`` runs the primary's mode, codec rules and limits, whatever its own flags say of them
(:func:`standby_config`): a standby must fold every record as the primary does. Where it listens, its keys, its
metrics folder, (if given) its checkpoint folder and the process it follows (an embedded standby's:
``parent_pid``) stay its own. The join itself (:class:`JoinRequest`) is answered
only once the primary has sent the whole state and the standby has acknowledged it, from its serving loop: so the
request goes first, and its answer is read between requests. Both requests prove the standby's credential
(:mod:`plug_asgd.ps.standby_credential`): a keyed standby connects with its own key (DIR/standby), a keyless one
signs them with its primary's secret.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import time
from typing import Any

import zmq

from plug_asgd.protocol.security import load_standby_keys
from plug_asgd.protocol.wire import decode, encode
from plug_asgd.ps.config import PSConfig
from plug_asgd.ps.curve_auth import client_socket
from plug_asgd.ps.standby_credential import prove, read_secret

log = logging.getLogger("plug_asgd.ps")

# a standby's own, whatever its primary runs with
OWN_FIELDS = ("bind", "keys", "insecure", "run_dir", "metrics_every", "io_retry_seconds", "standby_of", "parent_pid")
LEADER_GRACE_S = 0.5  # find_leader: once one member leads, how long the others still silent may take to answer
# the join's answer: the primary sends the whole model first (replication_join.JOIN_TIMEOUT_S) and may be busy
JOIN_WAIT_S = 90.0


def proven(address: str, step: str, fields: dict[str, Any], keys: Any) -> dict[str, Any]:
    """A standby's request to the primary at ``address``: keyed, as it is (the connection's key proves it);
    keyless, with the proof of the primary's secret.

    Args:
        address: the primary's address.
        step: the request's step (``config`` or ``join``).
        fields: its other fields.
        keys: the standby's keys (None: keyless).

    Raises:
        OSError: where a keyless standby cannot read its primary's secret.
    """
    fields = {**fields, "step": step}
    return fields if keys is not None else prove(read_secret(address), step, fields)


def _ask(context: zmq.Context, address: str, fields: dict[str, Any], timeout: float, keys: Any) -> dict[str, Any]:
    sock = client_socket(context, keys, standby=keys is not None)
    try:
        sock.connect(address)
        sock.send_multipart(encode("standby", {**proven(address, fields["step"], fields, keys), "rid": 1}))
        if not sock.poll(int(timeout * 1000)):
            raise OSError(f"no answer from the primary parameter server at {address} within {timeout:g} s: is it "
                          "running, and is the address right (--standby-of)?")
        reply = decode(sock.recv_multipart())
    finally:
        sock.close(0)
    if reply.type == "error":
        raise Refused(f"the parameter server at {address} refused this standby: {reply.fields.get('message')}",
                      reply.fields)
    return reply.fields


class Refused(OSError):
    """A PS refused a standby's request; ``fields`` are its answer's (``code``; ``leader``, where it was replaced).

    Args:
        message: what to say.
        fields: the answer's fields.
    """

    def __init__(self, message: str, fields: dict[str, Any]) -> None:
        super().__init__(message)
        self.fields = fields


def ask_peer(context: zmq.Context, address: str, timeout: float, keys: Any = None) -> dict[str, Any] | None:
    """Another PS's counters (its role, epoch, leader and run: a ``stats`` request), or None where it does not answer
    within ``timeout``.

    Args:
        context: the ZeroMQ context to ask in.
        address: the other PS's address.
        timeout: seconds to wait for its answer.
        keys: the PS's CURVE keys (a keyed pair's other PS admits them); None: none.
    """
    sock = client_socket(context, keys)
    try:
        sock.connect(address)
        sock.send_multipart(encode("stats", {"rid": 1}))
        if not sock.poll(int(timeout * 1000)):
            return None
        reply = decode(sock.recv_multipart())
    except Exception:  # a malformed answer, an address ZeroMQ refuses: nothing learnt
        return None
    finally:
        sock.close(0)
    stats = reply.fields.get("stats")
    return stats if reply.type == "stats" and isinstance(stats, dict) else None


def find_leader(context: zmq.Context, members: str, timeout: float, keys: Any = None) -> str | None:
    """The PS that leads among ``members`` (addresses joined by ``|``), or that one of them names: each is asked
    for its counters (``stats``) at once; a replaced PS names its successor, which is asked in turn; of those that
    lead, the one of the highest epoch. Once one leads, the others still silent get :data:`LEADER_GRACE_S` more (a
    dead member costs no more than that).

    Args:
        context: the ZeroMQ context to ask in.
        members: the addresses, joined by ``|`` (one address: itself, or its successor where it was replaced).
        timeout: seconds to wait for the answers.
        keys: the PS's CURVE keys (a keyed pair's PSes admit them); None: none.
    """
    poller, pending, leading = zmq.Poller(), {}, {}
    asked: set[str] = set()

    def ask(address: str) -> None:
        if address and address not in asked:
            asked.add(address)
            sock = client_socket(context, keys)
            sock.connect(address)
            sock.send_multipart(encode("stats", {"rid": 1}))
            poller.register(sock, zmq.POLLIN)
            pending[sock] = address

    for member in members.split("|"):
        ask(member.strip())
    deadline = time.monotonic() + timeout
    try:
        while pending and (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000) + 1):
                address = pending.pop(sock)
                poller.unregister(sock)
                stats = _stats(sock)
                sock.close(0)
                if stats.get("role") == "primary" and type(stats.get("epoch")) is int:
                    leading[address] = stats["epoch"]
                    deadline = min(deadline, time.monotonic() + LEADER_GRACE_S)
                elif stats.get("role") == "replaced" and isinstance(stats.get("leader"), str):
                    ask(stats["leader"])
    finally:
        for sock in pending:
            sock.close(0)
    return max(leading, key=leading.__getitem__) if leading else None


def _stats(sock: zmq.Socket) -> dict[str, Any]:
    """The counters a ``stats`` reply on ``sock`` carries (empty where it is not one)."""
    try:
        reply = decode(sock.recv_multipart())
    except Exception:  # a malformed answer: nothing learnt
        return {}
    stats = reply.fields.get("stats")
    return stats if reply.type == "stats" and isinstance(stats, dict) else {}


def standby_config(own: PSConfig, timeout: float = 10.0, context: zmq.Context | None = None) -> PSConfig:
    """``own`` with the leader's options for everything but where it listens, its keys and its folders, and the
    leader as its primary (``standby_of``): ``own.standby_of`` may name any member of the run, a replaced primary
    included (it names its successor), or several joined by ``|``: the one that leads is found
    (:func:`find_leader`) and joined.

    Args:
        own: the standby's config (``standby_of`` set).
        timeout: seconds to wait for the primary's answer.
        context: the ZeroMQ context to ask in; None: the process's shared one.

    Raises:
        OSError: where the primary does not answer within ``timeout`` (its keys are not this standby's, say), or
            refuses (it is itself a standby, or the standby's credential is not the one it admits), or a keyless
            standby cannot read its primary's secret.
        KeysError: where ``own.keys`` holds no standby key.
        ValueError: where ``own`` names no primary.
    """
    if own.standby_of is None:
        raise ValueError("standby_config needs standby_of: the primary's address")
    keys = load_standby_keys(own.keys) if own.keys is not None else None
    context = context or zmq.Context.instance()
    members = [m.strip() for m in own.standby_of.split("|") if m.strip()]
    primary = members[0] if len(members) == 1 else find_leader(context, own.standby_of, timeout, keys) or members[0]
    try:
        fields = _ask(context, primary, {"step": "config"}, timeout, keys)
    except Refused as exc:  # a replaced primary names its successor: the leader is that one, or one after it
        leader = exc.fields.get("leader")
        if exc.fields.get("code") != "replaced" or not isinstance(leader, str):
            raise
        primary = find_leader(context, "|".join([leader, *members]), timeout, keys) or leader
        fields = _ask(context, primary, {"step": "config"}, timeout, keys)
    if primary != own.standby_of:
        log.warning("standby of %s: the parameter server that leads the run is %s; joining it", own.standby_of,
                    primary)
    theirs = json.loads(fields["config"])
    merged = {k: v for k, v in theirs.items() if k not in OWN_FIELDS and k not in ("resume", "run_id")}
    merged.update((f.name, getattr(own, f.name)) for f in dataclasses.fields(own) if f.name in OWN_FIELDS)
    merged["standby_of"] = primary
    if own.checkpoint_dir is not None:  # its own folder; else the primary's (a shared file system)
        merged["checkpoint_dir"] = own.checkpoint_dir
    return PSConfig(**merged)


def advertised(address: str) -> str:
    """The address workers reach a PS at: a wildcard's (``tcp://0.0.0.0:P``) with the host's name instead.

    Args:
        address: the endpoint the PS's socket bound.
    """
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if address.startswith(wildcard):
            return f"tcp://{socket.gethostname()}:{address[len(wildcard):]}"
    return address


class JoinRequest:
    """A standby's request to be taken, sent at start, its answer read between requests.

    Args:
        context: the ZeroMQ context.
        primary: the primary's address.
        address: where the workers reach this standby (named in the primary's replies).
        link_address: where the primary sends its records (the standby's record socket).
        link: the link's token (the record socket's password, and every record's).
        keys: the standby's CURVE keys (:func:`~plug_asgd.protocol.security.load_standby_keys`); None: none.

    Raises:
        OSError: where a keyless standby cannot read its primary's secret.
    """

    def __init__(self, context: zmq.Context, primary: str, address: str, link_address: str, link: str,
                 keys: Any = None) -> None:
        self.link = link
        self.primary = primary
        fields = proven(primary, "join", {"address": address, "link_address": link_address, "link": link}, keys)
        self._sock: zmq.Socket | None = client_socket(context, keys, standby=keys is not None)
        self._sock.connect(primary)
        self._sock.send_multipart(encode("standby", {**fields, "rid": 1}))
        self._deadline = time.monotonic() + JOIN_WAIT_S
        self.failed: str | None = None

    def check(self) -> bool | None:
        """True once the primary took this standby; False where it refused or did not answer (``failed`` says
        why); None while the answer is awaited."""
        if self._sock is None:
            return self.failed is None
        if not self._sock.poll(0):
            if time.monotonic() < self._deadline:
                return None
            self.failed = (f"the primary at {self.primary} did not take this standby within {JOIN_WAIT_S:g} s (can "
                           "it reach this standby's address? a standby beyond loopback needs --host)")
        else:
            reply = decode(self._sock.recv_multipart())
            if reply.type == "error":
                self.failed = f"the primary at {self.primary} refused this standby: {reply.fields.get('message')}"
        self.close()
        return self.failed is None

    def close(self) -> None:
        """Drop the request's socket."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
