"""CURVE authentication and the loopback rule, with real keys, real sockets and a real PS process.

A worker with the keys made with the PS's trains and pulls; one without keys, one with keys the
PS does not know and one that expects another PS's key are refused in the handshake: the client
fails at once with an error naming the address and the keys, it receives zero bytes, the PS
counts the refusal in ``refused["auth"]`` and sends it nothing. A PS asked to listen beyond
loopback without keys refuses to start.
"""

from __future__ import annotations

import json
import re
import stat
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from plug_asgd.cli import app as cli
from plug_asgd.protocol.security import InsecureBindError, KeysError, generate_keys, is_loopback, load_worker_keys
from plug_asgd.ps import ParameterServer, PSConfig, embedded_command
from plug_asgd.worker.client import PSClient, PSUnreachableError
from tests.conftest import PLUG_ASGD, free_port

pytestmark = pytest.mark.timeout(90)

W0 = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
runner = CliRunner()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keygen_writes_both_keypairs_secrets_0600_and_says_where_they_go(tmp_path):
    keys = tmp_path / "keys"
    result = runner.invoke(cli.app, ["keygen", str(keys)], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    for secret in (keys / "server" / "server.key_secret", keys / "worker" / "worker.key_secret"):
        assert _mode(secret) == 0o600, secret
        assert "secret-key" in secret.read_text()
    for public in (keys / "server" / "server.key", keys / "worker" / "worker.key", keys / "worker" / "server.key",
                   keys / "server" / "authorized_workers" / "worker.key"):
        assert "secret-key" not in public.read_text(), public
    assert (keys / "worker" / "server.key").read_text() == (keys / "server" / "server.key").read_text()
    assert ((keys / "server" / "authorized_workers" / "worker.key").read_text()
            == (keys / "worker" / "worker.key").read_text())
    assert not list((keys / "worker").glob("server.key_secret")), "the PS's secret must not go to the workers"
    for secret in (keys / "standby" / "standby.key_secret", keys / "standby" / "server.key_secret"):
        assert _mode(secret) == 0o600, secret
    assert _mode(keys / "standby") == 0o700
    assert not list((keys / "worker").glob("standby.key_secret")), "the standby's secret must not go to the workers"
    out = " ".join(result.output.split())
    assert "the PS machine only" in out and "every worker machine" in out and "the standby machine only" in out
    assert f"--keys {keys / 'server'}" in out and f"--ps-keys {keys / 'worker'}" in out
    assert f"--keys {keys / 'standby'}" in out
    again = runner.invoke(cli.app, ["keygen", str(keys)])
    assert again.exit_code == 2 and "never overwrites" in again.output


def test_keygen_through_the_console_script(procs, tmp_path):
    code, out = procs.run([PLUG_ASGD, "keygen", str(tmp_path / "k")], timeout=60)
    assert code == 0, out
    assert _mode(tmp_path / "k" / "worker" / "worker.key_secret") == 0o600


def test_missing_keys_are_named_with_how_to_make_them(tmp_path):
    with pytest.raises(KeysError, match=r"worker\.key_secret not found.*plug-asgd keygen"):
        load_worker_keys(tmp_path)


@pytest.fixture
def keyed_ps(procs, tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys)
    address = f"tcp://127.0.0.1:{free_port()}"
    procs.start(embedded_command(PSConfig(bind=address, keys=keys / "server")))
    yield address, keys
    for p in procs.procs:
        p.terminate()
        p.wait(10)


def _refused(address: str, keys: Path | None) -> None:
    c = PSClient(address, rank=1, world_size=2, mode="asgd", request_timeout=15, keys=keys)
    with pytest.raises(PSUnreachableError) as err:
        c.hello(stage=1, training=True)
    text = str(err.value)
    assert address in text and "keygen" in text and "keys" in text, text
    assert c.counters.bytes_down == 0, "a refused worker received bytes"
    c.close()


def _check_refused_and_sent_nothing(good: PSClient, address: str, keys: Path | None, name: str) -> None:
    """Refused, counted in refused["auth"], and every byte the PS sent meanwhile went to ``good``."""
    down = good.counters.bytes_down
    before = good.stats()
    _refused(address, keys)
    for _ in range(50):  # the PS's monitor event may lag the client's by a few ms
        time.sleep(0.1)
        received = good.counters.bytes_down - down  # every reply ``good`` got since its ``before`` request
        after = good.stats()
        if after["refused"].get("auth", 0) > before["refused"].get("auth", 0):
            break
    auth = after["refused"].get("auth", 0) - before["refused"].get("auth", 0)
    # one count per failed handshake: the client gives up at the first, but libzmq may have retried once or
    # twice (every 100 ms) before it did
    assert 1 <= auth <= 3, (name, before["refused"], after["refused"])
    # snapshots are taken before their own reply is sent: between the two, the PS sent exactly what good got
    assert after["bytes_out"] - before["bytes_out"] == received, f"{name}: the PS sent bytes to a refused worker"
    assert {k: v for k, v in after["refused"].items() if k != "auth"} == \
        {k: v for k, v in before["refused"].items() if k != "auth"}, name


@pytest.mark.faults
def test_keyed_worker_is_served_and_unkeyed_or_wrongly_keyed_ones_are_refused_and_counted(keyed_ps, tmp_path,
                                                                                          fault_report):
    address, keys = keyed_ps
    good = PSClient(address, rank=0, world_size=2, mode="asgd", request_timeout=15, keys=keys / "worker")
    good.hello(stage=1, training=True, timeout=30)
    assert good.init(W0)
    np.testing.assert_array_equal(good.push(0, {"w": np.ones((2, 3), np.float32)}).tensors["w"], W0["w"] + 1)

    other = tmp_path / "other"
    generate_keys(other)
    impostor = tmp_path / "impostor"  # the right PS key, but a worker key the PS never authorized
    impostor.mkdir()
    for f in ("worker.key", "worker.key_secret"):
        (impostor / f).write_bytes((other / "worker" / f).read_bytes())
    (impostor / "server.key").write_bytes((keys / "worker" / "server.key").read_bytes())
    wrong_server = tmp_path / "wrong_server"  # an authorized worker key, but another PS's public key
    wrong_server.mkdir()
    for f in ("worker.key", "worker.key_secret"):
        (wrong_server / f).write_bytes((keys / "worker" / f).read_bytes())
    (wrong_server / "server.key").write_bytes((other / "worker" / "server.key").read_bytes())

    _check_refused_and_sent_nothing(good, address, None, "no keys")
    _check_refused_and_sent_nothing(good, address, impostor, "unauthorized key")
    _check_refused_and_sent_nothing(good, address, wrong_server, "wrong server key")
    reply = good.pull()
    assert reply.version == 1
    np.testing.assert_array_equal(reply.tensors["w"], W0["w"] + 1)
    assert good.stats()["refused"].keys() == {"auth"}
    fault_report(fault="workers without the right CURVE key (none, unauthorized, another PS's)", injected=3,
                 handled=3, pushes_lost=0, recovery_s=None,
                 detail=f"refused in the handshake ({good.stats()['refused']['auth']} counted), 0 model bytes sent")
    good.close()


def test_the_top_level_keygen_folder_works_for_both_sides(keyed_ps):
    address, keys = keyed_ps
    good = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=15, keys=keys)
    assert good.hello(stage=1, training=True, timeout=30)["version"] == 0
    good.close()


@pytest.mark.timeout(180)  # two CLI runs of up to 60 s each, and the PS of keyed_ps
def test_status_needs_the_keys_of_a_keyed_ps(keyed_ps, procs):
    address, keys = keyed_ps
    code, out = procs.run([PLUG_ASGD, "status", address, "--keys", str(keys / "worker"), "--json"], timeout=60,
                          env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert code == 0, out
    code, out = procs.run([PLUG_ASGD, "status", address, "--timeout", "10"], timeout=60,
                          env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert code == 1 and "requires authentication" in out, out


@pytest.mark.parametrize("endpoint, local", [
    ("tcp://127.0.0.1:1", True), ("tcp://127.3.2.1:1", True), ("tcp://localhost:1", True),
    ("tcp://[::1]:1", True), ("ipc:///tmp/x", True), ("tcp://0.0.0.0:1", False), ("tcp://*:1", False),
    ("tcp://10.1.2.3:1", False), ("tcp://[::]:1", False), ("tcp://example.org:1", False),
])
def test_loopback_is_recognised(endpoint, local):
    assert is_loopback(endpoint) is local


def test_a_ps_beyond_loopback_without_keys_refuses_to_start(procs, tmp_path):
    with pytest.raises(InsecureBindError, match="plug-asgd keygen"):
        ParameterServer(PSConfig(bind="tcp://0.0.0.0:*"))
    result = runner.invoke(cli.app, ["serve-ps", "--host", "0.0.0.0", "--port", str(free_port()), "--quiet"],
                           env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 2
    assert re.search(r"refusing to listen on tcp://0\.0\.0\.0:\d+ without authentication.*plug-asgd keygen",
                     " ".join(result.output.split())), result.output
    command = embedded_command(PSConfig())
    command[-1] = json.dumps({"bind": f"tcp://0.0.0.0:{free_port()}"})  # (PSConfig refuses it here too)
    code, out = procs.run(command, timeout=60)
    assert code == 2 and "without authentication" in out, out


@pytest.mark.integration
def test_insecure_and_keys_each_allow_a_non_loopback_bind(tmp_path):
    server = ParameterServer(PSConfig(bind="tcp://0.0.0.0:*", insecure=True))
    server.close()
    generate_keys(tmp_path / "k")
    server = ParameterServer(PSConfig(bind="tcp://0.0.0.0:*", keys=tmp_path / "k"))
    assert server.keyed
    server.close()


@pytest.mark.integration
def test_the_strategy_refuses_an_embedded_ps_beyond_loopback_without_keys(monkeypatch):
    from lightning_fabric.plugins.environments import LightningEnvironment

    from plug_asgd import AsyncPSStrategy

    monkeypatch.setenv("MASTER_ADDR", "0.0.0.0")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    strategy = AsyncPSStrategy(cluster_environment=LightningEnvironment())
    with pytest.raises(InsecureBindError, match="ps_keys|--ps-keys"):
        strategy.ps.connect(strategy._shapes, strategy._trainer())
    assert strategy.connection.embedded.process is None, "no PS may have been started"


if sys.platform == "win32":  # pragma: no cover
    pytest.skip("file modes", allow_module_level=True)


@pytest.mark.integration
def test_a_keyed_run_trains_on_an_embedded_ps_listening_beyond_loopback(monkeypatch, tmp_path):
    """MASTER_ADDR 0.0.0.0: rank 0's embedded PS listens on every interface, so it needs (and gets) the keys."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from plug_asgd import AsyncPSStrategy
    from plug_asgd.modes import Asgd
    from tests.conftest import group_members
    from tests.test_strategy import Tiny

    generate_keys(tmp_path / "keys")
    monkeypatch.setenv("MASTER_ADDR", "0.0.0.0")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    strategy = AsyncPSStrategy(mode=Asgd(push_every=5), ps_keys=tmp_path / "keys")
    x = torch.randn(320, 4, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(Tiny(), loader)
        assert strategy.connection.client is not None and strategy.connection.client.keyed
        stats = strategy.ps_stats()
        assert stats["version"] == 4 and stats["pushes_applied"] == 4 and not stats["refused"]
        central = strategy.connection.client.pull().tensors["layer.weight"]
        np.testing.assert_array_equal(trainer.lightning_module.layer.weight.detach().numpy(), central)
    finally:
        proc = strategy.connection.embedded.process
        strategy._shutdown(wait_for_workers=0)
        if proc is not None:
            assert proc.poll() is not None and not group_members(proc.pid)


def test_serve_ps_with_keys_and_a_message_limit_serves_keyed_workers(procs, tmp_path):
    generate_keys(tmp_path / "keys")
    port = free_port()
    proc = procs.start([PLUG_ASGD, "serve-ps", "--host", "0.0.0.0", "--port", str(port), "--quiet", "--log-every",
                        "0", "--keys", str(tmp_path / "keys" / "server"), "--max-message-bytes", "5000",
                        "--run-dir", str(tmp_path / "run")], env={"COLUMNS": "300", "NO_COLOR": "1"})
    c = PSClient(f"tcp://127.0.0.1:{port}", rank=0, world_size=1, mode="asgd", request_timeout=15,
                 keys=tmp_path / "keys" / "worker")
    try:
        c.hello(stage=1, training=True, timeout=30)
        assert c.max_message_bytes == 5000
        assert c.init(W0)
    finally:
        c.close()
        proc.terminate()
        out, _ = proc.communicate(timeout=15)
    assert "CURVE keys, authorized workers only" in " ".join(out.split()), out


@pytest.mark.timeout(120)
def test_every_shard_takes_the_same_keys_and_refuses_a_worker_without_them_each_on_its_own(procs, tmp_path):
    """Two shards of one model (serve-ps --shard I/2) started with the same keys serve a keyed worker; a worker
    without keys is refused by each shard, which counts it and sends it nothing; a shard started with other
    keys refuses the worker the first one serves, naming its own address."""
    from plug_asgd.protocol.partition import Partition
    from plug_asgd.sharding.client import ShardedClient

    keys, other = tmp_path / "keys", tmp_path / "other"
    generate_keys(keys)
    generate_keys(other)
    shapes = {"w": (8, 5), "b": (5,)}
    part = Partition(shapes, 2)
    assert {p.shard for p in part.pieces} == {0, 1}, "every shard must hold a piece"
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
    for i, (address, server) in enumerate(zip(addresses, [keys, keys, other], strict=True)):
        procs.start(embedded_command(PSConfig(bind=address, keys=server / "server", shard=f"{i % 2}/2")))
    options = {"world_size": 2, "mode": "asgd", "request_timeout": 15}

    good = ShardedClient(addresses[:2], part, rank=0, keys=keys / "worker", **options)
    try:
        good.hello(stage=1, training=True, timeout=30)
        w0 = {"w": np.arange(40, dtype=np.float32).reshape(8, 5), "b": np.zeros(5, np.float32)}
        assert good.init(w0)
        reply = good.push(good.pull().version, {n: np.ones(s, np.float32) for n, s in shapes.items()})
        assert reply.version.per_shard == (1, 1)
        for name, t in w0.items():
            np.testing.assert_array_equal(reply.tensors[name], t + 1)
        before = [s["refused"].get("auth", 0) for s in good.stats()["shards"]]
        bytes_out = [s["bytes_out"] for s in good.stats()["shards"]]

        bare = ShardedClient(addresses[:2], part, rank=1, keys=None, **options)
        try:
            with pytest.raises(PSUnreachableError) as err:
                bare.hello(stage=1, training=True)
            assert "keygen" in str(err.value)
            assert bare.counters.bytes_down == 0, "a refused worker received bytes"
        finally:
            bare.close()
        for _ in range(50):  # the shards' monitor events may lag the client by a few ms
            after = good.stats()["shards"]
            if all(s["refused"].get("auth", 0) > b for s, b in zip(after, before, strict=True)):
                break
            time.sleep(0.1)
        for i, (s, b) in enumerate(zip(after, before, strict=True)):
            assert 1 <= s["refused"].get("auth", 0) - b <= 3, (i, s["refused"])
        # each shard sent, since, only the replies to good's three stats requests (none to the refused worker)
        sent = [s["bytes_out"] - o for s, o in zip(after, bytes_out, strict=True)]
        assert all(0 < x < 20_000 for x in sent), sent

        mixed = ShardedClient([addresses[0], addresses[2]], part, rank=1, keys=keys / "worker", **options)
        try:
            with pytest.raises(PSUnreachableError) as err:
                mixed.hello(stage=1, training=True)
            assert addresses[2] in str(err.value) and addresses[0] not in str(err.value), str(err.value)
        finally:
            mixed.close()
    finally:
        good.close()
        for p in procs.procs:  # the shards serve until stopped
            p.terminate()
            p.wait(10)
