"""PS checkpoints: exact round trips, refusal of damaged files, and a PS killed and resumed under live clients."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from plug_asgd.modes import AdaCompRule, CentralState, Push
from plug_asgd.protocol.checkpoint import (
    CheckpointError,
    CheckpointPolicy,
    central_tensors,
    checkpoint_name,
    epoch_of,
    list_checkpoints,
    read_checkpoint,
    resolve_checkpoint,
    run_of,
    write_checkpoint,
)
from plug_asgd.protocol.wire import Sparse
from plug_asgd.ps import PSConfig, embedded_command
from plug_asgd.worker.client import PSClient
from tests.conftest import free_port

W = {"model/w": np.arange(12, dtype=np.float32).reshape(3, 4), "model/b": np.ones(3, np.float64)}


def test_names_carry_the_epoch_past_the_first_and_a_later_epoch_is_newer_whatever_its_version(tmp_path):
    assert checkpoint_name(500, "r") == "ps-v0000000500-r.ckpt" == checkpoint_name(500, "r", epoch=1)
    assert checkpoint_name(500, "e2-r", epoch=3) == "ps-e3-v0000000500-e2-r.ckpt"
    policy = CheckpointPolicy(tmp_path, every_n_updates=1, keep=3, run_id="e2-r")  # a run id that looks like an epoch
    policy.save(155, {"version": 155}, W)  # a replaced primary's, at a version its successor has not reached
    for v in (152, 153):
        policy.save(v, {"version": v}, W, epoch=2)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["ps-v0000000155-e2-r.ckpt", "ps-e2-v0000000152-e2-r.ckpt", "ps-e2-v0000000153-e2-r.ckpt"]
    assert [(epoch_of(p), run_of(p)) for p in list_checkpoints(tmp_path)] == [(1, "e2-r"), (2, "e2-r"), (2, "e2-r")]
    assert resolve_checkpoint(tmp_path).name == "ps-e2-v0000000153-e2-r.ckpt"
    policy.save(154, {"version": 154}, W, epoch=2)  # keep=3: the earlier epoch's file goes first
    assert [p.name for p in list_checkpoints(tmp_path)][0] == "ps-e2-v0000000152-e2-r.ckpt"


def test_round_trip_is_exact(tmp_path):
    path = write_checkpoint(tmp_path / "c.ckpt", {"version": 7, "mode": "asgd"}, W)
    msg = read_checkpoint(path)
    assert msg.fields == {"version": 7, "mode": "asgd"}
    for name, t in central_tensors(msg).items():
        np.testing.assert_array_equal(t, W[f"model/{name}"])
        assert t.dtype == W[f"model/{name}"].dtype
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed, not left


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "empty", "append"])
def test_a_damaged_checkpoint_is_refused_never_loaded(tmp_path, damage):
    path = write_checkpoint(tmp_path / "c.ckpt", {"version": 1}, W)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "magic":
        data[:5] = b"NOPE!"
    elif damage == "empty":
        data = bytearray()
    else:
        data += b"x"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(path)
    assert str(path) in str(err.value)


def test_policy_keeps_the_newest_and_resolves_a_folder(tmp_path):
    policy = CheckpointPolicy(tmp_path, every_n_updates=10, keep=2)
    assert policy.due(10) and not policy.due(0)
    for v in (10, 20, 30):
        policy.save(v, {"version": v}, W)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ps-v0000000020.ckpt", "ps-v0000000030.ckpt"]
    assert resolve_checkpoint(tmp_path).name == "ps-v0000000030.ckpt"
    assert not policy.due(35) and policy.due(40)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        resolve_checkpoint(tmp_path / "nowhere")


def test_adacomp_history_survives_a_checkpoint():
    state = CentralState({"w": np.zeros(8, np.float32)})
    rule = AdaCompRule()
    rule.push(state, Push(1, 0, 0, {"w": Sparse(np.array([1, 2]), np.ones(2, np.float32), (8,))}))
    rule.push(state, Push(2, 0, 1, {"w": np.ones(8, np.float32)}))
    fields, arrays = rule.state()
    again = AdaCompRule()
    again.restore(fields, arrays)
    idx = np.arange(8)
    np.testing.assert_array_equal(again.staleness(0, "w", idx), rule.staleness(0, "w", idx))
    np.testing.assert_array_equal(again.staleness(0, "w", idx), [1, 2, 2, 1, 1, 1, 1, 1])


def _ps(procs, address, ckdir, **options):
    return procs.start(embedded_command(PSConfig(bind=address, mode="adacomp", checkpoint_dir=ckdir,
                                                 checkpoint_every_updates=4, **options)))


def _wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_ps_resumes_from_its_checkpoint_and_clients_carry_on(procs, tmp_path):
    address = f"tcp://127.0.0.1:{free_port()}"
    ckdir = tmp_path / "ck"
    ps = _ps(procs, address, ckdir)
    c = PSClient(address, rank=0, world_size=1, mode="adacomp", request_timeout=60)
    c.hello(stage=1, training=True, timeout=20)
    c.init({"w": np.zeros(100, np.float32)})
    one = Sparse(np.array([3]), np.ones(1, np.float32), (100,))
    for v in range(4):
        c.push(v, {"w": one})
    # every 4 updates: versions 1..5 have one checkpoint, at 4, whenever the PS gets to write it
    _wait_for(lambda: [p.name[:15] for p in list_checkpoints(ckdir)] == ["ps-v0000000004-"])
    assert c.push(4, {"w": one}).version == 5
    os.killpg(ps.pid, signal.SIGKILL)  # the fifth update came after the checkpoint: lost, the stated bound
    ps.wait(10)

    # a push sent while the PS is down waits, and goes through once a PS resumed from the checkpoint is up
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", c.push(5, {"w": one})))
    t.start()
    time.sleep(1.0)
    assert t.is_alive()
    resumed = _ps(procs, address, ckdir, resume=ckdir)
    t.join(30)
    assert not t.is_alive()
    r = result["r"]
    assert r.status == "applied" and r.version == 5  # checkpoint's version 4, plus this push
    assert r.tensors["w"][3] == 5.0  # 4 from the checkpoint + 1; the fifth update was lost with the PS
    assert c.reconnections == 1
    stats = c.stats()
    assert stats["resumed_from"] == str(list_checkpoints(ckdir)[0])
    assert stats["resumed_from"].endswith(f"ps-v0000000004-{stats['run_id']}.ckpt")  # the run continued
    c.close()
    resumed.terminate()
    assert resumed.wait(10) == 0


def test_resume_refuses_a_corrupt_checkpoint_with_a_clear_message(procs, tmp_path):
    path = write_checkpoint(tmp_path / "ps-v0000000003.ckpt", {"version": 3, "mode": "asgd"}, W)
    path.write_bytes(path.read_bytes()[:-10])
    code, out = procs.run(embedded_command(PSConfig(bind=f"tcp://127.0.0.1:{free_port()}", resume=path)), timeout=30)
    assert code == 2
    assert "corrupt or truncated" in out and str(path) in out


def test_a_worker_whose_ps_vanishes_stops_after_lost_timeout_naming_it(procs):
    from plug_asgd.worker.client import PSUnreachableError

    address = f"tcp://127.0.0.1:{free_port()}"
    ps = procs.start(embedded_command(PSConfig(bind=address)))
    c = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=60, lost_timeout=1.0)
    c.hello(stage=1, training=True, timeout=20)
    c.init({"w": np.zeros(3, np.float32)})
    os.killpg(ps.pid, signal.SIGKILL)
    ps.wait(10)
    start = time.monotonic()
    with pytest.raises(PSUnreachableError, match=f"{address} went away"):
        c.pull()
    assert time.monotonic() - start < 10  # not the 60 s request timeout
    c.close()


@pytest.mark.integration
def test_a_resumed_ps_leads_its_checkpoints_epoch_where_the_leader_it_names_is_gone(tmp_path):
    from plug_asgd.ps.server import ParameterServer

    gone = f"tcp://127.0.0.1:{free_port()}"  # the epoch's leader, which answers no more
    write_checkpoint(tmp_path / checkpoint_name(7, "r", epoch=2), {
        "mode": "asgd", "version": 7, "run_id": "r", "epoch": 2, "leader": gone, "standby": None}, W)
    started = time.monotonic()
    server = ParameterServer(PSConfig(bind="tcp://127.0.0.1:0", resume=tmp_path, checkpoint_dir=tmp_path,
                                      failover_timeout=0.5))
    try:
        assert 0.5 <= time.monotonic() - started < 5  # it asked the leader, which did not answer in failover_timeout
        assert (server.epoch, server.store.version, server.lineage()["epoch"]) == (2, 7, 2)
        path = server.persistence.save_checkpoint()
        assert path.name == "ps-e2-v0000000007-r.ckpt" and read_checkpoint(path).fields["leader"] == server.address
    finally:
        server.close()
