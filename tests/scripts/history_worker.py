"""A worker of the history checker (tests/test_history.py): each push adds 1 to a coordinate of its own.

Rank r's push i is the one-hot of coordinate ``r * pushes + i`` of a vector of ``world * pushes`` zeros (float64), in
mode asgd, whose PS folds ``w += update`` exactly: the final central model says, coordinate by coordinate, whether
each push was folded in, and how many times. Each line of ``--log`` is one event, as this process saw it:

- ``send``: the push of ``coord`` is about to go (from here on it may be folded in, whatever happens next);
- ``ack``: its reply (``status`` applied or duplicate), the ``version`` it names, the ``epoch`` the answering PS
  leads and the address it was sent to (``by``): the push is acknowledged, it must be in the model exactly once;
- ``error``: a refusal or no reply (``code``): the push was not acknowledged (it may still be in the model, once);
- ``done`` / ``gave_up``: the end of the run as it went.

``--query ADDRESS`` instead prints one JSON line, the PS's stats and its central model as a bystander sees them
(the test runs it on an emulated host, where the test's own process cannot reach).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

# The client without plug_asgd/__init__ (which imports Lightning): the process starts in 0.2 s (ps_worker.py's way)
_package = types.ModuleType("plug_asgd")
_package.__path__ = [str(Path(__file__).resolve().parents[2] / "plug_asgd")]
sys.modules.setdefault("plug_asgd", _package)

from plug_asgd.protocol.wire import Message  # noqa: E402
from plug_asgd.worker.client import PSClient, PSError, PSUnreachableError  # noqa: E402


class RecordingClient(PSClient):
    """A PSClient that keeps, of the last reply, the epoch it names and the address it came from."""

    answered: tuple[str, int | None] = ("", None)

    def request(self, msg_type: str, fields: Any = None, tensors: Any = None, **kw: Any) -> Message:
        """:meth:`PSClient.request`, noting who answered (``self.answered``: address, epoch).

        Args:
            msg_type: the request's type.
            fields: its fields.
            tensors: its tensors.
            **kw: the other arguments of :meth:`PSClient.request`.
        """
        reply = super().request(msg_type, fields, tensors, **kw)
        epoch = reply.fields.get("epoch")
        self.answered = (self.address, epoch if isinstance(epoch, int) else None)
        return reply


def query(address: str, timeout: float) -> dict[str, Any]:
    """The stats and the central model of the PS at ``address``, asked by a bystander (no hello: only that PS).

    Args:
        address: the PS's address.
        timeout: seconds to wait for each reply.
    """
    client = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=timeout, heartbeat_s=None)
    try:
        stats = client.stats(timeout=timeout)
        out: dict[str, Any] = {"stats": stats, "w": None}
        if stats.get("version") is not None and stats.get("role") == "primary":
            try:
                out["w"] = client.pull().tensors["w"].tolist()
            except PSError as exc:
                out["pull_error"] = str(exc)
        return out
    finally:
        client.close()


def run(args: argparse.Namespace) -> int:
    """Say hello, then push ``args.pushes`` one-hots, logging every event; 0 once done, 1 if it gave up.

    Args:
        args: the parsed command line.
    """
    size = args.world * args.pushes
    client = RecordingClient(args.members, rank=args.rank, world_size=args.world, mode="asgd",
                             request_timeout=args.request_timeout, lost_timeout=args.request_timeout,
                             heartbeat_s=0.5)
    with open(args.log, "a") as log:
        def record(event: str, **fields: Any) -> None:
            """One line of the log, flushed at once (the process may be killed any time)."""
            log.write(json.dumps({"event": event, "rank": args.rank, **fields, "t": time.time()}) + "\n")
            log.flush()

        try:
            client.hello(stage=0, training=True, timeout=30)
            client.init({"w": np.zeros(size)})
            version = client.pull().version
            for i in range(args.pushes):
                time.sleep(args.interval)
                coord = args.rank * args.pushes + i
                update = np.zeros(size)
                update[coord] = 1.0
                record("send", coord=coord, base=version)
                try:
                    reply = client.push(version, {"w": update}, want_model=False)
                except PSError as exc:  # refused: not acknowledged; learn the version anew and go on
                    record("error", coord=coord, code=exc.code, message=str(exc)[:300])
                    version = client.pull().version
                    continue
                by, epoch = client.answered
                record("ack", coord=coord, status=reply.status, version=reply.version, epoch=epoch, by=by)
                version = reply.version
            client.bye(stage=0, timeout=10)
            record("done")
            return 0
        except (PSError, PSUnreachableError) as exc:
            record("gave_up", code=getattr(exc, "code", "unreachable"), message=str(exc)[:300])
            return 1
        finally:
            client.close()


def main() -> int:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", help="the PS's members: primary|standby")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--pushes", type=int, default=60)
    parser.add_argument("--interval", type=float, default=0.02, help="seconds of 'compute' before each push")
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--log")
    parser.add_argument("--query", metavar="ADDRESS", help="print the stats and model of the PS at ADDRESS")
    args = parser.parse_args()
    if args.query:
        print(json.dumps(query(args.query, args.request_timeout)))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
