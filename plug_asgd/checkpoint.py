"""Checkpoint files of the central state: written atomically, verified before anything is trusted.

A checkpoint is the wire format itself (a msgpack header frame and raw tensor frames, see
:mod:`plug_asgd.wire`) laid out in a file::

    MAGIC | u32 format | u64 frame count | (u64 length, frame bytes)* | sha256 of all before it

It is written to a temporary name, flushed and fsync'ed, then renamed over the final name, so a
crash leaves either the old file or the new one, never half of one. Loading checks the magic,
the checksum and then every frame as the wire does; nothing is unpickled. Only numpy and the
wire are needed, so the PS reads and writes checkpoints without torch.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plug_asgd.wire import Limits, Message, Tensor, WireError, decode, encode

MAGIC = b"PLUG-ASGD-CKPT\n"
FORMAT = 1
_NAME = re.compile(r"^ps-v(\d{10})\.ckpt$")
_LIMITS = Limits(max_header_bytes=1 << 28, max_frames=1 << 24, max_message_bytes=1 << 40)


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted (corrupt, truncated, not a checkpoint, wrong mode)."""


def write_checkpoint(path: str | os.PathLike[str], fields: dict[str, Any], tensors: dict[str, Tensor]) -> Path:
    """Write atomically: temp file, fsync, rename, fsync of the directory."""
    path = Path(path)
    frames = encode("checkpoint", fields, tensors)
    digest = hashlib.sha256()
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        def put(data: bytes | memoryview) -> None:
            f.write(data)
            digest.update(data)

        put(MAGIC)
        put(struct.pack("<IQ", FORMAT, len(frames)))
        for frame in frames:
            view = memoryview(frame).cast("B")
            put(struct.pack("<Q", len(view)))
            put(view)
        f.write(digest.digest())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def read_checkpoint(path: str | os.PathLike[str]) -> Message:
    """The checkpoint's header fields and tensors, or :class:`CheckpointError` saying what is wrong."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    head = len(MAGIC) + 12
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{path} is not a plug_asgd checkpoint (it does not start with the magic bytes)")
    if len(data) < head + 32:
        raise CheckpointError(f"{path} is truncated ({len(data)} bytes): refusing to load it")
    body, digest = memoryview(data)[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError(f"{path} is corrupt or truncated (its checksum does not match): refusing to load "
                              "it; resume from an older checkpoint in the same folder, or start afresh")
    fmt, count = struct.unpack_from("<IQ", body, len(MAGIC))
    if fmt != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {fmt}; this plug_asgd reads format {FORMAT}")
    frames, pos = [], head
    for _ in range(count):
        if pos + 8 > len(body):
            raise CheckpointError(f"{path}: frame table runs past the end of the file")
        (length,) = struct.unpack_from("<Q", body, pos)
        pos += 8
        if pos + length > len(body):
            raise CheckpointError(f"{path}: a frame runs past the end of the file")
        frames.append(body[pos:pos + length])
        pos += length
    if pos != len(body):
        raise CheckpointError(f"{path}: {len(body) - pos} stray bytes after the last frame")
    try:
        msg = decode(frames, _LIMITS)
    except WireError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    if msg.type != "checkpoint":
        raise CheckpointError(f"{path} holds a {msg.type!r} message, not a checkpoint")
    return msg


def checkpoint_name(version: int) -> str:
    return f"ps-v{version:010d}.ckpt"


def list_checkpoints(dirpath: str | os.PathLike[str]) -> list[Path]:
    """Checkpoint files of a folder, oldest version first."""
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    return sorted((p for p in dirpath.iterdir() if _NAME.match(p.name)), key=lambda p: p.name)


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint file, or the newest one of a folder."""
    path = Path(path)
    if path.is_dir():
        found = list_checkpoints(path)
        if not found:
            raise CheckpointError(f"no checkpoint (ps-v*.ckpt) in {path}")
        return found[-1]
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    return path


def central_tensors(msg: Message) -> dict[str, np.ndarray]:
    """The central model's tensors of a checkpoint, by parameter name."""
    return {name[len("model/"):]: t for name, t in msg.tensors.items()
            if name.startswith("model/") and isinstance(t, np.ndarray)}


@dataclass
class CheckpointPolicy:
    """When the PS writes a checkpoint, where, and how many it keeps."""

    dirpath: Path
    every_n_updates: int | None = None
    every_n_seconds: float | None = None
    keep: int = 3

    def __post_init__(self) -> None:
        self.dirpath = Path(self.dirpath)
        if self.every_n_updates is None and self.every_n_seconds is None:
            self.every_n_seconds = 60.0
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        self._last_version = -1
        self._last_time = time.monotonic()

    def due(self, version: int) -> bool:
        if version == self._last_version:
            return False
        if self.every_n_updates is not None and version - max(self._last_version, 0) >= self.every_n_updates:
            return True
        return self.every_n_seconds is not None and time.monotonic() - self._last_time >= self.every_n_seconds

    def unsaved(self, version: int) -> bool:
        return version != self._last_version

    def save(self, version: int, fields: dict[str, Any], tensors: dict[str, Tensor]) -> Path:
        self.dirpath.mkdir(parents=True, exist_ok=True)
        path = write_checkpoint(self.dirpath / checkpoint_name(version), fields, tensors)
        self._last_version, self._last_time = version, time.monotonic()
        for old in list_checkpoints(self.dirpath)[:-self.keep]:
            old.unlink(missing_ok=True)
        return path

    def saved_version(self, version: int) -> None:
        """Mark ``version`` as already on disk (after a resume), so it is not written again at once."""
        self._last_version = version
