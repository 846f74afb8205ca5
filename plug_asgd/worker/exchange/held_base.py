"""The held base: a worker's update is its weights less the central model its client holds (``w - c``).

The push exchange keeps a base ``b`` of its own, the weights after the last merge, and pushes ``r + s * (w
- b)`` (``r`` the codec's residual, ``s`` the staleness scale). Each push then walks the model several
times: the difference, the residual's sum, the codec's reading of it, ``b = w`` and, after the reply, the
weights and the base set again. Where the worker is alone with the central model (its pushes land on the
version they were based on, ``s = 1``, no look-ahead), two things hold:

- **the residual is implicit** (codecs whose residual stays in the model, ``RESIDUAL``): the weights are
  the central model plus what was not sent plus the progress since, ``w = c + r + p``, so the update is
  ``w - c`` itself, with nothing kept beside it;
- **the base is the central model** (every other codec, ``CENTRAL``): ``w = c + p``, so the update is
  ``r + (w - c)``, ``r`` the residual error feedback keeps outside the model (powersgd's), if any.

The codec encodes ``w - c`` chunk by chunk (``Codec.encode_difference``) and the PS answers "own": the
new central model is ``c`` plus what was sent, decoded as the PS decodes it, and the client makes it
itself (:meth:`plug_asgd.worker.held_model.HeldModel.add`). With the residual implicit the weights are then right as
they are, ``w - c_new`` being the new residual plus the progress: nothing is written but the sparse
coordinates sent. A reply that another worker's push raced is merged as ``w += (c_new - c_old) -
sent`` (``c_old``: the arrays the client lent, which its replies do not write), which keeps the invariant.

The rule is that of the exchange's own base, computed in another order: the two agree up to the rounding
of the residual's additions (``tests/test_held_base.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

from plug_asgd.compressors import QSGD, Compressor, decode, native
from plug_asgd.protocol.wire import Packed, Sparse
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.exchange.in_flight import InFlight
from plug_asgd.worker.held_model import HeldModel
from plug_asgd.worker.model_reply import ModelReply

_UNCHANGED = np.zeros(0, dtype=np.int64)
RESIDUAL = "residual"  # w = c + r + p: the residual is w - c less the progress, kept nowhere else
CENTRAL = "central"  # w = c + p: the base is the central model held


_pool: ThreadPoolExecutor | None = None


def _map(fn: Callable[[str], Any], names: list[str], threads: int) -> list[Any]:
    """``fn`` of each name, in order, by up to ``threads`` threads (kept between calls)."""
    global _pool
    threads = min(threads, len(names))
    if threads <= 1:
        return [fn(n) for n in names]
    if _pool is None or _pool._max_workers < threads:
        _pool = ThreadPoolExecutor(threads, thread_name_prefix="plug_asgd-encode")
    return list(_pool.map(fn, names))


def host_arrays(tensors: Mapping[str, Tensor]) -> dict[str, np.ndarray] | None:
    """The tensors' own memory as numpy arrays, where every one is a contiguous float32 CPU tensor; else None.

    Args:
        tensors: the worker's parameters and buffers, by name; writing an array returned writes its tensor.
    """
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors.values()):
        return None
    return {name: t.detach().numpy() for name, t in tensors.items()}


class HeldBase:
    """Which held base the exchange pushes from (``kind``: ``RESIDUAL``, ``CENTRAL`` or None: its own base)."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.pushes = 0  # pushed from the held base
        self.raced = 0  # ... and answered with another model than held + sent (another push's, an outer step's)

    def enter(self, kind: str, weights: dict[str, np.ndarray], base: Mapping[str, Tensor],
              central: Mapping[str, np.ndarray], residual: Callable[[str], np.ndarray | None], version: int) -> None:
        """Push from the held base from now on: the weights are made ``c (+ r) + (w - b)``, the progress kept,
        which is what the exchange's own base would push next (``c``: ``central``, the held model of
        ``version``). Nothing to do where already there.

        Args:
            kind: the held base to push from, ``RESIDUAL`` or ``CENTRAL``.
            weights: the worker's weights as host arrays (:func:`host_arrays`), rewritten in place.
            base: the exchange's own base, ``b``: the weights after the last merge.
            central: the central model the client holds, of ``version``.
            residual: the codec's residual of a tensor (None: none), folded into the weights for ``RESIDUAL``.
            version: the central version of ``central``.
        """
        if self.kind == kind:
            return
        for name, w in weights.items():
            progress = np.subtract(w, base[name].detach().numpy(), out=w)
            progress += central[name].reshape(w.shape)
            r = residual(name) if kind == RESIDUAL else None
            if r is not None:
                progress += r.reshape(w.shape)
        self.kind = kind

    def encode(self, encoder: Compressor, weights: dict[str, np.ndarray],
               central: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Each tensor's update ``w - c`` (plus the residual kept outside the model, for ``CENTRAL``), encoded: by
        as many threads as torch computes with, where the codec encodes each tensor on its own (numpy lets go of
        the interpreter in its loops, and the training's threads are idle meanwhile).

        Args:
            encoder: the worker's codec state, which encodes each tensor's difference (and keeps its residual).
            weights: the worker's weights as host arrays, by name; only read.
            central: the central model the client holds, by the same names.
        """
        implicit = {"implicit_residual": True} if self.kind == RESIDUAL else {}
        self.pushes += 1

        def one(name: str) -> Any:
            w = weights[name]
            return encoder.encode_difference(name, w, central[name].reshape(w.shape), **implicit)  # type: ignore[attr-defined]

        threads = torch.get_num_threads() if getattr(encoder, "independent_keys", False) else 1
        names = list(weights)  # in order: a codec with one random generator draws for each tensor in turn
        if threads > 1:
            names.sort(key=lambda n: -weights[n].size)  # the largest first: the threads end together
        sent = dict(zip(names, _map(one, names, threads), strict=True))
        return {name: sent[name] for name in weights}

    @staticmethod
    def decoded(update: Mapping[str, Any], weights: Mapping[str, np.ndarray],
                encoder: Compressor | None = None) -> dict[str, np.ndarray | Sparse]:
        """What the PS folds in of ``update``, decoded as it decodes it (the same function, the same bits), or as
        the encoder's error feedback decoded it already (:meth:`ErrorFeedback.decoded_of`: the same call).

        Args:
            update: the encoded update that was pushed, by tensor name.
            weights: the worker's weights by name, whose dtypes and shapes the update decodes to.
            encoder: the codec state that encoded it, asked first; None: each tensor is decoded here.
        """
        known = getattr(encoder, "decoded_of", None)
        out: dict[str, np.ndarray | Sparse] = {}
        for name, sent in update.items():
            found = known(name, sent) if known is not None else None
            out[name] = found if found is not None else decode(sent, weights[name].dtype, shape=weights[name].shape)
        return out

    def settle(self, reply: ModelReply, held: HeldModel, weights: dict[str, np.ndarray],
               central_before: Mapping[str, np.ndarray], decoded: Mapping[str, np.ndarray | Sparse],
               guessed: bool = False, made: dict[str, np.ndarray] | None = None) -> None:
        """Take the reply to a push from the held base: "own" (the held model plus what was sent, made here), or
        the central model with another worker's pushes in it, merged keeping the invariant.

        Args:
            reply: the PS's answer to the push.
            held: the central model the client holds, brought up to the reply's version here on an "own" reply.
            weights: the worker's weights as host arrays, written in place.
            central_before: the central arrays the push was based on (lent by the client: no reply wrote them).
            decoded: the pushed update as the PS decoded it (:meth:`decoded`).
            guessed: the weights were made the model an "own" reply means (:meth:`HeldPush.guess_own`) and the
                optimizer has stepped from there since.
            made: that model, made at the guess beside the weights, which the held model then takes as it is;
                None: the held model adds ``decoded``.
        """
        if reply.own:
            if made is not None:
                held.adopt(made, reply.version)
            else:
                held.add(dict(decoded), reply.version)
            if self.kind == CENTRAL and not guessed:
                for name, w in weights.items():
                    np.copyto(w, held.tensors[name].reshape(w.shape))
            return
        self.raced += 1
        if self.kind == CENTRAL:  # w = c_new: the progress was all pushed (and the steps since the guess kept)
            for name, w in weights.items():
                new = np.asarray(reply.tensors[name]).reshape(w.shape)
                if guessed:  # w += c_new - (c_old + sent)
                    w += new
                    w -= central_before[name].reshape(w.shape)
                    w -= np.asarray(decoded[name]).reshape(w.shape)
                else:
                    np.copyto(w, new)
            return
        changed = reply.changed
        for name, w in weights.items():
            flat, new = w.reshape(-1), np.asarray(reply.tensors[name]).reshape(-1)
            old = central_before[name].reshape(-1)  # lent: the reply's changes went into copies
            idx = changed.indices.get(name, _UNCHANGED) if changed is not None else None
            if idx is None:  # the tensor came whole: w += c_new - c_old
                flat += new
                flat -= old
            elif idx.size:
                flat[idx] += new[idx] - old[idx]
            sent = decoded[name]
            if isinstance(sent, Sparse):
                flat[sent.indices] -= sent.values
            else:
                flat -= sent.reshape(-1)

    def settle_own(self, reply: ModelReply, held: HeldModel, decoded: Mapping[str, np.ndarray | Sparse]) -> bool:
        """Take an "own" reply where it changes only the held model (the residual implicit: the weights are right
        as they are): the held model plus what was sent. Called by the push's thread as the reply comes, beside the
        next step's forward and backward, which read neither; nothing else reads the held model before the push is
        settled. Returns whether it was taken (else :meth:`settle` takes it).

        Args:
            reply: the PS's answer to the push.
            held: the central model the client holds.
            decoded: the pushed update as the PS decoded it (:meth:`decoded`).
        """
        if not reply.own or self.kind != RESIDUAL:
            return False
        held.add(dict(decoded), reply.version)
        return True

    def leave(self, weights: dict[str, np.ndarray], base: Mapping[str, Tensor], central: Mapping[str, np.ndarray],
              set_residual: Callable[[str, np.ndarray], None] | None) -> None:
        """Back to the exchange's own base, the progress made since the held model kept for the next push (the
        exchange leaves at a push as well as after a merge, with a round of inner steps pending in DiLoCo's):
        where the base was the central model (``CENTRAL``, ``w = c + p``), ``b = c``; where the residual was
        implicit (``w = c + r + p``), ``r + p = w - c`` kept by the codec again and ``b = w``.

        Args:
            weights: the worker's weights as host arrays.
            base: the exchange's own base, set to ``c`` or to the weights.
            central: the central model the client holds (of the version the weights' progress is counted from).
            set_residual: hands the codec a tensor's residual back (needed where the residual was implicit).
        """
        if self.kind is None:
            return
        for name, w in weights.items():
            c = central[name].reshape(w.shape)
            if self.kind == RESIDUAL:
                assert set_residual is not None  # (only a codec that keeps a residual keeps it in the model)
                set_residual(name, np.subtract(w, c))
            base[name].detach().numpy()[...] = c if self.kind == CENTRAL else w
        self.kind = None


class HeldPush(InFlight):
    """One push from the held base, encoded and sent by a thread of its own while the next step's forward and
    backward compute: they only read the weights, which the optimizer writes after them (the exchange waits for
    the encoding there, :meth:`encoded`). With the residual implicit an "own" reply leaves the weights as they
    are, so a lone worker trains the same steps as if it had waited; a raced reply is merged one step later.

    Args:
        held: the held base the push is made from (its kind already entered).
        encoder: the worker's codec state, which encodes the update.
        client: the client the push goes through.
        weights: the worker's weights as host arrays; read by the encoding, which must end before they change.
        central: the central model the client lent for this push (no reply writes it).
        base: the central version the update is based on.
        scaled_for: the staleness the update was scaled for (None: not scaled), which the PS corrects for.
        mask: masks the optimizers' momentum where an update was sent; run by the push's thread once the push is
            sent, while the PS folds it (the momentum is read only by the optimizer's step, which waits for it).
        rate: the worker's local steps per second, said with the push (``PSClient.push``'s); None: none said.
    """

    def __init__(self, held: HeldBase, encoder: Compressor, client: PSClient, weights: dict[str, np.ndarray],
                 central: dict[str, np.ndarray], base: int, scaled_for: float | None,
                 mask: Callable[[Mapping[str, Any]], None] | None = None, rate: float | None = None) -> None:
        self.held, self.weights, self.central, self.base = held, weights, central, base
        self.encoder, self._mask = encoder, mask
        self.update: dict[str, Any] = {}
        self.decoded: dict[str, Any] = {}
        self.masked = False  # the optimizers' momentum was masked where the update was sent
        self.added = False  # an "own" reply's update was added to the client's held model by the push's thread
        self.guessed = False  # the weights are the model an "own" reply means (guess_own)
        self.guessed_at = 0  # the worker's local steps then
        self.made: dict[str, np.ndarray] | None = None  # the model the guess made: the held model's at "own"
        self._encoded, self._decoded = threading.Event(), threading.Event()

        def work() -> ModelReply:
            try:
                try:
                    self.update = held.encode(encoder, weights, central)
                finally:
                    self._encoded.set()
                reply = client.push(base, self.update, want_model="unless_own", scaled_for=scaled_for,
                                    while_waiting=self._decode, rate=rate)
            finally:
                self._decoded.set()
            if client.held is not None and self.decoded.keys() == self.update.keys():
                self.added = held.settle_own(reply, client.held, self.decoded)
            return reply

        super().__init__(work)

    def _decode(self) -> None:
        if not self._fuses():
            self.decoded.update(self.held.decoded(self.update, self.weights, self.encoder))
        if self._mask is not None:
            self._mask(self.update)
            self.masked = True
        self._decoded.set()

    def wait_masked(self) -> None:
        """Wait until the push's thread has masked the momentum, or has ended without (:attr:`masked` says)."""
        self._decoded.wait()

    def _fuses(self) -> bool:
        """Whether the guess adds each tensor's decoding to the held model in the pass that decodes it, never
        written (qsgd's 8- or 16-bit levels, in C): then the update is decoded only where a reply needs it."""
        return (self.held.kind == CENTRAL and native.library() is not None and bool(self.update)
                and getattr(self.encoder, "decoded_of", None) is None
                and all(isinstance(s, Packed) and s.codec == "qsgd" and s.meta.get("bits") in (8, 16)
                        for s in self.update.values()))

    def encoded(self) -> dict[str, Any]:
        """The update, once encoded (the weights may change from then on)."""
        self._encoded.wait()
        if not self.update:
            self.answered()  # raises what went wrong
        return self.update

    def guess_own(self, local_steps: int) -> bool:
        """Where the weights become the central model itself at an "own" reply (``CENTRAL``), make them that model
        now, ``c + sent`` with the PS's float additions, without waiting for the reply: the optimizer may then step
        while the push is answered, and the reply, taken after the step, keeps it (:meth:`HeldBase.settle`,
        ``guessed``). Waits for the update's decoding; False, with nothing written, where it is not there (the
        push failed) or is sparse. Once per push.

        Args:
            local_steps: the worker's local steps so far, from which those taken since the guess are counted.
        """
        if self.guessed:
            return True
        self._decoded.wait()
        decoded = self.decoded
        fused = not decoded and self.update.keys() == self.weights.keys() and self._fuses()
        if not fused and (decoded.keys() != self.weights.keys()
                          or not all(isinstance(d, np.ndarray) for d in decoded.values())):
            return False
        made = {}
        for name, w in self.weights.items():
            c = self.central[name]
            # the sums go to the weights and to the held model's next arrays in one pass: an "own" reply then
            # takes those as they are (HeldModel.adopt), where adding the update to the held model again read it
            made[name] = np.empty_like(c)
            flat = (c.reshape(-1), w.reshape(-1), made[name].reshape(-1))
            if fused and QSGD.add_decoded(self.update[name], *flat):
                continue
            if name not in decoded:
                decoded.update(self.held.decoded({name: self.update[name]}, self.weights))
            native.add_twice(decoded[name].reshape(-1), *flat)
        self.made = made
        self.guessed, self.guessed_at = True, local_steps
        return True

    def settle(self, held: HeldModel) -> ModelReply:
        """Take the reply (:meth:`HeldBase.settle`) and return it.

        Args:
            held: the central model the client holds.
        """
        reply = self.answered()
        if self.made is None or not reply.own:  # the decoding is read: made here where it is not yet (sent again
            # after a reconnection, or never written by the guess)
            missing = {name: sent for name, sent in self.update.items() if name not in self.decoded}
            self.decoded.update(self.held.decoded(missing, self.weights))
        if not self.added:
            self.held.settle(reply, held, self.weights, self.central, self.decoded, self.guessed, self.made)
        return reply
