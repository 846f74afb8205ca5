"""The parameter server, in parts (the picture: ``docs/design.md``, "The parameter server").

- :mod:`~plug_asgd.ps.config`: :class:`PSConfig`, every option of a PS;
- :mod:`~plug_asgd.ps.server`: the serving loop (socket, CURVE, dispatch, error replies);
- :mod:`~plug_asgd.ps.model_requests`: the ``init``, ``pull`` and ``push`` handlers and their model replies;
- :mod:`~plug_asgd.ps.membership`: hello and bye, heartbeats, lost and taken back;
- :mod:`~plug_asgd.ps.gathers`: the gather behind barriers, broadcasts and reductions;
- :mod:`~plug_asgd.ps.store`, :mod:`~plug_asgd.ps.reference_store` and :mod:`~plug_asgd.ps.fast_store`: the
  central tensors, their fold and who owns each buffer (what every store does, the reference store, and the one
  that serves); :mod:`~plug_asgd.ps.store_records`: what a push brings in, what becomes of it, what a checkpoint
  keeps;
- :mod:`~plug_asgd.ps.persistence` and :mod:`~plug_asgd.ps.stats`: checkpoints, metrics, counters;
- :mod:`~plug_asgd.ps.disk`: failed writes counted and retried, the file-descriptor limit;
- :mod:`~plug_asgd.ps.embedded`: the PS as a process of its own;
- :mod:`~plug_asgd.protocol.partition` and :mod:`~plug_asgd.ps.shard_guard`: a model cut over the shards of a
  sharded PS, and what a shard checks of its workers' partition.

The PS knows nothing of torch or Lightning: it holds named float arrays.
"""

from plug_asgd.ps.config import DEFAULT_WORKER_TIMEOUT, PSConfig
from plug_asgd.ps.disk import raise_fd_limit
from plug_asgd.ps.embedded import embedded_command
from plug_asgd.ps.server import ParameterServer

__all__ = ["DEFAULT_WORKER_TIMEOUT", "PSConfig", "ParameterServer", "embedded_command", "raise_fd_limit"]
