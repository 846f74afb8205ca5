"""The push exchange: ``w - w_base`` every ``push_every`` local steps, the central model in the reply."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from plug_asgd.modes import PushMode
from plug_asgd.protocol.wire import Sparse
from plug_asgd.worker.client import PSUnreachableError
from plug_asgd.worker.exchange.held_base import CENTRAL, RESIDUAL, HeldBase, HeldPush, host_arrays
from plug_asgd.worker.exchange.held_device import DeviceHeldBase, device_tensors, selects_on_device
from plug_asgd.worker.exchange.in_flight import InFlight
from plug_asgd.worker.exchange.update_making import UpdateMaking
from plug_asgd.worker.model_reply import ModelReply

LET_GO_S = 5.0  # how long a stage's end waits for a push in flight after a failure


class PushExchange(UpdateMaking):
    """Pushes the update (encoded by the mode's codec) and takes the central model, or its own "own" reply.

    A dense float32 update is made in buffers kept across pushes (in memory the PS maps, where it
    offers that: ``shm_pushes``); a worker that nothing raced pushes its weights instead (see
    ``PSClient.push(weights=True)``). Between pushes, a pull every ``pull_every`` steps keeps the
    progress not yet pushed (DOWNPOUR's fetch).

    Args:
        mode: the configured mode, with its push and pull periods.
        **kwargs: :class:`~plug_asgd.worker.exchange.base.Exchange`'s keyword arguments (codec, compensation,
            shm_pushes).
    """

    mode: PushMode
    # where pushes from the held base work: None, where the tensors are (True: on the device path for CPU tensors
    # too, as the tests run it)
    held_on_device: bool | None = None

    def __init__(self, mode: PushMode, **kwargs: Any) -> None:
        super().__init__(mode, **kwargs)
        # whether the next push may send the weights themselves: in the modes whose PS can take them, until
        # it answers that another push came first; again after an "own" reply
        self.weights_ok = mode.folds_into_update
        self.own_guesses = [0, 0]  # models of an "own" reply made while waiting for it; of those, answered "own"
        # whether an encoded update is pushed from the central model the client holds, on the host or the device
        self.held_host, self.held_device = HeldBase(), DeviceHeldBase()
        # whether the last push from the held base was answered "own": the next one is then taken after the next
        # step's backward (its weights stay as they are); after a raced one, before that step
        self.held_answered_own = True
        # a push sent by a thread of its own (of weights, or from the held base) and how its reply is taken
        self.pending: tuple[InFlight, Callable[[], None]] | None = None

    @override
    def after_step(self) -> None:
        if self.pending is not None and isinstance(push := self.pending[0], HeldPush) and push.guessed:
            self.finish()  # the reply the optimizer's step went without (before_update), before what is due
        if self.since_push >= self.steps_per_push:
            self.send()
        elif self.mode.pull_every is not None and self.since_pull >= self.mode.pull_every:
            self.pull_keeping_progress()

    @override
    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "own_guesses": self.own_guesses[0], "own_guesses_right": self.own_guesses[1],
                "held_base_pushes": self.held_host.pushes + self.held_device.pushes,
                "held_base_raced": self.held_host.raced + self.held_device.raced}

    @property
    @override
    def lookahead(self) -> bool:
        """Where a worker pushes every step; and in agn where its optimizers normalize their steps (Adam's): with
        several local steps per push the look-ahead extrapolates what a heavy ball's momentum already carries, but
        normalized steps take no Nesterov's form, and agn's chunks under Adam ended closer to DDP with it
        (docs/momentum.md, "agn's chunks at 4 workers")."""
        one_step = self.mode.push_every == 1 and self.mode.pull_every is None
        return one_step or (self.mode.normalize and self.normalized_steps)

    @override
    def send(self) -> None:
        """Send ``w - w_base`` (over the steps it spans, for agn/sagn); take the central model if a pull is due."""
        self.finish()  # the push in flight first: one request at a time
        link = self._link
        tensors = link.tensors()
        want_model = self.mode.pull_every is None or self.since_pull >= self.mode.pull_every
        cheap_refusal = self.shares_pushes and link.client.shares_memory  # else a lone worker's only
        if (want_model and self.weights_ok and link.client.takes_weights and self.base_is_central
                and self.dense(tensors) and self.scale() == 1.0 and (cheap_refusal or link.world_size == 1)
                and self.push_weights(tensors)):
            return
        found = self.held_base_for(tensors, want_model)
        if found is not None:
            self.push_from_held(tensors, found)
            return
        self.push_update(tensors, want_model)

    def push_update(self, tensors: dict[str, Tensor], want_model: bool) -> None:
        """Push ``w - w_base`` (encoded) from the exchange's own base, and take the reply.

        Args:
            tensors: the worker's parameters and buffers, by name.
            want_model: whether the reply should carry the central model (a pull is due); without it the worker
                keeps training from its own weights.
        """
        link = self._link
        self.leave_held_base()
        update, deltas, exact = self.update(tensors)
        self.since_push = 0
        base = self.version
        # not while the PS may still hold our base as its model (lent): the guess would write it during the push
        ask_own = want_model and exact and not self.base_lent

        def own_model() -> None:
            """The model an "own" reply means, base + update: the same float32 additions as the PS's."""
            with torch.no_grad():
                for name, t in tensors.items():
                    self.base[name].add_(deltas[name])
                    t.copy_(self.base[name])

        # Made while the PS folds the same sum, where the last push was answered "own" too. Where it was not
        # (another worker raced it), this one will most likely not be either: the whole model comes, and
        # replaces base and weights alike, so the guess would be two passes over the model for nothing,
        # on cores the PS and the other workers need.
        guess = ask_own and self.weights_ok
        reply = link.client.push(base, update, want_model="unless_own" if ask_own else want_model,
                                 while_waiting=own_model if guess else None, scaled_for=self.scaled_for(),
                                 ahead=self.asks_ahead, rate=self.rate())
        self.count_staleness(reply, base)
        self.own_guesses[0] += guess
        self.own_guesses[1] += guess and reply.own
        self.weights_ok = reply.own  # nothing raced this push: the next may well be a lone one too
        if reply.own:  # the central model is base + update
            if not guess:
                own_model()
            self.based_on(reply)
        elif want_model:
            self.load(reply, ahead=True)
        else:  # what was pushed is the PS's now; keep training from our own weights
            for name, t in tensors.items():
                self.base[name].copy_(t.detach())
            self.based_on(reply, central=False)

    def push_weights(self, tensors: dict[str, Tensor]) -> bool:
        """Push ``w`` itself, from a thread of its own (its reply is taken before the next step writes the weights,
        :meth:`settle_weights`); False, with nothing sent, where the buffers it goes from are not ready.

        For a lone worker the PS's new model is then ``w``, bit for bit: no ``w - base`` to
        compute here, no ``base + delta`` there and again here. ``w`` is copied into the update
        buffers (the PS reads them, or the socket sends them, while ``w`` is free to change), and
        on an "own" reply those buffers become the base: no copy back.

        Args:
            tensors: the worker's parameters and buffers, by name (dense float32).
        """
        if not self.buffers_fit(tensors, self.delta_buffers):
            self.delta_buffers = self.new_delta_buffers(tensors)
        sent = self.delta_buffers
        with torch.no_grad():
            for name, t in tensors.items():
                sent[name].copy_(t.detach())
        base, lend, client = self.version, self.shares_pushes, self._link.client
        host, copied = self.staging.copy_out(sent, shared=True)  # on a GPU: waited for by the push's thread

        def push_when_copied() -> ModelReply:
            copied()
            return client.push(base, host, want_model="unless_own", weights=True, lend=lend)

        push = InFlight(push_when_copied)
        self.pending = (push, lambda: self.settle_weights(push, sent, base, lend))
        self.since_push = 0
        return True

    def settle_weights(self, push: InFlight, sent: dict[str, Tensor], base: int, lend: bool) -> None:
        """Take the reply to a push of weights: "own" (the weights sent are the base now), the whole model, or
        "not_current" (another push came first, nothing was folded: ``w - base`` is pushed now instead).

        Args:
            push: the push of weights in flight.
            sent: the buffers the weights were sent from, which become the base on an "own" reply.
            base: the central version the push was based on.
            lend: whether the PS may keep ``sent`` as its model until it answers this worker again.
        """
        reply = push.answered()
        if reply.status == "not_current":  # nothing folded: the same progress goes as an update (the weights have
            self.weights_ok = False        # not changed since: the optimizer writes them after this)
            self.base_lent = False
            self.push_update(self._link.tensors(), want_model=True)
            return
        self.count_staleness(reply, base)
        if reply.own:  # the PS's model is what we sent: it is our base now
            self.delta_buffers, self.base = self.base, sent
            self.based_on(reply)
            # lent: the PS may keep these buffers as its model until it answers our next push or pull;
            # nothing writes the base before such an answer but the guess of an "own" reply, which waits
            self.base_lent = lend
        else:  # the PS had stopped, or held the reply (ssp) while others pushed: the whole model came
            self.load(reply)

    # -- pushing from the held central model (plug_asgd.worker.exchange.held_base) -------------------------

    def held_base_for(self, tensors: dict[str, Tensor], want_model: bool) -> tuple[HeldBase, str, dict] | None:
        """The held base this push goes from (its arrays, ``RESIDUAL`` or ``CENTRAL``, and the weights it
        works on), or None for the exchange's own: an encoded update, a pull due, the client holding the
        central model of our version, and the worker's pushes landing on the version they were based on (its
        staleness estimate 0: nothing to scale or look ahead for); never where pushes ask for a model ahead
        (:attr:`asks_ahead`), which the held central model is not. Float32 CPU tensors as numpy views; on a
        GPU, where the codec selects the top of the difference and keeps its residual in the model, the tensors
        themselves (:mod:`.held_device`).

        Args:
            tensors: the worker's parameters and buffers, by name.
            want_model: whether the reply should carry the central model (a pull is due).
        """
        held = getattr(self._link.client, "held", None)
        if (not want_model or self.asks_ahead or self.dense(tensors) or held is None or held.model_id is None
                or not held.exact or held.version != self.version or not tensors.keys() <= held.tensors.keys()
                or self.scale() != 1.0 or self.compensator.staleness > 0):
            return None
        kind = RESIDUAL if self.pending_residual() is not None else CENTRAL
        on_device = self.held_on_device
        if on_device is None:
            on_device = any(t.device.type != "cpu" for t in tensors.values())
        if on_device:
            weights = device_tensors(tensors)
            usable = weights is not None and kind == RESIDUAL and selects_on_device(self.encoder)
            return (self.held_device, kind, weights) if usable else None  # type: ignore[return-value]
        arrays = host_arrays(tensors)
        return (self.held_host, kind, arrays) if arrays is not None else None

    @property
    def held(self) -> HeldBase:
        """The held base pushed from (host or device), or the host's when none is."""
        return self.held_device if self.held_device.kind is not None else self.held_host

    def push_from_held(self, tensors: dict[str, Tensor], found: tuple[HeldBase, str, dict]) -> None:
        """Push ``w - c`` (encoded), ``c`` the central model the client holds, from a thread of its own
        (:class:`HeldPush`); the next step's forward and backward compute meanwhile, and the reply is taken before
        its optimizer writes the weights (:meth:`before_update`).

        Args:
            tensors: the worker's parameters and buffers, by name.
            found: what :meth:`held_base_for` returned: the held base, its kind and the weights it works on.
        """
        held, kind, weights = found
        if held is not self.held:
            self.leave_held_base()
        client = self._link.client
        central = client.held.lend()  # type: ignore[union-attr]
        residual = self.pending_residual() or (lambda name: None)
        held.enter(kind, weights, self.base, central, residual, client.held.version)  # type: ignore[union-attr]
        push = HeldPush(held, self.encoder, client, weights, central,  # type: ignore[arg-type]
                        self.version, self.scaled_for(), mask=self.mask_update if held is self.held_host else None,
                        rate=self.rate())
        self.pending = (push, lambda: self.settle_held(push))
        self.since_push = 0
        if not self.held_answered_own and not self.overlaps:
            self.finish()  # the last one was raced: this one's reply may change the weights before the next step

    @property
    def overlaps(self) -> bool:
        """Whether a reply is taken after the next step by design (``overlap``), not before it."""
        return False

    def settle_held(self, push: HeldPush) -> None:
        """Take the reply to a push from the held base: the momentum masked where it was sent, the reply merged
        (:meth:`HeldPush.settle`), its staleness counted and its version the base's.

        Args:
            push: the push from the held base in flight.
        """
        self.mask_sent(push)
        reply = push.settle(self._link.client.held)  # type: ignore[union-attr]
        self.held_answered_own = reply.own
        self.count_staleness(reply, push.base)
        self.based_on(reply)
        if push.guessed:  # the weights were that model at the guess: the steps since are not pulled yet
            self.since_pull = self.local_steps - push.guessed_at

    def mask_sent(self, push: HeldPush) -> None:
        """Zero the optimizers' momentum where ``push``'s update was sent (once), before they step again.

        Args:
            push: the push from the held base whose sparse update says where.
        """
        push.wait_masked()  # its thread masks once the push is sent
        if not push.masked:
            push.masked = True
            self.mask_update(push.encoded())

    def mask_update(self, update: Mapping[str, Any]) -> None:
        """Zero the optimizers' momentum where the sparse tensors of ``update`` were sent.

        Args:
            update: an encoded update, by tensor name.
        """
        tensors = self._link.tensors()
        for name, sent in update.items():
            if isinstance(sent, Sparse):
                self.compensator.mask(self.optimizers, tensors[name], sent.indices)

    @override
    def before_update(self) -> None:
        """The push in flight, taken before the optimizer writes the weights; but where a push from the host's
        held base makes the weights the central model at an "own" reply (``CENTRAL``), they are made that model
        now (:meth:`HeldPush.guess_own`) and the reply is taken after the step (:meth:`after_step`), so that its
        round trip runs beside the optimizer's step."""
        pending = self.pending
        if pending is not None and isinstance(push := pending[0], HeldPush) and push.held is self.held_host:
            if self.held_host.kind == CENTRAL and push.guess_own(self.local_steps):
                self.mask_sent(push)
                return
        self.finish()

    @override
    def finish(self) -> None:
        """Take the reply of the push in flight, if any."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending[1]()

    @override
    def flush(self) -> None:
        super().flush()
        self.finish()  # a push flush() made from a thread is answered before anything else

    def leave_held_base(self) -> None:
        """Back to the exchange's own base (before anything else reads or changes the weights or the held model:
        a pull, a load, a push of another kind)."""
        held = self.held
        if held.kind is not None:
            tensors = self._link.tensors()
            weights = device_tensors(tensors) if held is self.held_device else host_arrays(tensors)
            assert weights is not None
            held.leave(weights, self.base, self._link.client.held.tensors,  # type: ignore[union-attr]
                       getattr(self.encoder, "set_pending", None))

    @override
    def load(self, reply: ModelReply, ahead: bool = False) -> None:
        self.leave_held_base()
        super().load(reply, ahead)

    @override
    def refresh(self) -> None:
        self.flush()
        self.leave_held_base()
        super().refresh()

    @override
    def leave(self) -> None:
        self.flush()
        self.leave_held_base()
        super().leave()

    @override
    def central_state(self, state: dict[str, Any]) -> dict[str, Any]:
        self.finish()
        self.leave_held_base()
        return super().central_state(state)

    @override
    def let_go(self) -> None:
        """After a failure the socket is the push's in flight until it is done: wait a little, then give up.

        Raises:
            PSUnreachableError: where the push in flight is not done within ``LET_GO_S`` seconds.
        """
        pending, self.pending = self.pending, None
        if pending is not None:
            pending[0].thread.join(LET_GO_S)
            if pending[0].thread.is_alive():
                raise PSUnreachableError("a push is still in flight")

    def pull_keeping_progress(self) -> None:
        """DOWNPOUR's fetch: ``w = central + (w - w_base)``, so steps not yet pushed are not lost."""
        self.finish()  # a push whose reply waits for the next push (before_update): one request at a time
        self.leave_held_base()
        reply = self._link.client.pull()
        tensors = self._link.tensors()
        with torch.no_grad():  # the weights hold the pending steps while the base becomes the central model
            for name, t in tensors.items():
                t.sub_(self.base[name])
            self.staging.load({n: self.base[n] for n in tensors}, reply.tensors)
            for name, t in tensors.items():
                t.add_(self.base[name])
        self.based_on(reply)
