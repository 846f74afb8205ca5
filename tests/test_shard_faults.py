"""A sharded PS's checkpoints and faults (issue 21, phase 2): each shard checkpoints itself, records its
``I/N`` and its partition digest, and a killed shard restarted from its checkpoint rejoins while the
other keeps serving.

In process (quick): what a shard's checkpoint records and what a resume refuses. With real processes:
two shards started by hand (``plug-asgd serve-ps --shard I/2 --checkpoint-dir``), two workers
(tests/scripts/shard_pusher.py, a ShardedClient each) pushing a constant update; shard 1 is SIGKILLed
mid-run and restarted with ``--resume``. What each shard must hold is computed here from the workers'
logs and the checkpoint file, never from the sharded code.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from harness.ports import free_port_block
from plug_asgd.protocol.checkpoint import CheckpointError, list_checkpoints, read_checkpoint, resolve_checkpoint
from plug_asgd.protocol.partition import Partition
from plug_asgd.protocol.wire import WireError
from plug_asgd.ps import PSConfig
from plug_asgd.ps.fast_store import FastStore
from plug_asgd.ps.membership import Membership
from plug_asgd.ps.persistence import Persistence
from plug_asgd.ps.shard_guard import ShardGuard
from plug_asgd.ps.stats import Stats
from plug_asgd.sharding.client import ShardedClient
from plug_asgd.sharding.config import shard_folder
from plug_asgd.worker.client import PSClient
from tests.conftest import PLUG_ASGD, PYTHON

PUSHER = "tests/scripts/shard_pusher.py"
SHAPES = {"w": (64,), "b": (8,)}  # tests/scripts/shard_pusher.py's model


# -- in process: what a shard's checkpoint records, what a resume refuses -----------------------------------

def _shard(tmp_path: Path, shard: str | None, **options) -> Persistence:
    config = PSConfig(mode="asgd", shm_pushes=False, shard=shard, **{"checkpoint_dir": tmp_path / "ck",
                                                                     "checkpoint_every_updates": 4, **options})
    stats = Stats()
    store = FastStore(config, stats)
    guard = ShardGuard(shard)
    if options.get("resume") is None:
        pieces = Partition(SHAPES, 2).by_shard[0]
        store.init({p.key: np.zeros(p.size, np.float32) for p in pieces})
    return Persistence(config, store, Membership(config.worker_timeout, stats), stats, shard=guard)


def _hello(digest: str, shard: int = 0) -> dict:
    return {"partition": {"shards": 2, "shard": shard, "digest": digest}}


def test_a_shard_checkpoint_records_its_place_and_digest_and_a_resumed_shard_refuses_another_partition(tmp_path):
    digest = Partition(SHAPES, 2).digest
    first = _shard(tmp_path, "0/2")
    first.shard.fix(first.shard.check(_hello(digest)), final=True)  # the first worker's init fixes the digest
    path = first.save_checkpoint()
    fields = read_checkpoint(path).fields
    assert fields["shard"] == "0/2" and fields["partition_digest"] == digest

    resumed = _shard(tmp_path / "again", "0/2", resume=path)
    resumed.resume(path)
    assert resumed.shard.digest == digest and resumed.store.version == first.store.version
    # no worker has come yet, and one whose model is cut otherwise is refused: the digest came from the file
    other = Partition({**SHAPES, "b": (9,)}, 2).digest
    with pytest.raises(WireError, match="names or shapes differ") as info:
        resumed.shard.check(_hello(other))
    assert info.value.code == "partition_mismatch"
    resumed.shard.check(_hello(digest))  # the same model still joins


@pytest.mark.parametrize(("saved", "started", "says"), [
    ("0/2", "1/2", "resume each shard from its own checkpoints (this one with --shard 0/2)"),
    ("0/2", "0/3", "this one with --shard 0/2"),
    ("0/2", None, "start it with --shard 0/2"),
    (None, "0/2", "holds a whole model"),
])
def test_a_shard_refuses_the_checkpoint_of_another_shard_index_or_count(tmp_path, saved, started, says):
    writer = _shard(tmp_path, saved)
    if saved is not None:
        writer.shard.fix(writer.shard.check(_hello(Partition(SHAPES, 2).digest, int(saved[0]))), final=True)
    path = writer.save_checkpoint()
    reader = _shard(tmp_path / "other", started, resume=path)
    with pytest.raises(CheckpointError, match="was written by") as info:
        reader.resume(path)
    assert says in str(info.value)


def test_a_checkpoint_written_before_shards_were_recorded_is_taken_as_it_is(tmp_path):
    from plug_asgd.protocol.checkpoint import write_checkpoint

    old = write_checkpoint(tmp_path / "ps-v0000000003.ckpt", {"mode": "asgd", "version": 3, "world_size": 2},
                           {"model/w[0:8]": np.ones(8, np.float32)})
    reader = _shard(tmp_path / "r", "1/2", resume=old)
    reader.resume(old)
    assert reader.store.version == 3 and reader.shard.digest is None  # the first worker's, as before


def test_embedded_shards_keep_a_folder_each():
    assert shard_folder("/ck", "1/2") == Path("/ck/shard-1")
    assert shard_folder("/ck", None) == Path("/ck") and shard_folder(None, "0/2") is None


# -- real processes: a shard SIGKILLed mid-run, restarted from its checkpoint --------------------------------

def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.integration
@pytest.mark.faults
@pytest.mark.timeout(150)
def test_a_killed_shard_restarted_with_resume_rejoins_while_the_other_serves_and_the_run_finishes(procs, tmp_path,
                                                                                                 fault_report):
    base = free_port_block(2)
    addresses = [f"tcp://127.0.0.1:{base + i}" for i in range(2)]
    ck = [tmp_path / f"ck{i}" for i in range(2)]

    def serve(i: int, *extra: str):
        return procs.start([PLUG_ASGD, "serve-ps", "--port", str(base + i), "--mode", "asgd", "--shard", f"{i}/2",
                            "--workers", "2", "--linger", "5", "--quiet", "--log-every", "0", "--checkpoint-dir",
                            str(ck[i]), "--checkpoint-every-updates", "20", "--run-dir", str(tmp_path / f"run{i}"),
                            *extra])

    shards = [serve(0), serve(1)]
    logs = [tmp_path / f"w{r}.log" for r in range(2)]
    pushes_each = 250
    workers = [procs.start([PYTHON, PUSHER, "--addresses", ",".join(addresses), "--rank", str(r), "--pushes",
                            str(pushes_each), "--delta", str(r + 1.0), "--log", str(logs[r])]) for r in range(2)]
    _wait_for(lambda: any(int(p.name[4:14]) >= 60 for p in list_checkpoints(ck[1]))
              or any(w.poll() is not None for w in workers), 60, "a checkpoint of shard 1 at version >= 60")
    assert all(w.poll() is None for w in workers), "a worker ended before shard 1 could be killed"
    time.sleep(0.1)  # a few pushes past the checkpoint (about 100 a second): they die with the shard
    os.killpg(shards[1].pid, signal.SIGKILL)
    shards[1].wait(10)
    saved = resolve_checkpoint(ck[1])
    saved_version = int(saved.name[4:14])
    # what the restarted shard will start from (read now: the checkpoints it writes then prune this file)
    ckpt = {n[len("model/"):]: t for n, t in read_checkpoint(saved).tensors.items() if n.startswith("model/")}
    # the other shard keeps serving: its counters answer while shard 1 is down, and it holds no request back
    watcher = PSClient(addresses[0], rank=0, world_size=1, mode="asgd", request_timeout=20, heartbeat_s=None)
    try:
        during = watcher.stats(timeout=10)
    finally:
        watcher.close()
    assert during["version"] >= saved_version and during["initialized"]
    time.sleep(1.0)  # the workers wait for shard 1, their pushes unanswered there
    shards[1] = serve(1, "--resume", str(ck[1]))
    restarted_at = time.time()
    # `plug-asgd status` of both shards while the run goes on: shard 1 resumed, with the digest of its checkpoint
    code, out = procs.run([PLUG_ASGD, "status", *addresses, "--json", "--timeout", "20"], timeout=60)
    assert code == 0, out
    both = json.loads(out)
    assert [s["shard"] for s in both] == ["0/2", "1/2"]
    assert both[1]["resumed_from"] == str(saved) and both[0]["resumed_from"] is None
    assert both[0]["partition_digest"] == both[1]["partition_digest"] == Partition(SHAPES, 2).digest
    for w in workers:
        out, _ = w.communicate(timeout=90)
        assert w.returncode == 0, out[-3000:]
    # the model both shards hold once every worker has left (they linger 5 s before they exit)
    part = Partition(SHAPES, 2)
    reader = ShardedClient(addresses, part, rank=0, world_size=1, mode="asgd", request_timeout=20, heartbeat_s=None)
    try:
        final = reader.pull()
    finally:
        reader.close()
    ps_outs = []
    for s in shards:  # every worker left: each shard ends by itself
        out, _ = s.communicate(timeout=30)
        assert s.returncode == 0, out[-3000:]
        ps_outs.append(out)
    assert f"resumed from {saved} at version {saved_version}" in ps_outs[1], ps_outs[1][-2000:]

    rows = [(r + 1.0, rec) for r in range(2) for rec in _log(logs[r]) if rec["event"] == "push"]
    assert len(rows) == 2 * pushes_each and all(rec["status"] == "applied" for _, rec in rows)
    done = [next(rec for rec in _log(logs[r]) if rec["event"] == "done") for r in range(2)]
    assert all(rec["finite"] for rec in done) and all(np.isfinite(t).all() for t in final.tensors.values())
    assert all(rec["reconnections"] >= 1 for rec in done)  # each worker's client to shard 1 came back
    versions = final.version.per_shard
    # shard 0 never stopped: every push folded there once
    assert versions[0] == 2 * pushes_each
    # shard 1 went on from its checkpoint: each push it folded after the restart counts one version past it (a
    # reply after the restart comes from the restarted shard: it cannot answer before it is started)
    after = sorted(rec["versions"][1] for _, rec in rows if rec["t"] > restarted_at)
    assert after == list(range(saved_version + 1, saved_version + len(after) + 1)) and after
    assert versions[1] == saved_version + len(after)
    lost = 2 * pushes_each - versions[1]  # those folded on shard 1 after its last checkpoint, gone with it
    assert 0 <= lost <= 20 + 2  # a checkpoint every 20 updates, and the pushes in flight when it died
    # each coordinate holds what its shard folded: shard 0 every push, shard 1 the checkpoint's model plus the
    # pushes it folded after the restart (constant deltas 1 and 2: sums exact in float32)
    delta_after = sum(d for d, rec in rows if rec["t"] > restarted_at)
    for piece in part.pieces:
        got = np.asarray(final.tensors[piece.name], np.float32).reshape(-1)[piece.start:piece.stop]
        if piece.shard == 0:
            expected = np.full(piece.size, sum(d for d, _ in rows), np.float32)
        else:
            expected = ckpt[piece.key].reshape(-1) + np.float32(delta_after)
        assert np.array_equal(got, expected), piece
    recovery = min(rec["t"] for _, rec in rows if rec["t"] > restarted_at) - restarted_at
    fault_report(fault="shard 1 of 2 SIGKILLed, restarted with --resume (checkpoint every 20 updates)", injected=1,
                 handled=1, pushes_lost=lost, recovery_s=round(recovery, 2),
                 detail=f"shard 0 served on; shard 1 went on from version {saved_version}, {lost} of its updates "
                        "lost (those since its last checkpoint)")


# -- plug-asgd status ADDR1 ADDR2: one table for the whole sharded PS (in process) ----------------------------

def _counters(shard: str | None, version: int, digest: str = "d1", **extra) -> dict:
    return {"shard": shard, "partition_digest": digest, "mode": "asgd", "version": version, "initialized": True,
            "workers": [0, 1], "lost": [], "uptime_s": 10.0, "updates_per_s": 5.0, "busy_fraction": 0.25,
            "messages_in": 100, "bytes_in": 2_000_000, "push_bytes_in": 1_900_000, "bytes_out": 1_000_000,
            "model_bytes_out": 900_000, "pushes_applied": version, "pushes_dropped": 0, "refused": {},
            "resumed_from": None, "last_checkpoint": None, **extra}


def test_status_of_several_shards_is_one_table_with_totals_and_says_what_is_out_of_place():
    from rich.console import Console

    from plug_asgd.cli.dashboard import human_bytes
    from plug_asgd.cli.shard_status import order_problems, sharded_table

    addresses = ["tcp://a:1", "tcp://b:1"]
    stats = [_counters("0/2", 50), _counters("1/2", 41, resumed_from="/ck1/ps-v0000000040-r.ckpt")]
    assert order_problems(addresses, stats) == []
    console = Console(record=True, width=200)
    console.print(sharded_table(addresses, stats, human_bytes))
    text = console.export_text()
    assert "shard 0" in text and "shard 1" in text and "total" in text
    assert "4.00 MB" in text  # bytes in, summed over the shards: 2 x 2 MB
    assert "differ (a shard resumed from a checkpoint?)" in text and "ps-v0000000040" in text
    # listed out of order, a lone PS among shards, models cut otherwise: each said
    assert "in the order of their --shard" in order_problems(addresses, stats[::-1])[0]
    assert "started without --shard" in order_problems(addresses, [stats[0], _counters(None, 3)])[0]
    assert "different partitions" in order_problems(addresses, [stats[0], _counters("1/2", 3, "d2")])[0]


# -- the model of a sharded PS's checkpoints, assembled for inference ----------------------------------------

def _write_shards(folder: Path, model: dict, digest: str | None = None, specs=("0/2", "1/2")) -> None:
    from plug_asgd.protocol.checkpoint import checkpoint_name, write_checkpoint

    part = Partition(SHAPES, 2)
    for i, pieces in enumerate(part.split(model)):
        (folder / f"shard-{i}").mkdir(parents=True)
        fields = {"mode": "asgd", "version": 10 + i, "shard": specs[i], "partition_digest": digest or part.digest}
        write_checkpoint(folder / f"shard-{i}" / checkpoint_name(10 + i, "r"), fields,
                         {f"model/{k}": np.ascontiguousarray(v) for k, v in pieces.items()})


def test_load_central_weights_assembles_the_shards_checkpoints_and_refuses_a_module_cut_otherwise(tmp_path):
    import torch

    from plug_asgd.callbacks import load_central_weights

    class Net(torch.nn.Module):
        def __init__(self, b: int = 8) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(64))
            self.b = torch.nn.Parameter(torch.zeros(b))

    model = {"w": np.arange(64, dtype=np.float32), "b": -np.arange(8, dtype=np.float32)}
    _write_shards(tmp_path / "ck", model)
    net = Net()
    assert load_central_weights(net, tmp_path / "ck") == 11  # the newest shard's version
    assert np.array_equal(net.w.detach().numpy(), model["w"]) and np.array_equal(net.b.detach().numpy(), model["b"])
    with pytest.raises(CheckpointError, match="names or shapes differ"):
        load_central_weights(Net(b=9), tmp_path / "ck")
    _write_shards(tmp_path / "swapped", model, specs=("1/2", "0/2"))
    with pytest.raises(CheckpointError, match="lies in the folder of shard 0"):
        load_central_weights(Net(), tmp_path / "swapped")
    (tmp_path / "gap" / "shard-1").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="not of shards \\[0\\]"):
        load_central_weights(Net(), tmp_path / "gap")


# -- embedded shards with PSCheckpoint: a folder each, and a fit resumed from them ----------------------------

def _bn_net():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bn_sched", Path(__file__).parent / "scripts" / "bn_sched.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BNNet()


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_embedded_shards_checkpoint_each_in_its_folder_and_a_fit_resumes_from_them(procs, tmp_path):
    from plug_asgd.callbacks import load_central_weights
    from plug_asgd.worker.tensors import synced_tensors

    ck = tmp_path / "ck"

    def fit(out: Path, *extra: str) -> dict:
        code, log = procs.run([PYTHON, "tests/scripts/shard_fit.py", "--modes", "asgd", "--ps-ports",
                               str(free_port_block(2)), "--out", str(out), *extra], timeout=110)
        assert code == 0, log[-4000:]
        return json.loads((out / "asgd" / "rank0.json").read_text())

    first = fit(tmp_path / "first", "--checkpoint-dir", str(ck))
    assert first["shard_versions"] == [80, 80]  # 2 workers x 40 steps, every push on both shards
    net = _bn_net()
    shapes = {n: tuple(t.shape) for n, t in synced_tensors(net).items()}
    for i in range(2):  # each shard wrote its own folder, its last checkpoint as it stopped
        fields = read_checkpoint(resolve_checkpoint(ck / f"shard-{i}")).fields
        assert (fields["shard"], fields["version"]) == (f"{i}/2", 80)
        assert fields["partition_digest"] == Partition(shapes, 2).digest
    # the model assembled from both folders is the central model the run ended with
    assert load_central_weights(net, ck) == 80
    held = {n: t.detach().flatten().tolist() for n, t in synced_tensors(net).items()}
    assert held == first["central"]
    second = fit(tmp_path / "second", "--resume-from", str(ck))
    assert second["shard_versions"] == [160, 160]  # each shard went on from its own checkpoint


def test_load_central_weights_reads_shards_whose_codec_kept_a_tensor_whole(tmp_path):
    """PowerSGD keeps the matrices it factors whole on one shard: the pieces' names, not a partition, place them."""
    import torch

    from plug_asgd.callbacks import load_central_weights
    from plug_asgd.protocol.checkpoint import checkpoint_name, write_checkpoint

    held = [{"w": np.arange(64, dtype=np.float32)}, {"b": -np.ones(8, np.float32)}]  # w whole on shard 0
    for i, tensors in enumerate(held):
        (tmp_path / f"shard-{i}").mkdir()
        write_checkpoint(tmp_path / f"shard-{i}" / checkpoint_name(5, "r"),
                         {"mode": "asgd", "version": 5, "shard": f"{i}/2", "partition_digest": "kept-whole"},
                         {f"model/{k}": v for k, v in tensors.items()})
    net = torch.nn.Module()
    net.w, net.b = torch.nn.Parameter(torch.zeros(64)), torch.nn.Parameter(torch.zeros(8))
    assert load_central_weights(net, tmp_path) == 5
    assert np.array_equal(net.w.detach().numpy(), held[0]["w"]) and float(net.b.detach().sum()) == -8.0
