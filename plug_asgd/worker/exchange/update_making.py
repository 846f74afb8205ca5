"""What a push of the push exchange carries: the update ``w - w_base``, scaled and encoded, in buffers kept
across pushes (:class:`UpdateMaking`, the base of :class:`~plug_asgd.worker.exchange.push.PushExchange`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from plug_asgd.compressors import NoCompression
from plug_asgd.modes import PushMode
from plug_asgd.protocol.wire import Sparse
from plug_asgd.worker.exchange.base import Exchange


class UpdateMaking(Exchange):
    """The update a push carries, and the buffers it is made in: kept across pushes, so that a step allocates
    nothing of the model's size; a dense float32 update's in memory the PS maps, where it offers that.

    Args:
        mode: the configured mode, with its push period and AGN's normalisation.
        **kwargs: :class:`~plug_asgd.worker.exchange.base.Exchange`'s keyword arguments.
    """

    mode: PushMode

    def __init__(self, mode: PushMode, **kwargs: Any) -> None:
        super().__init__(mode, **kwargs)
        self.delta_buffers: dict[str, Tensor] = {}
        self.encoded_buffers: dict[str, Tensor] = {}  # an update to encode, made here (not in the PS's memory)
        # whether those buffers and the base are in memory the PS maps: a push of weights the PS does not
        # take then cost a header; over the socket, the model's bytes, so only a lone worker sends them
        self.shared_buffers = False

    def update(self, tensors: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Tensor], bool]:
        """The update to push (``w - w_base``, encoded), the deltas, and whether the PS may answer "own".

        The update is made in buffers kept across pushes (no allocation of the model's size per
        step; a dense float32 one in memory the PS maps, when it offers that), free again once the
        PS has replied (an encoder keeps nothing of what it is given). Sent as it is, a dense update
        can be answered "your base plus this" instead of the model (see ``PSClient.push``).

        Args:
            tensors: the worker's parameters and buffers, by name; only read.
        """
        scale = self.scale()
        dense = self.dense(tensors)
        exact = dense and self.base_is_central and scale == 1.0
        if dense and not self.buffers_fit(tensors, self.delta_buffers):
            self.delta_buffers = self.new_delta_buffers(tensors)
        if not dense and not self.buffers_fit(tensors, self.encoded_buffers):
            self.encoded_buffers = {n: torch.empty_like(t.detach()) for n, t in tensors.items()}
        buffers = self.delta_buffers if dense else self.encoded_buffers
        deltas = {}
        for name, t in tensors.items():
            deltas[name] = torch.sub(t.detach(), self.base[name], out=buffers[name])
            if scale != 1.0:
                deltas[name].mul_(scale)
        update: dict[str, Any] = self.staging.to_host(deltas, shared=dense)  # on a GPU: every copy queued, one wait
        if not dense:
            for name, t in tensors.items():
                update[name] = self.encoder.encode(name, update[name])
                if isinstance(update[name], Sparse):
                    self.compensator.mask(self.optimizers, t, update[name].indices)
        return update, deltas, exact

    def scale(self) -> float:
        """What the update is multiplied by: agn's ``1/steps`` and the staleness compensation's ``1/(1 + s)``."""
        steps = self.since_push if self.mode.normalize and self.since_push else 1
        return self.compensator.update_scale() / steps

    def scaled_for(self) -> float | None:
        """The staleness the update of :meth:`update` was scaled for, for the PS to correct; None if unscaled or if
        no optimizer keeps momentum (nothing to correct).

        agn's pushes are not scaled, but its division by ``push_every`` (N steps, N workers) stands for a scale of
        ``1 / (1 + s)`` at the ``N - 1`` pushes of the others that land between two of its own: a push landing
        staler than that, or than the worker's typical staleness, is corrected as downpour's are."""
        if not self.correct:
            return None
        if self.compensator.scale:
            return self.compensator.staleness
        if self.mode.normalize and self.mode.rule.corrects:
            return max(float(self.mode.push_every - 1), self.compensator.staleness)
        return None

    def dense(self, tensors: dict[str, Tensor]) -> bool:
        """Whether the update goes uncompressed and every tensor is float32 (what an "own" reply and a push of
        weights need).

        Args:
            tensors: the worker's parameters and buffers, by name.
        """
        return isinstance(self.encoder, NoCompression) and all(t.dtype == torch.float32 for t in tensors.values())

    @staticmethod
    def buffers_fit(tensors: dict[str, Tensor], buffers: dict[str, Tensor]) -> bool:
        """Whether ``buffers`` can take ``tensors`` as they are: the same names, shapes, devices and dtypes.

        Args:
            tensors: the worker's parameters and buffers, by name.
            buffers: the buffers kept from an earlier push, by name.
        """
        return buffers.keys() == tensors.keys() and all(
            buffers[n].shape == t.shape and buffers[n].device == t.device and buffers[n].dtype == t.dtype
            for n, t in tensors.items())

    def new_delta_buffers(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Buffers for dense updates: in memory the PS maps where it can (``shm_pushes``), else private.

        The base moves into that memory too: a push of weights (:meth:`push_weights`) swaps the
        two sets, so both must be where the PS can read them. Tensors on a device keep their buffers
        there; their pushes are staged in two sets of that memory instead (:meth:`Staging.share_out`).

        Args:
            tensors: the worker's parameters and buffers, by name, whose shapes the buffers take.
        """
        staged = [self.staging.staged(t.device) for t in tensors.values()]
        shared = None
        if self.shm_pushes and (not any(staged) or all(staged)):
            shapes = {f"{kind}:{n}": (tuple(t.shape), np.float32) for n, t in tensors.items() for kind in "db"}
            shared = self._link.client.push_buffers(shapes)
        if shared is not None and not any(staged):
            for name in tensors:
                base = torch.from_numpy(shared[f"b:{name}"])
                if name in self.base:
                    base.copy_(self.base[name])
                self.base[name] = base
            self.shared_buffers = True
            return {n: torch.from_numpy(shared[f"d:{n}"]) for n in tensors}
        self.shared_buffers = False
        if shared is not None:  # a device's: each push is copied into one set, the PS reads it there
            self.staging.share_out([{n: shared[f"{kind}:{n}"] for n in tensors} for kind in "db"])
        return {n: torch.empty_like(t.detach()) for n, t in tensors.items()}

    @property
    def shares_pushes(self) -> bool:
        """Whether a dense push reaches the PS through its memory (the buffers, or their staging, in it)."""
        return self.shared_buffers or self.staging.shares_out
