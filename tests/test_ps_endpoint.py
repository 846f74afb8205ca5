"""Where the embedded PS listens: the cluster's main port, or the next one under torchrun, whose agent
serves its rendezvous store on the main port (plug_asgd.placement.ps_launcher.endpoint). Environments only: quick."""

from __future__ import annotations

import pytest
from lightning_fabric.plugins.environments import LightningEnvironment, TorchElasticEnvironment

from plug_asgd import AsyncPSStrategy
from plug_asgd.placement.ps_launcher import endpoint

TORCHRUN = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "h23"}


@pytest.fixture
def torchrun_env(monkeypatch):
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)


def test_under_torchrun_the_embedded_ps_takes_the_port_after_the_agents_store(torchrun_env):
    strategy = AsyncPSStrategy(cluster_environment=TorchElasticEnvironment())
    assert strategy.ps_endpoint == "tcp://127.0.0.1:29518"
    # rank 0 binds it too
    assert strategy.connection.endpoints(strategy.placement()) == (["tcp://127.0.0.1:29518"], ["tcp://127.0.0.1:29518"])
    # embedded shards: consecutive ports from there, shard 0's the one the collectives (and ps_endpoint) use
    sharded = AsyncPSStrategy(ps_shards=2, cluster_environment=TorchElasticEnvironment())
    assert sharded.ps_endpoints == ["tcp://127.0.0.1:29518", "tcp://127.0.0.1:29519"]
    assert sharded.ps_endpoint == "tcp://127.0.0.1:29518"


def test_under_lightnings_own_launcher_the_embedded_ps_takes_the_main_port_itself(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29517")
    strategy = AsyncPSStrategy(cluster_environment=LightningEnvironment())
    assert strategy.ps_endpoint == "tcp://127.0.0.1:29517"


def test_an_explicit_ps_port_wins_under_torchrun_and_an_external_ps_is_not_bound(torchrun_env):
    env = TorchElasticEnvironment()
    main = (env.main_address, env.main_port)
    assert endpoint(None, 40123, *main, elastic=True) == ("tcp://127.0.0.1:40123", "tcp://127.0.0.1:40123")
    assert endpoint("tcp://10.0.0.5:7000", None, *main, elastic=True) == ("tcp://10.0.0.5:7000", None)
    # the address workers connect to keeps the host's name; rank 0 binds its resolved address
    assert endpoint(None, None, "localhost", 29517, elastic=True) == ("tcp://localhost:29518", "tcp://127.0.0.1:29518")
