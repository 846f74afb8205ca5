"""The elastic exchange of EASGD and EAMSGD: worker and center pulled towards each other."""

from __future__ import annotations

import torch
from typing_extensions import override

from plug_asgd.modes import EASGD
from plug_asgd.worker.exchange.base import Exchange


class ElasticExchange(Exchange):
    """Every ``tau`` local steps: ``e = alpha * (w - center)``; the worker steps ``-e``, the center ``+e`` (pushed)."""

    mode: EASGD

    @override
    def after_step(self) -> None:
        if self.since_push >= self.mode.tau:
            self.send()

    @override
    def send(self) -> None:
        link = self._link
        reply = link.client.pull()
        tensors = link.tensors()
        # the center into the base (the central model of ``reply.version``): on a GPU one batch of
        # non-blocking copies through pinned buffers, not a synchronous copy per tensor
        for name, t in tensors.items():
            base = self.base.get(name)
            if base is None or base.shape != t.shape or base.dtype != t.dtype or base.device != t.device:
                self.base[name] = torch.empty_like(t.detach())
        self.staging.load({n: self.base[n] for n in tensors}, reply.tensors)
        moves = {}
        for name, t in tensors.items():
            e = moves[name] = self.mode.alpha * (t.detach() - self.base[name])
            with torch.no_grad():
                t.sub_(e)
        elastic = {name: self.encoder.encode(name, e) for name, e in self.staging.to_host(moves).items()}
        self.since_push = 0
        done = link.client.push(reply.version, elastic, want_model=False)
        self.version = done.version
        if reply.stop or done.stop:
            link.stop()
