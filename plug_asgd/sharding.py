"""The strategy's side of a sharded PS: which modes and codecs work sharded, the shards' addresses, the client.

``AsyncPSStrategy(ps_shards=N)`` has rank 0 start N embedded PS processes (ports ``ps_port`` to
``ps_port + N - 1``); ``ps_address=[...]`` names shards started by hand (``plug-asgd serve-ps --shard
I/N``), in order. A setting that would work on one PS but not yet sharded is refused when the strategy
is built, saying what works, rather than trained half right. Embedded shards keep their checkpoints,
resume and metrics in a folder each (:func:`shard_folder`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plug_asgd.client import PSClient
from plug_asgd.compressors import Codec
from plug_asgd.modes import Mode
from plug_asgd.ps.partition import Partition
from plug_asgd.sharded_client import ShardedClient

# Modes whose every version is one push folded in, piece by piece, by the same rule on each shard: the sharded
# fold is the one PS's on every slice. Not (yet): the synchronous rounds (sync, localsgd, sagn, osp, losp: one
# shard could drop a push another applies), the overlapped and elastic exchanges, hogwild (no PS traffic).
SHARDED_MODES = ("asgd", "adacomp", "dynsgd", "ssp", "downpour")
# Codecs whose update can be cut into slices (dense, or sparse by index); a packed form (bf16, qsgd, sign,
# powersgd) describes a whole tensor.
SHARDED_CODECS = ("none", "fp16", "topk", "randomk")


def shard_count(ps_address: str | Sequence[str] | None, ps_shards: int | None) -> int:
    """How many shards the strategy's arguments name (1: one PS); refuses a count that contradicts the list."""
    if ps_shards is not None and (isinstance(ps_shards, bool) or not isinstance(ps_shards, int) or ps_shards < 1):
        raise ValueError(f"ps_shards must be an integer >= 1, got {ps_shards!r}")
    if ps_address is None or isinstance(ps_address, str):
        return ps_shards or 1
    if not ps_address:
        raise ValueError("ps_address=[] names no PS: give one address, or one per shard")
    if ps_shards is not None and ps_shards != len(ps_address):
        raise ValueError(f"ps_shards={ps_shards} but ps_address lists {len(ps_address)} shards: the list alone says "
                         "how many shards there are")
    return len(ps_address)


def check_sharded(mode: Mode, codec: Codec, shards: int, **refused: Any) -> None:
    """Refuses, when the strategy is built, what does not work sharded yet; ``refused``: options that must be unset."""
    if shards == 1:
        return
    if mode.name not in SHARDED_MODES or mode.exchange != "push":
        raise ValueError(f"mode={mode.name!r}{' with overlap' if getattr(mode, 'overlap', False) else ''} does not "
                         f"work on a sharded PS yet (ps_shards={shards}); the modes that do: "
                         f"{', '.join(SHARDED_MODES)} (without overlap). Use one of them, or one PS")
    if codec.name not in SHARDED_CODECS:
        raise ValueError(f"compressor={codec.name!r} sends a packed form of each tensor, which cannot be cut over "
                         f"shards; on a sharded PS use one of {', '.join(SHARDED_CODECS)}, or one PS")
    for name, value in refused.items():
        if value not in (None, False):
            raise ValueError(f"{name} does not work on a sharded PS yet (ps_shards={shards}): leave it unset, or "
                             "use one PS")


def sharded(ps_address: str | Sequence[str] | None, ps_shards: int | None, mode: Mode, codec: Codec,
            **refused: Any) -> int:
    """The shard count of the strategy's arguments (:func:`shard_count`), once :func:`check_sharded` let it be."""
    shards = shard_count(ps_address, ps_shards)
    check_sharded(mode, codec, shards, **refused)
    return shards


def shard_folder(path: str | os.PathLike[str] | None, shard: str | None) -> Path | None:
    """Where embedded shard ``"I/N"`` keeps what a lone embedded PS keeps in ``path``: ``path/shard-I``.

    Each shard checkpoints its own pieces, and resumes from its own folder (``resume_from=DIR`` of a
    sharded run: ``DIR/shard-0``, ``DIR/shard-1``...); a shard checkpoint records its ``I/N``, so one
    resumed from another shard's folder is refused. A lone PS (``shard`` None) keeps ``path`` as it is."""
    if path is None or shard is None:
        return None if path is None else Path(path)
    return Path(path) / f"shard-{shard.split('/')[0]}"


def shards(binds: Sequence[str]) -> list[tuple[str, str | None]]:
    """Each embedded PS's bind address and its ``--shard`` (``"I/N"``; None for a lone PS)."""
    return [(bind, f"{i}/{len(binds)}" if len(binds) > 1 else None) for i, bind in enumerate(binds)]


def connect(addresses: Sequence[str], shapes: Mapping[str, Sequence[int]], **client_options: Any
            ) -> PSClient | ShardedClient:
    """A PSClient for one PS; a ShardedClient over the partition of ``shapes`` for several."""
    if len(addresses) == 1:
        return PSClient(addresses[0], **client_options)
    return ShardedClient(addresses, Partition(shapes, len(addresses)), **client_options)
