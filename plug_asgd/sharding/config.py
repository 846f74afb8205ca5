"""The strategy's side of a sharded PS: which modes and codecs work sharded, the shards' addresses, the client.

``AsyncPSStrategy(ps_shards=N)`` has rank 0 start N embedded PS processes (ports ``ps_port`` to
``ps_port + N - 1``); ``ps_shards="per_node"`` has each node's local rank 0 start one on its node
(:mod:`plug_asgd.sharding.per_node`); ``ps_address=[...]`` names shards started by hand (``plug-asgd serve-ps --shard
I/N``), in order. A setting that would work on one PS but not yet sharded is refused when the strategy
is built, saying why, rather than trained half right.

Every mode works sharded but hogwild, each shard folding its slices by the mode's rule: the asynchronous
modes fold every push as one PS would; the synchronous ones run their rounds on each shard, and a
worker's push is done once every shard has answered it (with the default ``replicas_to_aggregate``,
every training worker, each shard's round holds the same pushes; with fewer, each shard averages the
first ones it received, which may be other workers' on another shard); the elastic modes pull the
assembled center and push each shard its slice of ``alpha * (w - center)``. Every codec works: dense and
sparse updates are cut by the partition, bf16, qsgd and sign updates by their codec (each slice decodes
as the whole would), and the matrices PowerSGD factors stay whole on one shard (:func:`make_partition`).
Embedded shards keep their checkpoints, resume and metrics in a folder each (:func:`shard_folder`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from plug_asgd.compressors import Codec, NoCompression
from plug_asgd.modes import Mode
from plug_asgd.protocol.partition import Partition
from plug_asgd.sharding.client import ShardedClient
from plug_asgd.sharding.per_node import PER_NODE
from plug_asgd.worker.client import PSClient

# The modes that work sharded: each shard folds its slices by the mode's rule (see the module's docstring).
SHARDED_MODES = ("asgd", "adacomp", "dynsgd", "ssp", "downpour", "agn", "sync", "localsgd", "sagn", "osp", "losp",
                 "easgd", "eamsgd", "diloco", "async_diloco")
# The modes that do not, and why.
UNSHARDED_MODES = {"hogwild": "its workers step one model in the shared memory of one machine and the PS holds no "
                              "model at all: there is nothing to shard"}
# The codecs that work sharded: dense and sparse updates cut by index, bf16/qsgd/sign by their codec
# (Codec.slice_packed), PowerSGD's matrices kept whole (Codec.keeps_whole).
SHARDED_CODECS = ("none", "fp16", "bf16", "topk", "randomk", "qsgd", "sign", "powersgd")


def shard_count(ps_address: str | Sequence[str] | None, ps_shards: int | str | None) -> int | str:
    """How many shards the strategy's arguments name (1: one PS; ``"per_node"``: one per node, counted once the
    job's nodes are known); refuses a count that contradicts the list.

    Args:
        ps_address: the strategy's ``ps_address``: one address, one per shard, or None (embedded).
        ps_shards: the strategy's ``ps_shards``: a count, ``"per_node"``, or None (as many as addresses).

    Raises:
        ValueError: where ``ps_shards`` is not a count >= 1 nor ``"per_node"``, ``"per_node"`` comes with
            addresses, the list is empty, or the count is not the list's length.
    """
    if ps_shards == PER_NODE:
        if ps_address is not None:
            raise ValueError("ps_shards='per_node' starts one embedded shard on each node, and ps_address names a PS "
                             "started by hand: give one or the other")
        return PER_NODE
    if ps_shards is not None and (isinstance(ps_shards, bool) or not isinstance(ps_shards, int) or ps_shards < 1):
        raise ValueError(f"ps_shards must be an integer >= 1 or 'per_node' (one shard on each node), got "
                         f"{ps_shards!r}")
    if ps_address is None or isinstance(ps_address, str):
        return ps_shards or 1
    if not ps_address:
        raise ValueError("ps_address=[] names no PS: give one address, or one per shard")
    if ps_shards is not None and ps_shards != len(ps_address):
        raise ValueError(f"ps_shards={ps_shards} but ps_address lists {len(ps_address)} shards: the list alone says "
                         "how many shards there are")
    return len(ps_address)


def check_sharded(mode: Mode, codec: Codec, shards: int | str) -> None:
    """Refuses, when the strategy is built, a mode or codec not known to work sharded (``shards``: a count, or
    ``"per_node"``, refused alike: the job may have several nodes).

    Args:
        mode: the strategy's mode.
        codec: the strategy's compressor.
        shards: the shard count (:func:`shard_count`).

    Raises:
        ValueError: where the mode or the codec is not known to work sharded.
    """
    if shards == 1:
        return
    if mode.name in UNSHARDED_MODES:
        raise ValueError(f"mode={mode.name!r} takes no sharded PS (ps_shards={shards!r}): "
                         f"{UNSHARDED_MODES[mode.name]}. Leave ps_shards and ps_address unset (one PS serves its "
                         "barriers)")
    if mode.name not in SHARDED_MODES:
        raise ValueError(f"mode={mode.name!r} is not known to work on a sharded PS (ps_shards={shards!r}); the modes "
                         f"that do: {', '.join(SHARDED_MODES)}. Use one of them, or one PS")
    if codec.name not in SHARDED_CODECS:
        raise ValueError(f"compressor={codec.name!r} is not known to work on a sharded PS (ps_shards={shards!r}); "
                         f"the codecs that do: {', '.join(SHARDED_CODECS)}. Use one of them, or one PS")


def sharded(ps_address: str | Sequence[str] | None, ps_shards: int | str | None, mode: Mode,
            codec: Codec) -> int | str:
    """The shard count of the strategy's arguments (:func:`shard_count`), once :func:`check_sharded` let it be.

    Args:
        ps_address: the strategy's ``ps_address`` (see :func:`shard_count`).
        ps_shards: the strategy's ``ps_shards`` (see :func:`shard_count`).
        mode: the strategy's mode.
        codec: the strategy's compressor.
    """
    shards = shard_count(ps_address, ps_shards)
    check_sharded(mode, codec, shards)
    return shards


def shard_folder(path: str | os.PathLike[str] | None, shard: str | None) -> Path | None:
    """Where embedded shard ``"I/N"`` keeps what a lone embedded PS keeps in ``path``: ``path/shard-I``.

    Each shard checkpoints its own pieces, and resumes from its own folder (``resume_from=DIR`` of a
    sharded run: ``DIR/shard-0``, ``DIR/shard-1``...); a shard checkpoint records its ``I/N``, so one
    resumed from another shard's folder is refused. A lone PS (``shard`` None) keeps ``path`` as it is.

    Args:
        path: the folder a lone embedded PS would use (checkpoints, resume, metrics), or None.
        shard: the embedded PS's ``"I/N"``, or None for a lone PS.
    """
    if path is None or shard is None:
        return None if path is None else Path(path)
    return Path(path) / f"shard-{shard.split('/')[0]}"


def shards(binds: Sequence[str]) -> list[tuple[str, str | None]]:
    """Each embedded PS's bind address and its ``--shard`` (``"I/N"``; None for a lone PS).

    Args:
        binds: the embedded PS processes' bind addresses, in shard order.
    """
    return [(bind, f"{i}/{len(binds)}" if len(binds) > 1 else None) for i, bind in enumerate(binds)]


def make_partition(shapes: Mapping[str, Sequence[int]], shards: int, codec: Codec | None = None) -> Partition:
    """The partition of a model of ``shapes`` over ``shards`` shards for workers that push through ``codec``.

    The codec decides which tensors stay whole (:meth:`Codec.keeps_whole`: those PowerSGD factors), so every
    worker, the Supervisor and any bystander that assembles the model must name the run's codec; the
    partition's digest, which each shard checks, then differs where a worker names another that cuts
    otherwise.

    Args:
        shapes: the shape of each of the model's tensors, by name.
        shards: the number of shards.
        codec: the codec the workers push through; None: no compression.
    """
    codec = codec if codec is not None else NoCompression()
    whole = [name for name, shape in shapes.items() if codec.keeps_whole(tuple(int(d) for d in shape))]
    return Partition(shapes, shards, whole=whole)


def connect(addresses: Sequence[str], shapes: Mapping[str, Sequence[int]], codec: Codec | None = None,
            **client_options: Any) -> PSClient | ShardedClient:
    """A PSClient for one PS; a ShardedClient over the partition of ``shapes`` (for ``codec``) for several.

    Args:
        addresses: the PS's address, or each shard's, in shard order.
        shapes: the shape of each of the model's tensors, by name.
        codec: the codec the workers push through; None: no compression.
        **client_options: passed to each :class:`~plug_asgd.worker.client.PSClient`.
    """
    if len(addresses) == 1:
        return PSClient(addresses[0], **client_options)
    return ShardedClient(addresses, make_partition(shapes, len(addresses), codec), **client_options)
