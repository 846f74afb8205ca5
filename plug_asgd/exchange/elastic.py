"""The elastic exchange of EASGD and EAMSGD: worker and center pulled towards each other."""

from __future__ import annotations

import torch

from plug_asgd.exchange.base import Exchange
from plug_asgd.modes import EASGD
from plug_asgd.tensors import to_numpy


class ElasticExchange(Exchange):
    """Every ``tau`` local steps: ``e = alpha * (w - center)``; the worker steps ``-e``, the center ``+e`` (pushed)."""

    mode: EASGD

    def after_step(self) -> None:
        if self.since_push >= self.mode.tau:
            self.send()

    def send(self) -> None:
        link = self._link
        reply = link.client.pull()
        elastic = {}
        for name, t in link.tensors().items():
            center = torch.as_tensor(reply.tensors[name], dtype=t.dtype, device=t.device).reshape(t.shape)
            e = self.mode.alpha * (t.detach() - center)
            with torch.no_grad():
                t.sub_(e)
            elastic[name] = self.encoder.encode(name, to_numpy(e))
        self.since_push = 0
        done = link.client.push(reply.version, elastic, want_model=False)
        self.version = done.version
        if reply.stop or done.stop:
            link.stop()
