"""The overlapped push: each update sent by a background thread while the next step computes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from typing_extensions import override

from plug_asgd.modes import APPLIED, PushMode
from plug_asgd.worker.client import PSUnreachableError
from plug_asgd.worker.compensation import keeps_momentum
from plug_asgd.worker.exchange.held_base import RESIDUAL, HeldPush
from plug_asgd.worker.exchange.push import LET_GO_S, PushExchange
from plug_asgd.worker.model_reply import ModelReply
from plug_asgd.worker.tensors import assign


class OverlapExchange(PushExchange):
    """``overlap``: the push of ``push_every`` steps goes out from a thread; its reply is merged when the
    next push is due, keeping the progress made meanwhile (``w = central + (w - w_at_send)``).

    losp's rounds (``Mode.compensate == "round"``), where an optimizer keeps momentum: each worker keeps
    only its own share of that progress (``w = central + p / R``, ``R`` the updates a round averages, its
    own share of the round in flight) and sends all of it, scaled by 1/2 (each round lands one round
    late). Keeping it whole, each worker's model runs ahead of the central one by its own progress and
    the workers' differences are never averaged away: with momentum SGD they grow from round to round
    (docs/momentum.md).

    Args:
        mode: the configured mode, with its push period (and, for losp, the updates a round averages).
        **kwargs: :class:`Exchange`'s keyword arguments (codec, compensation, shm_pushes).
    """

    def __init__(self, mode: PushMode, **kwargs: Any) -> None:
        super().__init__(mode, **kwargs)
        self.in_flight: threading.Thread | None = None
        self.result: dict[str, Any] = {}
        self.overlapped_steps = 0
        self.trace: list[tuple[float, float | None, float]] = []
        self.share = 1.0  # of the progress made while a round was in flight, what the weights keep
        # the version of the held central model that the base is, plus the codec's residual, after a merge (else
        # None): the next merge may then touch only what the reply changed (_merge_changes)
        self.merged_from: int | None = None
        self.spare: dict[str, torch.Tensor] = {}  # buffers for the next copy of the weights sent
        self.merges_of_changes = 0  # replies merged at the coordinates they changed only

    @override
    def start_fit(self, optimizers: list[Any], rank: int, world_size: int) -> None:
        super().start_fit(optimizers, rank, world_size)
        replicas = getattr(self.mode, "replicas_to_aggregate", None) or world_size
        # with one step per round (osp's form) the share diverges at 4 workers, the progress kept whole does not
        rounds = self.mode.compensate == "round" and self.compensator.scale and self.mode.push_every > 1
        momentum = not optimizers or any(keeps_momentum(o) for o in optimizers)
        self.share = 1.0 / replicas if rounds and momentum and replicas > 1 else 1.0

    @override
    def scale(self) -> float:
        if self.mode.compensate != "round":
            return super().scale()
        return 0.5 if self.share < 1.0 else 1.0  # a round lands one round late: 1 / (1 + 1)

    @override
    def scaled_for(self) -> float | None:
        return None if self.mode.compensate == "round" else super().scaled_for()

    @override
    def step(self, run: Callable[[], Any], optimizer: Any) -> Any:
        if self.in_flight is not None:
            if self.result.get("next_step_at") is None:
                self.result["next_step_at"] = time.monotonic()
            if self.in_flight.is_alive():
                self.overlapped_steps += 1  # this step computes while the last update is on its way
        elif self.pending is not None and self.pending[0].thread.is_alive():
            self.overlapped_steps += 1  # ... a push from the held base (plug_asgd.worker.exchange.held_base)
        return super().step(run, optimizer)

    @override
    def after_step(self) -> None:
        if self.since_push >= self.mode.push_every:
            self.push_overlapped()

    @override
    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "overlapped_steps": self.overlapped_steps, "overlap_trace": list(self.trace),
                "merges_of_changes": self.merges_of_changes}

    def push_overlapped(self) -> None:
        """Finish the push in flight, then send this update from a background thread."""
        self.finish()
        tensors = self._link.tensors()
        found = self.held_base_for(tensors, True) if self.share == 1.0 else None
        if found is not None and found[1] == RESIDUAL:
            self.push_from_held(tensors, found)  # its reply is taken at the next push, as any here
            return
        self.leave_held_base()
        update, deltas, exact = self.update(tensors)
        scaled_for = self.scaled_for()
        # what the reply's model is merged with: the weights sent, unless the PS answers "own"
        sent = None if exact else self.copy_of(tensors)
        client, base, result = self._link.client, self.version, self.result
        result.clear()

        def send() -> None:
            try:
                result["reply"] = client.push(base, update, want_model="unless_own" if exact else True,
                                              scaled_for=scaled_for)
            except BaseException as exc:  # re-raised in the training thread
                result["error"] = exc
            result["done_at"] = time.monotonic()

        result["sent"], result["deltas"], result["base"] = sent, deltas, base
        result["scaled"] = self.scale() != 1.0
        result["sent_at"], result["next_step_at"] = time.monotonic(), None
        self.since_push = 0
        self.in_flight = threading.Thread(target=send, name="plug_asgd-sender", daemon=True)
        self.in_flight.start()

    @override
    def finish(self) -> None:
        """Take the reply of the push in flight: ``w = central + (w - w_at_send)`` keeps the steps made since."""
        super().finish()  # a push from the held base
        thread, self.in_flight = self.in_flight, None
        if thread is None:
            return
        thread.join()
        result = self.result
        if "error" in result:
            raise result["error"]
        reply, sent = result["reply"], result["sent"]
        self.count_staleness(reply, result["base"])  # the compensation's estimate and the counters, as a push's
        self._trace(result)
        if reply.own:  # central = base + what was sent: the weights sent plus the progress are the weights now
            with torch.no_grad():
                for name, delta in result["deltas"].items():
                    self.base[name].add_(delta)
        else:
            if sent is None:  # an "own" push raced, or duplicate: merge with the weights sent, base + delta
                sent = {n: self.base[n] + d for n, d in result["deltas"].items()}
            tensors = self._link.tensors()
            share = self.share
            pending = self.pending_residual()
            changes_only = (pending is not None and share == 1.0 and not result["scaled"]
                            and reply.status == APPLIED and reply.changed is not None
                            and reply.changed.since == self.merged_from)
            if not (changes_only and self._merge_changes(tensors, sent, reply, pending)):
                self.spare = sent
                self._merge(tensors, sent, reply, share, pending)
        self.based_on(reply)
        if not reply.own and (self.share != 1.0 or pending is not None):
            self.base_is_central = False
            if self.share == 1.0:
                self.merged_from = reply.version  # the base is the held central model plus the residual

    def _trace(self, result: dict[str, Any]) -> None:
        if len(self.trace) < 20:  # (sent, next step started, reply received): the overlap, measured
            self.trace.append((result["sent_at"], result["next_step_at"], result["done_at"]))

    def _merge(self, tensors: dict[str, torch.Tensor], sent: dict[str, torch.Tensor], reply: ModelReply,
               share: float, pending: Callable[[str], Any] | None) -> None:
        """``w = central (+ r) + share * (w - sent)``, ``base = central (+ r) - (1 - share) p``, over every tensor."""
        with torch.no_grad():  # the weights hold the progress p while the base becomes the central model
            for name, t in tensors.items():
                t.sub_(sent[name])
            self.staging.load({n: self.base[n] for n in tensors}, reply.tensors)
            for name, t in tensors.items():
                base = self.base[name]
                if share != 1.0:  # base = central - (1 - share) p: the next update, w - base, is all of p
                    base.add_(t, alpha=share - 1.0)
                residual = pending(name) if pending is not None else None
                if residual is not None:  # what the codec holds back stays in the model, as load() keeps it
                    base.add_(torch.as_tensor(residual, device=base.device).view(base.shape).to(base.dtype))
                t.add_(base)  # central (+ the residual) + share * p

    @override
    def based_on(self, reply: ModelReply, central: bool = True) -> None:
        super().based_on(reply, central)
        self.merged_from = None  # whatever the base is now, a merge that follows takes the whole model

    def copy_of(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights as they are sent, in buffers kept from an earlier merge where they fit.

        Args:
            tensors: the worker's parameters and buffers, by name; only read.
        """
        out = {}
        with torch.no_grad():
            for name, t in tensors.items():
                buf = self.spare.pop(name, None)
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
                    out[name] = t.detach().clone()
                else:
                    out[name] = buf.copy_(t.detach())
        self.spare = {}
        return out

    def _merge_changes(self, tensors: dict[str, torch.Tensor], sent: dict[str, torch.Tensor], reply: ModelReply,
                       pending: Callable[[str], Any]) -> bool:
        """The merge ``w = central + r + (w - sent)``, ``base = central + r``, where only the coordinates the
        reply changed need work; False (nothing done) where it cannot be done so.

        The base was the held central model plus the residual (``r_old``) at the last merge, and the update
        sent was ``w_sent - base``, which the codec added to ``r_old``, keeping ``r`` of it: so wherever the
        central model did not change (our push, applied, is among what changed), ``central + r`` is
        ``w_sent`` itself and ``w`` stays as it is. The weights sent become the base (no pass over the
        model); at the changed coordinates both take ``central + r``. Before this, a merge made four passes
        over every tensor (the subtraction, the load, the residual, the addition) at each push.
        """
        changed = reply.changed
        assert changed is not None
        if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                   and sent[name].is_contiguous() for name, t in tensors.items()):
            return False
        with torch.no_grad():
            for name, t in tensors.items():
                if name not in changed.indices:
                    continue  # unchanged at the PS: central + r is the weights sent
                base, central = sent[name], reply.tensors[name]
                residual = pending(name)
                indices = changed.indices[name]
                if indices is None:  # the tensor came whole
                    t.sub_(base)
                    assign(base, central)
                    if residual is not None:
                        base.add_(torch.from_numpy(residual).view(base.shape))
                    t.add_(base)
                    continue
                target = np.asarray(central).reshape(-1)[indices]  # a copy: fancy indexing
                if residual is not None:
                    target += np.asarray(residual).reshape(-1)[indices]
                # numpy views of the tensors (float32, contiguous, on the CPU): a few thousand coordinates cost
                # less there than in torch's indexing, whose overhead per call is several times numpy's
                flat, sent_flat = t.detach().numpy().reshape(-1), base.numpy().reshape(-1)
                flat[indices] = (flat[indices] - sent_flat[indices]) + target
                sent_flat[indices] = target
        self.merges_of_changes += 1
        old = self.base
        self.base = {**old, **sent}
        self.spare = {n: old[n] for n in sent if n in old}
        return True

    @property
    @override
    def overlaps(self) -> bool:
        return True

    @override
    def before_update(self) -> None:
        """A push from the held base is encoded before the optimizer writes the weights; its reply waits for the
        next push, as every reply here."""
        if self.pending is not None and isinstance(self.pending[0], HeldPush):
            self.mask_sent(self.pending[0])

    @override
    def let_go(self) -> None:
        """After a failure the socket is the sender's until it is done: wait a little, then give up on it.

        Raises:
            PSUnreachableError: where the push in flight is not done within ``LET_GO_S`` seconds.
        """
        super().let_go()
        sender, self.in_flight = self.in_flight, None
        if sender is not None:
            sender.join(LET_GO_S)
            if sender.is_alive():
                raise PSUnreachableError("a push is still in flight")
