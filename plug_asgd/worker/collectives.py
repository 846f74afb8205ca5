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
    """``sum``, ``mean``, ``max`` or ``min`` for a torch ``ReduceOp`` or Lightning's name of one."""
    if isinstance(reduce_op, ReduceOp.RedOpType) or isinstance(reduce_op, ReduceOp):
        name = {ReduceOp.SUM: "sum", ReduceOp.AVG: "mean", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}.get(reduce_op)
    else:
        name = _REDUCE_OPS.get(str(reduce_op or "mean").lower())
    if name is None:
        raise ValueError(f"reduce_op {reduce_op!r} is not supported by AsyncPSStrategy (sum, mean, max, min)")
    return name


class Collectives:
    """The collectives of one worker through ``gather`` (one PS round trip each); None: every one is local."""

    def __init__(self, gather: Gather | None) -> None:
        self.gather = gather

    def barrier(self, name: str | None) -> None:
        if self.gather is not None:
            self.gather(f"barrier:{name or ''}")

    def broadcast(self, obj: Any, src: int, rank: int) -> Any:
        """``obj`` of rank ``src``, which must be msgpack data (str, numbers, lists, dicts, bytes, None)."""
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
        if sync_grads:
            raise RuntimeError("all_gather(sync_grads=True) needs autograd across processes, which "
                               "AsyncPSStrategy does not provide")
        if self.gather is None:
            return tensor.unsqueeze(0)
        parts = [t["x"] for _, _, t in self.gather("all_gather", tensors={"x": to_numpy(tensor)})]
        return torch.tensor(np.stack(parts), dtype=tensor.dtype, device=tensor.device)

    def reduce(self, tensor: Any, reduce_op: Any, training: bool) -> Any:
        """Reduce across workers; during training (``training``) the local value is returned."""
        if not isinstance(tensor, Tensor) or self.gather is None or training:
            return tensor
        op = op_name(reduce_op)
        parts = np.stack([t["x"] for _, _, t in self.gather(f"reduce:{op}", tensors={"x": to_numpy(tensor)})])
        result = parts.astype(np.float64).mean(axis=0) if op == "mean" else getattr(parts, op)(axis=0)
        return torch.tensor(result, dtype=tensor.dtype if op != "mean" or tensor.is_floating_point()
                            else torch.float32, device=tensor.device)
