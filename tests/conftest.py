"""Process helpers: every process a test starts lives in its own process group, which must be
empty when the test ends; anything left is killed and the test fails.

Tiers: a test that starts a process or opens a socket is ``integration``; every other test is
``quick`` (pure logic: ``pytest -m quick``; ZeroMQ sockets joined over ``inproc://``, memory of this
process, are allowed: ``tests/threaded_fit.py``). The marking is automatic: a test using the ``procs`` or
``start_ps`` fixture (directly or through another fixture) is integration; other modules and tests
say so with ``pytestmark = pytest.mark.integration`` or ``@pytest.mark.integration``. A quick test
that starts a process or opens a socket anyway (in its fixtures too) fails, saying to mark it.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.process
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

# Under pytest-xdist (pyproject.toml) the workers share the cores: one torch/OpenMP thread per process that sets
# none itself, as Lightning and the benchmarks' launcher give their ranks; threads beyond the cores only wait for them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# LAUNCHER_VARIABLES: set by Lightning's launchers in the launching process, a child that inherits them
# believes it is one rank of an already launched job. group_members: the pids of a process group.
from harness.ports import free_port_block
from harness.processes import LAUNCHER_VARIABLES, group_members

ROOT = Path(__file__).resolve().parent.parent
FASHION = Path("/usr/share/datasets/fashion-mnist")
PYTHON = sys.executable
PLUG_ASGD = str(Path(sys.executable).with_name("plug-asgd"))

# what the session fixture recipe_run lets its launch take: every test requesting it has a timeout above this
RECIPE_RUN_TIMEOUT_S = 170

HAVE_FASHION = (FASHION / "train-images-idx3-ubyte.gz").exists()
if not HAVE_FASHION and os.environ.get("PLUG_ASGD_REQUIRE_DATA") == "1":
    raise RuntimeError(f"PLUG_ASGD_REQUIRE_DATA=1 but {FASHION} holds no Fashion-MNIST: "
                       "apt-get install dataset-fashion-mnist")
# The MNIST recipe on a Fashion-MNIST subset, as the training tests run it
# The one accuracy threshold of the training tests (every mode, every compressor, on one PS and on 2 shards, the
# callbacks' run, the fault tests' finished runs), at the settings of RECIPE. Chance is 0.10. Measured over 10
# launches of all 21 mode and codec cases on one PS (`python tests/scripts/threshold_runs.py --repeats 10 --out
# DIR`, on 2 cores shared with a test suite for about half of them): the lowest
# case downpour 0.769-0.793, then dynsgd 0.776-0.800, eamsgd 0.776-0.811, randomk (1%) 0.777-0.798; every other
# case's minimum 0.779-0.805. On 2 shards, 3 launches: 0.777 (downpour) and up. The threshold is the lowest of
# the 210 one-PS runs less about 2 points. A case that cannot reach it fails (or is marked xfail with its
# numbers); it gets no settings of its own. Do not move it without a note here saying why.
ACCURACY_THRESHOLD = 0.75
RECIPE = ["recipes/mnist.py", "--data-dir", str(FASHION), "--no-download", "--quiet", "--no-val",
          "--train-subset", "8000", "--test-subset", "1000"]
# CI (.ci/run) sets PLUG_ASGD_REQUIRE_DATA=1: there, a test that would skip for want of something the
# machine should have (the dataset, network namespaces as root) fails instead, so no row of the fault
# table or real-data check silently drops out of a CI run.
REQUIRE_ALL = "PLUG_ASGD_REQUIRE_DATA"


def skip_unless_required(reason: str) -> None:
    """Skip with ``reason``; fail with it where CI asked for every test to run (``PLUG_ASGD_REQUIRE_DATA=1``)."""
    if os.environ.get(REQUIRE_ALL) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ALL}=1, as .ci/run sets: this test must run here, not skip)", pytrace=False)
    pytest.skip(reason)


needs_fashion = pytest.mark.skipif(
    not HAVE_FASHION, reason="Fashion-MNIST not installed: apt-get install dataset-fashion-mnist"
)


# A suite started in the background without job control (`cmd &` in a script) inherits SIGINT
# ignored, and every process it starts would too: Python then never raises KeyboardInterrupt, and
# the Ctrl-C test's workers never stop. Take SIGINT back as a terminal gives it; the processes the
# tests start then get it at its default (a handler, unlike "ignored", is not inherited across exec).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# matplotlib builds its font cache on its first import by running fc-list, a process: on a fresh machine the first
# quick test that draws a plot (tests/test_plot.py's, say) would trip the guard below for it. Build it here, once.
try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401
except ImportError:  # a dev extra (pyproject.toml), which the set-up installs
    pass


# the sparse codecs' C selection pass (plug_asgd/compressors/native.py) is compiled by a process at its first use on
# a machine: compile it here, once, before a quick test could be that first use
from plug_asgd.compressors import native  # noqa: E402

native.library()


# fixtures that start processes or open sockets: a test using one, even through another fixture, is integration
INTEGRATION_FIXTURES = {"procs", "start_ps"}


# pytest-xdist (`-n auto --dist loadfile`, pyproject.toml) keeps a file's tests on one worker, so its module
# fixtures are set up once, and starts the files with the most tests first (its default order: longest-first
# gained nothing over it). (Not `loadgroup`: under pytest 9.2 it ignores its groups, pytest-xdist issue 1386.)


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``'s workers: one more than the cores for the suite, whose failovers and lost workers wait out
    timeouts while a launch computes beside them (on 2 cores: 3 workers took 14 min 26 s in the work tree where 2
    took 16 min 26 s; 4 workers took 13 min 20 s in a fresh clone, inside 3 workers' 12 min 7 s to 14 min 16 s, each
    test 39% slower for 33% more workers); one a core, at least 2, for the quick tier, which only computes (each
    worker's start imports torch)."""
    cores = len(os.sched_getaffinity(0))
    quick_only = (config.option.markexpr or "").strip() == "quick"
    return max(2, cores) if quick_only else cores + 1


def full_tier_param(value: str, suite: tuple[str, ...]) -> Any:
    """``value`` as a parameter, marked for the full tier where ``suite`` leaves it out."""
    return value if value in suite else pytest.param(value, marks=pytest.mark.full)


def params_to_run(request: pytest.FixtureRequest, name: str) -> list[str]:
    """The values of parameter ``name`` that this session's tests of the requesting fixture will run, in order
    (the full tier's left out unless it is selected): what a module fixture's one launch must fit."""
    seen: dict[str, None] = {}
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is request.module and request.fixturename in getattr(item, "fixturenames", ()) \
                and callspec is not None and name in callspec.params and item.get_closest_marker("skip") is None:
            seen.setdefault(callspec.params[name], None)
    return list(seen)


def full_tier_selected(config) -> bool:
    """Whether this run selects the full tier (``pytest -m full``, or an expression naming it but not negating it)."""
    return "full" in (config.option.markexpr or "").replace("not full", "")


def pytest_collection_modifyitems(config, items):
    backstop = float(config.getini("timeout") or 0)
    # the full tier runs only when named (`pytest -m full`): its half hour of runs has no place in the suite
    full_selected = full_tier_selected(config)
    for item in items:
        full = item.get_closest_marker("full") is not None
        if full and not full_selected:
            item.add_marker(pytest.mark.skip(reason="the full tier: run it with pytest -m full (31 min on 2 "
                                                    "cores)"))
        marker = item.get_closest_marker("timeout")
        # the backstop bounds the suite's tests; the full tier's run alone, each beyond it
        if backstop and not full and marker is not None and marker.args and float(marker.args[0]) >= backstop:
            raise pytest.UsageError(f"{item.nodeid}: timeout {marker.args[0]} s is not below the global {backstop:g} s "
                                    "(pyproject.toml), which must stay above every per-test timeout")
        if item.get_closest_marker("integration") is None and INTEGRATION_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.integration)
        if item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.quick)
    _order_files(items)


# The files pytest-xdist hands out first (`--dist loadfile --no-loadscope-reorder`, pyproject.toml), each worker
# taking two at the start: the long launches that keep both cores busy beside the tests that mostly wait out
# timeouts (failovers, lost workers), so that the waiting leaves its core to a launch. After them, the other files
# that start processes (most such tests first), then the files of quick tests alone (most tests first): small
# pieces of pure computing at the end, where a file that waits out timeouts left the cores idle while the other
# workers had finished. Measured: bench/results/README.md, "The README's two commands".
FIRST_FILES = ("test_training", "test_standby", "test_momentum", "test_faults", "test_bench", "test_totals",
               "test_features", "test_worker_failures", "test_sharding", "test_shard_faults", "test_slowlink",
               # quick, but long: threaded fits of 10 to 20 s each, and a timeout of 15 s waited out
               "test_momentum_quick", "test_momentum_quick_off", "test_liveness_clock")


def _order_files(items: list[pytest.Item]) -> None:
    """Sort ``items`` by file: FIRST_FILES first, then the other files with tests that start processes (by their
    count of such tests), then the files of quick tests alone (by their test count); a file's own order kept."""
    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    counts = Counter(file_of(i) for i in items)
    integration = Counter(file_of(i) for i in items if i.get_closest_marker("quick") is None)

    def rank(item: pytest.Item) -> tuple[int, int, int, str]:
        name, file = Path(file_of(item)).stem, file_of(item)
        first = FIRST_FILES.index(name) if name in FIRST_FILES else len(FIRST_FILES)
        return first, 0 if integration[file] else 1, -(integration[file] or counts[file]), file

    items.sort(key=rank)  # stable: each file's tests keep their order


@contextlib.contextmanager
def _no_processes_or_sockets(item):
    """Within a quick test (its fixtures included), starting a process or opening a socket fails."""
    if item.get_closest_marker("quick") is None:
        yield
        return
    import zmq

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{item.nodeid} is a quick test (no processes, no sockets) but started a process or "
                           "opened a socket: mark it @pytest.mark.integration (tests/conftest.py)")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child", refuse)
        mp.setattr(multiprocessing.process.BaseProcess, "start", refuse)
        mp.setattr(socket.socket, "bind", refuse)
        mp.setattr(socket.socket, "connect", refuse)
        # ZeroMQ's sockets may join endpoints of this process (inproc://: memory, no I/O), no other
        for name in ("bind", "connect"):
            original = getattr(zmq.Socket, name)

            def in_process(sock, address, *args, _original=original, **kwargs):
                if not str(address).startswith("inproc://"):
                    refuse()
                return _original(sock, address, *args, **kwargs)

            mp.setattr(zmq.Socket, name, in_process)
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _no_processes_or_sockets(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _no_processes_or_sockets(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that failed waiting on a PS gets tests/diagnosis.py's report beside its traceback."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and call.when == "call" and item.get_closest_marker("quick") is None:
        from tests.diagnosis import report, waited_on_a_ps

        if waited_on_a_ps(rep.longrepr):
            ps = item.funcargs.get("start_ps")
            rep.sections.append(("what the test process saw", report(ps.started if ps is not None else {})))


def free_port() -> int:
    """A port free now, below the ephemeral range and never handed out before in this session's worker.

    A port the kernel gives ``bind(("", 0))`` comes from the ephemeral range: before the process it is meant for
    binds it, the kernel may give it to the next such call (the next PS this test starts) or to a connection's
    local end, and the PS then fails to bind or a worker reaches another test's PS.
    """
    return free_port_block(1)




def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without the launcher variables, unbuffered, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def kill_group(proc: subprocess.Popen, wait: float = 10.0) -> None:
    """SIGKILL the process group a test started (the leader and all it spawned), then reap the leader."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        pass


@pytest.fixture(autouse=True)
def _restore_environment():
    """An in-process Trainer writes launcher variables into os.environ: undo that after each test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


class ProcessGroups:
    """Starts commands in new sessions and checks, at the end, that none of them left anything behind."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(**(env or {})), start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
        self.procs.append(proc)
        return proc

    def run(self, cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int, str]:
        proc = self.start(cmd, env)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            out, _ = proc.communicate()
            pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s; output:\n{out[-4000:]}")
        return proc.returncode, out

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        kill_group(proc, wait=0)

    def leftovers(self, grace: float = 15.0) -> list[int]:
        deadline = time.monotonic() + grace
        while True:
            left = [pid for p in self.procs for pid in group_members(p.pid)]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


def run_to_end(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` in a new session to its end; fail unless it exits 0 and leaves no process behind. Its output."""
    groups = ProcessGroups()
    try:
        code, out = groups.run(cmd, timeout=timeout, env=env)
    finally:
        left = groups.leftovers()
        for p in groups.procs:
            groups.kill(p)
    assert code == 0, out[-4000:]
    assert not left, f"processes left running: {left}"
    return out


@pytest.fixture
def procs():
    groups = ProcessGroups()
    yield groups
    left = groups.leftovers()
    for p in groups.procs:
        groups.kill(p)
        if p.poll() is None:
            p.wait(10)
    assert not left, f"processes left running after the test: {left}"


@pytest.fixture
def fault_report(request):
    """``record(**row)``: one line of the fault table in docs/faults.md (scripts/fault_table.py sets the file)."""
    path = os.environ.get("PLUG_ASGD_FAULT_REPORT")

    def record(**row) -> None:
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"test": request.node.name, **row}) + "\n")

    return record


class PSProcesses:
    """PS processes a test starts: ``start_ps(mode, **options)`` -> address; ``stop(address)`` -> its output.

    ``options`` are :class:`plug_asgd.ps.PSConfig` fields; ``self.options`` those every PS gets (a test
    module may set some, ``worker_timeout`` say); ``env`` is added to their environment.
    """

    def __init__(self, procs: ProcessGroups) -> None:
        self.procs = procs
        self.options: dict = {}
        self.env: dict[str, str] = {}
        self.started: dict[str, subprocess.Popen] = {}

    def __call__(self, mode: str = "asgd", *, host: str = "127.0.0.1", prefix: tuple[str, ...] = (),
                 **options) -> str:
        from plug_asgd.ps import PSConfig, embedded_command

        address = f"tcp://{host}:{free_port()}"
        assert address not in self.started, f"{address} handed out twice: the first PS would be left running"
        config = PSConfig(bind=address, mode=mode, **{**self.options, **options})
        self.started[address] = self.procs.start([*prefix, *embedded_command(config)], env=self.env)
        return address

    def stop(self, address: str) -> str:
        """SIGTERM, the PS's clean stop; returns what it printed."""
        proc = self.started.pop(address)
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
        return out


@pytest.fixture
def start_ps(procs):
    processes = PSProcesses(procs)
    yield processes
    for address in list(processes.started):
        processes.stop(address)


@pytest.fixture(scope="session")
def recipe_run(tmp_path_factory):
    """The MNIST recipe on Fashion-MNIST, asgd, 2 workers, with the Supervisor, PSCheckpoint and
    CommunicationMonitor on: (folder, Lightning log dir, the recipe's summary). test_callbacks checks
    the callbacks; test_training checks the asgd run itself (what the callbacks leave unchanged:
    accuracy, versions, pushes and their bytes)."""
    if not HAVE_FASHION:
        pytest.skip("Fashion-MNIST not installed: apt-get install dataset-fashion-mnist")
    with once_per_session(tmp_path_factory, "recipe") as tmp:
        if not (tmp / "m.json").exists():  # the other pytest-xdist worker may have run it already
            for left in tmp.iterdir():  # what a failed attempt left
                shutil.rmtree(left) if left.is_dir() else left.unlink()
            run_to_end([PYTHON, *RECIPE, "--workers", "2", "--mode", "asgd", "--run-dir", str(tmp / "runs"),
                        "--metrics-json", str(tmp / "m.json.part"), "--supervise-every", "40",
                        "--checkpoint-dir", str(tmp / "ck"), "--checkpoint-every", "50", "--comm-monitor", "25"],
                       timeout=RECIPE_RUN_TIMEOUT_S)
            (tmp / "m.json.part").rename(tmp / "m.json")
    summary = json.loads((tmp / "m.json").read_text())
    return tmp, Path(summary["log_dir"]), summary


@contextlib.contextmanager
def once_per_session(tmp_path_factory, name: str):
    """A folder every pytest-xdist worker of this session shares, held under a lock: a session fixture that
    finds its result there reuses it instead of computing it a second time (the pattern xdist's docs give)."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # one basetemp per worker under it
    folder = shared / f"shared-{name}"
    folder.mkdir(exist_ok=True)
    with open(shared / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits here while the first computes
        try:
            yield folder
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def in_process_ps(mode: str, **options):
    """A ParameterServer of ``mode`` serving from a thread of this process on a free loopback port, stopped after."""
    import threading

    from plug_asgd.ps import ParameterServer, PSConfig

    server = ParameterServer(PSConfig(bind="tcp://127.0.0.1:*", mode=mode, **options))
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_ms": 10}, daemon=True)
    serving.start()
    try:
        yield server
    finally:
        server.request_stop()
        serving.join(10)


def serving_pair(address: str, tensors: dict, session: str = "raw") -> tuple:
    """A worker (rank 0 of 2) that initialised the PS at ``address`` with ``tensors``, and a raw DEALER socket
    to it that said hello as rank 1 in ``session``: the PS checks what it sends, not whether it may send."""
    import zmq

    from plug_asgd.protocol.wire import decode, encode
    from plug_asgd.worker.client import PSClient

    good = PSClient(address, rank=0, world_size=2, mode="asgd", request_timeout=10)
    good.hello(stage=1, training=True, timeout=20)
    assert good.init(tensors)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    raw.send_multipart(encode("hello", {"rid": 0, "rank": 1, "world_size": 2, "stage": 1, "session": session,
                                        "mode": "asgd", "training": True}))
    assert raw.poll(20_000) and decode(raw.recv_multipart()).type == "welcome"
    return good, raw


def run_on_emulated_hosts(command: list[str], timeout: float) -> tuple[int, str]:
    """Runs a benchmark that makes network namespaces (harness/netns.py) to its end; fails if it left a process
    or a namespace behind. Returns its exit code and output."""
    from harness.netns import PREFIX

    groups = ProcessGroups()

    def namespaces() -> set[str]:  # the benchmark's own (named with its pid): other tests may run beside it
        done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
        owners = [f"{PREFIX}{p.pid}" for p in groups.procs]  # then a host's name, which starts with a letter
        names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
        return {n for n in names for o in owners if n.startswith(o) and n[len(o):][:1].isalpha()}

    try:
        rc, output = groups.run(command, timeout=timeout)
        left = groups.leftovers()
    finally:
        for p in groups.procs:
            groups.kill(p)
    assert not left, f"the benchmark left processes behind: {left}"
    assert not namespaces(), "the benchmark left network namespaces behind"
    return rc, output


def require_emulated_hosts(rate_mbit: float | None, tag: str, **topology: Any) -> None:
    """Makes and removes a 2-host topology (harness/netns.py) to learn whether namespaces, veths, a bridge and htb
    can be made here (root, iproute2); skips if not, or fails where the suite must run everything."""
    from harness.netns import Topology, TopologyError

    try:
        with Topology(["a", "b"], rate_mbit, tag=f"{os.getpid()}{tag}", **topology):
            pass
    except FileNotFoundError:
        skip_unless_required("iproute2's `ip` is not installed: apt-get install iproute2")
    except TopologyError as exc:
        skip_unless_required(f"cannot emulate hosts here ({exc}); this benchmark needs root, iproute2 and tc")
