"""What a PS checks of a worker's partition (:mod:`plug_asgd.ps.partition`) in its hello and init.

A shard started with ``--shard I/N`` takes only workers that spread the model over N shards and take
it for shard I; the first worker to name a partition digest fixes it (as the first hello fixes the
world size), and a later worker whose model is cut otherwise (other names or shapes) is refused. A
PS started without ``--shard`` refuses a worker that believes it is one of several shards. Every
refusal says what to do.
"""

from __future__ import annotations

from typing import Any

from plug_asgd.ps.partition import parse_shard
from plug_asgd.wire import WireError

CODE = "partition_mismatch"


class ShardGuard:
    """This PS's shard (``"I/N"``, None: the whole model) and the partition digest its workers agree on."""

    def __init__(self, shard: str | None) -> None:
        self.index, self.count = parse_shard(shard) if shard is not None else (0, 1)
        self.sharded = shard is not None
        self.digest: str | None = None

    def check(self, fields: dict[str, Any], address: str = "") -> None:
        """Refuses (``partition_mismatch``) a hello or init whose ``partition`` field this shard cannot take."""
        part = fields.get("partition")
        here = f"the parameter server {address}".rstrip()
        if part is None:
            if self.sharded:
                raise WireError(CODE, f"{here} holds shard {self.index}/{self.count} of a sharded model and the "
                                      f"worker asked for the whole model: give the strategy every shard's address, "
                                      f"in order (ps_address=[...]), or start one PS without --shard")
            return
        if not (isinstance(part, dict) and isinstance(part.get("shards"), int) and isinstance(part.get("shard"), int)
                and isinstance(part.get("digest"), str) and 0 < len(part["digest"]) <= 64):
            raise WireError("bad_field", "field 'partition' must be {shards: int, shard: int, digest: str}")
        shards, shard, digest = part["shards"], part["shard"], part["digest"]
        if not self.sharded:
            raise WireError(CODE, f"{here} holds the whole model (started without --shard) and the worker spreads "
                                  f"it over {shards} shards: start each shard with `plug-asgd serve-ps --shard "
                                  f"I/{shards}`, or give the strategy this one address")
        if shards != self.count:
            raise WireError(CODE, f"{here} is shard {self.index} of {self.count} and the worker spreads the model "
                                  f"over {shards} shards: give the strategy the {self.count} shards' addresses "
                                  f"(ps_address=[...] or ps_shards={self.count}), or restart the shards with "
                                  f"--shard I/{shards}")
        if shard != self.index:
            raise WireError(CODE, f"{here} is shard {self.index}/{self.count} and the worker took it for shard "
                                  f"{shard}: list the shards' addresses in the order of their --shard")
        if self.digest is None:
            self.digest = digest
        elif digest != self.digest:
            raise WireError(CODE, f"{here} (shard {self.index}/{self.count}) holds a model cut by partition "
                                  f"{self.digest} and the worker cuts its own as {digest}: its tensors' names or "
                                  "shapes differ from those of the workers that came first, or its compressor "
                                  "keeps other tensors whole. Train the same model with the same compressor on "
                                  "every worker, or restart the shards for this one")
