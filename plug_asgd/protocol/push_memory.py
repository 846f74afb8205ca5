"""Pushes through shared memory, for workers on the parameter server's machine.

Over TCP loopback a dense push of the recipe CNN (4.8 MB) costs two kernel copies and the
wake-ups of four threads, which on a small machine take the cores training needs. A worker on
the PS's machine instead computes its update straight into memory that the PS has mapped, and
its push names only where each tensor lies (a :class:`~plug_asgd.protocol.wire.Local` reference): the
socket carries a header of a few hundred bytes.

The memory is an anonymous ``memfd`` (Linux), sealed so that it can never shrink or grow: a
worker cannot truncate it under the PS, whose reads would then fault. Nothing is ever named
in a file system, so nothing is left behind whatever process dies; the memory is freed once
neither maps it. The handshake (``attach``): the worker writes a random token at the start and
tells the PS its pid and the descriptor; the PS opens ``/proc/PID/fd/FD`` read-only (the same
user, or root, on the same machine and in the same pid namespace), checks the seals and the
token, and maps it. A worker elsewhere, or one that names memory not its own, is refused, and
pushes over the socket as before.

What the PS trusts: nothing it read before it checked. The worker writes its memory only
between pushes (it waits for each reply), but a worker that wrote during a fold would only
tear its own update: the PS folds ``central + update`` into buffers of its own and checks the
result for NaN/Inf before keeping it (rules that fold otherwise get a private copy first).
"""

from __future__ import annotations

import fcntl
import hmac
import math
import mmap
import os
import secrets
import stat
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from plug_asgd.protocol.wire import Local, WireError

TOKEN_BYTES = 16
HEADER_BYTES = 64  # the token, then padding: every tensor starts 64-byte aligned
_ALIGN = 64
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0) | getattr(fcntl, "F_SEAL_SEAL", 0)
_MAX_FD = 1 << 20
_MAX_PID = 1 << 22


def available() -> bool:
    """Whether this machine can share sealed memory between processes (Linux: memfd, /proc)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and Path("/proc/self/fd").is_dir()


class PushSegment:
    """The worker's side: one buffer per tensor, in sealed shared memory the PS maps once.

    ``shapes`` maps each tensor's name to its shape and dtype. The buffers are numpy arrays in
    the memory (``buffers``); :meth:`offset` tells whether an array is one of them, and where.
    Raises OSError where the memory cannot be had (no memfd, or too little shared memory left:
    it is reserved here, so that a full ``/dev/shm`` is an error now, not a fault at a write).

    Args:
        shapes: each tensor's shape and dtype by name; each gets a 64-byte aligned buffer, in this order.
    """

    def __init__(self, shapes: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:
        layout: dict[str, tuple[int, tuple[int, ...], np.dtype]] = {}
        pos = HEADER_BYTES
        for name, (shape, dtype) in shapes.items():
            dtype = np.dtype(dtype).newbyteorder("<")
            layout[name] = (pos, tuple(shape), dtype)
            pos += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        self.size = pos
        self.token = secrets.token_bytes(TOKEN_BYTES)
        fd = os.memfd_create("plug_asgd_push", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._finalizer = weakref.finalize(self, os.close, fd)
        os.ftruncate(fd, self.size)
        os.posix_fallocate(fd, 0, self.size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        self.fd = fd  # open while this object lives: the PS opens the memory through it
        self._map = mmap.mmap(fd, self.size)
        self._map[:TOKEN_BYTES] = self.token
        memory = np.frombuffer(self._map, dtype=np.uint8)
        self._start = memory.ctypes.data
        self.buffers = {name: memory[o:o + math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)
                        for name, (o, shape, dtype) in layout.items()}

    def offset(self, array: np.ndarray) -> int | None:
        """``array``'s byte offset in the memory, if it is a C-contiguous array inside it; else None.

        Args:
            array: the array to place, typically one of ``buffers`` (or a view of one).
        """
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            return None
        offset = array.ctypes.data - self._start
        return offset if HEADER_BYTES <= offset and offset + array.nbytes <= self.size else None

    def close(self) -> None:
        """Close the descriptor (the memory stays mapped here, and at the PS if it attached)."""
        self._finalizer()


class AttachedSegments:
    """The PS's side: the memory each worker session attached, mapped read-only.

    Args:
        max_bytes: the most bytes of tensors one worker's memory may hold (its header excluded).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._maps: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._maps)

    def attach(self, session: str, pid: object, fd: object, token: object) -> int:
        """Map the memory descriptor ``fd`` of process ``pid`` for ``session`` (replacing its previous); its size.

        Args:
            session: the worker session the memory belongs to.
            pid: the worker's process id, as the worker sent it (checked to be an integer).
            fd: the worker's descriptor of the memory, as it sent it (checked to be an integer).
            token: the random bytes the worker wrote at the memory's start, proving the memory is its own.

        Raises:
            WireError: where the arguments are malformed, the memory cannot be opened (another machine or
                user), is not a sealed memfd of an allowed size, or does not hold ``token``.
        """
        if not (isinstance(pid, int) and isinstance(fd, int) and 0 < pid < _MAX_PID and 0 <= fd < _MAX_FD):
            raise WireError("bad_local", "attach needs the worker's pid and the descriptor of its memory (integers)")
        if not isinstance(token, bytes) or len(token) != TOKEN_BYTES:
            raise WireError("bad_local", f"the memory's token must be {TOKEN_BYTES} bytes")
        try:
            handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise WireError("bad_local", f"cannot open the worker's memory: {exc.strerror} (is the worker on another "
                                         "machine, or run by another user?)") from None
        try:
            try:
                seals = fcntl.fcntl(handle, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0  # not a memfd
            info = os.fstat(handle)
            if seals & _SEALS != _SEALS or not stat.S_ISREG(info.st_mode):
                raise WireError("bad_local", "the worker's memory must be a memfd sealed against shrinking and growing")
            if not HEADER_BYTES <= info.st_size <= self.max_bytes + HEADER_BYTES:
                raise WireError("bad_local", f"the worker's memory must hold {HEADER_BYTES} to "
                                             f"{self.max_bytes + HEADER_BYTES} bytes")
            mapped = mmap.mmap(handle, info.st_size, prot=mmap.PROT_READ)
        finally:
            os.close(handle)
        if not hmac.compare_digest(mapped[:TOKEN_BYTES], token):
            mapped.close()
            raise WireError("bad_local", "the memory named does not hold the sender's token: it is not the sender's")
        self._maps[session] = np.frombuffer(mapped, dtype=np.uint8)  # read-only, as the map is
        return info.st_size

    def resolve(self, session: str, ref: Local) -> np.ndarray:
        """The read-only array ``ref`` names in ``session``'s segment (checked against its bounds).

        Args:
            session: the worker session that sent ``ref``.
            ref: the local reference of a pushed tensor.

        Raises:
            WireError: where ``session`` has no memory attached, or ``ref`` lies outside it or is misaligned.
        """
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
        """Forget ``session``'s memory (unmapped once no array of it is left); nothing where it has none.

        Args:
            session: the worker session that is gone.
        """
        self._maps.pop(session, None)

    def clear(self) -> None:
        """Forget every session's memory."""
        self._maps.clear()


def read_locals(segments: AttachedSegments | None, session: str,
                tensors: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """``tensors`` with each :class:`Local` reference read (as a view) from ``session``'s segment; their bytes.

    Args:
        segments: the PS's attached segments; None where it takes pushes over its socket only.
        session: the pushing worker's session.
        tensors: the push's tensors.

    Raises:
        WireError: ``bad_local`` where there are no segments to read, or a reference is out of its segment.
    """
    if not any(isinstance(t, Local) for t in tensors.values()):
        return tensors, 0
    if segments is None:
        raise WireError("bad_local", "this parameter server takes pushes over its socket only: push the "
                                     "update's bytes")
    out, nbytes = {}, 0
    for name, t in tensors.items():
        if isinstance(t, Local):
            t = segments.resolve(session, t)
            nbytes += t.nbytes
        out[name] = t
    return out, nbytes
