"""What proves a standby: the standby key of a keyed PS, a secret in a file only the PS's user can read for a
keyless one; and the primary's check of it, before a standby's request changes anything (:class:`StandbyCredential`).

A keyed PS admits as its standby only a connection that authenticated with a key of its ``authorized_standby``
folder (``plug-asgd keygen DIR`` writes DIR/standby and authorizes it: :mod:`plug_asgd.protocol.security`); the key
is the connection's ZeroMQ ``User-Id`` (:func:`plug_asgd.ps.curve_auth.standby_key`). A worker's key, or the PS's
own, is refused ``bad_standby``.

A PS without keys (loopback, or ``--insecure``) writes, once it listens, 32 random bytes to
``ROOT/ps-PORT/standby.secret`` (mode 0600 in folders of mode 0700, written whole or not at all; removed when the
PS stops), where PORT is the port it listens on and ROOT is ``$PLUG_ASGD_SECRET_DIR`` where set, else
``$XDG_RUNTIME_DIR/plug_asgd`` where that folder exists, else ``~/.cache/plug_asgd/run``. The file holds the
writer's host name and process id besides the secret: a PS that writes its own removes this host's files whose
process is gone (a PS killed before it could). A standby of that PS
(``serve-ps --standby-of tcp://HOST:PORT``, or the embedded one) reads it from the same place, found from the
primary's port alone: it needs no option of the primary's, and runs as the same user on the same machine (or one
that shares ROOT). Each of its requests to the primary (``standby`` ``step: config`` and ``step: join``) carries
``issued`` (its clock) and ``proof``, an HMAC-SHA256 under the secret of the step, ``issued`` and the join's
fields (the standby's addresses and its link's token): the secret never travels. The primary checks it before
the request changes anything: a proof that does not match, or ``issued`` more than
:data:`PROOF_WINDOW_S` from the primary's clock, is refused ``bad_standby`` at the cost of one HMAC.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from plug_asgd.protocol.wire import WireError
from plug_asgd.ps.curve_auth import standby_key, standby_keys

log = logging.getLogger("plug_asgd.ps")

SECRET_DIR_ENV = "PLUG_ASGD_SECRET_DIR"
PROOF_WINDOW_S = 120.0  # how far a request's ``issued`` may be from the primary's clock (one machine's clock)
SIGNED = ("address", "link_address", "link")  # the join's fields a proof covers, besides the step and its time


def secret_root() -> Path:
    """The folder of the keyless PSes' secrets (see the module doc)."""
    if os.environ.get(SECRET_DIR_ENV):
        return Path(os.environ[SECRET_DIR_ENV])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "plug_asgd"
    return Path.home() / ".cache" / "plug_asgd" / "run"


def secret_path(address: str) -> Path:
    """Where the PS listening at ``address`` keeps its standby secret: ``ROOT/ps-PORT/standby.secret`` (another
    transport than tcp: a digest of the address instead of the port).

    Args:
        address: the PS's address (``tcp://HOST:PORT``); its host does not matter.
    """
    port = re.fullmatch(r"tcp://.*:(\d+)", address)
    name = port.group(1) if port else hashlib.sha256(address.encode()).hexdigest()[:16]
    return secret_root() / f"ps-{name}" / "standby.secret"


def _private_folder(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_uid != os.getuid():
        raise OSError(f"{path} belongs to another user: a PS's standby secret goes only where its user alone may "
                      f"read (set {SECRET_DIR_ENV} to such a folder)")
    os.chmod(path, 0o700)


def write_secret(address: str) -> bytes:
    """Make the standby secret of the PS at ``address`` and write it (see the module doc); returns it.

    Args:
        address: the address the PS listens on.

    Raises:
        OSError: where the folder cannot be made private, or the file cannot be written.
    """
    path = secret_path(address)
    _private_folder(path.parent.parent)
    _private_folder(path.parent)
    _prune(path.parent.parent)
    secret = secrets.token_bytes(32)
    partial = path.with_name(f".standby.secret.{os.getpid()}")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"{socket.gethostname()} {os.getpid()} {secret.hex()}\n")
    os.replace(partial, path)
    return secret


def _prune(root: Path) -> None:
    """Remove this host's secret files whose writer is gone (a PS killed before it could), and their folders."""
    host = socket.gethostname()
    for path in root.glob("ps-*/standby.secret"):
        try:
            writer, pid, _ = path.read_text().split()
            if writer == host and path.stat().st_uid == os.getuid() and not _alive(int(pid)):
                path.unlink()
                path.parent.rmdir()
        except (OSError, ValueError):
            continue  # another PS's, being written or removed now; or not one of ours


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parse(text: str) -> bytes:
    """The secret in a secret file's text (its last word: host, process id, secret)."""
    return bytes.fromhex(text.split()[-1])


def read_secret(address: str) -> bytes:
    """The standby secret of the keyless PS at ``address``, as its standby reads it.

    Args:
        address: the primary's address.

    Raises:
        OSError: where there is none (no keyless PS listens there on this machine, or it could not write it), or
            it is readable by another user than this one.
    """
    path = secret_path(address)
    try:
        status, text = path.stat(), path.read_text()
    except OSError as exc:
        raise OSError(f"cannot read the standby secret of the parameter server at {address} ({path}: "
                      f"{exc.strerror or exc}): a standby of a PS without keys runs on its machine as its user (or "
                      f"where {SECRET_DIR_ENV} names a folder that PS writes to); a PS with keys takes its standby "
                      "by the standby key instead (serve-ps --keys DIR/standby)") from None
    if status.st_uid != os.getuid() or status.st_mode & 0o077:
        raise OSError(f"{path} is readable by others than its owner, or is not this user's: refusing it as a "
                      "standby secret")
    try:
        return _parse(text)
    except (ValueError, IndexError):
        raise OSError(f"{path} does not hold a standby secret (hex digits)") from None


def forget_secret(address: str, secret: bytes) -> None:
    """Remove the secret file of the PS at ``address`` where it still holds ``secret`` (a later PS on the same port
    may have written its own), and its folder where empty.

    Args:
        address: the address the PS listened on.
        secret: the secret it wrote.
    """
    path = secret_path(address)
    # a file gone already, another PS's now, or a folder not empty stays as it is
    with contextlib.suppress(OSError, ValueError, IndexError):
        if hmac.compare_digest(_parse(path.read_text()), secret):
            path.unlink()
        path.parent.rmdir()


def _mac(secret: bytes, step: str, issued: float, fields: dict[str, Any]) -> str:
    signed = "\x1f".join([step, repr(float(issued)), *(str(fields.get(name, "")) for name in SIGNED)])
    return hmac.new(secret, b"plug_asgd standby\x1f" + signed.encode(), hashlib.sha256).hexdigest()


def prove(secret: bytes, step: str, fields: dict[str, Any], issued: float | None = None) -> dict[str, Any]:
    """``fields`` with the proof of ``secret`` a standby's request carries (``issued`` and ``proof``).

    Args:
        secret: the primary's standby secret (:func:`read_secret`).
        step: the request's step (``config`` or ``join``).
        fields: the request's other fields (a join's addresses and link token are signed).
        issued: the time it claims to be made at (``time.time()``); None: now.
    """
    issued = time.time() if issued is None else float(issued)
    return {**fields, "issued": issued, "proof": _mac(secret, step, issued, fields)}


class StandbyCredential:
    """A primary's check that a request to join (or for its options) comes from its standby: by the connection's
    key where the PS is keyed, by the proof of its secret (written now, once it listens) where it is not.

    Args:
        keys: the PS's keys (None: keyless).
        address: the address the PS listens on.
    """

    def __init__(self, keys: Any, address: str) -> None:
        self.address = address
        self.admitted = standby_keys(keys) if keys is not None else None
        self.secret: bytes | None = None
        if keys is None:
            try:
                self.secret = write_secret(address)
            except OSError as exc:
                log.warning("no standby can join this parameter server: its standby secret cannot be written (%s)",
                            exc)

    def check(self, step: str, fields: dict[str, Any], frame: Any) -> None:
        """Refuse a request that does not come from this PS's standby; a key lookup or one HMAC, nothing else.

        Args:
            step: the request's step.
            fields: its fields.
            frame: a frame of the request as received (its ``User-Id``: the connection's key).

        Raises:
            WireError: ``bad_standby``, where the key is not a standby's, or the proof is missing, wrong or stale.
        """
        if self.admitted is not None:
            if not standby_key(frame, self.admitted):
                raise WireError("bad_standby", "only this parameter server's standby may ask that: it connects with "
                                               "the standby key (DIR/standby of `plug-asgd keygen DIR`, admitted "
                                               "in the PS's authorized_standby folder); a worker's key may not")
            return
        issued, proof = fields.get("issued"), fields.get("proof")
        if (self.secret is None or not isinstance(proof, str) or not proof.isascii() or type(issued) is not float
                or not abs(time.time() - issued) <= PROOF_WINDOW_S
                or not hmac.compare_digest(proof, _mac(self.secret, step, issued, fields))):
            raise WireError("bad_standby", f"only this parameter server's standby may ask that: its requests prove "
                                           f"the secret in {secret_path(self.address)}, readable by the PS's user "
                                           "alone")

    def close(self) -> None:
        """The PS stops: its secret file goes (a keyless PS's)."""
        if self.secret is not None:
            forget_secret(self.address, self.secret)
