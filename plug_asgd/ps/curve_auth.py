"""The PS's CURVE authentication: a ZAP thread that admits only the authorized workers' public keys."""

from __future__ import annotations

import logging
from typing import Any

import zmq

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def authenticate(ctx: zmq.Context, socket: zmq.Socket, keys: Any) -> tuple[Any, zmq.Socket]:
    """CURVE on the ROUTER; a ZAP thread accepts only the authorized workers' public keys. A refused peer
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
    auth.configure_curve(domain="*", location=str(keys.authorized_dir))
    socket.curve_server = True
    socket.curve_publickey = keys.public
    socket.curve_secretkey = keys.secret
    return auth, socket.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED)
