"""The PS's housekeeping without a disk to trust, in process (quick): failed writes counted by kind and
retried on their schedule, no half file or half line left, a checkpoint header the reader accepts,
and checkpoint folders that belong to runs. The same faults on a real PS: tests/test_disk_faults.py."""

from __future__ import annotations

import errno
import inspect
import os

import msgpack
import numpy as np
import pytest

from plug_asgd.protocol import checkpoint
from plug_asgd.protocol.checkpoint import (
    LIMITS,
    CheckpointError,
    HeaderTooLarge,
    checkpoint_name,
    list_checkpoints,
    read_checkpoint,
    write_checkpoint,
)
from plug_asgd.protocol.wire import Limits
from plug_asgd.ps import PSConfig, disk, persistence
from plug_asgd.ps.fast_store import FastStore
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.persistence import Persistence
from plug_asgd.ps.stats import Stats

W = {"model/w": np.arange(4, dtype=np.float32)}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _persistence(tmp_path, clock=None, **options) -> Persistence:
    config = PSConfig(mode="asgd", shm_pushes=False, **{"checkpoint_dir": tmp_path / "ck",
                                                        "checkpoint_every_updates": 4, **options})
    stats = Stats()
    store = FastStore(config, stats)
    store.init({"w": np.zeros(4, np.float32)})
    return Persistence(config, store, Membership(config.worker_timeout, stats), stats, clock=clock or Clock())


def _fail_with(monkeypatch, target, name, codes: list[int]) -> None:
    """``target.name`` raises OSError(code) for each code of ``codes`` in turn, then works again."""
    real = getattr(target, name)

    def failing(*args, **kwargs):
        if codes:
            code = codes.pop(0)
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)


# -- a checkpoint it writes can be read back ------------------------------------------------------

def test_the_writer_and_the_reader_share_one_header_bound():
    for fn in (write_checkpoint, read_checkpoint):
        assert inspect.signature(fn).parameters["limits"].default is LIMITS
    assert checkpoint.CheckpointPolicy(".").limits is LIMITS


def test_a_header_at_the_bound_is_written_and_reads_back_one_byte_more_is_never_written(tmp_path):
    def header_bytes(text: str) -> int:
        return len(msgpack.packb({"v": 1, "type": "checkpoint", "fields": {"s": text},
                                  "tensors": [{"name": "model/w", "enc": "dense", "dtype": "float32",
                                               "shape": [4]}]}, use_bin_type=True))

    limits = Limits(max_header_bytes=4096, max_frames=16, max_message_bytes=1 << 20)
    text = "x" * (4096 - header_bytes(""))
    while header_bytes(text) > 4096:  # msgpack's str length prefix grows with the string
        text = text[:-1]
    assert header_bytes(text) == 4096
    path = write_checkpoint(tmp_path / "at.ckpt", {"s": text}, W, limits)
    assert read_checkpoint(path, limits).fields["s"] == text
    with pytest.raises(HeaderTooLarge, match="not written") as err:
        write_checkpoint(tmp_path / "over.ckpt", {"s": text + "x"}, W, limits)
    assert err.value.excess == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["at.ckpt"]  # no file, no temporary file


def test_a_dedupe_table_past_the_bound_loses_its_longest_sessions_and_the_checkpoint_reads_back(tmp_path):
    p = _persistence(tmp_path, run_id="r")
    p.policy.limits = limits = Limits(max_header_bytes=8192, max_frames=16, max_message_bytes=1 << 20)
    short = {f"s{i}": i for i in range(20)}
    long = {f"{i:03d}" + "x" * 297: 100 + i for i in range(40)}  # 300-byte sessions: 12 kB of them
    p.store.last_seq = {**long, **short}
    p.store.state.version = 4
    path = p.save_checkpoint()
    kept = read_checkpoint(path, limits).fields["last_seq"]
    dropped = sorted(set(p.store.last_seq) - set(kept))
    assert {k: kept[k] for k in short} == short and all(kept[k] == long[k] for k in set(long) - set(dropped))
    assert set(dropped) <= set(long) and p.sessions_left_out == len(dropped) > 0
    # no more than needed: with any one of them back, the writer refuses the header
    fields = read_checkpoint(path, limits).fields
    with pytest.raises(HeaderTooLarge):
        write_checkpoint(tmp_path / "again.ckpt", {**fields, "last_seq": {**kept, dropped[0]: long[dropped[0]]}},
                         {"model/w": np.zeros(4, np.float32)}, limits)
    assert p.disk_counters()["checkpoint_sessions_left_out"] == len(dropped)


# -- housekeeping never raises ------------------------------------------------------------------

def test_failed_checkpoints_are_counted_by_kind_and_retried_on_a_backoff_or_at_the_next_point(tmp_path,
                                                                                               monkeypatch):
    clock = Clock()
    p = _persistence(tmp_path, clock, run_id="r", io_retry_seconds=2.0)
    codes = [errno.ENOSPC, errno.ENOSPC, errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EMFILE]
    _fail_with(monkeypatch, checkpoint, "_write_frames", codes)
    counts = p.stats.io_errors
    p.store.state.version = 4
    p.housekeeping()  # the point at 4: ENOSPC; next try at t=2 or at version 8
    assert counts == {"checkpoint ENOSPC": 1}
    clock.now = 1.9
    p.housekeeping()
    assert counts == {"checkpoint ENOSPC": 1}
    clock.now = 2.0
    p.housekeeping()  # the backoff: ENOSPC again, next in 4 s
    assert counts == {"checkpoint ENOSPC": 2}
    clock.now = 5.9
    p.housekeeping()
    assert counts == {"checkpoint ENOSPC": 2}
    p.store.state.version = 8
    p.housekeeping()  # a checkpoint point, within the backoff: tried
    assert counts == {"checkpoint ENOSPC": 3}
    for now, kind in ((5.9 + 8, "EROFS"), (5.9 + 8 + 16, "EACCES"), (5.9 + 8 + 16 + 32, "EMFILE")):
        clock.now = now - 0.01
        p.housekeeping()
        assert sum(counts.values()) == 3 + ["EROFS", "EACCES", "EMFILE"].index(kind)
        clock.now = now
        p.housekeeping()
        assert counts[f"checkpoint {kind}"] == 1
    assert counts == {"checkpoint ENOSPC": 3, "checkpoint EROFS": 1, "checkpoint EACCES": 1, "checkpoint EMFILE": 1}
    assert list_checkpoints(tmp_path / "ck") == [] and not any((tmp_path / "ck").iterdir())  # no .tmp left
    assert "Too many open files" in p.stats.io_last_error
    clock.now += 64
    p.housekeeping()  # the disk is back: written, and the backoff starts over
    assert [f.name for f in list_checkpoints(tmp_path / "ck")] == [checkpoint_name(8, "r")]
    assert not p.checkpoint_retry.failing and sum(counts.values()) == 6
    assert p.disk_counters()["last_checkpoint"] == str(tmp_path / "ck" / checkpoint_name(8, "r"))


def test_a_failed_metrics_line_waits_out_its_backoff_and_a_failed_final_checkpoint_is_exit_code_1(tmp_path,
                                                                                                   monkeypatch):
    clock = Clock()
    p = _persistence(tmp_path, clock, run_id="r", run_dir=tmp_path / "run", metrics_every=1.0,
                     io_retry_seconds=2.0)
    _fail_with(monkeypatch, persistence, "append_line", [errno.EMFILE, errno.EACCES])
    for now, expected in ((0.0, {"metrics EMFILE": 1}), (1.0, {"metrics EMFILE": 1}),
                          (2.0, {"metrics EMFILE": 1, "metrics EACCES": 1}), (5.9, {"metrics EMFILE": 1,
                                                                                     "metrics EACCES": 1})):
        clock.now = now
        p.housekeeping()
        assert p.stats.io_errors == expected, now
    assert not (tmp_path / "run" / "ps_metrics.jsonl").exists()
    clock.now = 6.0
    p.housekeeping()
    lines = (tmp_path / "run" / "ps_metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"metrics EACCES": 1' in lines[0] and '"run_id": "r"' in lines[0]
    _fail_with(monkeypatch, checkpoint, "_write_frames", [errno.ENOSPC])
    p.store.state.version = 3  # not a point: only the final checkpoint tries it
    assert p.housekeeping(final=True) == 1
    assert p.stats.io_errors["checkpoint ENOSPC"] == 1


def test_a_metrics_line_cut_short_by_a_full_disk_is_taken_back(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    disk.append_line(path, '{"a": 1}\n')
    real_write, calls = os.write, []

    def short_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.raises(OSError, match="No space"):
        disk.append_line(path, '{"b": 2222222}\n')
    monkeypatch.undo()
    assert calls == [15, 10] and path.read_text() == '{"a": 1}\n'


# -- a checkpoint folder belongs to runs ----------------------------------------------------------

def test_a_fresh_ps_refuses_a_folder_of_another_run_saying_what_to_do(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    theirs = write_checkpoint(ck / checkpoint_name(500, "theirs"), {"version": 500}, W)
    with pytest.raises(CheckpointError) as err:
        _persistence(tmp_path)
    text = str(err.value)
    assert f"{ck} holds checkpoints of another run (run theirs: newest {theirs.name})" in text
    assert f"--resume {ck}" in text and "--checkpoint-dir" in text and "--run-id NAME" in text
    with pytest.raises(CheckpointError, match=f"already holds checkpoints of run theirs.*--resume {ck} --run-id "
                                              "theirs"):
        _persistence(tmp_path, run_id="theirs")  # a fresh run may not write into a run's files either
    assert list_checkpoints(ck) == [theirs]


def test_a_named_run_beside_another_prunes_only_its_own_files(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    theirs = [write_checkpoint(ck / checkpoint_name(v, "theirs"), {"version": v}, W) for v in (100, 200, 300)]
    older = write_checkpoint(ck / checkpoint_name(50), {"version": 50}, W)  # an older plug_asgd's, no run
    p = _persistence(tmp_path, run_id="mine", keep=2)
    for v in (4, 8, 12):
        p.store.state.version = v
        p.housekeeping()
    mine = [ck / checkpoint_name(v, "mine") for v in (8, 12)]
    assert list_checkpoints(ck) == sorted([older, *mine, *theirs], key=lambda f: f.name)
    assert p.stats.io_errors == {}


def test_the_new_run_ids_are_distinct_file_names():
    ids = {persistence.new_run_id() for _ in range(50)}
    assert len(ids) == 50 and all(checkpoint.RUN_ID.match(i) for i in ids)
    with pytest.raises(ValueError, match="a run id is 1 to 64 letters"):
        PSConfig(run_id="../x")


def test_a_folder_of_several_runs_resolves_only_with_a_run_named(tmp_path):
    mine = [write_checkpoint(tmp_path / checkpoint_name(v, "mine"), {"version": v}, W) for v in (4, 8)]
    write_checkpoint(tmp_path / checkpoint_name(100, "theirs"), {"version": 100}, W)
    assert checkpoint.resolve_checkpoint(tmp_path, "mine") == mine[-1]
    assert checkpoint.checkpoint_candidates(tmp_path, "mine") == mine[::-1]
    with pytest.raises(CheckpointError, match="holds checkpoints of 2 runs .*mine: newest ps-v0000000008-mine.ckpt; "
                                              "theirs: newest ps-v0000000100-theirs.ckpt.*--run-id RUN"):
        checkpoint.resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"no checkpoint of run other in .* \(runs there: mine, theirs\)"):
        checkpoint.resolve_checkpoint(tmp_path, "other")
