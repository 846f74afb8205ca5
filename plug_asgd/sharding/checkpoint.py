"""The model of a sharded PS's checkpoints: each shard's newest file (``DIR/shard-I``), assembled.

Each shard checkpoints only its pieces (``PSCheckpoint`` with ``ps_shards=N`` writes ``DIR/shard-0`` to
``DIR/shard-{N-1}``; shards started by hand, a ``--checkpoint-dir`` each), so no file holds the model.
:func:`read_sharded` joins them by the pieces' own names: a whole tensor under its name, a slice of a
cut one as ``name[start:stop]`` of its flat view (:class:`~plug_asgd.protocol.partition.Piece`). That needs
neither the codec the run pushed through (PowerSGD keeps some tensors whole, which changes the cut)
nor the partition's rule; what is checked is that each file was written by the shard of its folder,
that the shards agree on one partition digest, and that the pieces cover every value of the module's
tensors exactly once: a module of other names or shapes is refused, not filled with misplaced values.
The shards' versions may differ (one restarted from an older checkpoint): they are all returned.
numpy and the checkpoint format only, as the PS.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from plug_asgd.protocol.checkpoint import CheckpointError, central_tensors, read_checkpoint, resolve_checkpoint
from plug_asgd.protocol.partition import piece_span

_SHARD_DIR = re.compile(r"^shard-(\d+)$")


def shard_folders(path: str | os.PathLike[str]) -> list[Path]:
    """``path``'s folders ``shard-0`` .. ``shard-{N-1}``, in order; empty when it has none (a lone PS's folder).
    CheckpointError when some index is missing: the model cannot be assembled without every shard.

    Args:
        path: the folder of a run's checkpoints.

    Raises:
        CheckpointError: where some shard's folder is missing (the indices found are not 0 to N-1).
    """
    path = Path(path)
    if not path.is_dir():
        return []
    found = {int(m.group(1)): p for p in path.iterdir() if p.is_dir() and (m := _SHARD_DIR.match(p.name))}
    if found and sorted(found) != list(range(len(found))):
        missing = sorted(set(range(max(found) + 1)) - set(found))
        raise CheckpointError(f"{path} holds the checkpoints of shards {sorted(found)} but not of shards {missing}: "
                              "every shard's folder is needed to assemble the model")
    return [found[i] for i in sorted(found)]


def read_sharded(path: str | os.PathLike[str], shapes: Mapping[str, Sequence[int]],
                 run_id: str | None = None) -> tuple[list[int], dict[str, np.ndarray]]:
    """Each shard's version and the model assembled from the newest checkpoint (of run ``run_id``) of every
    ``path/shard-I``, as tensors of ``shapes`` (the module's parameters and float buffers).

    Args:
        path: the folder that holds the ``shard-I`` folders.
        shapes: the shape of each of the module's tensors, by name.
        run_id: the run whose checkpoints to read; None: the one run each folder holds.

    Raises:
        CheckpointError: where ``path`` holds no shard folders, a file lies in another shard's folder, the
            shards' partitions differ, or the pieces do not cover the module's tensors exactly once.
    """
    folders = shard_folders(path)
    if not folders:
        raise CheckpointError(f"{path} holds no shard-I folders of a sharded PS's checkpoints")
    count = len(folders)
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    pieces: dict[str, list[tuple[int, int, np.ndarray]]] = {name: [] for name in shapes}
    versions: list[int] = []
    digests = set()
    for i, folder in enumerate(folders):
        file = resolve_checkpoint(folder, run_id)
        msg = read_checkpoint(file)
        spec = msg.fields.get("shard", f"{i}/{count}")  # (none recorded: an older shard's, taken as it is)
        if spec != f"{i}/{count}":
            raise CheckpointError(f"{file} was written by shard {spec} of a sharded PS, and lies in the folder of "
                                  f"shard {i} of {count}: put each shard's checkpoints in shard-I, I its index")
        if msg.fields.get("partition_digest"):
            digests.add(msg.fields["partition_digest"])
        versions.append(int(msg.fields["version"]))
        for key, values in central_tensors(msg).items():
            name, start, stop = piece_span(key, shapes)
            whole_ok = key != name or values.shape == tuple(shapes[name])
            if name not in sizes or stop > sizes[name] or values.size != stop - start or not whole_ok:
                raise CheckpointError(f"{file} holds {key!r} of shape {values.shape}, no piece of the module's "
                                      "tensors: its names or shapes differ from those of the model that was trained")
            pieces[name].append((start, stop, values.reshape(-1)))
    if len(digests) > 1:
        raise CheckpointError(f"the shards' checkpoints in {path} hold models cut by {len(digests)} different "
                              "partitions: they are not one run's")
    model = {}
    for name, held in pieces.items():
        held.sort(key=lambda piece: piece[0])
        starts = [0, *(b for _, b, _ in held[:-1])]  # each piece begins where the one before ended
        if not held or [a for a, _, _ in held] != starts or held[-1][1] != sizes[name]:
            raise CheckpointError(f"the shards' checkpoints in {path} do not hold every value of {name!r} exactly "
                                  "once: the module's names or shapes differ from those of the model that was trained")
        model[name] = np.concatenate([v for _, _, v in held]).reshape(tuple(shapes[name]))
    return versions, model

