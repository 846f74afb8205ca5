"""The PS's CURVE authentication: a ZAP thread that admits only the authorized workers' public keys."""

from __future__ import annotations

import logging
from typing import Any

import zmq

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def authenticate(ctx: zmq.Context, socket: zmq.Socket, keys: Any) -> tuple[Any, zmq.Socket]:
    """CURVE on the ROUTER; a ZAP thread accepts only the authorized workers' public keys, and the PS's own (the
    other PS of a primary and its hot standby, which share the PS's keys, connects with it). A refused peer
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
    auth.configure_curve_callback(domain="*", credentials_provider=_Admitted(keys))
    socket.curve_server = True
    socket.curve_publickey = keys.public
    socket.curve_secretkey = keys.secret
    return auth, socket.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED)


class _Admitted:
    """The public keys a keyed PS admits: its authorized workers' (read at start), and its own."""

    def __init__(self, keys: Any) -> None:
        from zmq.auth import load_certificates

        self.keys = {*load_certificates(str(keys.authorized_dir)), keys.public}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def client_socket(ctx: zmq.Context, keys: Any) -> zmq.Socket:
    """A DEALER from one PS to the other of a primary and its standby: CURVE with the PS's own keypair, where it
    has keys (both hold the same ones), plain otherwise.

    Args:
        ctx: the context to make it in.
        keys: the PS's keys (:func:`plug_asgd.protocol.security.load_server_keys`); None: no encryption.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_publickey = keys.public
        sock.curve_secretkey = keys.secret
        sock.curve_serverkey = keys.public
    return sock

