"""CURVE keys for the PS and its workers, and the rule that a non-loopback PS needs them.

``plug-asgd keygen DIR`` writes::

    DIR/server/server.key               the PS's public key
    DIR/server/server.key_secret        the PS's secret key (mode 0600)   -> the PS machine only
    DIR/server/authorized_workers/      public keys of the workers the PS accepts
    DIR/worker/worker.key               the workers' public key
    DIR/worker/worker.key_secret        the workers' secret key (mode 0600) -> every worker machine
    DIR/worker/server.key               the PS's public key (workers check they talk to the real PS)
    DIR/server/authorized_standby/      public keys of the standbys the PS admits (for that role alone)
    DIR/standby/standby.key             the hot standby's public key
    DIR/standby/standby.key_secret      the hot standby's secret key (mode 0600) -> the standby machine only
    DIR/standby/server.key(_secret), authorized_workers/, authorized_standby/
                                        the PS's keypair and lists: a standby that leads is the PS

``DIR/server`` goes to the PS machine (``serve-ps --keys DIR/server``), ``DIR/worker`` to every
worker machine (``--ps-keys DIR/worker``), ``DIR/standby`` to a hot standby's machine (``serve-ps --standby-of
ADDR --keys DIR/standby``). Where one machine runs them all (the embedded PS of rank 0, or a shared file
system), ``DIR`` itself works for every side. Keygen run on a folder of keys made before the standby's (a
server and a worker keypair, no ``standby``) adds ``DIR/standby`` and its line in ``authorized_standby``, and
touches nothing else.

With keys, ZeroMQ's CURVE encrypts and authenticates every connection; the PS's ZAP handler
accepts only the public keys in ``authorized_workers`` and ``authorized_standby`` (and its own), and a
connection's key says its role: only a key of ``authorized_standby`` may join as a standby
(:mod:`plug_asgd.ps.curve_auth`). Imports nothing of plug_asgd but zmq.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

SERVER = "server"
WORKER = "worker"
STANDBY = "standby"
AUTHORIZED = "authorized_workers"
AUTHORIZED_STANDBY = "authorized_standby"
KEYGEN_HINT = ("make keys with `plug-asgd keygen DIR`, then give the PS `--keys DIR/server` and the workers "
               "`--ps-keys DIR/worker` (AsyncPSStrategy(ps_keys=...))")


class KeysError(ValueError):
    """Keys missing, unreadable or malformed; the message names the file and how to make keys."""


class InsecureBindError(ValueError):
    """A PS asked to listen beyond loopback without authentication."""


@dataclass(frozen=True)
class ServerKeys:
    """The PS's CURVE keypair and the folder of the worker public keys it accepts.

    Attributes:
        public: the PS's public key (Z85).
        secret: the PS's secret key (Z85).
        authorized_dir: the folder of the public keys (``*.key``) of the workers the PS accepts.
        standby_dir: the folder of the public keys of the standbys it accepts (None: none, keys made before).
        standby_public: a standby's own public key, which it joins with (None: not a standby's keys).
        standby_secret: a standby's own secret key (None: not a standby's keys).
    """

    public: bytes
    secret: bytes
    authorized_dir: Path
    standby_dir: Path | None = None
    standby_public: bytes | None = None
    standby_secret: bytes | None = None


@dataclass(frozen=True)
class WorkerKeys:
    """A worker's CURVE keypair and the public key of the PS it expects to talk to.

    Attributes:
        public: the worker's public key (Z85).
        secret: the worker's secret key (Z85).
        server_public: the PS's public key (Z85), so the worker connects only to the real PS.
    """

    public: bytes
    secret: bytes
    server_public: bytes


def _secret_file(path: Path) -> None:
    os.chmod(path, 0o600)


def generate_keys(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Write a server, a worker and a standby keypair under ``directory`` (see the module doc); returns the files.
    Where ``directory`` holds a server and a worker keypair but no standby's (keys made before), only the
    standby's are written.

    Args:
        directory: the folder to write ``server/``, ``worker/`` and ``standby/`` in; made where missing.

    Raises:
        FileExistsError: where ``directory`` holds secret keys already (keys are never overwritten).
    """
    root = Path(directory)
    server_dir, worker_dir, standby_dir = root / SERVER, root / WORKER, root / STANDBY
    ours = (server_dir / "server.key_secret", worker_dir / "worker.key_secret")
    upgrade = all(f.exists() for f in ours)
    for existing in (*([] if upgrade else ours), standby_dir / "standby.key_secret", standby_dir / "server.key_secret"):
        if existing.exists():
            raise FileExistsError(f"{existing} exists already: keygen never overwrites keys; choose another folder")
    files = {} if upgrade else _server_and_workers(server_dir, worker_dir)
    return {**files, **_standby(server_dir, standby_dir)}


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _server_and_workers(server_dir: Path, worker_dir: Path) -> dict[str, Path]:
    authorized = server_dir / AUTHORIZED
    for d in (server_dir, worker_dir, authorized):
        d.mkdir(parents=True, exist_ok=True)
    _private_dir(server_dir)
    _private_dir(worker_dir)
    server_public, server_secret = zmq.auth.create_certificates(server_dir, SERVER)
    worker_public, worker_secret = zmq.auth.create_certificates(worker_dir, WORKER)
    _secret_file(Path(server_secret))
    _secret_file(Path(worker_secret))
    # public keys only: the PS's to the workers, the worker's to the PS's authorized list
    (worker_dir / "server.key").write_bytes(Path(server_public).read_bytes())
    (authorized / "worker.key").write_bytes(Path(worker_public).read_bytes())
    return {"server_public": Path(server_public), "server_secret": Path(server_secret),
            "authorized": authorized, "worker_public": Path(worker_public),
            "worker_secret": Path(worker_secret), "worker_server_public": worker_dir / "server.key"}


def _standby(server_dir: Path, standby_dir: Path) -> dict[str, Path]:
    """The standby's keypair in ``standby_dir``, beside a copy of the PS's keypair and lists (a standby that leads
    is the PS: workers check its key is the PS's); its public key admitted for the standby role by the PS."""
    _private_dir(standby_dir)
    public, secret = zmq.auth.create_certificates(standby_dir, STANDBY)
    _secret_file(Path(secret))
    (server_dir / AUTHORIZED_STANDBY).mkdir(exist_ok=True)
    (server_dir / AUTHORIZED_STANDBY / "standby.key").write_bytes(Path(public).read_bytes())
    shutil.copyfile(server_dir / "server.key", standby_dir / "server.key")
    fd = os.open(standby_dir / "server.key_secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write((server_dir / "server.key_secret").read_bytes())
    for folder in (AUTHORIZED, AUTHORIZED_STANDBY):
        shutil.copytree(server_dir / folder, standby_dir / folder, dirs_exist_ok=True)
    return {"standby_public": Path(public), "standby_secret": Path(secret),
            "authorized_standby": server_dir / AUTHORIZED_STANDBY}


def _side(path: str | os.PathLike[str], side: str) -> Path:
    """``path`` itself, or its ``side`` subfolder where it is the folder keygen wrote."""
    p = Path(path)
    return p / side if (p / side).is_dir() else p


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeysError(f"key file {path} not found; {KEYGEN_HINT}")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"key file {path} is not a ZeroMQ certificate ({exc}); {KEYGEN_HINT}") from None
    if secret and not secret_key:
        raise KeysError(f"{path} holds no secret key; {KEYGEN_HINT}")
    return public, secret_key


def load_server_keys(path: str | os.PathLike[str]) -> ServerKeys:
    """The PS's keypair and its authorized-workers folder, from ``DIR/server`` (or ``DIR``).

    Args:
        path: the folder keygen wrote (``DIR``) or its ``server`` subfolder.

    Raises:
        KeysError: where the secret key is missing or malformed, or no worker public key is authorized.
    """
    d = _side(path, SERVER)
    public, secret = _load(d / "server.key_secret", secret=True)
    authorized = d / AUTHORIZED
    if not authorized.is_dir() or not any(authorized.glob("*.key")):
        raise KeysError(f"{authorized} holds no worker public key (*.key), so no worker could connect; "
                        f"{KEYGEN_HINT}")
    assert secret is not None
    standbys = d / AUTHORIZED_STANDBY
    return ServerKeys(public, secret, authorized, standbys if standbys.is_dir() else None)


def load_standby_keys(path: str | os.PathLike[str]) -> ServerKeys:
    """A hot standby's keys, from ``DIR/standby`` (or ``DIR``): its own keypair, which it joins its primary with,
    and the PS's keypair and lists, which it serves with once it leads.

    Args:
        path: the folder keygen wrote (``DIR``) or its ``standby`` subfolder.

    Raises:
        KeysError: where the standby's secret key is missing (keys made before the standby's: keygen run again on
            ``DIR`` adds it) or malformed, or the PS's keys beside it are (as :func:`load_server_keys`).
    """
    d = _side(path, STANDBY)
    if not (d / "standby.key_secret").is_file():
        raise KeysError(f"{d / 'standby.key_secret'} not found: a hot standby joins with the standby key of "
                        "`plug-asgd keygen DIR` (serve-ps --standby-of ADDR --keys DIR/standby); keys made before "
                        "it: run `plug-asgd keygen DIR` again, which adds DIR/standby and overwrites nothing")
    public, secret = _load(d / "standby.key_secret", secret=True)
    return dataclasses.replace(load_server_keys(d), standby_public=public, standby_secret=secret)


def load_worker_keys(path: str | os.PathLike[str]) -> WorkerKeys:
    """A worker's keypair and the PS's public key, from ``DIR/worker`` (or ``DIR``).

    Args:
        path: the folder keygen wrote (``DIR``) or its ``worker`` subfolder.
    """
    d = _side(path, WORKER)
    public, secret = _load(d / "worker.key_secret", secret=True)
    server_public, _ = _load(d / "server.key", secret=False)
    assert secret is not None
    return WorkerKeys(public, secret, server_public)


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://host:port`` endpoint (brackets of IPv6 removed); None for ipc/inproc.

    Args:
        endpoint: a ZeroMQ endpoint (``tcp://...``, ``ipc://...``, ``inproc://...``).
    """
    m = re.fullmatch(r"tcp://(\[[^\]]*\]|[^:]*):(\d+|\*)", endpoint)
    if m is None:
        return None if not endpoint.startswith("tcp://") else endpoint[len("tcp://"):]
    return m.group(1).strip("[]")


def is_loopback(endpoint: str) -> bool:
    """Whether binding ``endpoint`` exposes nothing beyond this machine (ipc and inproc count as local).

    Args:
        endpoint: the ZeroMQ endpoint to bind; a wildcard or host name counts as reachable from elsewhere.
    """
    host = endpoint_host(endpoint)
    if host is None:
        return True
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a host name: assume it is reachable from elsewhere


def check_bind(endpoint: str, keyed: bool, insecure: bool) -> None:
    """Refuse to listen beyond loopback without keys, unless explicitly told ``insecure``.

    Args:
        endpoint: the ZeroMQ endpoint the PS is to bind.
        keyed: whether the PS has CURVE keys (authenticates and encrypts).
        insecure: whether the user explicitly allowed listening beyond loopback without keys.

    Raises:
        InsecureBindError: where ``endpoint`` reaches beyond loopback, without keys and without ``insecure``.
    """
    if not keyed and not insecure and not is_loopback(endpoint):
        raise InsecureBindError(
            f"refusing to listen on {endpoint} without authentication: anyone who reaches it could read and "
            f"overwrite the model. {KEYGEN_HINT}; or bind 127.0.0.1; or pass --insecure (insecure=True) "
            "on a network you trust completely")
