"""The held base on the model's own device (a GPU's): the update ``w - c`` made, selected and merged there.

:mod:`plug_asgd.worker.exchange.held_base` works on numpy views of CPU tensors. On a GPU the weights stay on the
device, and so does a mirror of the central model the client holds: the difference, the selection of its
largest coordinates and the merges run in torch on the device, and only what is sent (the chosen indices and
values) crosses to the host, where the client keeps its numpy copy for the protocol. The rule and the
arithmetic are the numpy path's, float operation for float operation: on CPU tensors the two give the same
bits (``tests/test_held_base.py``). The codecs that select the top of the difference (AdaComp's, top-k's)
run here; the others encode on the host (the exchange's own base).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor
from typing_extensions import override

from plug_asgd.compressors import Compressor, ErrorFeedback, TopK, TopKResidual
from plug_asgd.protocol.wire import Sparse
from plug_asgd.protocol.wire import Tensor as WireTensor
from plug_asgd.worker.exchange.held_base import RESIDUAL, HeldBase
from plug_asgd.worker.held_model import HeldModel
from plug_asgd.worker.model_reply import ModelReply


def largest_differences(w: Tensor, c: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Ascending indices of the ``k`` largest ``|w - c|`` (flat, exact zeros left out; NaN ranks largest) and
    ``w - c`` there, on the tensors' device: the set :func:`plug_asgd.compressors.difference.largest_differences`
    chooses on the host, values tied with the k-th largest going to the lowest indices as there
    (:func:`plug_asgd.compressors.difference.ascending_top`).

    Args:
        w: the worker's weights of one tensor.
        c: the central values of the same tensor, on the same device.
        k: how many coordinates to choose (all of them where ``k`` is at least the tensor's size).
    """
    v = (w - c).reshape(-1)
    if k >= v.numel():
        chosen = torch.arange(v.numel(), device=v.device)
    else:
        mag = v.abs()
        chosen = _lowest_on_ties(mag, torch.topk(mag, k, sorted=False).indices)
    chosen = chosen[v[chosen] != 0].sort().values
    return chosen, v[chosen]


def _lowest_on_ties(mag: Tensor, chosen: Tensor) -> Tensor:
    """``chosen`` (the top ``k`` of ``mag``, NaN largest) with the values tied with the k-th largest taken at the
    lowest indices: the host's rule, in torch."""
    picked = mag[chosen]
    nan = picked.isnan()
    kth = torch.where(nan, torch.inf, picked).min()
    all_nan, crossed = torch.stack([nan.all(), (mag == kth).sum() != (picked == kth).sum()]).tolist()  # one sync
    if all_nan:
        return mag.isnan().nonzero().flatten()[: chosen.numel()]
    if not crossed:
        return chosen
    above = ((mag > kth) | mag.isnan()).nonzero().flatten()
    return torch.cat([above, (mag == kth).nonzero().flatten()[: chosen.numel() - above.numel()]])


def selects_on_device(encoder: Compressor) -> bool:
    """Whether ``encoder`` sends the top of the difference, which this module selects on the device.

    Args:
        encoder: the worker's codec state (AdaComp's top-k with residual, or top-k under error feedback).
    """
    inner = encoder.inner if isinstance(encoder, ErrorFeedback) else None
    return isinstance(encoder, TopKResidual) or isinstance(inner, TopK)


def device_tensors(tensors: Mapping[str, Tensor]) -> dict[str, Tensor] | None:
    """The tensors themselves, where every one is a contiguous float32 tensor of one device; else None.

    Args:
        tensors: the worker's parameters and buffers, by name; the tensors returned are detached views of them.
    """
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1 or not all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors.values()):
        return None
    return {name: t.detach() for name, t in tensors.items()}


class DeviceHeldBase(HeldBase):
    """:class:`HeldBase` with the weights (and a mirror of the held central model) on their device; the residual
    is implicit (``RESIDUAL`` only)."""

    def __init__(self) -> None:
        super().__init__()
        self.mirror: dict[str, Tensor] = {}  # the held central model, on the device
        self.mirrored = -1  # ... of this version (-1: none)

    def _mirror(self, held: Mapping[str, np.ndarray], version: int, device: torch.device) -> dict[str, Tensor]:
        if self.mirrored != version or not self.mirror:
            self.mirror = {name: torch.from_numpy(np.array(array, copy=True)).to(device)
                           for name, array in held.items()}
            self.mirrored = version
        return self.mirror

    @override
    def enter(self, kind: str, weights: dict[str, Any], base: Mapping[str, Tensor], central: Mapping[str, Any],
              residual: Callable[[str], np.ndarray | None], version: int) -> None:
        """:meth:`HeldBase.enter` on the device, where the mirror of ``central`` is made first.

        Raises:
            ValueError: where ``kind`` is not ``RESIDUAL``, the only held base kept on a device.
        """
        if kind != RESIDUAL:
            raise ValueError("the held base on a device keeps its residual in the model (RESIDUAL) only")
        device = next(iter(weights.values())).device
        mirror = self._mirror(central, version, device)
        if self.kind == kind:
            return
        with torch.no_grad():
            for name, w in weights.items():
                w.sub_(base[name]).add_(mirror[name].view_as(w))
                r = residual(name)
                if r is not None:
                    w.add_(torch.from_numpy(np.asarray(r)).to(device).view_as(w))
        self.kind = kind

    @override
    def encode(self, encoder: Compressor, weights: dict[str, Any], central: Mapping[str, Any]) -> dict[str, Any]:
        """Each tensor's ``w - c``, its top chosen on the device; the indices and values copied to the host."""
        self.pushes += 1
        out: dict[str, WireTensor] = {}
        inner = encoder.inner if isinstance(encoder, ErrorFeedback) else encoder
        with torch.no_grad():
            for name, w in weights.items():
                chosen, values = largest_differences(w, self.mirror[name], inner.k_for(w.numel()))  # type: ignore[attr-defined]
                indices, sent = chosen.cpu().numpy(), values.cpu().numpy()
                if isinstance(encoder, TopKResidual):
                    encoder.residuals.pop(name, None)
                    out[name] = encoder._send(indices, sent, None, tuple(w.shape))
                else:
                    encoder.residuals.pop(name, None)  # type: ignore[union-attr]
                    out[name] = Sparse(indices=indices, values=sent, shape=tuple(w.shape))
        return out

    @staticmethod
    @override
    def decoded(update: Mapping[str, Any], weights: Mapping[str, Any],
                encoder: Compressor | None = None) -> dict[str, np.ndarray | Sparse]:
        return HeldBase.decoded(update, {n: np.empty(tuple(t.shape), np.float32) for n, t in weights.items()},
                                encoder)

    @override
    def settle_own(self, reply: ModelReply, held: HeldModel, decoded: Mapping[str, Any]) -> bool:
        """Never beside the step here: the device's mirror of the held model is written with it (:meth:`settle`)."""
        return False

    @override
    def settle(self, reply: ModelReply, held: HeldModel, weights: dict[str, Any], central_before: Mapping[str, Any],
               decoded: Mapping[str, np.ndarray | Sparse], guessed: bool = False,
               made: dict[str, np.ndarray] | None = None) -> None:
        """:meth:`HeldBase.settle` on the device: "own" adds what was sent to the mirror too; a raced reply's
        changes are copied to the device where they are, and merged into the weights there. (Never ``guessed``:
        the device pushes with the residual in the model, whose weights an "own" reply leaves as they are.)"""
        assert not guessed and made is None
        device = next(iter(weights.values())).device
        with torch.no_grad():
            if reply.own:
                held.add(dict(decoded), reply.version)
                for name, part in decoded.items():
                    assert isinstance(part, Sparse)
                    index = torch.from_numpy(part.indices).to(device)
                    self.mirror[name].view(-1).index_put_((index,), torch.from_numpy(part.values).to(device),
                                                          accumulate=True)
                self.mirrored = reply.version
                return
            self.raced += 1
            changed = reply.changed
            for name, w in weights.items():
                flat, mirror = w.view(-1), self.mirror[name].view(-1)
                new = np.asarray(reply.tensors[name]).reshape(-1)
                idx = changed.indices.get(name, np.zeros(0, np.int64)) if changed is not None else None
                if idx is None:  # the tensor came whole: w += c_new - c_old
                    whole = torch.from_numpy(np.array(new, copy=True)).to(device)
                    flat.add_(whole).sub_(mirror)
                    mirror.copy_(whole)
                elif idx.size:
                    index = torch.from_numpy(np.asarray(idx)).to(device)
                    values = torch.from_numpy(new[idx]).to(device)
                    flat[index] += values - mirror[index]
                    mirror[index] = values
                sent = decoded[name]
                assert isinstance(sent, Sparse)
                flat[torch.from_numpy(sent.indices).to(device)] -= torch.from_numpy(sent.values).to(device)
            self.mirrored = reply.version

    @override
    def leave(self, weights: dict[str, Any], base: Mapping[str, Tensor], central: Mapping[str, Any],
              set_residual: Callable[[str, np.ndarray], None] | None) -> None:
        if self.kind is None:
            return
        assert set_residual is not None
        with torch.no_grad():
            for name, w in weights.items():
                set_residual(name, (w - self.mirror[name].view_as(w)).cpu().numpy())
                base[name].copy_(w)
        self.kind = None
