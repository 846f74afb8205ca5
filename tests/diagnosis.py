"""What a test that failed waiting on a PS leaves in the report, so that a CI log alone tells where the silence was:
whether this test process's own ZeroMQ still carries a message, the state and output of each PS the test started,
every thread's stack, and the machine's load. tests/conftest.py adds it to such a failure's report.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

# what a failure says when it waited for a PS that did not answer
WAIT_FAILURES = ("PSUnreachableError", "did not answer", "timed out waiting", "no answer to", "no reply from")


def waited_on_a_ps(longrepr: object) -> bool:
    """Whether a failure's text is one of a PS not answering."""
    text = str(longrepr)
    return any(s in text for s in WAIT_FAILURES)


def zmq_round_trip(shared: bool, timeout_s: float = 5.0) -> str:
    """A message and its answer over loopback TCP between two sockets of this process, on the context every client
    of this process shares (``shared``) or on a fresh one: where only the shared one fails, its I/O thread is stuck
    and every client of this process goes unanswered, whatever the PS does."""
    import zmq

    ctx = zmq.Context.instance() if shared else zmq.Context()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (server, client):
        s.setsockopt(zmq.LINGER, 0)
    which = "zmq.Context.instance()" if shared else "a fresh zmq.Context"
    try:
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client.connect(f"tcp://127.0.0.1:{port}")
        start = time.monotonic()
        client.send(b"ping")
        if not server.poll(int(timeout_s * 1000)):
            return f"{which}: STUCK, a message between two of its sockets did not arrive within {timeout_s:g} s"
        peer, _ = server.recv_multipart()
        server.send_multipart([peer, b"pong"])
        if not client.poll(int(timeout_s * 1000)):
            return f"{which}: STUCK, the answer did not arrive within {timeout_s:g} s"
        client.recv()
        return f"{which}: a round trip in {(time.monotonic() - start) * 1000:.1f} ms"
    except Exception as exc:  # a diagnosis never hides the failure it describes
        return f"{which}: {type(exc).__name__}: {exc}"
    finally:
        server.close(0)
        client.close(0)
        if not shared:
            ctx.term()


def process_state(proc: subprocess.Popen) -> str:
    """Whether a process runs (its state and what it waits in) or how it ended, and what it printed so far."""
    code = proc.poll()
    if code is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
            state = next((line for line in status if line.startswith("State:")), "State: ?")
            wchan = Path(f"/proc/{proc.pid}/wchan").read_text()
        except OSError as exc:
            state, wchan = f"unreadable ({exc})", "?"
        head = f"pid {proc.pid} running, {state}, waiting in {wchan or '-'}"
    else:
        head = f"pid {proc.pid} exited with {code}"
    return f"{head}\n{_available_output(proc)}"


def _available_output(proc: subprocess.Popen) -> str:
    """What the process wrote to its pipe so far, read without waiting (the pipe is blocking again after)."""
    if proc.stdout is None:
        return ""
    chunks: list[bytes] = []
    try:
        fd = proc.stdout.fileno()
        os.set_blocking(fd, False)
        try:
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        finally:
            os.set_blocking(fd, True)
    except (OSError, ValueError) as exc:
        return f"(output unreadable: {exc})"
    return b"".join(chunks).decode(errors="replace")[-4000:]


def thread_stacks() -> str:
    """Every thread of this process, by name, with its stack."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- thread {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame))}"
                     for ident, frame in sys._current_frames().items())


def native_stacks(timeout_s: float = 60.0) -> str:
    """Each thread's native stack, ZeroMQ's I/O threads' included, from gdb attached to this process for a moment:
    where the shared context is stuck, its I/O thread shows what it waits in (a send of its own, such as a monitor's
    event into a full pipe; a lock, ``futex``), where an idle one waits in ``epoll_wait``. Says so where gdb is not
    installed."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return "native stacks: gdb is not installed"
    command = [gdb, "-p", str(os.getpid()), "-batch", "-nx", "-ex", "thread apply all bt 16"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"native stacks: gdb failed ({exc})"
    text = out.stdout
    first = text.find("\nThread ")  # (what gdb says before the stacks is left out)
    return "native stacks:\n" + (text[first + 1:] if first >= 0 else text)[-12000:]


def machine_load() -> str:
    """The load average and the memory available, which make a slow machine tell from a silent PS."""
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        available = next((line.split(":", 1)[1].strip() for line in meminfo if line.startswith("MemAvailable")), "?")
    except OSError:
        available = "?"
    return f"load average {os.getloadavg()}, memory available {available}"


def report(started: dict[str, subprocess.Popen]) -> str:
    """The whole diagnosis, for the PS processes ``started`` (address -> process) by the failed test."""
    parts = [machine_load(), zmq_round_trip(shared=True), zmq_round_trip(shared=False)]
    parts += [f"PS at {address}: {process_state(proc)}" for address, proc in started.items()]
    parts.append(thread_stacks())
    parts.append(native_stacks())
    return "\n\n".join(parts)
