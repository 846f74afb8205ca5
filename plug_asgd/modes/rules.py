"""The server half of the modes: the fold rules, which fold workers' pushes into the central tensors.

A mode (:mod:`plug_asgd.modes.base`) makes its rule with ``Mode.make_rule``. A rule answers every
push with a *resolution*: applied, dropped as stale, or (for ``sync``) nothing yet, in which case the
push is resolved later, when its round completes. The PS replies to a push only once it is resolved,
which is what makes ``sync`` workers wait. Everything here works on numpy arrays: the PS never
imports torch or Lightning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Any

import numpy as np
from typing_extensions import override

from plug_asgd.modes.fold import APPLIED, DROPPED, CentralState, Push, Resolution, _add_into, _fold_all
from plug_asgd.protocol.wire import Sparse, Tensor


class FoldRule(ABC):
    """Server half of a mode. ``trainers`` is the number of workers currently training."""

    # True when only ``_fold_all`` of a push changes the model: the PS gives buffers (Push.out), copies none on write
    folds_into_update = False
    # True when each version folds one push's tensors in and changes no coordinate its update does not name (a
    # sparse update: only its indices): the PS can then send a worker only what changed (``plug_asgd.ps.changes``).
    changes_only_pushed = False
    # True when a rule folds each push as it arrives, ``Push.scale`` applied: the PS may correct its staleness.
    corrects = False
    # True when a rule scales an unscaled push by its staleness itself (dynsgd's): a worker then scales only a push
    # it says it scaled (``scaled_for``), or it would be scaled twice.
    scales_by_staleness = False

    def __init__(self) -> None:
        self.training_ranks: frozenset[int] = frozenset()

    def adds_exactly(self, update: Tensor) -> bool:
        """Whether this rule folds ``update`` (decoded), pushed on the current version without correction, as
        ``central + update`` in the central dtype: its worker can then make the new model itself, bit for bit.

        Args:
            update: one tensor of a push, as decoded (dense or Sparse).
        """
        return self.folds_into_update

    @property
    def trainers(self) -> int:
        """How many workers are training now (:meth:`set_trainers`' ranks)."""
        return len(self.training_ranks)

    @abstractmethod
    def push(self, state: CentralState, push: Push) -> list[Resolution]:
        """Fold ``push`` in now, drop it, or hold it; return the pushes resolved by this call.

        Args:
            state: the central model, folded into in place (its ``version`` counts the updates).
            push: the worker's update.
        """

    def changed(self) -> frozenset[str] | None:
        """The tensors the last version this rule made changed, where it left the others as they were (streaming
        DiLoCo's rounds of one fragment): the PS then sends a worker only those (``ps/changes.py``); None where it
        may have changed any (a rule that folds a push's coordinates says so by ``changes_only_pushed`` instead)."""
        return None

    def ahead(self, names: frozenset[str] | None = None) -> dict[str, np.ndarray]:
        """By tensor, the step expected before a worker that just pushed pushes again (a reply ahead: ps/store.py).

        Args:
            names: the tensors to anticipate (a fragment's push); None: every one.
        """
        return {}

    def set_trainers(self, state: CentralState, ranks: frozenset[int]) -> list[Resolution]:
        """Called when workers join or leave training; a waiting push may now be released.

        Args:
            state: the central model, for a rule that completes a round now.
            ranks: the global ranks of the workers training from now on.
        """
        self.training_ranks = ranks
        return []

    def adopt(self, session: str, token: Any) -> bool:
        """Answer ``token`` when the push of ``session`` this rule still holds (a round's) is resolved: the same push
        sent again (to a standby that now leads, or after a reconnection) is answered as the first would have been.
        False where this rule holds no push of that session.

        Args:
            session: the pushing worker's session.
            token: what the push sent again is to be answered by.
        """
        return False

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """What a checkpoint must keep of this rule (header fields, arrays); most rules keep nothing."""
        return {}, {}

    def restore(self, fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:  # noqa: B027 (optional hook)
        """Take back what :meth:`state` returned, from a checkpoint.

        Args:
            fields: the header fields :meth:`state` returned.
            arrays: the arrays :meth:`state` returned, by name.
        """


class AsgdRule(FoldRule):
    """``w += delta`` at once, whatever the staleness (Dean et al.'s and the seeds' ASGD)."""

    folds_into_update = True
    changes_only_pushed = True
    corrects = True

    @override
    def push(self, state: CentralState, push: Push) -> list[Resolution]:
        _fold_all(state, push)
        state.version += 1
        return [(push.token, APPLIED)]


class AdaCompRule(FoldRule):
    """``w_i += delta_i / max(1, s_i)``, ``s_i`` = updates folded in since the base that touched i.

    The PS remembers which coordinates each of the last ``history`` updates touched (a dense one: all); an older
    push is scaled by what is remembered, a lower bound of its staleness (``truncated`` counts such pushes).

    Args:
        history: how many of the last updates' touched coordinates are remembered.
    """

    changes_only_pushed = True
    corrects = True

    def __init__(self, history: int = 256) -> None:
        super().__init__()
        self.history: deque[tuple[int, dict[str, np.ndarray | None]]] = deque(maxlen=history)
        self.truncated = 0

    @override
    def adds_exactly(self, update: Tensor) -> bool:
        """A sparse update on the current version: each coordinate is scaled by ``1 / max(1, 0)``, which leaves its
        float32 value as it is. A dense one is divided in float64 before the addition: not the worker's sum."""
        return isinstance(update, Sparse)

    def staleness(self, base_version: int, name: str, indices: np.ndarray) -> np.ndarray:
        """``s_i`` for each of ``indices`` of tensor ``name``, for an update based on ``base_version``.

        Args:
            base_version: the central version the update is based on.
            name: the tensor's name.
            indices: the flat coordinates of the tensor asked about, ascending.
        """
        counts = np.zeros(indices.size, dtype=np.int64)
        for version, touched in self.history:
            if version <= base_version:
                continue
            seen = touched.get(name, _UNTOUCHED)
            if seen is None:  # a dense update touched every coordinate
                counts += 1
            elif seen.size:
                pos = np.searchsorted(seen, indices)
                hit = pos < seen.size
                hit[hit] = seen[pos[hit]] == indices[hit]
                counts += hit
        return counts

    @override
    def push(self, state: CentralState, push: Push) -> list[Resolution]:
        if self.history and push.base_version < self.history[0][0] - 1:
            self.truncated += 1
        touched: dict[str, np.ndarray | None] = {}
        for name, update in push.update.items():
            target = state.tensors[name]
            if isinstance(update, Sparse):
                s = self.staleness(push.base_version, name, update.indices)
                _add_into(target, update, push.scale / np.maximum(1, s))
                touched[name] = update.indices
            else:
                idx = np.arange(target.size)
                s = self.staleness(push.base_version, name, idx).reshape(target.shape)
                target += (update if push.scale == 1.0 else update * push.scale) / np.maximum(1, s)
                touched[name] = None
        state.version += 1
        self.history.append((state.version, touched))
        return [(push.token, APPLIED)]

    @override
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        entries, arrays = [], {}
        for i, (version, touched) in enumerate(self.history):
            entries.append([version, [n for n, idx in touched.items() if idx is None],
                            [n for n, idx in touched.items() if idx is not None]])
            arrays.update((f"{i}/{n}", idx) for n, idx in touched.items() if idx is not None)
        return {"history": entries, "truncated": self.truncated}, arrays

    @override
    def restore(self, fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.history.clear()
        for i, (version, dense, sparse) in enumerate(fields.get("history", [])):
            touched: dict[str, np.ndarray | None] = dict.fromkeys(dense)
            touched.update((n, np.array(arrays[f"{i}/{n}"], dtype=np.int64)) for n in sparse)
            self.history.append((int(version), touched))
        self.truncated = int(fields.get("truncated", 0))


_UNTOUCHED = np.zeros(0, dtype=np.int64)


class SyncRule(FoldRule):
    """Average ``replicas_to_aggregate`` updates based on the current version, apply them as one.

    Updates based on an older version are dropped (their worker gets the current model back at
    once), so with ``replicas_to_aggregate`` below the number of workers the slowest ones act
    as the backup workers of TensorFlow's SyncReplicasOptimizer. The default aggregates every
    worker currently training; a worker that leaves stops being waited for.

    A round's updates are summed in the order of their ranks, not of their arrival: the same
    pushes make the same bits whichever came first, so a run's rounds do not depend on timing
    (beyond which pushes a round holds), and the shards of a sharded PS, each of which may receive
    a worker's pushes in another order, make together the bits of one PS.

    Args:
        replicas_to_aggregate: the updates averaged per round; None: every worker training.

    Raises:
        ValueError: where ``replicas_to_aggregate`` is below 1.
    """

    def __init__(self, replicas_to_aggregate: int | None = None) -> None:
        super().__init__()
        if replicas_to_aggregate is not None and replicas_to_aggregate < 1:
            raise ValueError(f"replicas_to_aggregate must be >= 1, got {replicas_to_aggregate}")
        self.replicas_to_aggregate = replicas_to_aggregate
        self.pending: list[Push] = []

    @property
    def target(self) -> int:
        """The updates the current round waits for: ``replicas_to_aggregate``, at most the workers training."""
        want = self.replicas_to_aggregate or self.trainers
        return max(1, min(want, self.trainers)) if self.trainers else 1

    @override
    def push(self, state: CentralState, push: Push) -> list[Resolution]:
        if not self.current(state, push) or any(p.rank == push.rank for p in self.pending):
            return [(push.token, DROPPED)]
        self.pending.append(push)
        return self._maybe_complete(state)

    def current(self, state: CentralState, push: Push) -> bool:
        """Whether ``push`` may join the round: sync's, based on the current version.

        Args:
            state: the central model.
            push: the worker's update.
        """
        return push.base_version == state.version

    @override
    def set_trainers(self, state: CentralState, ranks: frozenset[int]) -> list[Resolution]:
        super().set_trainers(state, ranks)
        return self._maybe_complete(state)

    def _maybe_complete(self, state: CentralState) -> list[Resolution]:
        if not self.pending or len(self.pending) < self.target:
            return []
        self.fold_round(state, sorted(self.pending, key=lambda p: p.rank))
        state.version += 1
        done = [(p.token, APPLIED) for p in self.pending]
        self.pending = []
        return done

    def fold_round(self, state: CentralState, by_rank: list[Push]) -> None:
        """Fold a complete round into the central tensors (before its version is counted): sync's, each tensor's
        mean update over the round's pushes (a push without the tensor adds nothing to it), by :meth:`apply_mean`.

        Args:
            state: the central model, changed in place.
            by_rank: the round's pushes, in the order of their ranks.
        """
        for name, target in state.tensors.items():
            total = np.zeros_like(target)
            for p in by_rank:
                if name in p.update:
                    _add_into(total, p.update[name])
            self.apply_mean(name, target, total / len(by_rank))

    def apply_mean(self, name: str, target: np.ndarray, mean: np.ndarray) -> None:
        """Fold a round's mean update of tensor ``name`` into ``target`` (sync's: added as it is).

        Args:
            name: the tensor's name.
            target: the central tensor, changed in place.
            mean: the mean of the round's updates of it.
        """
        target += mean

    @override
    def adopt(self, session: str, token: Any) -> bool:
        for p in self.pending:
            if p.session == session:
                p.token = token
                return True
        return False

    @override
    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The round's pushes held so far: a standby that joins mid-round, or a PS resumed from a checkpoint taken
        then, completes the round with the same pushes (each sent once: the pushes' numbers are kept too)."""
        entries, arrays = [], {}
        for i, p in enumerate(self.pending):
            sparse = {n: list(u.shape) for n, u in p.update.items() if isinstance(u, Sparse)}
            entries.append({"rank": p.rank, "base_version": p.base_version, "session": p.session,
                            "dense": [n for n in p.update if n not in sparse], "sparse": sparse})
            for n, u in p.update.items():
                if isinstance(u, Sparse):
                    arrays[f"{i}/{n}/indices"], arrays[f"{i}/{n}/values"] = u.indices, u.values
                else:
                    arrays[f"{i}/{n}"] = np.asarray(u)
        return {"pending": entries}, arrays

    @override
    def restore(self, fields: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        self.pending = []
        for i, e in enumerate(fields.get("pending", [])):
            update: dict[str, Tensor] = {n: np.array(arrays[f"{i}/{n}"]) for n in e["dense"]}
            update.update((n, Sparse(np.array(arrays[f"{i}/{n}/indices"]), np.array(arrays[f"{i}/{n}/values"]),
                                     tuple(shape))) for n, shape in e["sparse"].items())
            self.pending.append(Push(None, int(e["rank"]), int(e["base_version"]), update, session=e.get("session")))


class DynSGDRule(FoldRule):
    """``w += delta / (staleness + 1)``, staleness = updates folded in since the base (Jiang et al., SIGMOD 2017).

    A push its worker scaled (``scaled_for``: the staleness compensation's default) is folded as asgd's, at
    ``1 / (1 + max(e, staleness))`` in all: the worker's estimate ``e`` is the floor. Scaled by its own staleness
    alone, a push landing fresher than the worker looked ahead for (0 where the others' pushes are due) went in
    whole, and under momentum SGD those ended about a point below asgd's (docs/momentum.md, "dynsgd's floor")."""

    folds_into_update = True
    changes_only_pushed = True
    corrects = True
    scales_by_staleness = True

    @override
    def push(self, state: CentralState, push: Push) -> list[Resolution]:
        scale = 1.0 if push.scaled_by_worker else 1.0 / (state.version - push.base_version + 1)
        _fold_all(state, push, scale)
        state.version += 1
        return [(push.token, APPLIED)]


class SSPRule(FoldRule):
    """Stale synchronous parallel (Ho et al., NIPS 2013): asynchronous folds, bounded clock drift.

    A worker's clock is the number of its pushes in this training stage. Its push is folded in
    at once, but the reply (and so its next step) waits while its clock is more than
    ``staleness_bound`` ahead of the slowest training worker's.

    Args:
        staleness_bound: how many pushes a worker's clock may run ahead of the slowest's before its reply waits.

    Raises:
        ValueError: where ``staleness_bound`` is negative.
    """

    folds_into_update = True
    changes_only_pushed = True
    corrects = True

    def __init__(self, staleness_bound: int = 2) -> None:
        super().__init__()
        if staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {staleness_bound}")
        self.staleness_bound = staleness_bound
        self.clocks: dict[int, int] = {}
        self.waiting: list[tuple[Any, int]] = []

    @override
    def push(self, state: CentralState, push: Push) -> list[Resolution]:
        _fold_all(state, push)
        state.version += 1
        self.clocks[push.rank] = self.clocks.get(push.rank, 0) + 1
        self.waiting.append((push.token, push.rank))
        return self._release()

    @override
    def set_trainers(self, state: CentralState, ranks: frozenset[int]) -> list[Resolution]:
        super().set_trainers(state, ranks)
        return self._release()

    def _release(self) -> list[Resolution]:
        slowest = min((self.clocks.get(r, 0) for r in self.training_ranks), default=None)
        free = [(t, r) for t, r in self.waiting if slowest is None or r not in self.training_ranks
                or self.clocks[r] - slowest <= self.staleness_bound]
        self.waiting = [w for w in self.waiting if w not in free]
        return [(t, APPLIED) for t, _ in free]
