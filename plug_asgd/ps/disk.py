"""The PS's writes to disk that must never stop it: failures counted by kind, retried after a backoff.

A checkpoint or a metrics line that cannot be written (a full disk, a read-only one, a
permission, no file descriptor left) is logged, counted in ``Stats.io_errors`` as
``"checkpoint ENOSPC"`` and the like, and tried again later; the PS goes on serving. Written
here: the backoff (:class:`Retry`), the metrics line that leaves no half line behind
(:func:`append_line`), and the file-descriptor limit a server raises at start
(:func:`raise_fd_limit`).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from plug_asgd.ps.stats import Stats

log = logging.getLogger("plug_asgd.ps")

MAX_BACKOFF_S = 300.0  # a failing write is tried at least this often (unless the first delay is longer)


def error_kind(exc: BaseException) -> str:
    """``ENOSPC``, ``EROFS``, ``EACCES``, ``EMFILE``...: the errno's name (what the counters are keyed by).

    Args:
        exc: the failure; one without an errno is named by its class.
    """
    code = getattr(exc, "errno", None)
    if isinstance(code, int):
        return errno.errorcode.get(code, f"errno{code}")
    return type(exc).__name__


class Retry:
    """One kind of write (``what``): its failures counted and logged, its next try put off by a backoff.

    After ``n`` failures in a row the next try waits ``first_s * 2**(n-1)`` seconds, at most
    ``max(first_s, MAX_BACKOFF_S)``; a success starts over. ``clock`` is ``time.monotonic`` (a test's
    own clock otherwise).

    Args:
        what: the kind of write (``"checkpoint"``, ``"metrics"``): the counters' key and the log's word.
        stats: the counters its failures go to (``io_errors``, ``io_last_error``).
        first_s: the delay, in seconds, after a first failure.
        clock: what tells the time, in seconds.
    """

    def __init__(self, what: str, stats: Stats, first_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.stats, self.first_s, self.clock = what, stats, first_s, clock
        self.in_a_row = 0
        self.retry_at = 0.0

    @property
    def failing(self) -> bool:
        """True from a failure until the next success."""
        return self.in_a_row > 0

    def waiting(self) -> bool:
        """True while the backoff after a failure runs."""
        return self.failing and self.clock() < self.retry_at

    def failed(self, exc: Exception, final: bool = False) -> None:
        """Count and log ``exc``; put the next try off (a final try, at exit, is the last: no retry).

        Args:
            exc: why the write failed.
            final: whether it was the try at exit (logged as such).
        """
        kind = error_kind(exc)
        self.stats.io_errors[f"{self.what} {kind}"] += 1
        self.in_a_row += 1
        delay = min(self.first_s * 2 ** (self.in_a_row - 1), max(self.first_s, MAX_BACKOFF_S))
        self.retry_at = self.clock() + delay
        self.stats.io_last_error = f"{self.what}: {exc} ({time.strftime('%H:%M:%S')})"
        trace = not isinstance(exc, OSError | ValueError)  # not the disk's doing: a bug, show where
        if final:
            log.error("%s not written at exit (%s): %s", self.what, kind, exc, exc_info=trace)
        else:
            log.error("%s not written (%s): %s; the PS goes on serving and tries again in %.0f s at the latest",
                      self.what, kind, exc, delay, exc_info=trace)

    def succeeded(self) -> None:
        """The write went through: the backoff starts over (logged where it had failed)."""
        if self.failing:
            log.warning("%s written again after %d failure(s)", self.what, self.in_a_row)
        self.in_a_row = 0
        self.retry_at = 0.0


def append_line(path: Path, line: str) -> None:
    """Append ``line`` (one JSON line) to ``path`` whole or not at all: a write cut short by a full disk is
    taken back, so the file never holds half a line that the next one would be glued to.

    Args:
        path: the file to append to (made, with its folder, where missing).
        line: the text to append, its newline included.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        data = memoryview(line.encode())
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)


def raise_fd_limit() -> tuple[int, int] | None:
    """Raise this process's soft limit on open files to its hard limit, as servers commonly do; returns
    (soft, hard) as they are now (None where there are no such limits).

    Every connection holds a file descriptor: at a soft limit of 1,024 (a common default), 1,100
    idle connections leave none for a checkpoint. The PS polls with zmq_poll (poll, not select),
    so descriptors above 1,024 are fine. A write that fails anyway is counted and retried.
    """
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.info("could not raise the limit on open files from %d to %d: %s", soft, target, exc)
    return soft, hard
