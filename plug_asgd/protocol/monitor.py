"""A socket's connection events, read from a PAIR socket that can never stall the ZeroMQ context.

libzmq sends each event from its I/O thread, and a blocking send: once the events' pipe holds its high-water mark
(about 2,000 events with pyzmq's ``get_monitor_socket``), the I/O thread waits for a reader, and every socket of the
context waits with it. A client reads its events only while it waits for a reply, so a connection that keeps
dropping between two requests (a flaky link during a DiLoCo round's minutes of inner steps, a port taken over by a
peer that refuses the handshake) would freeze the whole process's ZeroMQ. The PAIR socket made here takes every
event the I/O thread sends (no high-water mark): a few dozen bytes each, read at the next request.

The same send blocks for good where the PAIR is closed while the monitored socket lives on: closed, the socket is
only handed to libzmq's reaper, whose connections still send events until it is gone. Closing the monitor first
(``disable_monitor``) makes no event follow. Python's collector closes an owner's sockets in its attributes' order,
the socket before its PAIR, so :func:`stop_on_drop` ties that order to the owner: an owner dropped unclosed (a test
that fails, a client nobody closed) cannot freeze the context. Imports nothing of plug_asgd but zmq.
"""

from __future__ import annotations

import itertools
import weakref

import zmq

_numbers = itertools.count()


def monitor_socket(socket: zmq.Socket, events: int) -> zmq.Socket:
    """The PAIR socket that receives ``socket``'s ``events``; close it with :func:`stop_monitor` (or the owner's
    :func:`stop_on_drop`), which stops the events first: libzmq would otherwise send to a closed pipe.

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


def stop_monitor(socket: zmq.Socket, pair: zmq.Socket) -> None:
    """Stop ``socket``'s events, then close their ``pair``: no event can be sent to a pipe nobody reads.

    Args:
        socket: the monitored socket (closed after this by its owner, or already).
        pair: the PAIR socket :func:`monitor_socket` gave for it.
    """
    if not socket.closed:
        socket.disable_monitor()
    pair.close(0)


def stop_on_drop(owner: object, socket: zmq.Socket, pair: zmq.Socket) -> weakref.finalize:
    """:func:`stop_monitor` once called, or once ``owner`` is collected without having called it.

    Args:
        owner: the object that holds ``socket`` and ``pair`` (a worker's transport, a PS).
        socket: the monitored socket.
        pair: its events' PAIR socket.

    Returns:
        The finalizer: call it where the owner closes, before closing ``socket``; later calls do nothing.
    """
    return weakref.finalize(owner, stop_monitor, socket, pair)
