"""ShardedClient: one worker's connection to a sharded PS, one :class:`PSClient` per shard, all asked at once.

It speaks to the exchange as a :class:`PSClient` does. Each push is cut by the partition
(:mod:`plug_asgd.protocol.partition`) and sent at once to every shard that holds a piece of it (every shard, but
for a push of some tensors: a fragment of streaming DiLoCo): the first shard's request from the calling
thread, the others' from a thread each, so the replies are awaited together and a push costs the
slowest shard's round trip, not their sum. A model reply is assembled from the shards' pieces.

Versions are per shard. A reply's ``version`` is a :class:`ShardVersions`: an int (the newest
shard's version, for the exchange's staleness arithmetic; a fragment's reply counts its staleness on the shards
it came from, :meth:`ShardVersions.since`) that carries each shard's version, and the
push based on it sends each shard its own base version, so every shard's rule (adacomp's
per-coordinate staleness, dynsgd's scale) sees the base that worker really had there.

A push is done once every shard has answered it. Where a shard holds its reply (a synchronous round
not complete yet, an ssp worker too far ahead), the worker waits for it as it would for one PS; each
shard runs its own rounds. Where the shards answered differently (a sync push that one shard took into
its round and another dropped as late: with ``replicas_to_aggregate`` below the training workers,
each shard averages the first pushes it received), the reply says ``partly_applied``.

Per shard, as on one PS: delta replies (each client's :class:`~plug_asgd.worker.held_model.HeldModel`),
approximate replies (``downlink_fraction``: each shard keeps its own copy of what the worker holds),
heartbeats, duplicate detection. Not sharded yet: pushes of weights (a shard could take them while
another refuses, and the update sent next would fold twice where they were taken) and shared-memory
pushes; a sharded worker pushes updates over the sockets. Collectives, notices and stats go to shard 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar

from plug_asgd.compressors import slice_packed
from plug_asgd.protocol.partition import Partition
from plug_asgd.protocol.wire import Tensor
from plug_asgd.worker.client import CommCounters, PSClient
from plug_asgd.worker.model_reply import ModelReply
from plug_asgd.worker.notices import Notices

T = TypeVar("T")

# the PS's counters that add up over shards (what crossed every shard's socket)
_TRAFFIC = ("bytes_in", "bytes_out", "push_bytes_in", "push_local_bytes_in", "model_bytes_out", "messages_in",
            "push_messages")
# the worker's counters that add up over its shard clients (bytes, requests); pushes are counted once per push
_SUMMED = ("bytes_up", "bytes_down", "push_bytes_up", "push_local_bytes_up", "requests", "delta_replies")
# a push some shards folded in and others dropped (see the module's docstring)
PARTLY_APPLIED = "partly_applied"


def combined_status(statuses: Sequence[str]) -> str:
    """The status of a push from each shard's: theirs where they agree; ``partly_applied`` where some applied it
    and the others dropped it; else the first that is not "applied" (stopped, duplicate).

    Args:
        statuses: each shard's status of the push, in shard order (at least one).
    """
    if all(s == statuses[0] for s in statuses):
        return statuses[0]
    if set(statuses) == {"applied", "dropped"}:
        return PARTLY_APPLIED
    return next(s for s in statuses if s != "applied")


class ShardVersions(int):
    """The version of a model held by several shards: the newest shard's, with each shard's in ``per_shard`` and the
    shards the reply came from in ``asked`` (every shard, but after a push of some tensors)."""

    per_shard: tuple[int, ...]
    asked: tuple[int, ...]

    def __new__(cls, versions: Sequence[int], asked: Sequence[int] | None = None) -> ShardVersions:
        obj = super().__new__(cls, max(versions))
        obj.per_shard = tuple(int(v) for v in versions)
        obj.asked = tuple(range(len(versions))) if asked is None else tuple(sorted(asked))
        return obj

    def since(self, base: int) -> int:
        """The staleness of the push this reply answers: the versions made since ``base`` less the push's own. A
        reply of every shard counts the newest shard's, as one PS counts its own; a reply of some (a fragment's)
        counts on the shards it came from, each against its own base: the newest shard's would count the other
        shards' versions, and nothing where another shard was ahead (a negative staleness).

        Args:
            base: the version the push was based on (one this client handed out).
        """
        if len(self.asked) == len(self.per_shard) or not isinstance(base, ShardVersions):
            return int(self) - int(base) - 1
        return max(self.per_shard[i] - base.per_shard[i] for i in self.asked) - 1

    def __repr__(self) -> str:
        return f"ShardVersions({list(self.per_shard)})"


class ShardedClient:
    """Requests to every shard of a sharded PS, made together; what the exchange and the strategy ask of a PSClient.

    Args:
        addresses: the shards' addresses, in the order of their ``--shard``.
        partition: how the model is cut over the shards (as many as ``addresses``).
        **client_options: each shard's :class:`PSClient`'s options.

    Raises:
        ValueError: where there are not as many addresses as the partition has shards.
    """

    takes_weights = False  # see the module's docstring: a push of weights is not made sharded

    def __init__(self, addresses: Sequence[str], partition: Partition, **client_options: Any) -> None:
        if len(addresses) != partition.shards:
            raise ValueError(f"{len(addresses)} shard addresses for a partition over {partition.shards} shards")
        self.partition = partition
        self.clients = [PSClient(a, **client_options) for a in addresses]
        for index, client in enumerate(self.clients):
            client.partition = {**partition.describe(), "shard": index}
        self._pool = ThreadPoolExecutor(len(addresses) - 1, thread_name_prefix="plug_asgd-shard")
        self._last: ShardVersions | None = None
        self.pushes = self.own_replies = self.partly_applied = 0

    # -- what a PSClient offers ------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank (every shard client's)."""
        return self.clients[0].rank

    @property
    def shares_memory(self) -> bool:
        """False: a sharded worker pushes over the sockets (see the module's docstring)."""
        return False

    def push_buffers(self, shapes: Mapping[str, Any]) -> None:
        """None: a sharded worker pushes over the sockets (see the module's docstring).

        Args:
            shapes: the buffers a :class:`PSClient` would be asked for (name -> shape, dtype); unused.
        """
        return None

    @property
    def counters(self) -> CommCounters:
        """Bytes and requests over every shard, and each shard's replies by kind; pushes and "own" replies counted
        once per push of the worker."""
        total = CommCounters()
        for client in self.clients:
            for name in _SUMMED:
                setattr(total, name, getattr(total, name) + getattr(client.counters, name))
            for kind, n in client.counters.replies.items():
                total.replies[kind] = total.replies.get(kind, 0) + n
        total.pushes, total.own_replies, total.partly_applied = self.pushes, self.own_replies, self.partly_applied
        total.wait_seconds = max(c.counters.wait_seconds for c in self.clients)
        total.weights_not_current = 0
        return total

    @property
    def reconnections(self) -> int:
        """The reconnections of every shard's client, summed."""
        return sum(c.reconnections for c in self.clients)

    def hello(self, stage: int, training: bool, *, timeout: float | None = None,
              alive: Callable[[], str | None] | None = None) -> dict[str, Any]:
        """Join every shard; shard 0's welcome, ``initialized`` only once every shard holds its pieces.

        Args:
            stage: the number of the Lightning stage being joined.
            training: whether the stage is a fit (the worker trains) rather than an evaluation.
            timeout: seconds each shard's client keeps asking; None: its ``request_timeout``.
            alive: says why the PS cannot answer (its process died), or None while it may.
        """
        welcomes = self._each(lambda c, _: c.hello(stage, training, timeout=timeout, alive=alive))
        return {**welcomes[0], "initialized": all(w.get("initialized") for w in welcomes)}

    def init(self, tensors: Mapping[str, Any]) -> bool:
        """Offer each shard its pieces; True if every shard took them (another worker may have come first on some).

        Args:
            tensors: this worker's model by name (parameters and floating-point buffers), whole.
        """
        parts = self.partition.split(tensors, slice_packed)
        return all(self._each(lambda c, i: c.init(parts[i])))

    def pull(self) -> ModelReply:
        """The central model, assembled from every shard's pieces."""
        return self._combine(self._each(lambda c, _: c.pull()))

    def pull_once_initialized(self, within: float) -> ModelReply | None:
        """The central model once every shard holds its pieces, each waited for at most ``within`` seconds; None
        where one does not by then.

        Args:
            within: seconds to wait for another worker's initial model, on each shard.
        """
        replies = self._each(lambda c, _: c.pull_once_initialized(within))
        return None if any(r is None for r in replies) else self._combine(replies)  # type: ignore[arg-type]

    def push(self, base_version: int, update: Mapping[str, Tensor],
             want_model: bool | Literal["unless_own", "pushed"] = True,
             while_waiting: Callable[[], None] | None = None, weights: bool = False,
             lend: bool = False, scaled_for: float | None = None, ahead: bool = False,
             rate: float | None = None) -> ModelReply:
        """The push of ``PSClient.push``, each shard sent its pieces and its own base version, all at once
        (``scaled_for`` to each: each shard corrects its pieces by the staleness they land with there).

        An "own" reply only when every shard answered "own". Where only some did (another worker's push reached
        the others first), the model comes back whole: those shards' pieces are pulled.

        A push of some tensors only (a fragment of streaming DiLoCo) goes to the shards that hold a piece of
        them, and its reply carries those tensors; the other shards are not asked and keep their versions. Each
        shard then counts the rounds of the tensors it holds, as one PS counts its rounds of every tensor.

        Args:
            base_version: the version of the reply the update was based on (a :class:`ShardVersions`).
            update: the update of every tensor (or of some: a fragment's), by name, whole: it is cut here.
            want_model: whether the reply carries the model (``"unless_own"``: not where every shard says "own";
                ``"pushed"``: each shard's pieces of the tensors pushed only).
            while_waiting: runs once the push is sent, while the shards fold it (with shard 0's request).
            weights: must be False: a sharded PS takes no pushes of weights.
            lend: must be False, as ``weights``.
            scaled_for: the staleness the worker scaled the update for, sent to every shard; None: not scaled.
            ahead: ask each shard for its pieces of the model its rule anticipates (``PSClient.push``'s).
            rate: this worker's local steps per second, said to each shard asked (``PSClient.push``'s); the reply's
                pace is the lowest of theirs (the fastest worker any shard has heard of).

        Raises:
            ValueError: for a push of weights, or of no tensor of the model.
        """
        if weights or lend:
            raise ValueError("a sharded PS takes no pushes of weights (ShardedClient.takes_weights)")
        bases = self._bases(base_version)
        parts = self.partition.split(update, slice_packed)
        asked = [i for i, part in enumerate(parts) if part]
        if not asked:
            raise ValueError(f"the update carries no tensor of the model ({sorted(update)[:5]}): push the update of "
                             "the model's tensors, by their names in the model")
        first = asked[0]
        answers = self._each(lambda c, i: c.push(bases[i], parts[i], want_model,
                                                 while_waiting=while_waiting if i == first else None,
                                                 scaled_for=scaled_for, ahead=ahead, rate=rate), asked)
        self.pushes += 1
        status = combined_status([r.status for r in answers])  # the push's, whatever the pulls below answer
        self.partly_applied += status == PARTLY_APPLIED
        names = None if len(asked) == len(parts) and want_model != "pushed" else set(update)
        replies = dict(zip(asked, answers, strict=True))
        owned = [i for i in asked if replies[i].own]
        if len(owned) == len(asked):
            self.own_replies += 1
            return self._combine(replies, status, own=True, names=names)
        if owned:
            replies.update(zip(owned, self._each(lambda c, i: c.pull(), owned), strict=True))
        return self._combine(replies, status, tensors=bool(owned) or want_model is not False, names=names)

    def gather(self, *args: Any, **kwargs: Any) -> list[tuple[int, Any, dict[str, Any]]]:
        """A collective: through shard 0 only.

        Args:
            *args: :meth:`PSClient.gather`'s arguments.
            **kwargs: :meth:`PSClient.gather`'s keyword arguments.
        """
        return self.clients[0].gather(*args, **kwargs)

    def notices(self) -> Notices:
        """The broadcasts inside the training loop: through shard 0 only."""
        return self.clients[0].notices()

    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        """Shard 0's counters (version, workers, pushes...) but the traffic, summed over shards; every shard's
        own under ``shards``.

        Args:
            timeout: seconds to wait for each shard's reply; None: the clients' ``request_timeout``.
        """
        each = self._each(lambda c, _: c.stats(timeout=timeout))
        summed = {k: sum(s.get(k) or 0 for s in each) for k in _TRAFFIC}
        return {**each[0], **summed, "shards": each}

    def bye(self, stage: int, timeout: float = 5.0, failed: str | None = None) -> None:
        """Leave ``stage`` on every shard.

        Args:
            stage: the number of the stage being left.
            timeout: seconds to wait for each shard's answer.
            failed: what the stage ended on, where it failed (each shard stops the job's other workers); None: it
                ended well.
        """
        self._each(lambda c, _: c.bye(stage, timeout=timeout, failed=failed))

    def close(self) -> None:
        """Close every shard's client, then the threads that made their requests."""
        for client in self.clients:
            client.close()
        self._pool.shutdown(wait=True)

    # -- the parts ----------------------------------------------------------------------------------

    def _each(self, request: Callable[[PSClient, int], T], among: Sequence[int] | None = None) -> list[T]:
        """``request(client, index)`` on every shard (or those of ``among``) at once: the first's in this thread,
        the others' in the pool; the results in that order.

        Every one is waited for before any error is raised: no socket may be left in use by a pool thread."""
        shards = list(range(len(self.clients))) if among is None else list(among)

        def call(i: int) -> T:
            return request(self.clients[i], i)

        try:
            futures = [self._pool.submit(call, i) for i in shards[1:]]
        except RuntimeError:  # the interpreter is exiting (the pool takes no more work): one shard after another
            return [call(i) for i in shards]
        results: list[Any] = []
        error: BaseException | None = None
        try:
            results.append(call(shards[0]))
        except BaseException as exc:
            error = exc
        for future in futures:
            try:
                results.append(future.result())
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error
        return results

    def _bases(self, base_version: int) -> tuple[int, ...]:
        """Each shard's base version of a push based on ``base_version`` (a reply's version)."""
        if isinstance(base_version, ShardVersions):
            return base_version.per_shard
        if self._last is not None and base_version == self._last:
            return self._last.per_shard
        raise ValueError(f"base version {base_version!r} is not one this sharded client handed out: base a push on "
                         "the version of a reply of this client")

    def _combine(self, replies: Sequence[ModelReply] | Mapping[int, ModelReply], status: str | None = None, *,
                 own: bool = False, tensors: bool = True, names: set[str] | None = None) -> ModelReply:
        """One reply from the shards' (every shard's, or by index those asked): versions kept per shard (a shard
        not asked keeps the last one known); the status given, or :func:`combined_status`; the tensors ``names``
        (None: every one)."""
        by_shard = replies if isinstance(replies, Mapping) else dict(enumerate(replies))
        known = self._last.per_shard if self._last is not None else (0,) * len(self.clients)
        version = ShardVersions([by_shard[i].version if i in by_shard else known[i] for i in range(len(self.clients))],
                                asked=list(by_shard))
        self._last = version
        answers = list(by_shard.values())
        if status is None:
            status = combined_status([r.status for r in answers])
        parts = [by_shard[i].tensors if i in by_shard else {} for i in range(len(self.clients))]
        model = self.partition.assemble(parts, names) if tensors and not own else {}
        paces = [r.pace for r in answers if r.pace is not None]
        return ModelReply(version=version, status=status, stop=any(r.stop for r in answers), tensors=model,
                          own=own, approx=any(r.approx for r in answers), ahead=any(r.ahead for r in answers),
                          part=any(r.part for r in answers), pace=min(paces) if paces else None)
