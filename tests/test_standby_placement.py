"""Where ``AsyncPSStrategy(ps_standby=True)`` puts the embedded PS's standby, and what it refuses, before anything
starts (the failover itself, on 2 emulated hosts: tests/test_standby.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from plug_asgd.placement.standby_launcher import standby_binds, standby_configs
from plug_asgd.ps import PSConfig
from plug_asgd.ps.standby_join import standby_config


def test_the_strategy_refuses_a_standby_it_cannot_place():
    from plug_asgd import AsyncPSStrategy

    with pytest.raises(ValueError, match="an external PS .* `plug-asgd serve-ps --standby-of ADDR`"):
        AsyncPSStrategy(ps_standby=True, ps_address="tcp://127.0.0.1:5555")
    with pytest.raises(ValueError, match="ps_shards='per_node' no node is left"):
        AsyncPSStrategy(ps_standby=True, ps_shards="per_node")
    with pytest.raises(ValueError, match="failover_timeout"):
        AsyncPSStrategy(ps_standby=True, failover_timeout=0.0)
    assert AsyncPSStrategy(ps_standby=True, ps_shards=2).connection.settings.ps_standby


def test_each_shards_standby_listens_on_node_1_past_the_primaries_ports():
    nodes = {0: "10.0.0.1", 1: "10.0.0.2"}
    binds = standby_binds("ps0", ["tcp://ps0:29500", "tcp://ps0:29501"], route=lambda main, node: nodes[node])
    assert binds == ["tcp://10.0.0.2:29502", "tcp://10.0.0.2:29503"]


def test_a_standbys_config_is_its_primarys_bound_on_node_1_following_node_1s_rank():
    primary = PSConfig(bind="tcp://10.0.0.1:29500", mode="adacomp", run=1, world_size=4, parent_pid=os.getpid(),
                       run_dir=Path("/logs/ps/shard-0"), failover_timeout=5.0, insecure=True)
    (made,) = standby_configs([primary], ["tcp://ps0:29500"], ["tcp://10.0.0.2:29502"])
    assert made.bind == "tcp://10.0.0.2:29502" and made.standby_of == "tcp://ps0:29500"
    assert made.run_dir == Path("/logs/ps/shard-0/standby") and made.parent_pid == os.getpid()
    assert (made.mode, made.run, made.world_size, made.failover_timeout) == ("adacomp", 1, 4, 5.0)


def test_a_standby_takes_its_primarys_options_but_follows_its_own_parent(monkeypatch):
    from plug_asgd.ps import standby_join

    theirs = PSConfig(bind="tcp://10.0.0.1:29500", mode="sync", run=3, parent_pid=101, insecure=True,
                      checkpoint_dir=Path("/ckpt"), checkpoint_every_updates=50)
    monkeypatch.setattr(standby_join, "_ask", lambda *a: {"config": theirs.to_json()})
    own = PSConfig(bind="tcp://10.0.0.2:29501", standby_of="tcp://10.0.0.1:29500", parent_pid=202, insecure=True)
    merged = standby_config(own)
    assert (merged.mode, merged.run, merged.checkpoint_every_updates) == ("sync", 3, 50)
    assert merged.parent_pid == 202 and merged.bind == own.bind and merged.standby_of == own.standby_of
    cli = standby_config(PSConfig(bind="tcp://127.0.0.1:29501", standby_of="tcp://10.0.0.1:29500"))
    assert cli.parent_pid is None  # `serve-ps --standby-of` follows no process
    assert json.loads(merged.to_json())["checkpoint_dir"] == "/ckpt"  # the primary's folder, on its own machine


def _on_node(monkeypatch, node: int, **strategy):
    from lightning_fabric.plugins.environments import LightningEnvironment

    from plug_asgd import AsyncPSStrategy
    from plug_asgd.placement import standby_launcher

    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": str(node)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(standby_launcher, "node_address", lambda main, n: "10.0.0.2" if n == 1 else main)
    return AsyncPSStrategy(ps_standby=True, cluster_environment=LightningEnvironment(), **strategy)


def test_one_node_is_refused_by_every_rank_before_anything_starts(monkeypatch):
    s = _on_node(monkeypatch, 0)
    with pytest.raises(ValueError, match="this job has one node"):
        s.ps.connect(s._shapes, s._trainer())
    assert s.connection.embedded.processes == [] and s.connection.standby.processes == []


def test_node_1s_standby_beyond_loopback_needs_keys_and_is_refused_before_anything_starts(monkeypatch):
    from plug_asgd.protocol.security import InsecureBindError

    s = _on_node(monkeypatch, 1)
    s.num_nodes = 2
    with pytest.raises(InsecureBindError, match="refusing to listen on tcp://10.0.0.2:29501 without authentication"):
        s.ps.connect(s._shapes, s._trainer())
    assert s.connection.standby.processes == []


def test_node_1_starts_a_new_standby_beside_the_one_that_leads_and_a_second_failover_keeps_every_push(start_ps):
    # node 1's side without Lightning: its standby started as the strategy starts it (EmbeddedPS, following this
    # process), watched from its join on (wait_joined). The primary SIGKILLed: the standby leads, and node 1 starts
    # a new standby of it on the next port; that leader SIGKILLed (a crashed PS process): the new standby leads, and
    # gets one of its own. Every push is a coordinate of its own: the final model says each was folded in once
    import signal

    import numpy as np

    from harness.ports import free_port_block
    from plug_asgd.placement.ps_launcher import EmbeddedPS
    from plug_asgd.placement.standby_launcher import wait_joined
    from plug_asgd.worker.client import PSClient
    from tests.test_faults import wait_for

    def stats(address: str) -> dict:
        client = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=10, heartbeat_s=None)
        try:
            return client.stats(timeout=10)
        finally:
            client.close()

    size, first = 40, free_port_block(4)
    binds = [f"tcp://127.0.0.1:{first + i}" for i in range(3)]
    primary = start_ps("asgd")
    wait_for(lambda: stats(primary)["role"] == "primary", 30, "the primary to answer")
    standby = EmbeddedPS("standby (ps_standby=True)")
    client = PSClient(primary, rank=0, world_size=1, mode="asgd", request_timeout=60, heartbeat_s=0.5)
    try:
        standby.start(PSConfig(bind=binds[0], standby_of=primary, parent_pid=os.getpid()))
        client.hello(0, True, timeout=30)
        wait_joined(client, binds[:1], standby, 30)
        client.init({"w": np.zeros(size)})

        def push(coords: range) -> None:
            for c in coords:
                update = np.zeros(size)
                update[c] = 1.0
                assert client.push(client.pull().version, {"w": update}).status == "applied"

        push(range(0, 10))
        os.killpg(start_ps.started.pop(primary).pid, signal.SIGKILL)
        push(range(10, 20))  # the first waits failover_timeout, then moves to the standby, which leads
        assert (client.address, client.epoch) == (binds[0], 2)
        wait_for(lambda: stats(binds[0])["standby"] == binds[1], 30, "node 1's new standby to join the leader")
        assert (stats(binds[1])["role"], stats(binds[1])["epoch"], stats(binds[1])["version"]) == ("standby", 2, 20)
        push(range(20, 30))
        os.kill(standby.processes[0].pid, signal.SIGKILL)  # the leader's PS process crashes
        push(range(30, 40))
        assert (client.address, client.epoch) == (binds[1], 3)
        wait_for(lambda: stats(binds[1])["standby"] == binds[2], 30, "a standby of the leader of epoch 3")
        final = client.pull()
        assert final.version == size and final.tensors["w"].tolist() == [1.0] * size
        assert stats(binds[2])["version"] == size and len(standby.processes) == 3
    finally:
        client.close()
        standby.stop()
    assert standby.processes == []
