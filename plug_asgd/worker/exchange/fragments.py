"""Streaming DiLoCo's exchange (Douillard et al. 2025): the model split in fragments, each synced at a step of its
own, so that a round's bytes are spread over its inner steps instead of sent at once.

With ``F`` fragments and ``H`` inner steps, fragment ``f`` is pushed at the fit's local steps ``t`` where
``t = f * H // F`` modulo ``H`` (fragment 0 at ``H``, ``2H``, ...; the others in between). A push carries
``w_f - base_f``, fragment ``f``'s pseudo-gradient, through the codec as any push; it is sent from a thread while
the inner steps go on, and its reply is merged after the first step that ends with it arrived (at the latest when
the next fragment is due, or before anything else is asked of the PS): ``w_f = central_f + (w_f - w_f_at_send)``,
``base_f = central_f``. So a fragment trains on a central model its round trip's steps late, the paper's overlap
``tau``, and not ``H / F`` steps late. The other fragments' weights and bases are left as they are. Each fragment's
base is the central model of the version its last reply carried, and its pushes say that version: the PS's rule
(:class:`~plug_asgd.modes.diloco.DiLoCoRule`) takes a push as current where no round changed its tensors since.

A push asks for its own tensors only (``want_model="pushed"``): its reply carries the fragment, ``1/F`` of the
model, and leaves the client's held model as it was; a reply ahead (async_diloco's ``momentum_lookahead``) costs
the fragment too. With one fragment (the modes' ``overlap=True``) the whole model is pushed every ``H`` steps this
way: a push's round trip goes on beside the inner steps instead of stopping them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from plug_asgd.compressors import NoCompression
from plug_asgd.modes import PushMode
from plug_asgd.protocol.wire import Sparse
from plug_asgd.worker.exchange.in_flight import InFlight
from plug_asgd.worker.exchange.push import PushExchange
from plug_asgd.worker.model_reply import ModelReply

TRACE = 64  # the pushes a worker's ``fragment_trace`` keeps: (the fit's local step, the fragment)


def split(sizes: Mapping[str, int], fragments: int) -> list[list[str]]:
    """The synced tensors in ``fragments`` groups of whole tensors and about equal sizes: each tensor, in order,
    goes to the group of the fewest elements so far (the lowest-numbered of equals). The groups' sizes then differ
    by at most the largest tensor's, and consecutive layers fall in different groups, as the paper's strided
    fragments do (its layers ``f, f + F, f + 2F, ...``). Deterministic: every worker makes the same groups.

    Args:
        sizes: each tensor's number of elements, by name, in the synced tensors' order (the module's named
            parameters, then its floating-point buffers: :func:`plug_asgd.worker.tensors.synced_tensors`).
        fragments: the number of groups.

    Raises:
        ValueError: where ``fragments`` is below 1, or a group would be empty (fewer tensors than groups).
    """
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    groups: list[list[str]] = [[] for _ in range(fragments)]
    loads = [0] * fragments
    for name, size in sizes.items():
        f = min(range(fragments), key=lambda i: (loads[i], i))
        groups[f].append(name)
        loads[f] += size
    if not all(groups):
        raise ValueError(f"fragments={fragments}: the model has {len(sizes)} tensors to sync ({sum(map(bool, groups))}"
                         " fragments would hold any); choose at most that many fragments")
    return groups


def offsets(period: int, fragments: int) -> list[int]:
    """Each fragment's step within a period of ``period`` local steps: ``f * period // fragments``.

    Args:
        period: the inner steps between two syncs of a fragment.
        fragments: the number of fragments.
    """
    return [f * period // fragments for f in range(fragments)]


class FragmentExchange(PushExchange):
    """Streaming DiLoCo's fragments, each pushed at its staggered step from a thread and merged once its reply came.

    One request at a time on the socket: a push waits for the one before it (its reply merged) first. A flush (the
    end of a fit, before evaluating) merges the push in flight, then pushes every fragment with steps not yet
    pushed, one after the other, each merged at once: every fragment's base is then the central one.

    Args:
        mode: the configured mode (diloco or async_diloco), with ``inner_steps`` and ``fragments``.
        **kwargs: :class:`~plug_asgd.worker.exchange.base.Exchange`'s keyword arguments (codec, compensation,
            shm_pushes).
    """

    def __init__(self, mode: PushMode, **kwargs: Any) -> None:
        super().__init__(mode, **kwargs)
        self.fragments: list[list[str]] = []  # the tensors of each fragment, by name (made at the join)
        self.fragment_versions: list[int] = []  # the central version each fragment's base is
        self.pushed_at: list[int] = []  # the fit's local step of each fragment's last push
        self.fit_step = 0  # the fit's local steps
        self.next_fragment = 0
        self.countdown = 0  # local steps until the next fragment is due
        self.fragment_pushes = 0
        self.fragment_trace: list[tuple[int, int]] = []
        self.overlapped_steps = 0

    @property
    def count(self) -> int:
        """The fragments: the mode's ``fragments``."""
        return int(getattr(self.mode, "fragments", 1))

    @override
    def start_fit(self, optimizers: list[Any], rank: int, world_size: int) -> None:
        super().start_fit(optimizers, rank, world_size)
        self.fit_step = 0
        self.fragments = []

    @override
    def join(self, init: bool) -> None:
        super().join(init)
        if not self.fragments:
            tensors = self._link.tensors()
            self.fragments = split({n: t.numel() for n, t in tensors.items()}, self.count)
        self.pushed_at = [self.fit_step] * self.count
        self.next_fragment = 1 % self.count
        self.countdown = self.gap(0)

    def gap(self, fragment: int) -> int:
        """The local steps from ``fragment``'s push to the next fragment's, at this worker's period (inner_steps, or
        async_diloco's shortened one).

        Args:
            fragment: the fragment pushed last.
        """
        starts = [*offsets(self.steps_per_push, self.count), self.steps_per_push]
        return max(1, starts[fragment + 1] - starts[fragment])

    @override
    def load(self, reply: ModelReply, ahead: bool = False) -> None:
        super().load(reply, ahead)
        self.base_is_central = False  # (a push's base is its fragment's: never an "own" reply)
        self.fragment_versions = [reply.version] * self.count

    @override
    def step(self, run: Callable[[], Any], optimizer: Any) -> Any:
        if self.pending is not None and self.pending[0].thread.is_alive():
            self.overlapped_steps += 1  # this step computes while a fragment is on its way
        return super().step(run, optimizer)

    @override
    def before_update(self) -> None:
        """Nothing: a fragment's reply is merged after a step, once it came (:meth:`after_step`)."""

    @override
    def after_step(self) -> None:
        if self.pending is not None and not self.pending[0].thread.is_alive():
            running = self.gap(last := (self.next_fragment - 1) % self.count)
            self.finish()  # the reply came during this step: merged now, not when the next fragment is due
            self.countdown += self.gap(last) - running  # its pace (async_diloco's) sets the length of this gap too
        self.fit_step += 1
        self.countdown -= 1
        if self.countdown <= 0:
            fragment = self.next_fragment
            self.push_fragment(fragment)
            self.next_fragment = (fragment + 1) % self.count
            self.countdown = self.gap(fragment)

    @override
    def send(self) -> None:
        """Push the fragment due next now."""
        self.push_fragment(self.next_fragment)

    @override
    def flush(self) -> None:
        """Merge the push in flight, then push each fragment with steps not pushed yet, in the order they fall due
        (every worker in the same order), each merged before the next."""
        self.finish()
        if not (self._link.fitting and self.joined and self.fragments):
            return
        for k in range(self.count):
            fragment = (self.next_fragment + k) % self.count
            if self.pushed_at[fragment] < self.fit_step:
                self.push_fragment(fragment)
                self.finish()

    def push_fragment(self, fragment: int) -> None:
        """Merge the push in flight, then send fragment ``fragment``'s ``w_f - base_f`` (encoded) from a thread.

        Args:
            fragment: the fragment to push.
        """
        self.finish()  # one request at a time on the socket
        names = self.fragments[fragment]
        tensors = self._link.tensors()
        with torch.no_grad():  # the fragment's weights as sent, and its pseudo-gradient: kept until the reply only
            sent = {n: tensors[n].detach().clone() for n in names}
            deltas = {n: torch.sub(sent[n], self.base[n]) for n in names}
        update: dict[str, Any] = self.staging.to_host(deltas)
        if not isinstance(self.encoder, NoCompression):
            for name in names:
                update[name] = self.encoder.encode(name, update[name])
                if isinstance(update[name], Sparse):
                    self.compensator.mask(self.optimizers, tensors[name], update[name].indices)
        base, client, sent_at, rate = self.fragment_versions[fragment], self._link.client, self.version, self.rate()
        push = InFlight(lambda: client.push(base, update, want_model="pushed", ahead=self.asks_ahead, rate=rate))
        self.pending = (push, lambda: self.merge(push, fragment, sent, sent_at))
        self.pushed_at[fragment] = self.fit_step
        self.since_push = 0
        self.fragment_pushes += 1
        if len(self.fragment_trace) < TRACE:
            self.fragment_trace.append((self.fit_step, fragment))

    def merge(self, push: InFlight, fragment: int, sent: dict[str, Tensor], sent_at: int) -> None:
        """Take a fragment's reply: ``w_f = central_f + (w_f - w_f_at_send)``, ``base_f = central_f``.

        Args:
            push: the fragment's push in flight.
            fragment: the fragment it carried.
            sent: the fragment's weights as they were sent, by tensor.
            sent_at: the version this worker was at when it sent the push (its last reply's).

        Raises:
            RuntimeError: where the reply's model lacks a tensor of the fragment.
        """
        reply = push.answered()
        names = self.fragments[fragment]
        missing = [n for n in names if n not in reply.tensors]
        if missing:
            raise RuntimeError(f"the parameter server's reply lacks {missing[:5]}: is it serving another model?")
        self.count_staleness(reply, sent_at)  # (and async_diloco's pace: this worker's inner steps)
        tensors = self._link.tensors()
        with torch.no_grad():
            for name in names:
                tensors[name].sub_(sent[name])  # the progress since the push
            self.staging.load({n: self.base[n] for n in names}, reply.tensors)
            for name in names:
                tensors[name].add_(self.base[name])
        self.fragment_versions[fragment] = reply.version
        self.based_on(reply, central=False)

    @override
    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "overlapped_steps": self.overlapped_steps, "fragment_pushes": self.fragment_pushes,
                "fragment_trace": list(self.fragment_trace)}
