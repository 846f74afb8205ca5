"""AsyncPSStrategy: the worker side of parameter-server training, as a Lightning Strategy.

Lightning launches the worker processes exactly as it does for DDP (its subprocess or
multiprocessing launcher, or an external one such as torchrun or SLURM), injects the
distributed sampler, and runs the user's LightningModule and optimizer untouched. This class
replaces DDP's gradient all-reduce by the parameter-server protocol: after a local optimizer
step its exchange (:mod:`plug_asgd.worker.exchange`, chosen by the mode) pushes ``delta = w - w_base``
to the PS and loads the central weights the PS answers with. No torch.distributed process group
exists; barriers, broadcasts and the metric reductions of evaluation travel through the PS, while
a reduction requested during training (``self.log(..., sync_dist=True)`` in ``training_step``)
stays local, because asynchronous workers are never in lockstep and must not wait for each other.

The strategy holds its parts as objects, each handed what it reads: the PS's connection
(:class:`~plug_asgd.placement.connection.PSConnection`), the PS as the strategy shows it (endpoints, ``ps_handle``,
counters: :class:`~plug_asgd.placement.ps_view.PSView`), Lightning's collectives through the PS
(:class:`~plug_asgd.placement.collectives.StrategyCollectives`), the exchange, the stage they share
(:class:`~plug_asgd.placement.stage.Stage`) and, with islands, the island's group
(:class:`~plug_asgd.placement.island.IslandGroup`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning_fabric.utilities.distributed import _set_num_threads_if_needed
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_utilities.core.rank_zero import rank_zero_warn
from typing_extensions import override

from plug_asgd import compressors, modes
from plug_asgd.compressors import Codec, NoCompression
from plug_asgd.compressors.heap import keep_freed_memory
from plug_asgd.lightning_bridge.plumbing import DDPPlumbing
from plug_asgd.modes import Mode
from plug_asgd.placement.collectives import StrategyCollectives
from plug_asgd.placement.connection import PSConnection, PSSettings
from plug_asgd.placement.island import (
    Island,
    IslandGroup,
    averaged_closure,
    check_island,
)
from plug_asgd.placement.ps_view import PSView
from plug_asgd.placement.stage import Stage
from plug_asgd.ps import DEFAULT_WORKER_TIMEOUT
from plug_asgd.sharding.client import ShardedClient
from plug_asgd.strategy_stage import StageSync
from plug_asgd.strategy_surface import PSSurface
from plug_asgd.worker.client import PSClient
from plug_asgd.worker.compensation import StalenessCompensation, resolve
from plug_asgd.worker.exchange import Link, make_exchange
from plug_asgd.worker.phase import Phase
from plug_asgd.worker.tensors import synced_tensors
from plug_asgd.worker.thread_tuner import ThreadTuner, threads_chosen

log = logging.getLogger("plug_asgd.strategy")

if TYPE_CHECKING:  # either namespace's classes (lightning_bridge.namespaces); pytorch_lightning's names them here
    import pytorch_lightning as pl
    from pytorch_lightning.accelerators import Accelerator
    from pytorch_lightning.plugins import CheckpointIO, ClusterEnvironment, Precision


_FITTING = "fit"  # TrainerFn.FITTING of either namespace (a str enum)
_TRAINING = "train"  # RunningStage.TRAINING of either namespace (a str enum)


class AsyncPSStrategy(StageSync, PSSurface, DDPPlumbing):
    """Train any LightningModule with asynchronous, compressed or synchronous parameter-server SGD.

    Written once for both Lightning namespaces: ``AsyncPSStrategy(...)`` is a
    ``pytorch_lightning`` or a ``lightning.pytorch`` ``ParallelStrategy``, whichever the program
    imported (``plug_asgd.pytorch_lightning`` and ``plug_asgd.lightning`` hold the two classes).

    Args:
        mode: the training scheme (``plug_asgd.modes``): a name (``"asgd"``, ``"adacomp"``, ...: its
            defaults), a configured mode (``SSP(staleness_bound=3)``, ``Downpour(push_every=4)``) or a dict
            ``{"name": ..., **knobs}``. Push and pull periods, overlap, the elastic step and the PS's
            staleness bound or round size are the mode's knobs, checked where it is built.
        compressor: how pushed updates are encoded (``plug_asgd.compressors``): a name, a configured
            codec (``TopK(0.01)``, ``PowerSGD(rank=4)``) or a dict; the mode refuses those it cannot take.
        staleness_compensation: what an asynchronous worker does so that staleness does not act as extra
            momentum (``plug_asgd.worker.compensation``, ``docs/momentum.md``): on by default for the modes that fold
            stale updates in, ``False`` turns it off, a ``StalenessCompensation`` (or a dict of it) picks.
        ps_address: ``tcp://host:port`` of a PS started with ``plug-asgd serve-ps``, or a list of them, one per
            shard of a sharded PS in the order of their ``--shard I/N``; by default global rank 0 starts an embedded
            PS on the cluster's main address, port ``ps_port``.
        ps_port: port of the embedded PS (default: the cluster's main port, + 1 under torchrun).
        ps_shards: rank 0 starts this many embedded PS processes (ports ``ps_port`` on), each holding a share of the
            model, and every worker pushes to all at once (``plug_asgd.sharding.config``: the modes and codecs that
            work).
            ``"per_node"``: one shard on each node of a multi-node job, started by the node's local rank 0 on the
            node's address, port ``ps_port + node_rank`` (``plug_asgd.sharding.per_node``: which address, and how every
            rank learns them); with one node, the lone embedded PS.
        connect_timeout: seconds to wait for the PS to answer the first time.
        request_timeout: seconds to wait for any reply (a sync round or a barrier included).
        lost_timeout: seconds a worker waits for a PS whose connection dropped to come back.
        heartbeat_s: seconds between two heartbeats of each worker; ``"auto"``: ``min(2, worker_timeout / 4)``;
            None sends none, and the PS then never declares this worker lost.
        max_updates: the PS stops every worker once it has folded in this many updates.
        worker_timeout: the embedded PS declares a heartbeating worker lost after this many seconds
            of silence, and stops waiting for it (an external PS takes ``serve-ps --worker-timeout``).
        start_method: ``"popen"`` (re-run the script, as DDP's default) or ``"spawn"``/``"fork"``.
        resume_from: a PS checkpoint file or folder the embedded PS starts from (see ``PSCheckpoint``).
        ps_run_dir: where the embedded PS writes ``ps_metrics.jsonl`` (default: the trainer's log dir).
        ps_keys: CURVE keys made by ``plug-asgd keygen DIR``: ``DIR`` (embedded PS) or ``DIR/worker``
            (external PS); required when the embedded PS would listen beyond loopback.
        ps_insecure: let the embedded PS listen beyond loopback without keys (unsafe).
        ps_threads: threads with which the embedded PS folds each large dense update in.
        shm_pushes: a worker on the PS's machine writes its dense float32 updates (or lends its weights)
            in shared memory the PS maps, the socket carrying only where they lie (``plug_asgd.protocol.push_memory``).
        delta_replies: the PS answers with only what changed since the model the worker holds, where that is
            less (sparse codecs: ``plug_asgd.ps.changes``); off, every reply carries the whole model.
        downlink_fraction: the embedded PS answers pushes with only this share of each tensor, where the worker is
            furthest off (``plug_asgd.ps.downlink``); None: the whole tensor.
        downlink_bound: with ``downlink_fraction``, every coordinate off by more than this is sent too.
        downlink_codec: the embedded PS answers pushes with every difference from the worker's copy, coded:
            ``"fp16"``, ``"int8"`` or ``"int4"`` (a half, a quarter, an eighth of a DiLoCo round's reply); None: exact.
        ps_standby: node 1's local rank 0 runs a hot standby of each embedded PS (port ``ps_port + shards + I``
            on node 1's address), which leads when node 0's PS is gone; the workers move to it by themselves
            (``plug_asgd.placement.standby_launcher``, docs/design.md "Hot standby"). Needs 2 nodes or more.
        failover_timeout: seconds of the PS's silence after which its standby may lead (the embedded PS's; an
            external one takes ``serve-ps --failover-timeout``).
        island: how many consecutive local ranks of a node train as one worker of the PS (``plug_asgd.placement.
            island``): inside an island the ranks all-reduce their gradients each step as DDP's do, and its first
            rank alone trades with the PS, then sends the island the weights. ``1``: every device a worker of its
            own; ``"node"``: each node one worker; ``"auto"`` (default): ``"node"`` on a job of several nodes, whose
            links between nodes are the slow ones, 1 on one node (docs/design.md, "Islands").
        accelerator: Lightning's, as for DDP's strategy (the Trainer sets it from ``accelerator=``).
        parallel_devices: this node's devices, one worker each (the Trainer sets them from ``devices=``).
        cluster_environment: where the ranks and the main address come from (the Trainer picks it: local, SLURM,
            torchrun...).
        checkpoint_io: Lightning's checkpoint writer, as for any strategy.
        precision_plugin: Lightning's precision plugin (the Trainer sets it from ``precision=``).

    Example:
        >>> import pytorch_lightning as pl
        >>> from plug_asgd import AdaComp, AsyncPSStrategy
        >>> trainer = pl.Trainer(strategy=AsyncPSStrategy(mode=AdaComp(overlap=True)), devices=2, accelerator="cpu",
        ...                      max_epochs=1, logger=False, enable_progress_bar=False)
        >>> type(trainer.strategy).__module__  # the strategy of the namespace the program imported
        'plug_asgd.pytorch_lightning'
        >>> trainer.strategy.mode.name, trainer.strategy.world_size
        ('adacomp', 2)

        Nothing starts until ``trainer.fit(model)``: Lightning then launches the two workers as for DDP, and global
        rank 0 starts the embedded PS. The registered names need no import of the classes:
        ``pl.Trainer(strategy="async_ps_adacomp", ...)``.
    """

    strategy_name = "async_ps"

    _tuner: ThreadTuner | None = None  # this fit's: torch's threads timed against one fewer (worker/thread_tuner.py)
    threads_kept: int | None = None  # what the last fit's tuner kept (None: not tuned, or undecided)
    _ps_initialized = False  # whether the PS holds a model (else this worker's offers its own)
    _island: IslandGroup | None = None  # this rank's island's group, made at its first stage (islands of 2 or more)

    def __init__(
        self,
        mode: Mode | str | dict[str, Any] = "asgd",
        *,
        compressor: Codec | str | dict[str, Any] = "none",
        staleness_compensation: StalenessCompensation | dict[str, Any] | bool | None = None,
        max_updates: int | None = None,
        ps_address: str | list[str] | None = None,
        ps_port: int | None = None,
        ps_shards: int | Literal["per_node"] | None = None,
        connect_timeout: float = 60.0,
        request_timeout: float = 600.0,
        lost_timeout: float = 60.0,
        heartbeat_s: float | Literal["auto"] | None = "auto",
        worker_timeout: float = DEFAULT_WORKER_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        resume_from: str | os.PathLike[str] | None = None,
        ps_run_dir: str | os.PathLike[str] | None = None,
        ps_keys: str | os.PathLike[str] | None = None,
        ps_insecure: bool = False,
        ps_threads: int = 1,
        shm_pushes: bool = True,
        delta_replies: bool = True,
        downlink_fraction: float | None = None,
        downlink_bound: float | None = None,
        downlink_codec: str | None = None,
        ps_standby: bool = False,
        failover_timeout: float = 3.0,
        island: Island = "auto",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.mode = modes.get(mode)
        self.compressor = compressors.get(compressor)
        self.mode.check_compressor(self.compressor)
        # the PS's arguments, placement and client (plug_asgd.placement.connection)
        settings = PSSettings(ps_address=ps_address, ps_port=ps_port, ps_shards=ps_shards, max_updates=max_updates,
                              connect_timeout=connect_timeout, request_timeout=request_timeout,
                              lost_timeout=lost_timeout, heartbeat_s=heartbeat_s, worker_timeout=worker_timeout,
                              resume_from=resume_from, ps_run_dir=ps_run_dir, ps_keys=ps_keys, ps_insecure=ps_insecure,
                              ps_threads=ps_threads, delta_replies=delta_replies,
                              downlink_fraction=downlink_fraction, downlink_bound=downlink_bound,
                              downlink_codec=downlink_codec, ps_standby=ps_standby, failover_timeout=failover_timeout)
        self.connection = PSConnection(self.mode, self.compressor, settings)
        self.shm_pushes = shm_pushes
        self.staleness_compensation = resolve(staleness_compensation, self.mode.name, self.mode.compensate)
        self._start_method, self._num_nodes = start_method, 1
        self.stage = Stage()  # what the parts share of the stage that runs
        self._threads_chosen = threads_chosen()  # (else the user's OMP_NUM_THREADS: no tuner)
        self._exchange = make_exchange(self.mode, codec=self.compressor, compensation=self.staleness_compensation,
                                       shm_pushes=shm_pushes)
        self.island = check_island(island, self.mode.name)
        self.ps = PSView(self.connection, self._exchange, self.stage, self.mode.name, self.compressor, self.placement)
        self.collectives = StrategyCollectives(self.connection, self._exchange, self.stage, self._ranks)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for mode in ("asgd", "adacomp", "sync"):
            name = "async_ps" if mode == "asgd" else f"async_ps_{mode}"
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"plug_asgd parameter-server SGD, mode {mode}",
                                           mode=mode)

    @override
    def _configure_launcher(self) -> None:
        self.island_ranks  # noqa: B018 (an island the nodes cannot hold is refused before any process starts)
        super()._configure_launcher()


    # -- stage life cycle ------------------------------------------------------------------------

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Lightning broadcasts a stop flag over an existing process group at every training step,
            # which puts the workers back in lockstep (measured by the benchmarks: bench/results/NOTES.md)
            rank_zero_warn("a torch.distributed process group exists: Lightning synchronises every training "
                           "step over it, so AsyncPSStrategy's workers cannot run ahead of each other. Call "
                           "torch.distributed.destroy_process_group() before fitting with it.")
        trainer = self._trainer()
        self._exchange.joined = False
        if self._island is None and self.island_ranks > 1:
            env = self.cluster_environment
            self._island = self.ps.island = self.collectives.island = IslandGroup(
                self.island_plan, node_rank=self.node_rank, local_rank=self.local_rank, devices=self.num_processes,
                main_port=env.main_port if env is not None else 0, device=self.root_device,
                timeout=self.connection.settings.request_timeout)
        stage = self.stage
        stage.begin(fitting=trainer is not None and trainer.state.fn == _FITTING)
        if self.island_leader:
            client = self.ps.connect(self._shapes, trainer)
            welcome = self.connection.hello(stage.number, stage.fitting)
            self._ps_initialized = bool(welcome.get("initialized"))
            self._exchange.attach(self._link(client))
        stage.phase = Phase.STAGE

    def _link(self, client: PSClient | ShardedClient) -> Link:
        """What the exchange needs of this worker for the stage that starts."""
        port = self.cluster_environment.main_port if self.cluster_environment is not None else 0
        job = self.placement()  # (with islands, the island's number and the island count: what the PS sees)
        return Link(client=client, tensors=lambda: synced_tensors(self.lightning_module), rank=job.global_rank,
                    world_size=job.world_size, stage=self.stage.number, fitting=self.stage.fitting,
                    barrier=self.collectives.ps_barrier, stop=self._request_stop,
                    shared_tag=f"{port}_{self.stage.number}",
                    one_cpu_machine=self.num_nodes == 1 and self.root_device.type == "cpu")

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == _FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == _FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            if self.island_leader:
                keep_freed_memory()  # the arrays each push makes and frees reuse their pages (compressors/heap.py)
                job = self.placement()
                self._exchange.start_fit(self.optimizers, job.global_rank if self.cluster_environment else 0,
                                         job.world_size)
                self._start_tuning()

    @override
    def on_train_start(self) -> None:
        self.mode.check_optimizers(self.optimizers)
        # the fit's length matters to randomk's lag only; estimated_stepping_batches is inf where it is unknown
        fit = self._exchange.fit_length(self.lightning_module.trainer.estimated_stepping_batches)
        if fit is not None:
            codec, pushes = fit
            if codec is not self._exchange.codec and self.global_rank == 0:
                log.info("this fit of about %.0f pushes per worker encodes with %r: the default fraction, raised so "
                         "that a coordinate waits at most a tenth of the fit in the residual (docs/momentum.md)",
                         pushes, codec)
            short = codec.short_fit_warning(pushes)
            if short:
                rank_zero_warn(short)
        self._join()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.stage.phase, self.stage.batches = Phase.BATCHES, self.stage.batches + 1
        if self._tuner is not None:
            self._tuner.batch_start(time.monotonic())

    @override
    def on_train_end(self) -> None:
        self._leave_batches()
        self._stop_tuning()

    def _start_tuning(self) -> None:
        """Time torch at one thread fewer where that may be faster (:mod:`plug_asgd.worker.thread_tuner`): a fit on
        the CPU whose codec encodes each push beside the step, torch on 2 threads or more of the strategy's own
        choosing (not ``OMP_NUM_THREADS``'s), and no deterministic algorithms asked for."""
        threads = torch.get_num_threads()
        if (self.island_leader and self.root_device.type == "cpu"
                and not isinstance(self._exchange.encoder, NoCompression) and threads >= 2
                and self._threads_chosen and not torch.are_deterministic_algorithms_enabled()):
            self._tuner = ThreadTuner(threads, torch.set_num_threads)

    def _stop_tuning(self) -> None:
        if self._tuner is not None:
            self._tuner.stop()
            self.threads_kept = self._tuner.kept
            self._tuner = None

    @override
    def on_validation_start(self) -> None:
        self._leave_batches()
        self._refresh()

    @override
    def on_test_start(self) -> None:
        self._refresh()

    @override
    def on_predict_start(self) -> None:
        self._refresh()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The local step (with islands: on the island's mean gradient, on every rank), then the exchange with the
        PS where one is due (the island's leader's), then the leader's weights and stop to the rest of its island."""
        island = self._island
        if island is not None:
            closure = averaged_closure(island, closure, optimizer)
        if not self.island_leader:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            self.ps.follower_steps += 1
        else:
            def run() -> Any:
                return super(AsyncPSStrategy, self).optimizer_step(optimizer, self._exchange.closure(closure), model,
                                                                   **kwargs)

            out = self._exchange.step(run, optimizer)
        if island is not None:
            trainer = self.lightning_module.trainer
            if island.send_weights(synced_tensors(self.lightning_module), stop=bool(trainer.should_stop)):
                trainer.should_stop = True  # a rank of the island stops (its PS said so): all stop at this step
        return out

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The state dict with the central tensors: a checkpoint holds the central model."""
        state = super().lightning_module_state_dict()
        return self._exchange.central_state(state) if self.connection.client is not None else state

    # -- what the parts are handed ----------------------------------------------------------------------------

    def _ranks(self) -> tuple[int, int]:  # a method, not a lambda: the spawn launcher pickles the strategy
        return self.global_rank, self.world_size

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: tuple(t.shape) for n, t in synced_tensors(self.lightning_module).items()}

    def _trainer(self) -> Any:
        return self.lightning_module.trainer if self.lightning_module is not None else None

    def _shutdown(self, wait_for_workers: float = 30.0) -> None:
        """Release the exchange, let the other workers finish with the PS, then stop it (rank 0) and close: what
        happens at exit, or when a later strategy of this process connects."""
        self.connection.shutdown(wait_for_workers)
