"""Lightning's collectives (barrier, broadcast, all_gather, reduce) through the PS: a gather of every worker's part."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import torch
from torch import Tensor
from torch.distributed import ReduceOp

from plug_asgd.worker.tensors import to_numpy

_REDUCE_OPS = {"sum": "sum", "mean": "mean", "avg": "mean", "max": "max", "min": "min"}
Gather = Callable[..., list[Any]]  # (kind, obj=None, tensors=None) -> [(rank, obj, tensors)] of every worker


def op_name(reduce_op: Any) -> str:
    """``sum``, ``mean``, ``max`` or ``min`` for a torch ``ReduceOp`` or Lightning's name of one.

    Args:
        reduce_op: a ``torch.distributed.ReduceOp``, or a name such as ``"sum"`` or ``"avg"`` (any case);
            None means ``mean``, as Lightning's default.

    Raises:
        ValueError: where ``reduce_op`` is another operation (a product, a bitwise one), which the PS does not do.
    """
    if isinstance(reduce_op, ReduceOp.RedOpType) or isinstance(reduce_op, ReduceOp):
        name = {ReduceOp.SUM: "sum", ReduceOp.AVG: "mean", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}.get(reduce_op)
    else:
        name = _REDUCE_OPS.get(str(reduce_op or "mean").lower())
    if name is None:
        raise ValueError(f"reduce_op {reduce_op!r} is not supported by AsyncPSStrategy (sum, mean, max, min)")
    return name


class Collectives:
    """The collectives of one worker through ``gather`` (one PS round trip each); None: every one is local.

    Args:
        gather: sends this worker's part of a collective to the PS and returns every worker's
            ``(rank, obj, tensors)``; None where the worker is alone (no PS round trip).
    """

    def __init__(self, gather: Gather | None) -> None:
        self.gather = gather

    def barrier(self, name: str | None) -> None:
        """Wait until every worker of the stage has reached the barrier ``name``.

        Args:
            name: Lightning's name of the barrier (None: unnamed), which keeps barriers of different names apart.
        """
        if self.gather is not None:
            self.gather(f"barrier:{name or ''}")

    def broadcast(self, obj: Any, src: int, rank: int) -> Any:
        """``obj`` of rank ``src``, which must be msgpack data (str, numbers, lists, dicts, bytes, None).

        Args:
            obj: the value to send where this worker is ``src``; ignored on the other ranks.
            src: the rank whose ``obj`` every worker gets.
            rank: this worker's rank.

        Raises:
            TypeError: where ``src``'s ``obj`` is not msgpack data, or ``src`` sent nothing.
            RuntimeError: where rank ``src`` is not among the workers that answered (it has left the stage).
        """
        if self.gather is None:
            return obj
        mine = None
        if rank == src:
            try:
                msgpack.packb(obj, use_bin_type=True)
                mine = {"value": obj}
            except (TypeError, ValueError) as exc:
                mine = {"error": f"AsyncPSStrategy.broadcast sends msgpack data only (str, numbers, lists, "
                                 f"dicts, bytes, None); got {type(obj).__name__}: {exc}"}
        for sender, payload, _ in self.gather("broadcast", mine):
            if sender == src:
                if payload is None or "error" in payload:
                    raise TypeError(payload["error"] if payload else f"broadcast source rank {src} sent nothing")
                return payload["value"]
        raise RuntimeError(f"broadcast source rank {src} has left the stage")

    def all_gather(self, tensor: Tensor, sync_grads: bool) -> Tensor:
        """Every worker's ``tensor``, stacked along a new first dimension in rank order.

        Args:
            tensor: this worker's part (each worker's of the same shape); the result has its dtype and device.
            sync_grads: whether gradients should flow back through the gather; they cannot, so it must be False.

        Raises:
            RuntimeError: where ``sync_grads`` is True.
        """
        if sync_grads:
            raise RuntimeError("all_gather(sync_grads=True) needs autograd across processes, which "
                               "AsyncPSStrategy does not provide")
        if self.gather is None:
            return tensor.unsqueeze(0)
        parts = [t["x"] for _, _, t in self.gather("all_gather", tensors={"x": to_numpy(tensor)})]
        return torch.tensor(np.stack(parts), dtype=tensor.dtype, device=tensor.device)

    def reduce(self, tensor: Any, reduce_op: Any, training: bool) -> Any:
        """Reduce across workers; during training (``training``) the local value is returned.

        Args:
            tensor: this worker's value; anything but a tensor is returned as it is.
            reduce_op: the operation (see :func:`op_name`); a mean is computed in float64.
            training: whether the training loop's batches are running, where no worker waits on the others.
        """
        if not isinstance(tensor, Tensor) or self.gather is None or training:
            return tensor
        op = op_name(reduce_op)
        parts = np.stack([t["x"] for _, _, t in self.gather(f"reduce:{op}", tensors={"x": to_numpy(tensor)})])
        result = parts.astype(np.float64).mean(axis=0) if op == "mean" else getattr(parts, op)(axis=0)
        return torch.tensor(result, dtype=tensor.dtype if op != "mean" or tensor.is_floating_point()
                            else torch.float32, device=tensor.device)
