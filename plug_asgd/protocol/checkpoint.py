"""Checkpoint files of the central state: written atomically, verified before anything is trusted.

A checkpoint is the wire format itself (a msgpack header frame and raw tensor frames, see
:mod:`plug_asgd.protocol.wire`) laid out in a file::

    MAGIC | u32 format | u64 frame count | (u64 length, frame bytes)* | sha256 of all before it

It is written to a temporary name, flushed and fsync'ed, then renamed over the final name, so a
crash leaves either the old file or the new one, never half of one; a failed write (a full disk)
removes its temporary file. The file is readable by its owner only (0600), whatever the umask.
Loading checks the magic, the checksum and then every frame as the wire does; nothing is unpickled.
The writer refuses what the reader would (one :data:`LIMITS`), so a checkpoint written can always be
read back. Only numpy and the wire are needed, so the PS reads and writes checkpoints without torch.

A PS's files are named ``ps-vVERSION-RUN.ckpt``, and ``ps-eEPOCH-vVERSION-RUN.ckpt`` past the first epoch (a
standby that leads writes its epoch, :mod:`plug_asgd.ps.failover`): a folder may hold several runs' files, and a PS
lists, prunes and resumes only its own run's, the latest epoch's newest first (``ps-vVERSION.ckpt``: an older
plug_asgd's, of no known run).
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

from plug_asgd.protocol.wire import Limits, Message, Tensor, WireError, decode, encode

MAGIC = b"PLUG-ASGD-CKPT\n"
FORMAT = 1
_NAME = re.compile(r"^ps-(?:e([1-9]\d{0,8})-)?v(\d{10})(?:-([A-Za-z0-9][A-Za-z0-9_.-]{0,63}))?\.ckpt$")
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# what the reader accepts, and so what the writer may write (the header bounds the dedupe table)
LIMITS = Limits(max_header_bytes=1 << 28, max_frames=1 << 24, max_message_bytes=1 << 40)


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted (corrupt, truncated, not a checkpoint, wrong mode)."""


class HeaderTooLarge(CheckpointError):
    """The header would exceed what the reader accepts; nothing was written. ``excess``: bytes over.

    Args:
        message: the explanation, the exception's text.
        excess: bytes of the header beyond the limit (zero or less where only the frame count is over).
    """

    def __init__(self, message: str, excess: int) -> None:
        super().__init__(message)
        self.excess = excess


def write_checkpoint(path: str | os.PathLike[str], fields: dict[str, Any], tensors: dict[str, Tensor],
                     limits: Limits = LIMITS) -> Path:
    """Write atomically: temp file (mode 0600), fsync, rename, fsync of the directory.

    Refuses (:class:`HeaderTooLarge`) what :func:`read_checkpoint` with the same ``limits`` would
    refuse, before writing a byte; on any OSError (a full or read-only disk) the temporary file is
    removed and the error raised, the files already there untouched.

    Args:
        path: the checkpoint file to write (its folder must exist); an existing file is replaced.
        fields: the header fields (msgpack values: the version, the run id, counters, ...).
        tensors: the tensors to store by name (``model/NAME`` for the central model's).
        limits: the bounds the reader will enforce; the writer refuses what goes beyond them.

    Raises:
        HeaderTooLarge: where the header or the frame count goes beyond ``limits`` (nothing is written).
    """
    path = Path(path)
    frames = encode("checkpoint", fields, tensors)
    header = len(memoryview(frames[0]).cast("B"))
    if header > limits.max_header_bytes or len(frames) > limits.max_frames:
        raise HeaderTooLarge(f"{path}: a header of {header} bytes and {len(frames)} frames, beyond what a "
                             f"checkpoint may hold ({limits.max_header_bytes} bytes, {limits.max_frames} frames): "
                             "not written", header - limits.max_header_bytes)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        _write_frames(tmp, frames)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def _write_frames(tmp: Path, frames: list[Any]) -> None:
    """Write ``frames`` to ``tmp``, readable and writable by its owner only (0600): a checkpoint holds the model and
    the sessions of the workers that push to it."""
    digest = hashlib.sha256()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a temporary file left by an earlier crash keeps its mode: set it
    with os.fdopen(fd, "wb") as f:
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


def read_checkpoint(path: str | os.PathLike[str], limits: Limits = LIMITS) -> Message:
    """The checkpoint's header fields and tensors, or :class:`CheckpointError` saying what is wrong.

    Args:
        path: the checkpoint file to read.
        limits: the bounds its frames are checked against, as the wire checks a message.

    Raises:
        CheckpointError: where the file cannot be read, is not a checkpoint, is truncated or corrupt, has
            another format, or holds a message that breaks the protocol or is not a checkpoint.
    """
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
        msg = decode(frames, limits)
    except WireError as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    if msg.type != "checkpoint":
        raise CheckpointError(f"{path} holds a {msg.type!r} message, not a checkpoint")
    return msg


def checkpoint_name(version: int, run_id: str | None = None, epoch: int = 1) -> str:
    """``ps-vVERSION-RUN.ckpt`` (``ps-vVERSION.ckpt`` without a run: an older plug_asgd's name), with ``eEPOCH-``
    after ``ps-`` past the first epoch.

    Args:
        version: the central model's version (updates applied) the checkpoint holds.
        run_id: the run the file belongs to; None for the name without a run.
        epoch: the epoch the PS that writes it leads.
    """
    prefix = f"ps-e{epoch}-" if epoch > 1 else "ps-"
    return f"{prefix}v{version:010d}-{run_id}.ckpt" if run_id else f"{prefix}v{version:010d}.ckpt"


def check_run_id(run_id: str) -> str:
    """``run_id`` if it may name a run (it goes into file names), else a ValueError saying what may.

    Args:
        run_id: the run id to check.

    Raises:
        ValueError: where ``run_id`` is not 1 to 64 letters, digits or ``_.-`` starting with a letter or digit.
    """
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise ValueError(f"a run id is 1 to 64 letters, digits or '_.-', starting with a letter or digit; "
                         f"got {run_id!r:.80}")
    return run_id


def run_of(path: Path) -> str | None:
    """The run a checkpoint file's name says it belongs to (None: an older plug_asgd's file).

    Args:
        path: the checkpoint file (only its name is read).
    """
    match = _NAME.match(path.name)
    return match.group(3) if match else None


def epoch_of(path: Path) -> int:
    """The epoch a checkpoint file's name says its writer led (1: a name without one).

    Args:
        path: the checkpoint file (only its name is read).
    """
    match = _NAME.match(path.name)
    return int(match.group(1)) if match and match.group(1) else 1


def list_checkpoints(dirpath: str | os.PathLike[str]) -> list[Path]:
    """Checkpoint files of a folder, every run's, oldest first: by epoch, then version.

    Args:
        dirpath: the folder to list; a missing one holds none.
    """
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return []
    found = ((int(m.group(1) or 1), int(m.group(2)), m.group(3) or "", p) for p in dirpath.iterdir()
             if (m := _NAME.match(p.name)))
    return [p for *_, p in sorted(found)]


def runs_in(dirpath: str | os.PathLike[str]) -> dict[str | None, list[Path]]:
    """A folder's checkpoint files by run (None: an older plug_asgd's, of no known run), each run's oldest first.

    Args:
        dirpath: the folder to list; a missing one holds none.
    """
    runs: dict[str | None, list[Path]] = {}
    for p in list_checkpoints(dirpath):
        runs.setdefault(run_of(p), []).append(p)
    return runs


def resolve_checkpoint(path: str | os.PathLike[str], run_id: str | None = None) -> Path:
    """A checkpoint file, or the newest one of a folder (of run ``run_id``, needed if it holds several runs).

    Args:
        path: a checkpoint file, or a folder of them.
        run_id: the run whose newest file to take from a folder; None where the folder holds one run only.
    """
    return checkpoint_candidates(path, run_id)[0]


def checkpoint_candidates(path: str | os.PathLike[str], run_id: str | None = None) -> list[Path]:
    """What a resume from ``path`` may load, best first: the file itself; in a folder, one run's files,
    newest first (run ``run_id``; without it, the folder's only run). CheckpointError if none.

    Args:
        path: a checkpoint file, or a folder of them.
        run_id: the run whose files to take from a folder; None where the folder holds one run only.

    Raises:
        CheckpointError: where ``path`` does not exist, the folder holds no file of the run (or none at all),
            or, without ``run_id``, holds several runs' files.
    """
    path = Path(path)
    if not path.is_dir():
        if not path.exists():
            raise CheckpointError(f"no checkpoint at {path}")
        return [path]
    runs = runs_in(path)
    if run_id is not None:
        if run_id not in runs:
            known = ", ".join(sorted(str(r) for r in runs)) or "none"
            raise CheckpointError(f"no checkpoint of run {run_id} in {path} (runs there: {known})")
        return runs[run_id][::-1]
    if not runs:
        raise CheckpointError(f"no checkpoint (ps-v*.ckpt) in {path}")
    if len(runs) > 1:
        listed = "; ".join(f"{r or 'no run id'}: newest {files[-1].name}" for r, files in runs.items())
        raise CheckpointError(f"{path} holds checkpoints of {len(runs)} runs ({listed}): say which to load "
                              "(--run-id RUN; run_id= in Python) or name a file")
    return next(iter(runs.values()))[::-1]


def central_tensors(msg: Message) -> dict[str, np.ndarray]:
    """The central model's tensors of a checkpoint, by parameter name.

    Args:
        msg: the checkpoint, as :func:`read_checkpoint` returns it.
    """
    return {name[len("model/"):]: t for name, t in msg.tensors.items()
            if name.startswith("model/") and isinstance(t, np.ndarray)}


@dataclass
class CheckpointPolicy:
    """When the PS writes a checkpoint, where, and how many it keeps.

    Attributes:
        dirpath: the folder the files go to (made at the first save).
        every_n_updates: write once this many updates were applied since the last try; None for no such point.
        every_n_seconds: write once this many seconds passed since the last try; None for no such point (where
            both are None, every 60 seconds).
        keep: how many of this run's newest files are kept; older ones are removed.
        run_id: the run its files are named for: it lists and prunes only these; None for names without a run.
        limits: the bounds the files must stay within, those the reader enforces.

    Raises:
        ValueError: where ``keep`` is below 1.
    """

    dirpath: Path
    every_n_updates: int | None = None
    every_n_seconds: float | None = None
    keep: int = 3
    run_id: str | None = None  # the run its files are named for: it lists and prunes only these
    limits: Limits = LIMITS

    def __post_init__(self) -> None:
        self.dirpath = Path(self.dirpath)
        if self.every_n_updates is None and self.every_n_seconds is None:
            self.every_n_seconds = 60.0
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1, got {self.keep}")
        self._last_version = -1
        self._last_attempt = -1  # version of the last try, saved or failed: the next point counts from it
        self._last_time = time.monotonic()

    def due(self, version: int) -> bool:
        """Whether a checkpoint point is reached: ``every_n_updates`` since the last try, or ``every_n_seconds``.

        Args:
            version: the central model's current version; never due where it is the one saved last.
        """
        if version == self._last_version:
            return False
        if self.every_n_updates is not None and version - max(self._last_attempt, 0) >= self.every_n_updates:
            return True
        return self.every_n_seconds is not None and time.monotonic() - self._last_time >= self.every_n_seconds

    def failed(self, version: int) -> None:
        """A try at ``version`` failed: the next point counts from it (the disk may be back by then).

        Args:
            version: the version whose checkpoint could not be written.
        """
        self._last_attempt, self._last_time = version, time.monotonic()

    def unsaved(self, version: int) -> bool:
        """Whether ``version`` differs from the version saved last (so a final checkpoint would add something).

        Args:
            version: the central model's current version.
        """
        return version != self._last_version

    def save(self, version: int, fields: dict[str, Any], tensors: dict[str, Tensor], epoch: int = 1) -> Path:
        """Write the checkpoint of ``version``, then remove this run's files beyond the newest ``keep``.

        Args:
            version: the central model's version the checkpoint holds (it names the file).
            fields: the header fields, as :func:`write_checkpoint` takes them.
            tensors: the tensors to store, as :func:`write_checkpoint` takes them.
            epoch: the epoch the writing PS leads (it names the file past the first).
        """
        self.dirpath.mkdir(parents=True, exist_ok=True)
        path = write_checkpoint(self.dirpath / checkpoint_name(version, self.run_id, epoch), fields, tensors,
                                self.limits)
        self.saved_version(version)
        self._last_time = time.monotonic()
        for old in runs_in(self.dirpath).get(self.run_id, [])[:-self.keep]:
            old.unlink(missing_ok=True)
        return path

    def saved_version(self, version: int) -> None:
        """Mark ``version`` as already on disk (after a resume), so it is not written again at once.

        Args:
            version: the version of the checkpoint on disk.
        """
        self._last_version = self._last_attempt = version
