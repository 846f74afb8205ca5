"""A socket's connection events, read from a PAIR socket that can never stall the ZeroMQ context.

libzmq sends each event from its I/O thread, and a blocking send: once the events' pipe holds its high-water mark
(about 2,000 events with pyzmq's ``get_monitor_socket``), the I/O thread waits for a reader, and every socket of the
context waits with it. A client reads its events only while it waits for a reply, so a connection that keeps
dropping between two requests (a flaky link during a DiLoCo round's minutes of inner steps, a port taken over by a
peer that refuses the handshake) would freeze the whole process's ZeroMQ. The PAIR socket made here takes every
event the I/O thread sends (no high-water mark): a few dozen bytes each, read at the next request. Imports nothing
of plug_asgd but zmq.
"""

from __future__ import annotations

import itertools

import zmq

_numbers = itertools.count()


def monitor_socket(socket: zmq.Socket, events: int) -> zmq.Socket:
    """The PAIR socket that receives ``socket``'s ``events``; stop it with ``socket.disable_monitor()`` before
    closing it (libzmq would otherwise send to a closed pipe).

    Args:
        socket: the socket whose connection events to receive.
        events: the ``zmq.EVENT_*`` bits wanted.
    """
    address = f"inproc://plug-asgd-monitor-{next(_numbers)}"  # (one per socket this process monitors)
    socket.monitor(address, events)
    pair = socket.context.socket(zmq.PAIR)
    pair.setsockopt(zmq.RCVHWM, 0)  # before connecting: the events' pipe takes its limit from it, 0 for none
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(address)
    return pair
