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
JOIN_WAIT_S = 90.0  # the join's answer: the primary sends the whole model first (JOIN_TIMEOUT_S) and may be busy


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
        raise OSError(f"the parameter server at {address} refused this standby: {reply.fields.get('message')}")
    return reply.fields


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


def standby_config(own: PSConfig, timeout: float = 10.0, context: zmq.Context | None = None) -> PSConfig:
    """``own`` with the primary's options for everything but where it listens, its keys and its folders.

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
    fields = _ask(context or zmq.Context.instance(), own.standby_of, {"step": "config"}, timeout, keys)
    theirs = json.loads(fields["config"])
    merged = {k: v for k, v in theirs.items() if k not in OWN_FIELDS and k not in ("resume", "run_id")}
    merged.update((f.name, getattr(own, f.name)) for f in dataclasses.fields(own) if f.name in OWN_FIELDS)
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
