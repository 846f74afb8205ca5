"""Processes of the PS benchmarks: a bare pyzmq echo server, minimal servers of the protocol, ingest clients.

Run as ``python -m bench.zmqtools echo ADDRESS``, ``python -m bench.zmqtools minimal ADDRESS [WORK]``,
``python -m bench.zmqtools split ADDRESS`` or ``python -m bench.zmqtools ingest ADDRESS KIND RANK``.
Like the embedded PS, they import only ``plug_asgd.worker.client``/``wire`` (``import plug_asgd`` imports
neither torch nor Lightning), so they start in a fraction of a second.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from plug_asgd.compressors import TopKResidual
from plug_asgd.modes import all_finite
from plug_asgd.protocol.wire import decode, encode
from plug_asgd.worker.client import PSClient

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
    compressor = TopKResidual(fraction)
    return {n: compressor.encode(n, d) for n, d in delta.items()}


def _serve(address: str, answer: Callable[[list[Any]], list[Any] | None]) -> None:
    """Bind a ROUTER to ``address``; answer each message with ``answer(frames)`` (None: no reply).

    It serves while the parent process lives.
    """
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
            reply = answer(frames)
            if reply is not None:
                sock.send_multipart([identity, *reply], copy=False)


def echo(address: str) -> None:
    """Send every message back to its sender, frames untouched (zero-copy)."""
    _serve(address, lambda frames: frames)


MINIMAL_WORK = ("fold", "codec", "add", "check", "torch")


def fold_into(update: np.ndarray, central: np.ndarray | None) -> bool:
    """``update += central`` (none yet: zeros) and whether the sum is finite, checked as the PS checks it."""
    if central is not None:
        np.add(update, central, out=update)
    return all_finite(update)


def minimal(address: str, work: str = "fold") -> None:
    """The least a Python PS of this protocol does with a dense push: the floor under ``serve-ps``.

    It parses the push with the library's wire codec, folds each tensor into the push's own
    buffer (``central + update``, checked for NaN/Inf as the PS checks it) and answers with the
    whole model from those buffers, as the PS does; no sessions, version checks, statistics or
    other modes. Any message is taken as a push, from anyone, and the central model starts at
    zero; an update that is not finite is answered with an error and leaves it as it was.

    ``work`` takes that apart, to see what each piece costs: ``codec`` only parses and answers
    (the model is the last update), ``add`` folds without the check, ``check`` checks the update
    without folding it, ``torch`` folds and checks with torch's kernels on its intra-op threads
    (``OMP_NUM_THREADS``) instead of numpy's single thread. Diagnostics only: ``add`` keeps NaN.
    """
    if work not in MINIMAL_WORK:
        raise SystemExit(f"minimal: unknown work {work!r}; one of {', '.join(MINIMAL_WORK)}")
    fold = torch_fold() if work == "torch" else fold_into
    central: dict[str, np.ndarray] = {}
    version = 0

    def answer(frames: list[Any]) -> list[Any]:
        nonlocal central, version
        msg = decode(frames)
        finite = True
        for name, update in msg.tensors.items():
            before = central.get(name)
            if work in ("fold", "torch"):
                finite = fold(update, before) and finite
            elif work == "add" and before is not None:
                np.add(update, before, out=update)
            elif work == "check":
                finite = all_finite(update) and finite
        rid = msg.fields.get("rid")
        if not finite:
            return encode("error", {"rid": rid, "code": "not_finite", "message": "update refused: NaN or Inf"})
        central = dict(msg.tensors)
        version += 1
        return encode("model", {"rid": rid, "version": version, "status": "applied"}, central, reuse=msg.frames)

    _serve(address, answer)


def torch_fold() -> Callable[[np.ndarray, np.ndarray | None], bool]:
    """:func:`fold_into` in torch's kernels, on its intra-op threads; the check as :func:`all_finite` makes it."""
    import torch  # only this diagnostic pays for torch's import

    def fold(update: np.ndarray, central: np.ndarray | None) -> bool:
        u = torch.from_numpy(update).view(-1)
        if central is not None:
            u.add_(torch.from_numpy(central).view(-1))
        return bool(torch.isfinite(torch.dot(u, u))) or bool(torch.isfinite(u).all())
    return fold


def split_update(tensors: dict[str, np.ndarray], parts: int) -> list[dict[str, np.ndarray]]:
    """``tensors`` cut into ``parts`` messages' worth: each tensor's rows split evenly, named ``NAME#i/parts``.

    The count in the name keeps the split server's central slices of different splits apart.
    """
    pieces: list[dict[str, np.ndarray]] = [{} for _ in range(parts)]
    for name, array in tensors.items():
        for i, piece in enumerate(np.array_split(array, parts)):
            pieces[i][f"{name}#{i}/{parts}"] = piece
    return pieces


def split(address: str) -> None:
    """The minimal server taking each push in several messages, folding each part as it arrives.

    Whether overlapping the fold with the push's arrival takes it off the round trip's critical
    path: the parts (fields ``part`` and ``parts``, tensors from :func:`split_update`) are folded
    and checked one by one, as :func:`minimal` folds a whole push, while the next ones are still
    on the wire; the whole model goes back after the last part, from the parts' own frames.
    """
    central: dict[str, np.ndarray] = {}
    folded: dict[str, np.ndarray] = {}
    frames_of: dict[str, Any] = {}
    finite = True
    version = 0

    def answer(frames: list[Any]) -> list[Any] | None:
        nonlocal central, folded, frames_of, finite, version
        msg = decode(frames)
        for name, update in msg.tensors.items():
            finite = fold_into(update, central.get(name)) and finite
        folded.update(msg.tensors)
        frames_of.update(msg.frames)
        if msg.fields["part"] < msg.fields["parts"] - 1:
            return None
        rid, ok = msg.fields.get("rid"), finite
        model, reuse = folded, frames_of
        folded, frames_of, finite = {}, {}, True
        if not ok:
            return encode("error", {"rid": rid, "code": "not_finite", "message": "update refused: NaN or Inf"})
        central = model
        version += 1
        return encode("model", {"rid": rid, "version": version, "status": "applied"}, model, reuse=reuse)

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
        minimal(sys.argv[2], *sys.argv[3:4])
    elif what == "split":
        split(sys.argv[2])
    elif what == "ingest":
        ingest(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown tool {what!r}")
