"""A real PS whose disk fails under it: a tmpfs made full or read-only, a low ``ulimit -n`` filled with
idle connections; and checkpoint folders that hold another run's files. The PS must go on serving,
its worker see nothing change, each failed write be counted once by kind, no temporary file be left,
and a checkpoint be written again once the disk is back.

The checkpoint points are ``every 4 updates`` and the retry backoff is 600 s: every try in these
tests happens at a point the test's pushes reach, so the counts are exact. The mounts need root
(the tests skip, saying so, where mounting is refused; with PLUG_ASGD_REQUIRE_DATA=1, as in CI, they fail).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from plug_asgd.protocol.checkpoint import (
    CheckpointError,
    central_tensors,
    checkpoint_name,
    read_checkpoint,
    write_checkpoint,
)
from plug_asgd.ps import PSConfig, embedded_command
from plug_asgd.worker.client import PSClient
from tests.conftest import free_port, skip_unless_required

pytestmark = [pytest.mark.faults, pytest.mark.integration]

EVERY = 4  # updates between checkpoints
NO_TIMED_RETRY = {"checkpoint_every_updates": EVERY, "io_retry_seconds": 600.0, "shm_pushes": False}


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=20)


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` for the test (lazily unmounted after it)."""
    path.mkdir()
    try:
        done = _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
    except FileNotFoundError:
        skip_unless_required("no `mount` command here: these tests need util-linux's mount and root")
    if done.returncode != 0:
        skip_unless_required(f"cannot mount a tmpfs here ({done.stderr.strip()}): these tests need root")
    try:
        yield path
    finally:
        _run("umount", "-l", str(path))


def remount(path: Path, how: str) -> None:
    """``mount -o remount,ro|rw``; a remount read-only is refused while the PS has a file open for writing
    (its metrics line, for a moment): tried until it is not."""
    for _ in range(200):
        done = _run("mount", "-o", f"remount,{how}", str(path))
        if done.returncode == 0:
            return
        time.sleep(0.05)
    pytest.fail(f"mount -o remount,{how} {path}: {done.stderr}")


def fill(mnt: Path) -> Path:
    """A file that takes every free block of the file system at ``mnt``."""
    filler = mnt / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def wait_for(condition, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Worker:
    """An honest worker: pushes 1.0 at a time and checks every reply (the version and model it must see)."""

    def __init__(self, address: str) -> None:
        self.client = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=30, heartbeat_s=None)
        self.client.hello(stage=1, training=True, timeout=30)
        self.version = 0
        self.start = 0.0  # the model's values before the first push

    def init(self, start: float = 0.0) -> None:
        self.client.init({"w": np.full(4, start, np.float32)})

    def push(self, n: int) -> None:
        for _ in range(n):
            reply = self.client.push(self.version, {"w": np.ones(4, np.float32)})
            assert reply.status == "applied" and reply.version == self.version + 1, reply
            self.version = reply.version
            np.testing.assert_array_equal(reply.tensors["w"], np.full(4, self.start + self.version, np.float32))

    def errors(self) -> dict:
        return self.client.stats()["io_errors"]


def names(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir()) if ck.exists() else []


def test_a_full_disk_fails_checkpoints_while_the_ps_serves_on_and_they_are_written_again_once_freed(
        start_ps, tmp_path, fault_report):
    with tmpfs(tmp_path / "disk", "256k") as mnt:
        ck = mnt / "ck"
        address = start_ps("asgd", checkpoint_dir=ck, run_id="full", run_dir=tmp_path / "run", metrics_every=600.0,
                           **NO_TIMED_RETRY)
        w = Worker(address)
        w.init()
        w.push(4)
        wait_for(lambda: names(ck) == [checkpoint_name(4, "full")], "the checkpoint at 4")
        filler = fill(mnt)
        w.push(4)  # the point at 8: ENOSPC
        wait_for(lambda: w.errors() == {"checkpoint ENOSPC": 1}, "the failure at 8")
        assert names(ck) == [checkpoint_name(4, "full")]  # no .tmp left behind
        w.push(4)  # the point at 12: ENOSPC again
        wait_for(lambda: w.errors() == {"checkpoint ENOSPC": 2}, "the failure at 12")
        assert names(ck) == [checkpoint_name(4, "full")]
        filler.unlink()
        freed = time.monotonic()
        w.push(4)  # the point at 16: written
        wait_for(lambda: checkpoint_name(16, "full") in names(ck), "the checkpoint at 16")
        recovery = time.monotonic() - freed
        stats = w.client.stats()
        assert stats["io_errors"] == {"checkpoint ENOSPC": 2} and "No space left" in stats["io_last_error"]
        assert stats["last_checkpoint"] == str(ck / checkpoint_name(16, "full")) and stats["version"] == 16
        assert names(ck) == [checkpoint_name(4, "full"), checkpoint_name(16, "full")]
        msg = read_checkpoint(ck / checkpoint_name(16, "full"))
        np.testing.assert_array_equal(central_tensors(msg)["w"], np.full(4, 16.0, np.float32))
        assert msg.fields["run_id"] == "full"
        w.client.close()
        start_ps.stop(address)
    fault_report(fault="checkpoint folder full (tmpfs, ENOSPC) at 2 checkpoint points", injected=2, handled=2,
                 pushes_lost=0, recovery_s=round(recovery, 2),
                 detail="counted checkpoint ENOSPC:2, no .tmp left, the worker's 16 replies exact; written again "
                        "at the next point once freed")


def test_a_read_only_disk_fails_checkpoint_and_metrics_once_each_then_both_are_written_again(
        start_ps, tmp_path, fault_report):
    with tmpfs(tmp_path / "disk", "1m") as mnt:
        ck, run = mnt / "ck", mnt / "run"
        address = start_ps("asgd", checkpoint_dir=ck, run_id="ro", run_dir=run, metrics_every=0.2,
                           **NO_TIMED_RETRY)
        w = Worker(address)
        w.init()
        w.push(4)
        wait_for(lambda: names(ck) == [checkpoint_name(4, "ro")] and (run / "ps_metrics.jsonl").exists(),
                 "the checkpoint at 4 and a metrics line")
        remount(mnt, "ro")
        w.push(4)
        # the point at 8 fails, and the next metrics line; then neither is tried before the 600 s backoff
        wait_for(lambda: w.errors() == {"checkpoint EROFS": 1, "metrics EROFS": 1}, "both failures")
        remount(mnt, "rw")
        healed = time.monotonic()
        w.push(4)
        wait_for(lambda: checkpoint_name(12, "ro") in names(ck), "the checkpoint at 12")
        recovery = time.monotonic() - healed
        assert names(ck) == [checkpoint_name(4, "ro"), checkpoint_name(12, "ro")]
        assert w.errors() == {"checkpoint EROFS": 1, "metrics EROFS": 1}
        w.client.close()
        start_ps.stop(address)  # the metrics line at exit is written
        last = json.loads((run / "ps_metrics.jsonl").read_text().splitlines()[-1])
        assert last["version"] == 12 and last["run_id"] == "ro"
        assert last["io_errors"] == {"checkpoint EROFS": 1, "metrics EROFS": 1}
    fault_report(fault="checkpoint and metrics folder remounted read-only (EROFS)", injected=2, handled=2,
                 pushes_lost=0, recovery_s=round(recovery, 2),
                 detail="counted checkpoint EROFS:1 metrics EROFS:1, the PS served on; after remount rw the "
                        "checkpoint written at the next point, the metrics line at exit (its retry waits 600 s)")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_connections_past_the_fd_limit_fail_a_checkpoint_and_a_metrics_line_not_the_ps(
        procs, tmp_path, fault_report):
    limit = 64  # the 1,024 and 1,100 idle connections, scaled down: the same exhaustion, faster
    address = f"tcp://127.0.0.1:{free_port()}"
    ck = tmp_path / "ck"
    config = PSConfig(bind=address, checkpoint_dir=ck, run_id="fds", run_dir=tmp_path / "run", metrics_every=0.2,
                      **NO_TIMED_RETRY)
    ps = procs.start(embedded_command(config),
                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit // 2, limit)))
    w = Worker(address)
    # the PS raised its soft limit to the hard one at start
    limits = re.search(r"Max open files\s+(\d+)\s+(\d+)", Path(f"/proc/{ps.pid}/limits").read_text())
    assert limits is not None and limits.groups() == (str(limit), str(limit))
    w.init()
    w.push(4)
    wait_for(lambda: names(ck) == [checkpoint_name(4, "fds")], "the checkpoint at 4")
    baseline = _fds(ps.pid)
    ctx = zmq.Context.instance()
    idle = []
    try:
        for _ in range(limit + 16):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            idle.append(s)
        wait_for(lambda: _fds(ps.pid) == limit, f"the PS to hold {limit} descriptors")
        w.push(4)  # the point at 8: no descriptor for the temporary file; the next metrics line neither
        wait_for(lambda: w.errors() == {"checkpoint EMFILE": 1, "metrics EMFILE": 1}, "both failures")
        assert names(ck) == [checkpoint_name(4, "fds")]
    finally:
        for s in idle:
            s.close(0)
    closed = time.monotonic()
    wait_for(lambda: _fds(ps.pid) <= baseline, "the idle connections to be gone")
    w.push(4)
    wait_for(lambda: checkpoint_name(12, "fds") in names(ck), "the checkpoint at 12")
    recovery = time.monotonic() - closed
    assert w.errors() == {"checkpoint EMFILE": 1, "metrics EMFILE": 1}
    assert ps.poll() is None
    w.client.close()
    ps.terminate()
    assert ps.wait(10) == 0
    fault_report(fault=f"{limit + 16} idle connections at ulimit -n {limit} (EMFILE)", injected=2, handled=2,
                 pushes_lost=0, recovery_s=round(recovery, 2),
                 detail="counted checkpoint EMFILE:1 metrics EMFILE:1, the worker served throughout; written "
                        "again once the connections closed")


def _checkpoint(path: Path, version: int, run_id: str | None) -> Path:
    fields = {"mode": "asgd", "version": version, "world_size": None, "last_seq": {}, "rule": {}, "stats": {},
              **({"run_id": run_id} if run_id else {})}
    return write_checkpoint(path / checkpoint_name(version, run_id), fields,
                            {"model/w": np.full(4, float(version), np.float32)})


def _readable(path: Path) -> bool:
    try:
        read_checkpoint(path)
        return True
    except CheckpointError:
        return False


def test_a_fresh_ps_refuses_a_folder_of_another_run_and_touches_nothing(procs, tmp_path, fault_report):
    ck = tmp_path / "ck"
    ck.mkdir()
    theirs = _checkpoint(ck, 500, "theirs")
    before = theirs.read_bytes()
    code, out = procs.run(embedded_command(PSConfig(bind=f"tcp://127.0.0.1:{free_port()}", checkpoint_dir=ck)),
                          timeout=30)
    assert code == 2, out
    assert f"{ck} holds checkpoints of another run (run theirs: newest {theirs.name})" in out
    assert f"--resume {ck}" in out and "--run-id NAME" in out
    assert names(ck) == [theirs.name] and theirs.read_bytes() == before
    fault_report(fault="fresh PS given a checkpoint folder of another run", injected=1, handled=1, pushes_lost=0,
                 recovery_s=None, detail="refused at start (exit 2), saying to --resume it, use another folder "
                                         "or --run-id; the files untouched")


def test_resume_falls_back_past_a_corrupt_newest_ignores_another_run_and_prunes_only_its_own(
        start_ps, tmp_path, fault_report):
    ck = tmp_path / "ck"
    ck.mkdir()
    _checkpoint(ck, 4, "a")
    corrupt = _checkpoint(ck, 8, "a")
    corrupt.write_bytes(corrupt.read_bytes()[:-10])
    theirs = [_checkpoint(ck, v, "b") for v in (100, 200)]
    before = [p.read_bytes() for p in theirs]
    address = start_ps("asgd", checkpoint_dir=ck, resume=ck, run_id="a", keep=2, **NO_TIMED_RETRY)
    w = Worker(address)
    stats = w.client.stats()
    assert stats["version"] == 4 and stats["run_id"] == "a"
    assert stats["resumed_from"] == str(ck / checkpoint_name(4, "a"))
    assert stats["resume_skipped"] == [corrupt.name]
    w.version = 4  # the checkpoint at 4 holds 4.0: the model is its version, as if pushed from 0
    for v in (8, 12):  # the points at 8 (over the corrupt file) and 12; the 2 newest of run a are kept
        w.push(4)
        wait_for(lambda v=v: _readable(ck / checkpoint_name(v, "a")), f"the checkpoint at {v}")
    # the PS prunes after it wrote the newest: a loaded machine can be looked at in between (a CI run was)
    kept = sorted([checkpoint_name(8, "a"), checkpoint_name(12, "a"), *(p.name for p in theirs)])
    wait_for(lambda: names(ck) == kept, f"the checkpoints pruned to {kept}")
    assert [p.read_bytes() for p in theirs] == before
    np.testing.assert_array_equal(central_tensors(read_checkpoint(corrupt))["w"], np.full(4, 8.0, np.float32))
    w.client.close()
    out = start_ps.stop(address)
    assert f"{corrupt} is corrupt or truncated" in out and "falling back to the next newest checkpoint" in out
    fault_report(fault="newest checkpoint corrupt, another run's files beside (--resume)", injected=1, handled=1,
                 pushes_lost=0, recovery_s=None,
                 detail="resumed from the newest good one of its run, saying so; the other run's files untouched "
                        "by the resume and the pruning")
