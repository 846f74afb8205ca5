"""How a model is spread over the shards of a sharded PS: a pure function of the names, shapes and shard count.

Every worker computes it from its own module and every shard gets only its pieces, so nothing but
the result's digest needs to be agreed on (each worker's hello carries it; a shard refuses one that
differs). A tensor of more than ``max_piece`` values is cut into contiguous slices of its flat
view, each at most ``max_piece`` (as BytePS cuts large tensors), so one large layer does not make
one shard the bottleneck. A tensor named in ``whole`` is never cut: a codec that packs a tensor as a
whole (PowerSGD's factors of the matrix) says which (:meth:`plug_asgd.compressors.Codec.keeps_whole`),
and every worker, sharing the codec, names the same ones. The pieces then go, largest first, to the
least loaded shard (LPT): each shard ends at most one piece above the mean, so ``max load / mean <= 1
+ shards * largest piece / total``; the default ``max_piece`` (a quarter of a shard's mean share)
bounds that at 1.25 where no tensor larger than it is kept whole.

numpy, the wire and the codecs only: the PS imports this, and must not import torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from plug_asgd.protocol.wire import Packed, Sparse, Tensor

# pieces per shard that the default max_piece aims at: max load / mean <= 1 + 1 / PIECES_PER_SHARD
PIECES_PER_SHARD = 4


def parse_shard(spec: str) -> tuple[int, int]:
    """``"I/N"`` (serve-ps --shard) as ``(I, N)``, ``0 <= I < N``; a ValueError that says the form otherwise.

    Args:
        spec: the text given, ``"I/N"``: this PS holds shard ``I`` of ``N``, counted from 0.

    Raises:
        ValueError: where ``spec`` is not two integers ``I/N`` with ``0 <= I < N``.
    """
    try:
        index_text, count_text = spec.split("/")
        index, count = int(index_text), int(count_text)
    except ValueError:
        raise ValueError(f"shard must be I/N (this PS holds shard I of N, counted from 0: 0/2 and 1/2), "
                         f"got {spec!r}") from None
    if not (count >= 1 and 0 <= index < count):
        raise ValueError(f"shard I/N needs 0 <= I < N, got {spec!r}")
    return index, count


_SLICE_KEY = re.compile(r"^(.*)\[(\d+):(\d+)\]$")  # Piece.key of a slice


def piece_span(key: str, shapes: Mapping[str, Sequence[int]]) -> tuple[str, int, int]:
    """(tensor name, start, stop) of the piece named ``key`` (:attr:`Piece.key`): ``name[start:stop]`` of a cut
    tensor's flat view, or a whole tensor of ``shapes`` (an unknown name: ``(key, 0, 0)``).

    Args:
        key: the piece's name, a tensor's name or ``name[start:stop]``.
        shapes: the model's tensor shapes by name; a key found here is a whole tensor even where it looks
            like a slice.
    """
    match = _SLICE_KEY.match(key)
    if match and key not in shapes:
        return match.group(1), int(match.group(2)), int(match.group(3))
    return key, 0, math.prod(shapes[key]) if key in shapes else 0


@dataclass(frozen=True)
class Piece:
    """Values ``start:stop`` of tensor ``name``'s flat view, held by shard ``shard`` under the name ``key``.

    Attributes:
        name: the tensor's name in the model.
        start: the first value of the piece in the tensor's flat view.
        stop: one past its last value.
        shard: the index of the shard that holds it.
        whole: whether it is the whole tensor, held under its own name and shape.
    """

    name: str
    start: int
    stop: int
    shard: int
    whole: bool  # the whole tensor, under its own name and shape

    @property
    def key(self) -> str:
        """The name its shard holds it under: the tensor's name where whole, else ``name[start:stop]``."""
        return self.name if self.whole else f"{self.name}[{self.start}:{self.stop}]"

    @property
    def size(self) -> int:
        """Values it holds."""
        return self.stop - self.start


class Partition:
    """The pieces of a model over ``shards`` shards; see the module's docstring for the rule.

    Args:
        shapes: the model's tensor shapes by name.
        shards: how many shards the model is spread over.
        max_piece: the most values of a piece a tensor is cut into; None for a quarter of a shard's mean share.
        whole: names of tensors never cut (see the module's docstring); names not in ``shapes`` are ignored.

    Raises:
        ValueError: where ``shards`` or ``max_piece`` is below 1, or the model has fewer values than shards.
    """

    def __init__(self, shapes: Mapping[str, Sequence[int]], shards: int, max_piece: int | None = None,
                 whole: Collection[str] = ()) -> None:
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        self.shards = shards
        self.shapes = {name: tuple(int(d) for d in shapes[name]) for name in sorted(shapes)}
        sizes = {name: math.prod(shape) for name, shape in self.shapes.items()}
        total = sum(sizes.values())
        if total < shards:
            raise ValueError(f"a model of {total} values cannot be spread over {shards} shards: use fewer shards")
        self.max_piece = max(1, total // (PIECES_PER_SHARD * shards)) if max_piece is None else max_piece
        if self.max_piece < 1:
            raise ValueError(f"max_piece must be >= 1, got {max_piece}")
        cuts: list[tuple[str, int, int, bool]] = []
        for name, size in sizes.items():
            count = 1 if name in whole else max(1, -(-size // self.max_piece))
            bounds = [size * i // count for i in range(count + 1)]
            cuts += [(name, a, b, count == 1) for a, b in zip(bounds, bounds[1:], strict=False)]
        loads = [0] * shards
        pieces = []
        for name, a, b, whole in sorted(cuts, key=lambda c: (-(c[2] - c[1]), c[0], c[1])):
            shard = loads.index(min(loads))  # the least loaded, the lowest index among equals
            loads[shard] += b - a
            pieces.append(Piece(name, a, b, shard, whole))
        self.pieces = tuple(sorted(pieces, key=lambda p: (p.name, p.start)))
        self.loads = tuple(loads)
        self.by_shard = tuple(tuple(p for p in self.pieces if p.shard == s) for s in range(shards))
        text = json.dumps([shards, [[n, list(s)] for n, s in self.shapes.items()],
                           [[p.name, p.start, p.stop, p.shard] for p in self.pieces]], separators=(",", ":"))
        self.digest = hashlib.sha256(text.encode()).hexdigest()[:32]

    def split(self, tensors: Mapping[str, Tensor],
              slice_packed: Callable[[Packed, int, int], Packed] | None = None) -> list[dict[str, Tensor]]:
        """Each shard's pieces of ``tensors`` (any subset of the model's names): views where they can be.

        A dense array is sliced on its flat view, a sparse update by its indices (those of a slice are
        counted from its start), a packed update (a codec's own form) by ``slice_packed`` (its codec's,
        :func:`plug_asgd.compressors.slice_packed`), where its decoding is elementwise (bf16, qsgd, sign: each
        slice decodes to the values the whole would, bit for bit); a tensor that a codec packs as a whole
        (PowerSGD) must be kept whole (``whole``).

        Args:
            tensors: the tensors (dense, sparse or packed) by model name.
            slice_packed: cuts a packed update to the values ``start:stop`` of its flat view; None where no
                packed tensor is cut.

        Raises:
            ValueError: where a packed update of a cut tensor cannot be sliced (no ``slice_packed``, or its
                codec packs the tensor as a whole).
        """
        out: list[dict[str, Tensor]] = [{} for _ in range(self.shards)]
        for piece in self.pieces:
            if piece.name not in tensors:
                continue
            t = tensors[piece.name]
            if piece.whole:
                out[piece.shard][piece.key] = t
            elif isinstance(t, Sparse):
                lo, hi = np.searchsorted(t.indices, [piece.start, piece.stop])
                out[piece.shard][piece.key] = Sparse(indices=t.indices[lo:hi] - piece.start, values=t.values[lo:hi],
                                                     shape=(piece.size,))
            elif isinstance(t, Packed):
                try:
                    if slice_packed is None:
                        raise ValueError("no codec was given to cut it")
                    out[piece.shard][piece.key] = slice_packed(t, piece.start, piece.stop)
                except ValueError as exc:
                    raise ValueError(f"tensor {piece.name!r} is cut over shards and its update is packed by codec "
                                     f"{t.codec!r}: {exc}. Build the partition with the codec's whole tensors "
                                     "(plug_asgd.sharding.config.make_partition)") from exc
            else:
                out[piece.shard][piece.key] = np.asarray(t).reshape(-1)[piece.start:piece.stop]
        return out

    def assemble(self, parts: Sequence[Mapping[str, np.ndarray]],
                 names: Collection[str] | None = None) -> dict[str, np.ndarray]:
        """The model from each shard's pieces (a whole tensor as its shard sent it; a cut one joined, a copy).

        Args:
            parts: each shard's pieces by piece key, in shard order.
            names: the tensors to assemble, in the model's order whatever order they come in (a push of some
                tensors only: streaming DiLoCo's fragments); None: every tensor of the model.

        Raises:
            KeyError: where a shard did not send one of its pieces (it serves another model, or shards are
                out of order).
        """
        out: dict[str, np.ndarray] = {}
        cut: dict[str, list[np.ndarray]] = {}
        for piece in self.pieces:
            if names is not None and piece.name not in names:
                continue
            part = parts[piece.shard]
            if piece.key not in part:
                raise KeyError(f"shard {piece.shard} sent no {piece.key!r}: is it serving another model? Restart "
                               "the shards, or point ps_address at this run's shards, in order")
            if piece.whole:
                out[piece.name] = part[piece.key]
            else:
                cut.setdefault(piece.name, []).append(np.asarray(part[piece.key]).reshape(-1))
        for name, slices in cut.items():
            out[name] = np.concatenate(slices).reshape(self.shapes[name])
        return {name: out[name] for name in self.shapes if name in out}

    def describe(self) -> dict[str, int | str]:
        """What a worker tells each shard in its hello: the shard count and the partition's digest."""
        return {"shards": self.shards, "digest": self.digest}
