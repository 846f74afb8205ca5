"""What every exchange shares: the central model a worker is based on, and how it takes a reply's model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from plug_asgd.compressors import Codec, Compressor, NoCompression
from plug_asgd.modes import Mode
from plug_asgd.worker.compensation import (
    OFF,
    Compensator,
    StalenessCompensation,
    keeps_momentum,
    nesterov_form,
    normalizes_steps,
    warn_no_nesterov_form,
    warn_unknown_optimizers,
)
from plug_asgd.worker.exchange.link import Link
from plug_asgd.worker.exchange.pace import StepClock
from plug_asgd.worker.model_reply import ModelReply
from plug_asgd.worker.staging import Staging

INIT_WAIT_S = 10.0  # how long a rank other than 0 waits for rank 0's model before offering its own


class Exchange(ABC):
    """How a worker trades its model with the PS: joining a stage, after each local step, and at its end.

    The base keeps the model the worker is based on (``base``, central version ``version``) and
    takes a reply's model; a subclass says what happens after a step (:meth:`after_step`) and what
    a flush sends (:meth:`send`).

    Args:
        mode: the configured mode; a fit runs it as :meth:`Mode.for_workers` makes it for its workers.
        codec: how pushed updates are encoded (None: no compression).
        compensation: the staleness remedies, as :func:`~plug_asgd.worker.compensation.resolve` gave them
            (default: none).
        shm_pushes: a worker on the PS's machine may push through shared memory the PS maps.
    """

    def __init__(self, mode: Mode, *, codec: Codec | None = None, compensation: StalenessCompensation = OFF,
                 shm_pushes: bool = True) -> None:
        self.mode = mode  # as configured; for a fit, as it runs with the fit's workers (start_fit)
        self.configured_mode = mode
        self.codec = codec if codec is not None else NoCompression()
        self.compensation = compensation
        self.shm_pushes = shm_pushes
        self.fit_codec = self.codec  # the codec this fit encodes with (Codec.for_fit, once its length is known)
        self.rank = 0
        self.encoder: Compressor = mode.encoder(self.codec, 0)
        self.compensator = Compensator(compensation, 0)
        self.correct = compensation.correct  # whether pushes say what they were scaled for (start_fit decides)
        self.normalized_steps = False  # every optimizer normalizes its steps, as Adam's (start_fit decides)
        self.optimizers: list[Any] = []
        self.link: Link | None = None
        self.joined = False
        self.version = 0
        self.since_push = 0
        self.since_pull = 0
        self.local_steps = 0
        self.staleness = [0, 0, 0]  # sum, count, max over this worker's applied pushes
        self.base: dict[str, Tensor] = {}
        # whether base holds the central model of version ``version`` bit for bit (not after a push answered
        # without the model, whose worker keeps its own weights): only then may a push ask for an "own" reply
        self.base_is_central = False
        self.base_lent = False  # the PS may hold our base buffers as its model (a lent push of weights)
        self.staging = Staging()  # the model to numpy and back: views on the CPU, pinned buffers on CUDA
        self.closure_runs = True  # the optimizers run their closure before they write the weights (step)
        self.closure_ran = False
        self.steps_per_push = getattr(mode, "push_every", None) or 1  # this worker's (async_diloco's dynamic steps)
        self.clock = StepClock()  # this worker's steps per second, which its pushes say where its mode paces them
        # whether its inner steps follow its speed over the fastest worker's (async_diloco's dynamic_steps): its
        # steps are then timed and its pushes say its steps per second (rate)
        self.paced = False

    # -- what the strategy calls ---------------------------------------------------------------------

    def attach(self, link: Link) -> None:
        """Start of a stage: the client and the worker's side of Lightning for it.

        Args:
            link: what the strategy hands the exchange for the stage.
        """
        self.link = link

    def start_fit(self, optimizers: list[Any], rank: int, world_size: int) -> None:
        """A fit begins: a fresh encoder (no residuals) and compensator, and the optimizers it steps.

        Args:
            optimizers: the LightningModule's optimizers, which decide the remedies (momentum, normalized steps).
            rank: this worker's global rank, which seeds the encoder.
            world_size: the number of workers: the fit's mode, and the staleness assumed before any push lands.
        """
        self.optimizers = optimizers
        self.mode = self.configured_mode.for_workers(world_size)
        self.steps_per_push = getattr(self.mode, "push_every", None) or 1
        self.paced = bool(getattr(self.mode, "dynamic_steps", False))
        self.clock.start()
        self.rank, self.fit_codec = rank, self.codec
        self.encoder = self.mode.encoder(self.codec, rank)
        self.normalized_steps = normalized = bool(optimizers) and all(normalizes_steps(o) for o in optimizers)
        # normalized steps (Adam's) stay about lr however stale: a push of one went in better unscaled, a push of
        # several (downpour's, a chunk landing on the others') better scaled (docs/momentum.md); losp's rounds keep
        # their own remedy
        chunks = self.mode.compensate == "full" and getattr(self.mode, "push_every", 1) > 1
        self.correct = self.compensation.correct and (not optimizers or any(keeps_momentum(o) for o in optimizers))
        # dynsgd's PS scales an unscaled push by its staleness: its worker scales only pushes it says it scaled
        scale = self.compensation.scale and (chunks or not normalized) and (
            self.correct or not self.mode.rule.scales_by_staleness)
        self.compensator = Compensator(self.compensation, world_size - 1, scale=scale)
        if self.compensation.mask_momentum and not isinstance(self.encoder, NoCompression):
            warn_unknown_optimizers(optimizers)
        if self.nesterov_form_here:
            warn_no_nesterov_form(optimizers)

    def fit_length(self, steps: float) -> tuple[Codec, float] | None:
        """The fit makes about ``steps`` local steps per worker (inf where unknown): where the codec's lag depends
        on the fit's length (randomk's), it encodes with the codec set for the pushes those steps make
        (:meth:`Codec.for_fit`), through a fresh encoder (called before the first push: no residual is lost);
        returns that codec and the pushes, or None where the length does not matter.

        Args:
            steps: the local steps per worker the fit is expected to make (``inf`` where unknown).
        """
        if self.codec.lag_pushes() is None:
            return None
        pushes = steps / getattr(self.mode, "push_every", 1)  # the fit's mode (Mode.for_workers)
        codec = self.codec.for_fit(pushes)
        if codec != self.fit_codec:
            self.fit_codec, self.encoder = codec, self.mode.encoder(codec, self.rank)
        return codec, pushes

    def join(self, init: bool) -> None:
        """Start of a stage: offer our weights if the PS has none yet (``init``), then take the central ones.

        Rank 0 offers at once; another rank first waits a little for rank 0's (``INIT_WAIT_S``), and
        offers its own only if none came (rank 0 slow to start, or gone).

        Args:
            init: whether the PS holds no model yet (its hello reply said so).
        """
        client = self._link.client
        reply = None
        if init and self._link.rank != 0:
            reply = client.pull_once_initialized(INIT_WAIT_S)
        if init and reply is None:
            client.init(self.staging.to_host(self._link.tensors()))
        self.load(reply if reply is not None else client.pull())
        self.joined = True

    def refresh(self) -> None:
        """Before evaluating: send what is pending, then take the central model. During a fit every worker takes
        the same one (a barrier between the pushes and the pulls): the metrics reduced across workers, and the
        checkpoint they rank, are then those of one model, as under DDP."""
        self.flush()
        self.wait_for_the_others()
        self.load(self._link.client.pull())

    def wait_for_the_others(self) -> None:
        """During a fit, before evaluating: every worker has stopped training (and pushed what it had)."""
        if self._link.fitting and self.joined:
            self._link.barrier("plug_asgd.evaluate")

    def closure(self, closure: Callable[..., Any]) -> Callable[..., Any]:
        """``closure`` (Lightning's forward and backward, which the optimizer runs before it writes the weights),
        followed by :meth:`before_update`: what the last exchange still does runs beside them.

        Args:
            closure: Lightning's closure, which the optimizer calls.
        """

        def then_update(*args: Any, **kwargs: Any) -> Any:
            out = closure(*args, **kwargs)
            self.closure_ran = True
            self.before_update()
            return out

        return then_update

    def before_update(self) -> None:  # noqa: B027 (a hook: only an exchange with work in flight waits here)
        """Between the backward pass and the optimizer's writing of the weights: what must be done by then."""

    def step(self, run: Callable[[], Any], optimizer: Any) -> Any:
        """Run the local optimizer step ``run``, then exchange with the PS if one is due.

        An optimizer that does not call its closure (:meth:`closure`) would write the weights while the last
        exchange may still read them: once one is seen, the exchange waits before each step instead.

        Args:
            run: takes the optimizer's step (Lightning's ``optimizer.step(closure)``); its result is returned.
            optimizer: the optimizer that steps, taken in Nesterov's form where the compensation says.
        """
        nesterov = self._link.fitting and self.nesterov_steps
        if not self.closure_runs or nesterov:  # (Nesterov's form reads the momentum before the step: masked first)
            self.before_update()
        self.closure_ran = False
        with nesterov_form(optimizer) if nesterov else nullcontext():
            out = run()
        if not self.closure_ran:
            self.closure_runs = False
            self.before_update()
        self.local_steps += 1
        if self.joined and self._link.fitting:
            self.since_push += 1
            self.since_pull += 1
            if self.paced:
                self.clock.stepped()
            self.after_step()
            if self.paced:
                self.clock.exchanged()
        return out

    def flush(self) -> None:
        """Send the steps not pushed yet (end of a fit, before evaluating)."""
        self.finish()
        if self._link.fitting and self.joined and self.since_push:
            self.send()

    def finish(self) -> None:  # noqa: B027 (a hook: only an overlapping exchange has a request in flight)
        """Wait for the request in flight, if any: the socket then serves one request at a time again."""

    def leave(self) -> None:
        """End of a fit that went well: everything pushed, no round waits for us, the final central model taken."""
        link = self._link
        self.flush()
        link.client.hello(link.stage, training=False)  # no sync round waits for us any more
        link.barrier("plug_asgd.fit_end")  # the final central model includes every worker
        self.load(link.client.pull())

    def let_go(self) -> None:  # noqa: B027 (a hook, as finish)
        """End of a stage, also after a failure: nothing of ours may be left using the socket."""

    def close(self) -> None:
        """At exit: release what the exchange holds outside this process (pinned shared memory; hogwild's file)."""
        self.staging.release()

    def central_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (a state dict) with the central tensors in place of this worker's.

        Args:
            state: the module's state dict, changed in place and returned.
        """
        self.finish()
        if self.joined:
            central = self._link.client.pull().tensors
            for name, t in self._link.tensors().items():
                state[name] = torch.tensor(central[name], dtype=t.dtype).reshape(t.shape)
        return state

    def stats(self) -> dict[str, Any]:
        """This worker's counters of the exchange (see ``AsyncPSStrategy.comm_stats``)."""
        total, count, worst = self.staleness
        return {"local_steps": self.local_steps, "version": self.version,
                "staleness_mean": total / count if count else 0.0, "staleness_max": worst,
                "overlapped_steps": 0, "overlap_trace": [], "merges_of_changes": 0, "own_guesses": 0,
                "own_guesses_right": 0}

    # -- what subclasses define -------------------------------------------------------------------

    @abstractmethod
    def after_step(self) -> None:
        """After a local step of a fit (``since_push``/``since_pull`` counted): push or pull if due."""

    @abstractmethod
    def send(self) -> None:
        """Send the steps made since the last push now."""

    # -- the model the worker is based on -------------------------------------------------------------

    @property
    def _link(self) -> Link:
        if self.link is None:
            raise RuntimeError("the exchange is not attached to a stage yet")
        return self.link

    @property
    def lookahead(self) -> bool:
        """Whether the compensation may compute the next step where the model is heading."""
        return False

    def rate(self) -> float | None:
        """The local steps per second a push says, where this worker is :attr:`paced` (None otherwise, or where
        no step was timed since the last push)."""
        return self.clock.rate() if self.paced else None

    @property
    def asks_ahead(self) -> bool:
        """Whether pushes ask for the central model less the step the PS's rule anticipates (async_diloco's
        ``momentum_lookahead``): the worker then trains its next round from that model and measures its update
        from it."""
        return bool(getattr(self.mode, "asks_ahead", False))

    @property
    def nesterov_steps(self) -> bool:
        """Whether heavy-ball steps go in Nesterov's form: while others race this worker (a lone one's staleness is
        0: it trains the bits of plain Lightning); beside the look-ahead only where the worker scales its updates
        (with a PS that scales each push by its own staleness alone, the form diverged on the regression case under
        load: docs/momentum.md, "dynsgd's floor")."""
        return self.nesterov_form_here and self.compensator.staleness > 0

    @property
    def nesterov_form_here(self) -> bool:
        """Whether this fit's compensation takes Nesterov's form at all (set at ``start_fit``)."""
        return self.compensator.config.nesterov and (self.compensator.scale or not self.lookahead)

    @property
    def local_residual(self) -> bool:
        """Whether the codec's residual goes into the worker's model (error feedback, not powersgd's)."""
        return bool(getattr(self.encoder, "local_residual", False))

    def pending_residual(self) -> Callable[[str], Any] | None:
        """The codec's residual by tensor name, where the compensation keeps it in the worker's model (error
        feedback but powersgd's), else None. A model taken from the PS gets it added: the central one plus what
        is not sent yet, so a lone worker's weights are plain SGD's (here, and in an overlapped push's merge)."""
        config = self.compensator.config
        return self.encoder.pending if config.active and config.local_residual and self.local_residual else None

    def load(self, reply: ModelReply, ahead: bool = False) -> None:
        """Take the reply's model as weights and base: the central one, or (``ahead``) where it is heading.

        Args:
            reply: the PS's reply, which carries the whole model.
            ahead: whether the compensation may put the model ahead (look-ahead, local residual), where active.

        Raises:
            RuntimeError: where the reply's model lacks a tensor of the worker's (another model's PS).
        """
        tensors = self._link.tensors()
        missing = sorted(set(tensors) - set(reply.tensors))
        if missing:
            raise RuntimeError(f"the parameter server's model lacks {missing[:5]}: is it serving another model? "
                               "Restart it, or point ps_address at the PS of this run")
        central = True
        if ahead and self.compensator.config.active:
            # where the model will be when our next update lands (a single local step per push only), plus
            # what the codec still holds back
            central = self.compensator.load(tensors, reply.tensors, reply.version, lookahead=self.lookahead,
                                            pending=self.pending_residual(),
                                            staging=self.staging)
        else:
            self.compensator.forget()
            self.staging.load(tensors, reply.tensors)
        for name, t in tensors.items():
            base = self.base.get(name)
            if base is None or base.shape != t.shape or base.device != t.device:
                self.base[name] = t.detach().clone()
            else:
                base.copy_(t.detach())
        self.based_on(reply)
        self.base_is_central = central and not (reply.approx or reply.ahead)

    def based_on(self, reply: ModelReply, central: bool = True) -> None:
        """``base`` is now version ``reply.version``: the central model itself, unless ``central`` is False.

        Args:
            reply: the PS's reply the base now stands for; its ``stop`` stops the fit.
            central: whether ``base`` is the central model of that version (False: the worker's own weights).
        """
        self.base_is_central = central and not (reply.approx or reply.ahead)  # near the central model, or ahead
        self.base_lent = False  # whatever the PS held of ours, it gave back before this reply
        self.version = reply.version
        if central:
            self.since_pull = 0
        if reply.stop:
            self._link.stop()

    def count_staleness(self, reply: ModelReply, base: int) -> None:
        """Count an applied push's staleness into the compensator's estimate and this worker's counters, and take
        the pace its reply says as this worker's inner steps (where :attr:`paced`).

        Args:
            reply: the PS's reply to the push; only an ``applied`` one counts.
            base: the central version the push was based on.
        """
        if reply.status == "applied":
            since = getattr(reply.version, "since", None)  # a sharded PS's versions count it per shard
            staleness = since(base) if since is not None else reply.version - base - 1
            self.compensator.observe(staleness)
            if self.paced and reply.pace is not None:  # async_diloco: its speed over the fastest's sets its steps
                self.steps_per_push = self.mode.steps_for(reply.pace)  # type: ignore[attr-defined]
            st = self.staleness
            st[0], st[1], st[2] = st[0] + staleness, st[1] + 1, max(st[2], staleness)
