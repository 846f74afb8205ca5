"""The CURVE key loader's error paths (plug_asgd.protocol.security): each broken layout is refused with a
KeysError naming the file at fault and how to make keys, never a zmq traceback or a PS that no worker
can reach. Pure file handling: quick."""

from __future__ import annotations

import shutil

import pytest

from plug_asgd.protocol.security import KeysError, generate_keys, load_server_keys, load_worker_keys

HINT = r"plug-asgd keygen DIR"


@pytest.fixture
def keys(tmp_path):
    generate_keys(tmp_path / "k")
    return tmp_path / "k"


def test_a_complete_keygen_folder_loads_on_both_sides(keys):
    server, worker = load_server_keys(keys), load_worker_keys(keys / "worker")
    assert worker.server_public == server.public and len(server.secret) == len(worker.secret) == 40
    assert server.authorized_dir == keys / "server" / "authorized_workers"


@pytest.mark.parametrize("side, file, load", [
    ("server", "server.key_secret", load_server_keys),
    ("worker", "worker.key_secret", load_worker_keys),
    ("worker", "server.key", load_worker_keys),
])
def test_a_missing_key_file_is_named(keys, side, file, load):
    (keys / side / file).unlink()
    with pytest.raises(KeysError, match=rf"key file {keys / side / file} not found; .*{HINT}"):
        load(keys)


@pytest.mark.parametrize("side, file, load", [
    ("server", "server.key_secret", load_server_keys),
    ("worker", "server.key", load_worker_keys),
])
def test_a_file_that_is_not_a_certificate_is_named(keys, side, file, load):
    (keys / side / file).write_text("not a certificate\n")
    with pytest.raises(KeysError, match=rf"key file {keys / side / file} is not a ZeroMQ certificate"):
        load(keys)


def test_a_public_key_where_the_secret_one_belongs_is_refused(keys):
    shutil.copy(keys / "worker" / "worker.key", keys / "worker" / "worker.key_secret")  # public half only
    with pytest.raises(KeysError, match=rf"{keys / 'worker' / 'worker.key_secret'} holds no secret key; .*{HINT}"):
        load_worker_keys(keys)


@pytest.mark.parametrize("emptied", [True, False])
def test_a_server_without_authorized_workers_is_refused_before_it_serves_no_one(keys, emptied):
    authorized = keys / "server" / "authorized_workers"
    if emptied:
        (authorized / "worker.key").unlink()
    else:
        shutil.rmtree(authorized)
    with pytest.raises(KeysError, match=rf"{authorized} holds no worker public key \(\*\.key\)"):
        load_server_keys(keys / "server")


def test_keygen_refuses_to_overwrite_keys(keys):
    before = (keys / "server" / "server.key_secret").read_bytes()
    with pytest.raises(FileExistsError, match="keygen never overwrites keys"):
        generate_keys(keys)
    assert (keys / "server" / "server.key_secret").read_bytes() == before
