"""Emulated hosts on one machine: Linux network namespaces on a bridge, every link rate-limited with tc htb.

Each host is a namespace with one interface, ``eth0``, a veth whose other end is a port of a
bridge in a switch namespace. An htb class on the egress of both ends of each veth caps the
host's upload and its download at the link rate, so every byte between two hosts crosses two
capped links, as between machines on a switched network (netem is not needed: no added
latency or loss). Namespaces are named with the pid, so parallel runs do not clash, and are
deleted on exit (:meth:`Topology.down`, a context manager) even after a failure.

``python -m harness.netns recv HOST PORT`` / ``send HOST PORT BYTES`` are the two ends of
:meth:`Topology.measure`, the transfer that checks a link's real rate.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.processes import child_env, start, stop

PREFIX = "sl"  # namespaces of this module: sl<pid><host>; left-overs of dead pids are removed by up()
SUBNET = "10.99.0"
DEVICE = "eth0"  # each host's interface, inside its own namespace
IP_TIMEOUT = 20.0


class TopologyError(RuntimeError):
    """A namespace, link or qdisc could not be made; the message holds the command and its error."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``ip ARGS`` (iproute2), with a timeout; raises :class:`TopologyError` on failure when ``check``."""
    return _run(["ip", *args], check)


def _run(cmd: list[str], check: bool) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_TIMEOUT)
    if check and done.returncode != 0:
        raise TopologyError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class Host:
    """One emulated machine: its namespace, address, and its veth's end on the switch."""

    name: str
    ns: str
    address: str
    port_dev: str  # the switch's end of this host's link

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a command on this host."""
        return ["ip", "netns", "exec", self.ns]


class Topology:
    """Hosts joined by a bridge, each link capped at ``rate_mbit`` in both directions (None: no cap).

    ``host_rates`` gives some hosts a rate of their own (None: uncapped), whatever ``rate_mbit`` is set
    to: a server behind a capped link, say, pushed to by clients whose links must not be the bottleneck.
    ``leaf``: a qdisc put under each cap's htb class (``"pfifo limit 50"``: a shallow buffer, as a switch's
    port has; None: htb's default FIFO of the interface's txqueuelen packets).
    Use as a context manager: the namespaces exist inside the ``with`` block only.
    """

    def __init__(self, names: list[str], rate_mbit: float | None = None, tag: str | None = None,
                 host_rates: dict[str, float | None] | None = None, leaf: str | None = None) -> None:
        self.tag = tag or str(os.getpid())
        self.switch = f"{PREFIX}{self.tag}sw"
        self.hosts = {n: Host(n, f"{PREFIX}{self.tag}{n}", f"{SUBNET}.{i + 1}", f"p{self.tag}{i}")
                      for i, n in enumerate(names)}
        if any(len(h.port_dev) > 15 for h in self.hosts.values()):
            raise ValueError(f"tag {self.tag!r} too long for interface names")
        self.rate_mbit = rate_mbit
        self.host_rates = dict(host_rates or {})
        self.leaf = leaf
        unknown = set(self.host_rates) - set(self.hosts)
        if unknown:
            raise ValueError(f"host_rates names hosts that are not in the topology: {sorted(unknown)}")
        self._made: list[str] = []

    def __enter__(self) -> Topology:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Make the switch, the hosts and their links; on any failure, undo what was made and raise."""
        remove_stale()
        try:
            ip("netns", "add", self.switch)
            self._made.append(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            ip("-n", self.switch, "link", "set", "lo", "up")
            for h in self.hosts.values():
                ip("netns", "add", h.ns)
                self._made.append(h.ns)
                ip("link", "add", DEVICE, "netns", h.ns, "type", "veth", "peer", "name", h.port_dev,
                   "netns", self.switch)
                ip("-n", h.ns, "addr", "add", f"{h.address}/24", "dev", DEVICE)
                ip("-n", self.switch, "link", "set", h.port_dev, "master", "br0")
                for ns, dev in ((h.ns, DEVICE), (self.switch, h.port_dev), (h.ns, "lo")):
                    ip("-n", ns, "link", "set", dev, "up")
            self.set_rate(self.rate_mbit)
        except BaseException:
            self.down()
            raise

    def set_rate(self, rate_mbit: float | None) -> None:
        """Cap every link at ``rate_mbit`` (an htb class on both ends' egress), or lift the caps (None); the hosts
        of ``host_rates`` keep their own."""
        self.rate_mbit = rate_mbit
        for h in self.hosts.values():
            rate = self.host_rates.get(h.name, rate_mbit)
            for ns, dev in ((h.ns, DEVICE), (self.switch, h.port_dev)):
                ip("-n", ns, "link", "set", dev, "up")
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
                if rate is None:
                    continue
                tc = ["ip", "netns", "exec", ns, "tc"]
                _run([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"], check=True)
                _run([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                      "rate", f"{rate:g}mbit", "ceil", f"{rate:g}mbit"], check=True)
                if self.leaf is not None:
                    _run([*tc, "qdisc", "add", "dev", dev, "parent", "1:1", *self.leaf.split()], check=True)

    def down(self) -> None:
        """Delete the namespaces this topology made (their veths and the bridge go with them)."""
        while self._made:
            ip("netns", "del", self._made.pop(), check=False)

    def counters(self) -> dict[str, dict[str, int]]:
        """Bytes each host's interface sent (``tx``: up) and received (``rx``: down) so far, frames included."""
        out = {}
        for h in self.hosts.values():
            stats = json.loads(ip("-n", h.ns, "-j", "-s", "link", "show", "dev", DEVICE).stdout)[0]["stats64"]
            out[h.name] = {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}
        return out

    def measure(self, src: str, dst: str, nbytes: int, timeout: float = 120.0) -> dict[str, float]:
        """Send ``nbytes`` over TCP from host ``src`` to host ``dst``; the rate the receiver saw, in Mbit/s."""
        a, b = self.hosts[src], self.hosts[dst]
        port = 5201
        ready = Path(f"/tmp/{PREFIX}{self.tag}-recv-{time.monotonic_ns()}.json")
        receiver = start([*b.prefix, sys.executable, "-m", "harness.netns", "recv", b.address, str(port), str(ready)],
                         env=child_env())
        sender = None
        try:
            deadline = time.monotonic() + 30
            while not ready.exists():  # the receiver writes {} once it listens
                if receiver.poll() is not None or time.monotonic() > deadline:
                    raise TopologyError(f"the receiver on {dst} did not start (rc {receiver.poll()})")
                time.sleep(0.05)
            sender = start([*a.prefix, sys.executable, "-m", "harness.netns", "send", b.address, str(port),
                            str(nbytes)], env=child_env())
            receiver.wait(timeout=timeout)
            got = json.loads(ready.read_text())
            if not got.get("seconds"):
                raise TopologyError(f"the transfer {src} -> {dst} did not finish: {got}")
            return {"bytes": got["bytes"], "seconds": got["seconds"],
                    "mbit_per_s": got["bytes"] * 8 / got["seconds"] / 1e6}
        finally:
            for proc in (sender, receiver):
                if proc is not None:
                    stop(proc, grace=2.0)
            ready.unlink(missing_ok=True)


def remove_stale() -> None:
    """Delete namespaces of this module left by processes that no longer exist (a run killed with SIGKILL)."""
    listed = ip("netns", "list", check=False).stdout.split()
    for name in listed:
        if not name.startswith(PREFIX):
            continue
        rest = name[len(PREFIX):]
        digits = rest[:len(rest) - len(rest.lstrip("0123456789"))]
        rest = rest[len(digits):]
        if digits and rest and not Path(f"/proc/{digits}").exists():
            ip("netns", "del", name, check=False)


def _recv(host: str, port: int, out: Path) -> None:
    with socket.create_server((host, port)) as server:
        out.write_text("{}")
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            total = 0
            first = None
            while chunk := conn.recv(1 << 20):
                if first is None:
                    first = time.perf_counter()
                total += len(chunk)
            seconds = time.perf_counter() - first if first is not None else 0.0
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"bytes": total, "seconds": seconds}))
    tmp.replace(out)


def _send(host: str, port: int, nbytes: int) -> None:
    block = b"\0" * (1 << 20)
    with socket.create_connection((host, port), timeout=60) as conn:
        left = nbytes
        while left > 0:
            conn.sendall(block[:min(left, len(block))])
            left -= len(block)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the two ends of Topology.measure")
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("recv")
    r.add_argument("host")
    r.add_argument("port", type=int)
    r.add_argument("out", type=Path)
    s = sub.add_parser("send")
    s.add_argument("host")
    s.add_argument("port", type=int)
    s.add_argument("nbytes", type=int)
    args = parser.parse_args(argv)
    if args.cmd == "recv":
        _recv(args.host, args.port, args.out)
    else:
        _send(args.host, args.port, args.nbytes)


if __name__ == "__main__":
    main()
