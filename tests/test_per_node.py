"""One PS shard per node (``AsyncPSStrategy(ps_shards="per_node")``, plug_asgd/sharding/per_node.py): where a
node's shard
listens, how the shards' addresses are gathered, the arguments refused; and a 2-node Lightning job on 2 emulated
hosts (harness/netns.py) whose node 1 holds shard 1 on its own address."""

from __future__ import annotations

import argparse
import json

import pytest

from plug_asgd.sharding.per_node import (
    ADDRESS_VARIABLE,
    PER_NODE,
    node_address,
    routed_address,
    shard_endpoint,
    shard_list,
)
from tests.conftest import PYTHON, require_emulated_hosts, run_on_emulated_hosts

PER_NODE_FIT_TIMEOUT_S = 90  # measured: 13 s on 2 cores (two hosts' interpreters, 8 steps each)


def _route_from(address: str):
    calls = []

    def route(destination: str) -> str:
        calls.append(destination)
        return address

    return route, calls


def test_node_0s_shard_listens_on_the_main_address_and_another_nodes_on_its_route_to_it():
    route, calls = _route_from("10.0.0.7")
    assert node_address("10.0.0.1", 0, environ={}, route=route) == "10.0.0.1"
    assert calls == []  # node 0 is where the others already reach it
    assert node_address("10.0.0.1", 1, environ={}, route=route) == "10.0.0.7"
    assert calls == ["10.0.0.1"]  # the interface that routes to the main address
    # the variable wins (another interface than the route's); on node 0 the main address stays
    env = {ADDRESS_VARIABLE: " 192.168.5.3 "}
    assert node_address("10.0.0.1", 1, environ=env, route=route) == "192.168.5.3"
    assert node_address("10.0.0.1", 0, environ=env, route=route) == "10.0.0.1"
    assert node_address("10.0.0.1", 1, environ={ADDRESS_VARIABLE: ""}, route=route) == "10.0.0.7"  # empty: unset

    def no_route(destination: str) -> str:
        raise OSError("Network is unreachable")

    with pytest.raises(RuntimeError, match=f"no route to the main address 10.0.0.1.*set {ADDRESS_VARIABLE}"):
        node_address("10.0.0.1", 2, environ={}, route=no_route)
    assert shard_endpoint("10.0.0.7", 29500, 1) == "tcp://10.0.0.7:29501"  # port + node rank: nodes may share a host


def test_the_shards_addresses_come_from_each_nodes_local_rank_0():
    def gathered(*objs):
        return [(rank, obj, {}) for rank, obj in enumerate(objs)]

    a, b = "tcp://10.0.0.1:29500", "tcp://10.0.0.2:29501"
    # ranks 0, 1 on node 0, ranks 2, 3 on node 1; only local ranks 0 name their shard
    got = gathered({"node": 0, "address": a}, {"node": 0, "address": None}, {"node": 1, "address": b},
                   {"node": 1, "address": None})
    assert shard_list(got, 2) == [a, b]
    with pytest.raises(RuntimeError, match=r"no local rank 0 of node\(s\) \[1\]"):
        shard_list(gathered({"node": 0, "address": a}, {"node": 1, "address": None}), 2)
    with pytest.raises(RuntimeError, match="node 0's ranks disagree"):
        shard_list(gathered({"node": 0, "address": a}, {"node": 0, "address": b}), 2)
    with pytest.raises(RuntimeError, match="rank 0 named shard 2"):
        shard_list(gathered({"node": 2, "address": a}), 2)


def test_the_strategy_takes_per_node_and_refuses_what_contradicts_it():
    from plug_asgd import AsyncPSStrategy

    s = AsyncPSStrategy(ps_shards="per_node")
    assert s.per_node and s.ps_shards == 1  # one node until Lightning says how many: the lone embedded PS
    s.num_nodes = 3
    assert s.ps_shards == 3
    with pytest.raises(RuntimeError, match="known once the workers have connected"):
        _ = s.ps_endpoints
    with pytest.raises(ValueError, match="ps_address names a PS started by hand: give one or the other"):
        AsyncPSStrategy(ps_shards="per_node", ps_address=["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"])
    with pytest.raises(ValueError, match=r"mode='hogwild' takes no sharded PS \(ps_shards='per_node'\)"):
        AsyncPSStrategy(mode="hogwild", ps_shards="per_node")
    with pytest.raises(ValueError, match="an integer >= 1 or 'per_node'"):
        AsyncPSStrategy(ps_shards="per_host")


def test_a_nodes_shard_beyond_loopback_needs_keys_and_is_refused_before_anything_starts(monkeypatch):
    from lightning_fabric.plugins.environments import LightningEnvironment

    from plug_asgd import AsyncPSStrategy
    from plug_asgd.placement import connection as ps_connection
    from plug_asgd.protocol.security import InsecureBindError

    for name, value in {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(ps_connection, "node_address", lambda main, node: "10.0.0.2" if node == 1 else main)
    s = AsyncPSStrategy(ps_shards="per_node", cluster_environment=LightningEnvironment())
    s.num_nodes = 2
    with pytest.raises(InsecureBindError, match="refusing to listen on tcp://10.0.0.2:29501 without authentication"):
        s.ps.connect(s._shapes, s._trainer())
    assert s.connection.embedded.processes == []  # refused before this node's shard was started


def test_the_recipes_take_ps_shards_per_node():
    from plug_asgd.recipes.common import add_strategy_arguments

    parser = add_strategy_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--ps-shards", "per-node"]).ps_shards == PER_NODE
    assert parser.parse_args(["--ps-shards", "per_node"]).ps_shards == PER_NODE
    assert parser.parse_args(["--ps-shards", "3"]).ps_shards == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--ps-shards", "many"])


@pytest.mark.integration
def test_the_routed_address_to_loopback_is_loopback():
    assert routed_address("127.0.0.1") == "127.0.0.1"  # a UDP connect sends nothing: no listener needed


@pytest.mark.integration
@pytest.mark.timeout(PER_NODE_FIT_TIMEOUT_S + 60)
def test_a_two_node_job_puts_one_shard_on_each_nodes_own_address(tmp_path):
    require_emulated_hosts(None, "n")
    rc, output = run_on_emulated_hosts([PYTHON, "tests/scripts/per_node_launch.py", "--out", str(tmp_path),
                                        "--timeout", str(PER_NODE_FIT_TIMEOUT_S)], timeout=PER_NODE_FIT_TIMEOUT_S + 30)
    assert rc == 0, output[-6000:]
    hosts = json.loads((tmp_path / "hosts.json").read_text())
    port = hosts["master_port"]
    expected = [f"tcp://{hosts['addresses'][0]}:{port}", f"tcp://{hosts['addresses'][1]}:{port + 1}"]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, got in enumerate(ranks):
        assert got["node"] == r and got["steps"] == 8, got
        # every rank learned both shards' addresses: shard 1 on node 1's own interface, which only its
        # namespace can listen on, so the shard that answered there lives on node 1
        assert got["endpoints"] == expected, got
        assert [s["shard"] for s in got["shards"]] == ["0/2", "1/2"]
    for i, shard in enumerate(ranks[0]["shards"]):
        # each shard folded in its slice of every push of both workers (8 steps each)
        assert shard["pushes_by_rank"] == {"0": 8, "1": 8} and shard["version"] == 16, (i, shard)
        # its metrics in its own folder (each node's shard writes shard-I of the run dir)
        last = json.loads((tmp_path / "ps" / f"shard-{i}" / "ps_metrics.jsonl").read_text().splitlines()[-1])
        assert last["shard"] == f"{i}/2" and last["pushes_applied"] == 16, last
