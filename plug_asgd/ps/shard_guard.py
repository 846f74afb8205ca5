"""What a PS checks of a worker's partition (:mod:`plug_asgd.protocol.partition`) in its hello and init.

A shard started with ``--shard I/N`` takes only workers that spread the model over N shards and take
it for shard I; the first accepted request that names a partition digest fixes it, and a later worker
whose model is cut otherwise (other names or shapes) is refused. A PS started without ``--shard``
refuses a worker that believes it is one of several shards. Every refusal says what to do.

A request that is refused fixes nothing: :meth:`ShardGuard.check` only compares, and the server calls
:meth:`ShardGuard.fix` once the hello or init is accepted. A digest fixed by hellos alone, before any
model exists, holds only as the world size does (while a worker that said hello can still be counted
on, :meth:`~plug_asgd.ps.membership.Membership.claimed`): a hello that squatted a free rank with a
digest of its own and went away does not lock the run out. Once a model exists (an accepted init, a
resumed checkpoint), its digest is final.

A shard's checkpoint records its ``I/N`` and that digest (:meth:`ShardGuard.checkpoint_fields`), so a
shard resumed from it (:meth:`ShardGuard.restore`) refuses the checkpoint of another shard, and refuses
from the first hello a worker whose partition is not the one its pieces were cut by: without the
digest, a resumed shard would take whatever the first worker brought, and fold a differently cut
model's slices into its own.
"""

from __future__ import annotations

from typing import Any

from plug_asgd.protocol.checkpoint import CheckpointError
from plug_asgd.protocol.partition import parse_shard
from plug_asgd.protocol.wire import WireError

CODE = "partition_mismatch"


class ShardGuard:
    """This PS's shard (``"I/N"``, None: the whole model) and the partition digest its workers agree on.

    Args:
        shard: ``"I/N"``: this PS holds shard I of N; None: it holds the whole model.
    """

    def __init__(self, shard: str | None) -> None:
        self.index, self.count = parse_shard(shard) if shard is not None else (0, 1)
        self.sharded = shard is not None
        self.digest: str | None = None
        self.final = False  # fixed by the model itself (an accepted init, a checkpoint), not by hellos alone

    @property
    def spec(self) -> str | None:
        """``"I/N"``, or None for a PS that holds the whole model."""
        return f"{self.index}/{self.count}" if self.sharded else None

    def checkpoint_fields(self) -> dict[str, Any]:
        """What a checkpoint records of this PS's place: ``shard`` (``"I/N"``, None: the whole model) and the
        partition digest its workers agreed on (None before the first worker named one, or unsharded)."""
        return {"shard": self.spec, "partition_digest": self.digest}

    def restore(self, fields: dict[str, Any], path: Any) -> None:
        """Refuse (CheckpointError) a checkpoint written by another shard, or by a PS of another shard count
        (one that held the whole model included); take its partition digest.

        A checkpoint without a ``shard`` field was written before it was recorded: it is taken as it is, its
        digest left to the first worker, as then.

        Args:
            fields: the checkpoint's header fields (``shard``, ``partition_digest``).
            path: the checkpoint's path, for the error message.

        Raises:
            CheckpointError: where the checkpoint's shard is not this PS's.
        """
        if "shard" not in fields:
            return
        saved = fields["shard"]
        if saved != self.spec:
            if self.spec is None:
                what = f"this PS holds the whole model (started without --shard): start it with --shard {saved}"
            elif saved is None:
                what = (f"this PS is shard {self.spec} and that checkpoint holds a whole model (written by a PS "
                        "started without --shard): resume it without --shard, or start the shards afresh")
            else:
                what = (f"this PS was started as shard {self.spec}: resume each shard from its own checkpoints "
                        f"(this one with --shard {saved})")
            raise CheckpointError(f"{path} was written by "
                                  + (f"shard {saved} of a sharded PS" if saved else "a PS holding the whole model")
                                  + f"; {what}")
        digest = fields.get("partition_digest")
        if self.sharded and isinstance(digest, str) and 0 < len(digest) <= 64:
            self.digest, self.final = digest, True

    def fix(self, digest: str | None, *, final: bool, held: bool = True) -> None:
        """A hello or init that named ``digest`` (what :meth:`check` returned) was accepted: the first fixes it.

        Args:
            digest: the partition digest the request named; None: it named none (a whole model's worker).
            final: whether a model exists now (an init was accepted, or the PS resumed): the digest is then fixed
                for good.
            held: whether a digest fixed by hellos alone still holds (a worker that said hello can still be counted
                on); where not, this one replaces it.
        """
        if digest is None or not self.sharded:
            return
        if self.digest is None or not (self.final or held):
            self.digest = digest
        self.final = self.final or (final and digest == self.digest)

    def check(self, fields: dict[str, Any], address: str = "", *, held: bool = True) -> str | None:
        """Refuses (``partition_mismatch``) a hello or init whose ``partition`` field this shard cannot take; returns
        the digest it names (None: none), for :meth:`fix` once the request is accepted. It changes nothing.

        Args:
            fields: the request's header fields; its ``partition`` is None for a worker of a whole model.
            address: this PS's address, for the error message.
            held: whether a digest fixed by hellos alone still holds; where not, it is not compared.

        Raises:
            WireError: ``partition_mismatch`` where the worker's partition is not this shard's (whole model or
                sharded, shard count, shard index, or digest); ``bad_field`` where the field is malformed.
        """
        part = fields.get("partition")
        here = f"the parameter server {address}".rstrip()
        if part is None:
            if self.sharded:
                raise WireError(CODE, f"{here} holds shard {self.index}/{self.count} of a sharded model and the "
                                      f"worker asked for the whole model: give the strategy every shard's address, "
                                      f"in order (ps_address=[...]), or start one PS without --shard")
            return None
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
        if self.digest is not None and (self.final or held) and digest != self.digest:
            raise WireError(CODE, f"{here} (shard {self.index}/{self.count}) holds a model cut by partition "
                                  f"{self.digest} and the worker cuts its own as {digest}: its tensors' names or "
                                  "shapes differ from those of the workers that came first, or its compressor "
                                  "keeps other tensors whole. Train the same model with the same compressor on "
                                  "every worker, or restart the shards for this one")
        return digest
