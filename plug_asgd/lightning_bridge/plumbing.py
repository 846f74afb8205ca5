"""What Lightning asks of a parallel strategy (devices, ranks, launcher, sampler), answered as its DDP strategy does.

Written once for both Lightning namespaces, as :class:`~plug_asgd.strategy.AsyncPSStrategy` is: it
imports neither; the namespace's launchers and torchrun environment are class attributes that
``plug_asgd.pytorch_lightning`` and ``plug_asgd.lightning`` set.
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only
from typing_extensions import override

from plug_asgd.lightning_bridge.namespaces import LightningBound

# after a rank failed, how long the ranks its process launched may take to stop by themselves (the PS tells them at
# their next request) before they are killed
FAILED_GRACE_S = 2.5


class DDPPlumbing(LightningBound):
    """A ``ParallelStrategy``'s plumbing as DDP's: one process per device, ranks from the cluster environment."""

    # the namespace's launchers and torchrun environment, set by plug_asgd.pytorch_lightning / plug_asgd.lightning
    script_launcher: Any
    process_launcher: Any
    elastic_environment: Any
    # set by the strategy's __init__; parallel_devices, cluster_environment and the ranks are Lightning's
    _start_method: str
    _num_nodes: int

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """The job's node count: the Trainer sets it (``num_nodes=``) on a strategy that has one, as on DDP's."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        """Set by the Trainer's accelerator connector from ``Trainer(num_nodes=...)``.

        Args:
            num_nodes: the job's node count.
        """
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Workers on this node, one per device; Lightning's process launcher starts this many."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always: the workers are separate processes, even where one node runs them all."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = self.script_launcher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = self.process_launcher(self, start_method=self._start_method)

    def end_launched_ranks(self, grace: float) -> None:
        """This rank failed: the ranks its process launched (the children of Lightning's script launcher, on this
        node) get ``grace`` seconds to stop by themselves, then are killed, as Lightning's launcher kills them where
        one of them fails. Nothing where this process launched none.

        Args:
            grace: seconds to wait for them.
        """
        running = [p for p in getattr(self._launcher, "procs", None) or [] if p.poll() is None]
        deadline = time.monotonic() + grace
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def set_world_ranks(self) -> None:
        """Gives the cluster environment this worker's global rank and the world size, and Lightning's rank-zero
        helpers the rank, as DDP's strategy does (Lightning calls it once the environment is known)."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)
