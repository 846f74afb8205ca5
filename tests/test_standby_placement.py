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
