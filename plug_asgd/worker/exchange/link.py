"""What the strategy hands an exchange for one stage (:class:`Link`): the PS's client and the worker's side of
Lightning."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from plug_asgd.worker.client import PSClient

if TYPE_CHECKING:  # a sharded PS's client, which wraps this folder's (plug_asgd.sharding)
    from plug_asgd.sharding.client import ShardedClient


@dataclass
class Link:
    """What the strategy hands an exchange for one stage: the PS client and the worker's side of Lightning.

    Attributes:
        client: the PS's client, or a sharded PS's (every shard's).
        tensors: returns the floating-point parameters and buffers the PS holds, by name.
        rank: this worker's global rank.
        world_size: the number of workers.
        stage: the number of the stage, among this process's stages.
        fitting: whether the stage is a fit.
        barrier: a barrier of every worker, through the PS, by name.
        stop: asks Lightning to stop this fit (the PS said so).
        shared_tag: names hogwild's shared-memory file, one per stage.
        one_cpu_machine: every worker is on this machine's CPU (what hogwild needs).
    """

    client: PSClient | ShardedClient  # one PS's, or every shard's of a sharded PS
    tensors: Callable[[], dict[str, Tensor]]  # the floating-point parameters and buffers the PS holds
    rank: int
    world_size: int
    stage: int
    fitting: bool
    barrier: Callable[[str], None]  # a barrier of every worker, through the PS
    stop: Callable[[], None]  # ask Lightning to stop this fit (the PS said so)
    shared_tag: str = ""  # names hogwild's shared-memory file, one per stage
    one_cpu_machine: bool = True  # every worker on this machine's CPU (what hogwild needs)
