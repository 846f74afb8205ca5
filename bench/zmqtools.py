"""Processes of the PS benchmarks: a bare pyzmq echo server, a minimal server of the protocol, ingest clients.

Run as ``python -m bench.zmqtools echo ADDRESS``, ``python -m bench.zmqtools minimal ADDRESS`` or
``python -m bench.zmqtools ingest ADDRESS KIND RANK``. Like the embedded PS, they import
``plug_asgd.client``/``wire`` without the package's ``__init__`` (which imports Lightning), so
they start in a fraction of a second.
"""

from __future__ import annotations

import math
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if "plug_asgd" not in sys.modules:  # the bare package: no Lightning, no torch
    _pkg = types.ModuleType("plug_asgd")
    _pkg.__path__ = [str(Path(__file__).resolve().parent.parent / "plug_asgd")]
    sys.modules["plug_asgd"] = _pkg

import zmq  # noqa: E402

from plug_asgd.client import PSClient  # noqa: E402
from plug_asgd.modes import all_finite, get_mode  # noqa: E402
from plug_asgd.wire import decode, encode  # noqa: E402

# The recipe CNN's tensors (plug_asgd.recipes.mnist.MnistCNN): 1,199,882 float32 parameters.
CNN_SHAPES: dict[str, tuple[int, ...]] = {
    "net.0.weight": (32, 1, 3, 3), "net.0.bias": (32,),
    "net.2.weight": (64, 32, 3, 3), "net.2.bias": (64,),
    "net.7.weight": (128, 9216), "net.7.bias": (128,),
    "net.10.weight": (10, 128), "net.10.bias": (10,),
}
CNN_PARAMETERS = sum(math.prod(s) for s in CNN_SHAPES.values())


def model(seed: int = 0, scale: float = 0.05) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * scale).astype(np.float32) for n, s in CNN_SHAPES.items()}


def update(kind: str, seed: int = 1, fraction: float = 0.01) -> dict:
    """A dense float32 update of every tensor, or AdaComp's top-``fraction`` sparse encoding of one."""
    delta = model(seed, scale=1e-4)
    if kind == "dense":
        return delta
    compressor = get_mode("adacomp").make_compressor(fraction)
    return {n: compressor.encode(n, d) for n, d in delta.items()}


def _serve(address: str, answer: Callable[[list[Any]], list[Any]]) -> None:
    """Bind a ROUTER to ``address`` and send ``answer(frames)`` back for each message, while the parent lives."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    parent = os.getppid()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while os.getppid() == parent:
        if poller.poll(200):
            identity, *frames = sock.recv_multipart(copy=False)
            sock.send_multipart([identity, *answer(frames)], copy=False)


def echo(address: str) -> None:
    """Send every message back to its sender, frames untouched (zero-copy)."""
    _serve(address, lambda frames: frames)


def minimal(address: str) -> None:
    """The least a Python PS of this protocol does with a dense push: the floor under ``serve-ps``.

    It parses the push with the library's wire codec, folds each tensor into the push's own
    buffer (``central + update``, checked for NaN/Inf as the PS checks it) and answers with the
    whole model from those buffers, as the PS does; no sessions, version checks, statistics or
    other modes. Any message is taken as a push, from anyone, and the central model starts at
    zero; an update that is not finite is answered with an error and leaves it as it was.
    """
    central: dict[str, np.ndarray] = {}
    version = 0

    def answer(frames: list[Any]) -> list[Any]:
        nonlocal central, version
        msg = decode(frames)
        finite = True
        for name, update in msg.tensors.items():
            before = central.get(name)
            np.add(update, np.zeros_like(update) if before is None else before, out=update)
            finite = finite and all_finite(update)
        rid = msg.fields.get("rid")
        if not finite:
            return encode("error", {"rid": rid, "code": "not_finite", "message": "update refused: NaN or Inf"})
        central = dict(msg.tensors)
        version += 1
        return encode("model", {"rid": rid, "version": version, "status": "applied"}, central, reuse=msg.frames)

    _serve(address, answer)


def ingest(address: str, kind: str, rank: int) -> None:
    """Push the same update as fast as the PS takes it, without asking for the model back.

    ``dense_shm``: the dense update, made in shared memory the PS maps (a worker on its machine).
    """
    client = PSClient(address, rank=rank, world_size=64, mode="adacomp" if kind == "sparse" else "asgd",
                      request_timeout=30.0)
    client.hello(1, True, timeout=30.0)
    up = update("dense" if kind == "dense_shm" else kind, seed=rank + 1)
    if kind == "dense_shm":
        shared = client.push_buffers({n: (a.shape, a.dtype) for n, a in up.items()})
        if shared is None:
            raise SystemExit("the PS did not take this client's shared memory")
        for n, a in up.items():
            shared[n][...] = a
        up = shared
    parent = os.getppid()
    version = 0
    while os.getppid() == parent:
        version = client.push(version, up, want_model=False).version


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "echo":
        echo(sys.argv[2])
    elif what == "minimal":
        minimal(sys.argv[2])
    elif what == "ingest":
        ingest(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown tool {what!r}")
