"""Pushes through shared memory, for workers on the parameter server's machine.

Over TCP loopback a dense push of the recipe CNN (4.8 MB) costs two kernel copies and the
wake-ups of four threads, which on a small machine take the cores training needs. A worker on
the PS's machine instead computes its update straight into a segment of ``/dev/shm`` that the
PS has mapped, and its push names only where each tensor lies (a :class:`~plug_asgd.wire.Local`
reference): the socket carries a header of a few hundred bytes.

The handshake (``attach``): the worker creates ``/dev/shm/plug_asgd_push_<32 hex digits>``
(mode 0600, never an existing file) and writes a random token at its start; the PS opens the
name read-only (no symlink, a regular file, no larger than its message limit), maps it and
compares the token. A worker on another machine (whose ``/dev/shm`` the PS does not see) or a
name that is not the sender's own is refused, and the worker pushes over the socket as before.
Once attached the worker unlinks the name: the memory lives while either process maps it, and
nothing is left behind when either dies.

What the PS trusts: nothing it read before it checked. The worker writes its segment only
between pushes (it waits for each reply), but a worker that wrote during a fold would only
tear its own update: the PS folds ``central + update`` into buffers of its own and checks the
result for NaN/Inf before keeping it (rules that fold otherwise get a private copy first).
"""

from __future__ import annotations

import hmac
import math
import mmap
import os
import re
import secrets
import stat
import weakref
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from plug_asgd.wire import Local, WireError

SEGMENT_DIR = Path("/dev/shm")
TOKEN_BYTES = 16
HEADER_BYTES = 64  # the token, then padding: every tensor starts 64-byte aligned
_ALIGN = 64
_NAME = re.compile(r"plug_asgd_push_[0-9a-f]{32}")


def available() -> bool:
    """Whether this machine has a ``/dev/shm`` to share segments through."""
    return SEGMENT_DIR.is_dir() and os.access(SEGMENT_DIR, os.W_OK | os.X_OK)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


class PushSegment:
    """The worker's side: one buffer per tensor, in a segment the PS maps once.

    ``shapes`` maps each tensor's name to its shape and dtype. The buffers are numpy arrays in
    the segment (``buffers``); :meth:`offset` tells whether an array is one of them, and where.
    """

    def __init__(self, shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        layout: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        pos = HEADER_BYTES
        for name, (shape, dtype) in shapes.items():
            dtype = np.dtype(dtype).newbyteorder("<")
            layout[name] = (pos, tuple(shape), dtype)
            pos += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        self.size = pos
        self.name = f"plug_asgd_push_{secrets.token_hex(16)}"
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.path = SEGMENT_DIR / self.name
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        # from here on the name is removed when this object goes, or at exit, whatever happens
        self._finalizer = weakref.finalize(self, _unlink, self.path)
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self._map[:TOKEN_BYTES] = self.token
        memory = np.frombuffer(self._map, dtype=np.uint8)
        self._start = memory.ctypes.data
        self.buffers = {name: memory[o:o + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
                        for name, (o, shape, dtype) in layout.items()}

    def offset(self, array: np.ndarray) -> int | None:
        """``array``'s byte offset in the segment, if it is a C-contiguous array inside it; else None."""
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            return None
        offset = array.ctypes.data - self._start
        return offset if HEADER_BYTES <= offset and offset + array.nbytes <= self.size else None

    def unlink(self) -> None:
        """Remove the name (the memory stays mapped here, and at the PS if it attached)."""
        self._finalizer()


class AttachedSegments:
    """The PS's side: the segment each worker session attached, mapped read-only."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._maps: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._maps)

    def attach(self, session: str, name: object, token: object) -> int:
        """Map the segment ``name`` for ``session`` (replacing its previous one); returns its size."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise WireError("bad_local", f"segment name {name!r:.80} is not one a plug_asgd worker makes")
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
            raise WireError("bad_local", f"the segment token must be {TOKEN_BYTES} bytes")
        try:
            fd = os.open(SEGMENT_DIR / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise WireError("bad_local", f"cannot open shared segment {name}: {exc.strerror} (is the worker on "
                                         "another machine?)") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or not HEADER_BYTES <= info.st_size <= self.max_bytes + HEADER_BYTES:
                raise WireError("bad_local", f"shared segment {name} is not a regular file of {HEADER_BYTES} to "
                                             f"{self.max_bytes + HEADER_BYTES} bytes")
            mapped = mmap.mmap(fd, info.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if not hmac.compare_digest(mapped[:TOKEN_BYTES], token):
            mapped.close()
            raise WireError("bad_local", f"shared segment {name} does not hold the sender's token: it is not "
                                         "the sender's own")
        self._maps[session] = np.frombuffer(mapped, dtype=np.uint8)  # read-only, as the map is
        return info.st_size

    def resolve(self, session: str, ref: Local) -> np.ndarray:
        """The read-only array ``ref`` names in ``session``'s segment (checked against its bounds)."""
        memory = self._maps.get(session)
        if memory is None:
            raise WireError("bad_local", "this worker has no shared segment attached here (the parameter server "
                                         "restarted?): push the update's bytes instead")
        end = ref.offset + ref.nbytes
        if ref.offset < HEADER_BYTES or end > memory.size or ref.offset % ref.dtype.itemsize:
            raise WireError("bad_local", f"a local tensor at bytes [{ref.offset}, {end}) is outside the sender's "
                                         f"segment of {memory.size} bytes, or misaligned")
        return memory[ref.offset:end].view(ref.dtype).reshape(ref.shape)

    def drop(self, session: str) -> None:
        self._maps.pop(session, None)

    def clear(self) -> None:
        self._maps.clear()
