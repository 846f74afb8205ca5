"""tests/diagnosis.py: what a failure waiting on a PS reports, checked on live sockets and real processes."""

from __future__ import annotations

import shutil
import sys
import time

import pytest

from tests.diagnosis import native_stacks, process_state, report, waited_on_a_ps, zmq_round_trip

pytestmark = pytest.mark.integration


def test_a_round_trip_through_either_context_is_reported_with_its_time():
    for shared, which in ((True, "zmq.Context.instance()"), (False, "a fresh zmq.Context")):
        said = zmq_round_trip(shared)
        assert said.startswith(f"{which}: a round trip in ") and said.endswith(" ms"), said


def test_native_stacks_show_zeromqs_io_threads_waiting_where_they_wait():
    import zmq

    zmq.Context.instance()  # its I/O thread and reaper run from here on
    said = native_stacks()
    if shutil.which("gdb") is None:
        assert said == "native stacks: gdb is not installed"
        return
    assert said.startswith("native stacks:\n") and '"ZMQbg/IO/0"' in said and '"ZMQbg/Reaper"' in said, said
    io_thread = said.split('"ZMQbg/IO/0"')[1].split("\n\n")[0]
    assert "epoll_wait" in io_thread, io_thread  # an idle I/O thread waits for its sockets, not for a lock


def test_a_process_is_reported_running_or_with_its_exit_code_and_what_it_printed(procs):
    running = procs.start([sys.executable, "-c", "print('up', flush=True); import time; time.sleep(60)"])
    ended = procs.start([sys.executable, "-c", "import sys; print('bind failed'); sys.exit(2)"])
    ended.wait(30)
    deadline = time.monotonic() + 30
    said = process_state(running)
    while "up" not in said and time.monotonic() < deadline:  # until its line is in the pipe
        time.sleep(0.1)
        said += process_state(running)
    assert f"pid {running.pid} running, State:" in said and "up" in said, said
    assert process_state(ended) == f"pid {ended.pid} exited with 2\nbind failed\n"
    whole = report({"tcp://127.0.0.1:1": ended})
    assert "load average" in whole and f"PS at tcp://127.0.0.1:1: pid {ended.pid} exited with 2" in whole
    assert "--- thread MainThread" in whole
    procs.kill(running)
    running.wait(10)


@pytest.mark.parametrize("text, waited", [
    ("PSUnreachableError: no reply from the parameter server", True),
    ("AssertionError: timed out waiting for the primary to answer", True),
    ("AssertionError: assert 0.71 >= 0.75", False),
])
def test_only_failures_that_waited_on_a_ps_get_the_report(text, waited):
    assert waited_on_a_ps(text) is waited
