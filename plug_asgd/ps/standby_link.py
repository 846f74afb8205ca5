"""A standby's record socket: the one its primary's records, beats and the standby's acknowledgements travel on,
apart from the socket the workers (and anyone else) reach.

The standby binds it beside its own socket, on the same interface and a port the system chooses, and names it in
its join request (``link_address``); the primary connects to it alone. Only the primary can connect there: a keyed
standby's is a CURVE server that admits the PS's own key alone (ZAP domain
:data:`~plug_asgd.ps.curve_auth.LINK_DOMAIN`: a worker's key, or the standby's, is refused in the handshake); a
keyless standby's admits, by ZeroMQ's PLAIN mechanism, the link's token alone, which only its join request carried.
A stranger's messages there never reach the standby; each record still carries the token, checked before it is
applied. The serving loop reads this socket first, and again before each message of the workers' socket
(:meth:`StandbyLink.drain`), so garbage sent to the workers' socket delays a record by one message at most, not by
the whole queue.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import zmq

from plug_asgd.protocol.wire import Limits, encode
from plug_asgd.ps import limits as bounds
from plug_asgd.ps.curve_auth import LINK_DOMAIN, plain_link

LINK_BATCH = 64  # the most records read in one go before the workers' socket is served again


def link_bind(address: str) -> str:
    """Where a standby listening at ``address`` binds its record socket: the same interface, a port the system
    picks (another transport than tcp: the address with ``-link`` added).

    Args:
        address: the endpoint the standby's socket bound.
    """
    if address.startswith("tcp://"):
        return f"{address.rpartition(':')[0]}:*"
    return f"{address}-link"


class StandbyLink:
    """A standby's record socket (see the module doc).

    Args:
        context: the standby's context (a keyed standby's ZAP handler serves it; a keyless one gets its own).
        address: the endpoint the standby's socket bound.
        keys: the PS's keys (None: keyless).
        token: the link's token, sent to the primary in the join request.
        limits: the wire's limits.

    Raises:
        OSError: where it cannot bind (no port left on that interface).
    """

    def __init__(self, context: zmq.Context, address: str, keys: Any, token: str, limits: Limits) -> None:
        self.socket = context.socket(zmq.ROUTER)
        bounds.configure_router(self.socket, limits)
        self.socket.zap_domain = LINK_DOMAIN.encode()
        self._auth = None
        if keys is not None:
            self.socket.curve_server = True
            self.socket.curve_publickey = keys.public
            self.socket.curve_secretkey = keys.secret
        else:
            self._auth = plain_link(context, token)
            self.socket.plain_server = True
        try:
            self.socket.bind(link_bind(address))
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(f"the standby cannot listen for its primary's records on {link_bind(address)}: "
                          f"{exc}") from None
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def drain(self, handle: Callable[[bytes, list[Any]], None], most: int = LINK_BATCH) -> None:
        """Handle the records waiting (up to ``most``): ``handle(identity, frames)`` for each.

        Args:
            handle: called with the sender's identity and the message's frames.
            most: the most messages handled in this call.
        """
        for _ in range(most):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            handle(frames[0].bytes, frames[1:])

    def send(self, identity: bytes, msg_type: str, fields: dict[str, Any]) -> None:
        """Answer the primary (an acknowledgement, ``fenced``, an error); dropped where it is gone.

        Args:
            identity: the primary's connection.
            msg_type: the answer's type.
            fields: its fields.
        """
        # a connection gone, or not reading, loses the answer: its primary asks again or detaches this standby
        with contextlib.suppress(zmq.ZMQError):
            self.socket.send_multipart([identity, *encode(msg_type, fields)], zmq.NOBLOCK)

    def close(self) -> None:
        """Close the socket (and a keyless standby's ZAP handler)."""
        self.socket.close(0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
