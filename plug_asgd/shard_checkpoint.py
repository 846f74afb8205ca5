"""The model of a sharded PS's checkpoints: each shard's newest file (``DIR/shard-I``), assembled.

Each shard checkpoints only its pieces (``PSCheckpoint`` with ``ps_shards=N`` writes ``DIR/shard-0`` to
``DIR/shard-{N-1}``; shards started by hand, a ``--checkpoint-dir`` each), so no file holds the model.
:func:`read_sharded` joins them by the partition of the module's own shapes, after checking that each
file was written by the shard of its folder and that the pieces were cut by that same partition (the
digest the shard recorded): a module of other shapes is refused, not filled with misplaced values.
The shards' versions may differ (one restarted from an older checkpoint): they are all returned.
numpy and the checkpoint format only, as the PS.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from plug_asgd.checkpoint import CheckpointError, central_tensors, read_checkpoint, resolve_checkpoint
from plug_asgd.ps.partition import Partition

_SHARD_DIR = re.compile(r"^shard-(\d+)$")


def shard_folders(path: str | os.PathLike[str]) -> list[Path]:
    """``path``'s folders ``shard-0`` .. ``shard-{N-1}``, in order; empty when it has none (a lone PS's folder).
    CheckpointError when some index is missing: the model cannot be assembled without every shard."""
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
    ``path/shard-I``, cut by the partition of ``shapes`` (the module's parameters and float buffers)."""
    folders = shard_folders(path)
    if not folders:
        raise CheckpointError(f"{path} holds no shard-I folders of a sharded PS's checkpoints")
    part = Partition(shapes, len(folders))
    versions, parts = [], []
    for i, folder in enumerate(folders):
        file = resolve_checkpoint(folder, run_id)
        msg = read_checkpoint(file)
        spec = msg.fields.get("shard", f"{i}/{len(folders)}")  # (none recorded: an older shard's, taken as it is)
        if spec != f"{i}/{len(folders)}":
            raise CheckpointError(f"{file} was written by shard {spec} of a sharded PS, and lies in the folder of "
                                  f"shard {i} of {len(folders)}: put each shard's checkpoints in shard-I, I its index")
        digest = msg.fields.get("partition_digest")
        if digest is not None and digest != part.digest:
            raise CheckpointError(f"{file} holds pieces cut by partition {digest}, and the module's tensors cut "
                                  f"over {len(folders)} shards give {part.digest}: its names or shapes differ from "
                                  "those of the model that was trained")
        versions.append(int(msg.fields["version"]))
        parts.append(central_tensors(msg))
    try:
        return versions, part.assemble(parts)
    except KeyError as exc:
        raise CheckpointError(f"the shards' checkpoints in {path} do not hold the module's pieces: {exc}") from None
