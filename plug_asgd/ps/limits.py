"""Bounds on what a sender chooses, checked when a message arrives, so the PS can always answer.

Every value a worker picks and the PS keeps or sends back has a bound here: the world size it
claims, its session string, the objects of a gather (nesting and bytes: a reply nests one level
deeper than what it carries, and msgpack cannot encode past 1,024 levels), and the per-sender
state the PS keeps (sessions per rank, completed collectives). A value beyond its bound is refused
with code ``limit`` (``world_size`` / ``rank`` out of range: ``bad_field``), counted, and nothing
is kept of it.
"""

from __future__ import annotations

from typing import Any

import msgpack
import zmq

from plug_asgd.protocol.wire import DEFAULT_LIMITS, Limits, Message, WireError

MAX_WORLD_SIZE = 1 << 14  # ranks one PS serves
MAX_SESSION_CHARS = 128  # a worker's session string (PSClient's is 32 hex digits)
TOKEN_CHARS = (16, 128)  # the membership token a hello may carry back (the PS gives 32 hex digits)
MAX_KIND_CHARS = 256  # a gather's ``kind`` ("barrier:NAME", ...): it is quoted in error replies to other ranks
MAX_OBJ_DEPTH = 64  # nesting of a gather's object (the reply adds 3 levels; msgpack stops at 1,024)
MAX_OBJ_BYTES = 256 << 10  # a gather's object, packed
MAX_GATHER_OBJ_BYTES = 512 << 10  # all ranks' objects of one gather: its reply's header (a client reads 1 MiB)
SESSIONS_PER_RANK = 4  # sessions whose last push number the PS keeps per rank (a checkpoint holds them)
COMPLETED_KEPT = 1024  # completed collectives kept for a rank that comes back late ...
COMPLETED_MAX_BYTES = 64 << 20  # ... and their bytes as held (HELD_PER_TENSOR each tensor) at most, oldest first
# a gather's tensor as the PS holds it beyond its bytes: its array, its received frame, its name and dict entries
# (about 0.9 KB each, whatever the tensor's size: 22,000 empty tensors hold 20 MB)
HELD_PER_TENSOR = 1 << 10
GATHERS_PENDING_MAX_BYTES = 256 << 20  # contributions waiting for their gather, all ranks together, as held
# what a PSClient reads (its default limits): a reply the PS builds must fit them (a gather's carries every rank's)
REPLY_LIMITS = DEFAULT_LIMITS
# replies queued per connection (the ROUTER's SNDHWM). A PSClient has 1 or 2 unread; libzmq acknowledges reads
# in batches of (hwm + 1) // 2, so a client that pipelines a few requests needs room beyond what it has unread
REPLY_HWM = 32


def session(msg: Message) -> str:
    """The message's ``session`` field, a string of at most :data:`MAX_SESSION_CHARS` characters.

    Args:
        msg: a request that carries a ``session``.

    Raises:
        WireError: ``limit``, where the session is empty or longer than :data:`MAX_SESSION_CHARS`.
    """
    value = msg.str_field("session")
    assert value is not None
    if not 0 < len(value) <= MAX_SESSION_CHARS:
        raise WireError("limit", f"session must be 1 to {MAX_SESSION_CHARS} characters, got {len(value)}")
    return value


def token(msg: Message) -> str | None:
    """The hello's ``token`` (given by this PS, or by one before a restart), if any.

    Args:
        msg: the ``hello`` request.

    Raises:
        WireError: ``bad_field``, where the token is not a string of :data:`TOKEN_CHARS` characters.
    """
    value = msg.fields.get("token")
    if value is None:
        return None
    if not isinstance(value, str) or not TOKEN_CHARS[0] <= len(value) <= TOKEN_CHARS[1]:
        raise WireError("bad_field", f"token must be a string of {TOKEN_CHARS[0]} to {TOKEN_CHARS[1]} characters")
    return value


def world_size(msg: Message) -> int:
    """The hello's ``world_size``, at most :data:`MAX_WORLD_SIZE`.

    Args:
        msg: the ``hello`` request.

    Raises:
        WireError: ``limit``, where the world size is above :data:`MAX_WORLD_SIZE`.
    """
    value = msg.int_field("world_size", minimum=1)
    assert value is not None
    if value > MAX_WORLD_SIZE:
        raise WireError("limit", f"world_size {value} is beyond what one parameter server serves "
                                 f"({MAX_WORLD_SIZE})")
    return value


def depth(obj: Any, limit: int) -> int:
    """Nesting depth of ``obj`` (a scalar is 0), counted without recursion; stops once past ``limit``.

    Args:
        obj: a decoded msgpack value (dicts, lists, tuples and scalars).
        limit: the depth past which counting stops (the result is then some depth above it).
    """
    deepest, stack = 0, [(obj, 0)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list | tuple) else None
        if children is None:
            continue
        deepest = max(deepest, level + 1)
        if deepest > limit:
            return deepest
        stack.extend((c, level + 1) for c in children)
        if isinstance(item, dict):
            stack.extend((k, level + 1) for k in item)
    return deepest


def gather_obj(msg: Message) -> tuple[Any, int]:
    """A gather's ``obj`` and its packed bytes, refused (``limit``) if too deep or too large; ``kind`` too.

    Args:
        msg: the ``gather`` request.

    Raises:
        WireError: ``limit``, where ``kind`` is not a string of at most :data:`MAX_KIND_CHARS` characters, or
            the object nests deeper than :data:`MAX_OBJ_DEPTH` or packs to more than :data:`MAX_OBJ_BYTES`.
    """
    kind = msg.fields.get("kind", "")
    if not isinstance(kind, str) or len(kind) > MAX_KIND_CHARS:
        raise WireError("limit", f"a gather's kind must be a string of at most {MAX_KIND_CHARS} characters")
    obj = msg.fields.get("obj")
    if depth(obj, MAX_OBJ_DEPTH) > MAX_OBJ_DEPTH:
        raise WireError("limit", f"a gather's object may nest at most {MAX_OBJ_DEPTH} levels deep")
    size = len(msgpack.packb(obj))
    if size > MAX_OBJ_BYTES:
        raise WireError("limit", f"a gather's object is {size} bytes packed; at most {MAX_OBJ_BYTES}")
    return obj, size


def rid(fields: dict[str, Any]) -> Any:
    """The request id a reply echoes: an integer or None (anything else is never echoed back).

    Args:
        fields: the request's header fields.
    """
    value = fields.get("rid")
    return value if value is None or (isinstance(value, int) and not isinstance(value, bool)) else None


def header_rid(body: list[Any], limits: Limits) -> Any:
    """The request id of a request refused before it was decoded (a standby's screen, a malformed tensor), read
    from its header frame alone (within ``limits.max_header_bytes``): the refusal then answers that request, and a
    worker waiting on it reads it (a replaced PS's ``replaced``, naming its successor). None: none to be read.

    Args:
        body: the request's frames, header first.
        limits: the wire's limits.
    """
    try:
        raw = body[0].bytes if isinstance(body[0], zmq.Frame) else bytes(body[0])
        if len(raw) > limits.max_header_bytes:
            return None
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True)
        return rid(header["fields"]) if isinstance(header, dict) and isinstance(header.get("fields"), dict) else None
    except Exception:  # garbage: msgpack raises several unrelated types
        return None


def trim_sessions(last_seq: dict[str, int], world_size: int | None) -> None:
    """Keep the most recent ``SESSIONS_PER_RANK * world_size`` sessions of a resumed checkpoint (the store keeps
    them most recent last), so that a PS resumed again and again does not pile them up.

    Args:
        last_seq: the last push number of each session, most recent last; trimmed in place.
        world_size: the run's world size; None where it is not known (counted as 1).
    """
    keep = SESSIONS_PER_RANK * max(1, world_size or 1)
    for session in list(last_seq)[:max(0, len(last_seq) - keep)]:
        del last_seq[session]


def frame_cap(limits: Limits) -> int:
    """ZeroMQ's MAXMSGSIZE for the PS's socket: twice ``limits.max_message_bytes``.

    libzmq applies MAXMSGSIZE to each frame and drops the sender's connection without a word, which
    the PS could neither answer nor count; so the PS checks ``max_message_bytes`` itself on the whole
    message (an ``error`` reply ``too_large``), and libzmq only bounds memory.

    Args:
        limits: the wire's limits for the PS's requests.
    """
    return min(2 * limits.max_message_bytes, (1 << 63) - 1)


def configure_router(socket: zmq.Socket, limits: Limits) -> None:
    """The PS's ROUTER: frames bounded (:func:`frame_cap`), and at most :data:`REPLY_HWM` replies queued per
    connection. A reply beyond that, or to a connection that is gone, fails at once (ROUTER_MANDATORY, sent
    NOBLOCK) and the PS drops and counts it, instead of pinning a model version per reply for a connection
    that does not read.

    Args:
        socket: the PS's ROUTER socket, before it binds.
        limits: the wire's limits for the PS's requests.
    """
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, frame_cap(limits))
    socket.setsockopt(zmq.SNDHWM, REPLY_HWM)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
