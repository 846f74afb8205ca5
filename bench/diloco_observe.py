"""The central model of a ``bench.diloco`` run, kept as it changes, from a process on the PS's own host.

``python -m bench.diloco_observe --address tcp://HOST:PORT --mode MODE --out FILE --stop-file PATH``. A bystander
of the PS (a :class:`~plug_asgd.worker.client.PSClient` that never says hello, as the
:class:`~plug_asgd.callbacks.Supervisor`'s thread is): every ``--poll`` seconds it asks the PS's version, and at
each new one pulls the central model and keeps a copy with the wall-clock time (``time.time()``) and the PS's
counters (``pushes_applied``, ``pushes_by_rank``). Its requests go over the PS host's loopback, none over a capped
link, so the workers' link counters hold their own traffic only; a pull copies the model (a few hundred kB) and
nothing is evaluated while the workers train. Once ``--stop-file`` exists (the workers are done) it takes the last
version and writes every copy to ``--out`` (``torch.save``), for ``bench.diloco`` to evaluate.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from plug_asgd.worker.client import PSClient, PSError, PSUnreachableError


def take(client: PSClient, last: int | None) -> dict[str, Any] | None:
    """The central model and the PS's counters where its version is not ``last``; None where it is, or the PS
    holds no model yet.

    Args:
        client: the bystander's connection to the PS.
        last: the version kept last (None: none yet).

    Raises:
        PSError: the PS refused a request for another reason than holding no model yet.
    """
    try:
        if client.stats()["version"] == last:
            return None
        reply = client.pull()
    except PSError as exc:
        if exc.code == "not_initialized":
            return None
        raise
    stats = client.stats()  # after the pull: counters at least as new as the model's version
    return {"time": time.time(), "version": reply.version, "pushes_applied": stats.get("pushes_applied"),
            "pushes_by_rank": stats.get("pushes_by_rank"),
            "tensors": {k: torch.from_numpy(np.array(v, copy=True)) for k, v in reply.tensors.items()}}


def observe(address: str, mode: str, out: Path, stop_file: Path, poll_s: float) -> int:
    """Keep each version of the central model until ``stop_file`` exists, then the last one; write them to ``out``.

    Args:
        address: the PS's ``tcp://host:port``.
        mode: the PS's mode (a client names it; the PS checks it).
        out: the file the copies are written to.
        stop_file: the file whose existence ends the watch.
        poll_s: seconds between two questions of the version.

    Returns:
        0, or 1 where the PS went away before the stop file appeared (the copies so far are written).
    """
    # whole models (no delta replies): each copy is the PS's model as it sent it, patched onto nothing
    client = PSClient(address, rank=0, world_size=1, mode=mode, request_timeout=30.0, delta_replies=False)
    kept: list[dict[str, Any]] = []
    code = 0
    try:
        while not stop_file.exists():
            got = take(client, kept[-1]["version"] if kept else None)
            if got is not None:
                kept.append(got)
            time.sleep(poll_s)
        got = take(client, kept[-1]["version"] if kept else None)
        if got is not None:
            kept.append(got)
    except PSUnreachableError as exc:
        print(f"bench.diloco_observe: the PS went away: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        client.close()
        tmp = out.with_suffix(".tmp")
        torch.save(kept, tmp)
        tmp.replace(out)
    print(f"bench.diloco_observe: {len(kept)} versions kept", flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and :func:`observe`.

    Args:
        argv: the arguments; None: the command line's.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--poll", type=float, default=0.2, help="seconds between two questions (default 0.2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    return observe(args.address, args.mode, args.out, args.stop_file, args.poll)


if __name__ == "__main__":
    sys.exit(main())
