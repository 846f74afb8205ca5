"""Who may talk to a PS, and as what: its ZAP handler, the role a connection's key gives it, and the sockets a PS
opens to the other PS of a primary and hot standby pair.

A keyed PS (CURVE) admits on its socket the public keys of its authorized workers, of its authorized standbys
(``authorized_standby``, :mod:`plug_asgd.protocol.security`) and its own (the other PS of a pair, which holds the
PS's keys too, asks it for its counters with them); the key a connection authenticated with is its ``User-Id``,
which ZeroMQ hands with each message, and only a standby's key may ask to join as a standby
(:func:`standby_key`). A standby's record socket (:mod:`plug_asgd.ps.standby_link`, ZAP domain
:data:`LINK_DOMAIN`) admits the PS's own key alone, which only its primary connects with; a keyless standby's
admits, by ZeroMQ's PLAIN mechanism, the one password its join request gave the primary (the link's token).
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from plug_asgd.protocol.monitor import monitor_socket

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
LINK_DOMAIN = "plug_asgd.link"  # the ZAP domain of a standby's record socket
PRIMARY = b"primary"  # the PLAIN user name a keyless primary connects to its standby's record socket with


def authenticate(ctx: zmq.Context, socket: zmq.Socket, keys: Any) -> tuple[Any, zmq.Socket]:
    """CURVE on the ROUTER; a ZAP thread accepts only the authorized workers' and standbys' public keys, and the
    PS's own; on a standby's record socket (domain :data:`LINK_DOMAIN`), the PS's own alone. A refused peer
    never reaches the ROUTER; the returned monitor's HANDSHAKE_FAILED_* events count it (each attempt).

    Args:
        ctx: the context the ZAP handler serves (one per context).
        socket: the PS's ROUTER, made a CURVE server.
        keys: the PS's keys (:func:`plug_asgd.protocol.security.load_server_keys`).

    Returns:
        The authenticator thread (stop it when the PS closes) and the monitor socket of refusals and disconnections.
    """
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("plug_asgd.ps.auth"))
    auth.start()
    admitted = _Admitted(keys)
    auth.configure_curve_callback(domain="*", credentials_provider=admitted)
    auth.configure_curve_callback(domain=LINK_DOMAIN, credentials_provider=admitted)
    socket.curve_server = True
    socket.curve_publickey = keys.public
    socket.curve_secretkey = keys.secret
    return auth, monitor_socket(socket, HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED)


def plain_link(ctx: zmq.Context, token: str) -> Any:
    """A keyless standby's ZAP thread: its record socket admits the PLAIN user :data:`PRIMARY` with the link's
    token as password, and nothing else (stop it when the socket closes).

    Args:
        ctx: the standby's context (a ZAP handler is one per context: a keyless standby owns its context).
        token: the link's token, which the standby's join request gave the primary.
    """
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=logging.getLogger("plug_asgd.ps.auth"))
    auth.start()
    auth.configure_plain(domain=LINK_DOMAIN, passwords={PRIMARY.decode(): token})
    return auth


class _Admitted:
    """The public keys a keyed PS admits: its authorized workers' and standbys' (read at start), and its own; on a
    record socket, its own alone."""

    def __init__(self, keys: Any) -> None:
        from zmq.auth import load_certificates

        self.own = keys.public
        self.keys = {*load_certificates(str(keys.authorized_dir)), *standby_keys(keys), keys.public}

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.own if domain == LINK_DOMAIN else key in self.keys


def standby_keys(keys: Any) -> frozenset[bytes]:
    """The public keys (Z85) a keyed PS admits as its standby's: those of ``authorized_standby``.

    Args:
        keys: the PS's keys (:func:`plug_asgd.protocol.security.load_server_keys`).
    """
    from zmq.auth import load_certificates

    folder = getattr(keys, "standby_dir", None)
    return frozenset(load_certificates(str(folder))) if folder is not None else frozenset()


def standby_key(frame: Any, admitted: frozenset[bytes]) -> bool:
    """Whether the message ``frame`` belongs to came over a connection that authenticated with a standby's key.

    Args:
        frame: one frame of the message as received (a ``zmq.Frame``: its ``User-Id`` is the connection's key).
        admitted: the standbys' public keys (:func:`standby_keys`).
    """
    try:
        user = frame.get("User-Id")
    except (AttributeError, zmq.ZMQError):  # bytes (a test's), or a frame without the property: no key
        return False
    return isinstance(user, str) and user.encode() in admitted


def client_socket(ctx: zmq.Context, keys: Any, *, standby: bool = False, link: str | None = None) -> zmq.Socket:
    """A DEALER from one PS to the other of a primary and its standby: CURVE where it has keys (with the PS's own
    keypair, or the standby's where ``standby``), plain otherwise (with PLAIN's :data:`PRIMARY` and ``link``
    as password where ``link`` is given: a keyless primary's socket to its standby's record socket).

    Args:
        ctx: the context to make it in.
        keys: the PS's keys (:func:`plug_asgd.protocol.security.load_server_keys`); None: no encryption.
        standby: connect with the standby's own keypair (a standby asking its primary to join).
        link: a keyless link's token (its PLAIN password); None: no PLAIN credentials.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_publickey = keys.standby_public if standby else keys.public
        sock.curve_secretkey = keys.standby_secret if standby else keys.secret
        sock.curve_serverkey = keys.public
    elif link is not None:
        sock.plain_username = PRIMARY
        sock.plain_password = link.encode()
    return sock
