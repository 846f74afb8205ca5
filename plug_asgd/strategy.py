"""AsyncPSStrategy: the worker side of parameter-server training, as a Lightning Strategy.

Lightning launches the worker processes exactly as it does for DDP (its subprocess or
multiprocessing launcher, or an external one such as torchrun or SLURM), injects the
distributed sampler, and runs the user's LightningModule and optimizer untouched. This class
replaces DDP's gradient all-reduce by the parameter-server protocol: after a local optimizer
step it pushes ``delta = w - w_base`` to the PS and loads the central weights the PS answers
with. No torch.distributed process group exists; barriers, broadcasts and the metric
reductions of evaluation travel through the PS, while a reduction requested during training
(``self.log(..., sync_dist=True)`` in ``training_step``) stays local, because asynchronous
workers are never in lockstep and must not wait for each other.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import msgpack
import numpy as np
import torch
from lightning_fabric.utilities.distributed import _set_num_threads_if_needed
from lightning_fabric.utilities.optimizer import _optimizers_to_device
from lightning_utilities.core.rank_zero import rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.distributed import ReduceOp

from plug_asgd import shared
from plug_asgd.client import DEFAULT_HEARTBEAT_S, ModelReply, PSClient, PSError, PSUnreachableError
from plug_asgd.compressors import SPARSE_VALUES, NoCompression, make_compressor
from plug_asgd.modes import get_mode
from plug_asgd.namespaces import LightningBound
from plug_asgd.ps_server import DEFAULT_WORKER_TIMEOUT, embedded_command
from plug_asgd.security import check_bind
from plug_asgd.staleness import (
    Compensator,
    StalenessCompensation,
    normalizes_steps,
    resolve,
    scaled_step,
    warn_unknown_optimizers,
)
from plug_asgd.tensors import assign
from plug_asgd.wire import Sparse

if TYPE_CHECKING:  # either namespace's classes (plug_asgd.namespaces); pytorch_lightning's names them here
    import pytorch_lightning as pl
    from pytorch_lightning.accelerators import Accelerator
    from pytorch_lightning.plugins import CheckpointIO, ClusterEnvironment, Precision

log = logging.getLogger("plug_asgd.strategy")

# how long a worker that failed (Ctrl-C, an error) waits on each of its goodbye requests
_FAILED_EXIT_S = 5.0
_REDUCE_OPS = {"sum": "sum", "mean": "mean", "avg": "mean", "max": "max", "min": "min"}
# TrainerFn.FITTING and RunningStage.TRAINING of either namespace (str enums, equal to their values)
_FITTING, _TRAINING = "fit", "train"


def _op_name(reduce_op: Any) -> str:
    if isinstance(reduce_op, ReduceOp.RedOpType) or isinstance(reduce_op, ReduceOp):
        name = {ReduceOp.SUM: "sum", ReduceOp.AVG: "mean", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}.get(reduce_op)
    else:
        name = _REDUCE_OPS.get(str(reduce_op or "mean").lower())
    if name is None:
        raise ValueError(f"reduce_op {reduce_op!r} is not supported by AsyncPSStrategy (sum, mean, max, min)")
    return name


def _to_numpy(t: Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: bf16 tensors travel as float32
        t = t.float()
    return t.cpu().numpy()


@runtime_checkable
class ConfiguresPS(Protocol):
    """A callback that sets options of the embedded PS (``PSCheckpoint``: its checkpoint policy)."""

    def ps_options(self) -> dict[str, Any]: ...


class AsyncPSStrategy(LightningBound):
    """Train any LightningModule with asynchronous, compressed or synchronous parameter-server SGD.

    Written once for both Lightning namespaces: ``AsyncPSStrategy(...)`` is a
    ``pytorch_lightning`` or a ``lightning.pytorch`` ``ParallelStrategy``, whichever the program
    imported (``plug_asgd.pytorch_lightning`` and ``plug_asgd.lightning`` hold the two classes).

    Args:
        mode: a scheme of ``plug_asgd.modes.MODES``: ``asgd``, ``adacomp``, ``sync``, ``downpour``,
            ``dynsgd``, ``ssp``, ``localsgd``, ``agn``, ``sagn``, ``osp``, ``losp``, ``easgd``, ``eamsgd``,
            ``hogwild``.
        compression: for ``adacomp`` (and the ``topk``/``randomk`` compressors), the fraction of each
            tensor's coordinates sent per push.
        compressor: how pushed updates are encoded (``plug_asgd.compressors.COMPRESSORS``: none, fp16,
            bf16, topk, randomk, qsgd, sign, powersgd), for every push-based mode but adacomp (its own
            top-k) and easgd/eamsgd (whose exchange must move worker and center by the same amount).
        sparse_values: adacomp: ``"float16"`` sends the chosen values as halves (4 bytes per sent
            coordinate instead of 6, the rounding kept in the residual).
        bits: qsgd's bits per coordinate. rank: powersgd's rank.
        error_feedback: keep what a compressor did not send and add it to the next update (default:
            on for the biased compressors: topk, randomk, sign, powersgd).
        push_every: local optimizer steps between two pushes (the local steps of localsgd/agn/sagn;
            default: the mode's, 1 for asgd).
        pull_every: local steps between two pulls of the central model (default: with every push);
            a pull keeps the progress not yet pushed (DOWNPOUR's n_fetch).
        overlap: send each push from a background thread while the next step computes, and merge
            the reply when the push after it is due, keeping the progress made meanwhile (the
            central model then reaches the worker one push later). The default for osp/losp, which
            are defined by it; opt-in for the other push modes (asgd, dynsgd, ssp, downpour's pushes
            without pull_every, agn, sync, localsgd, sagn).
        tau: easgd/eamsgd: local steps between two elastic exchanges with the center.
        alpha: easgd/eamsgd: the elastic step: worker and center move ``alpha * (w - center)``.
        staleness_bound: ssp: how many pushes a worker may be ahead of the slowest (default 2).
        replicas_to_aggregate: for ``sync``, updates averaged per round (default: every training worker).
        max_updates: the PS stops every worker once it has folded in this many updates.
        ps_address: ``tcp://host:port`` of a PS started with ``plug-asgd serve-ps``; by default global
            rank 0 starts an embedded PS on the cluster's main address, port ``ps_port``.
        ps_port: port of the embedded PS (default: the cluster's main port, + 1 under torchrun).
        connect_timeout: seconds to wait for the PS to answer the first time.
        request_timeout: seconds to wait for any reply (a sync round or a barrier included).
        lost_timeout: seconds a worker waits for a PS whose connection dropped to come back.
        heartbeat_s: seconds between two heartbeats of each worker (a thread of its own, so a long
            step is not silence); ``"auto"``: ``min(2, worker_timeout / 4)``; None sends none, and the
            PS then never declares this worker lost.
        worker_timeout: the embedded PS declares a heartbeating worker lost after this many seconds
            of silence, and stops waiting for it (sync rounds, ssp, barriers); an external PS takes
            ``plug-asgd serve-ps --worker-timeout``.
        start_method: ``"popen"`` (re-run the script, as DDP's default) or ``"spawn"``/``"fork"``.
        resume_from: a PS checkpoint file or folder the embedded PS starts from (see ``PSCheckpoint``).
        ps_run_dir: where the embedded PS writes ``ps_metrics.jsonl`` (default: the trainer's log dir).
        ps_keys: CURVE keys made by ``plug-asgd keygen DIR``: ``DIR`` (both sides: the embedded PS uses
            ``DIR/server``, the workers ``DIR/worker``) or ``DIR/worker`` for an external PS. Required
            when the embedded PS would listen beyond loopback (``MASTER_ADDR`` not 127.0.0.1).
        ps_insecure: let the embedded PS listen beyond loopback without keys (anyone who reaches the
            port can then read and overwrite the model).
        ps_threads: threads with which the embedded PS folds each large dense update in (``serve-ps
            --threads``); worth it only where the PS has cores the workers leave idle.
        staleness_compensation: what an asynchronous worker does so that staleness does not act as extra
            momentum (``plug_asgd.staleness``, ``docs/momentum.md``): its update folded in at ``1/(1 + s)``,
            ``s`` its recent median staleness (not for dynsgd, whose PS scales, nor agn, which divides by its
            steps, nor where every optimizer normalizes its steps, as Adam does); its next step computed
            ``s`` versions ahead (modes that push every step); a codec's residual kept in its model (error
            feedback but powersgd); the optimizer's momentum zeroed where a sparse update was sent;
            hogwild's steps scaled by 1/workers. On by default for asgd, adacomp, downpour, dynsgd, ssp,
            agn and hogwild, which then train momentum SGD at the learning rate of one process or DDP;
            ``False`` turns it off; a ``StalenessCompensation(...)`` (or a dict of its fields) picks.
        shm_pushes: a worker on the PS's machine (Linux, the same user) writes its dense updates
            into shared memory that the PS maps, and the socket carries only where they lie (see
            ``plug_asgd.push_memory``); elsewhere, or where the PS does not offer it (``serve-ps
            --no-shm-pushes``), updates go over the socket. CPU tensors, dense float32 updates (no
            compressor). With it, a worker that nothing raced pushes its weights instead of its
            update (see ``PSClient.push(weights=True)``), and lends them: the PS keeps them as its
            model where they lie, without a copy (``lend=True``); without it only a lone worker does, since
            a push of weights the PS does not take would have sent the model's bytes for nothing.
    """

    strategy_name = "async_ps"
    # the namespace's launchers and torchrun environment, set by plug_asgd.pytorch_lightning / plug_asgd.lightning
    script_launcher: Any
    process_launcher: Any
    elastic_environment: Any

    def __init__(
        self,
        mode: str = "asgd",
        *,
        compression: float = 0.01,
        compressor: str = "none",
        sparse_values: str = "float32",
        bits: int = 8,
        rank: int = 4,
        error_feedback: bool | None = None,
        push_every: int | None = None,
        pull_every: int | None = None,
        overlap: bool | None = None,
        tau: int | None = None,
        alpha: float | None = None,
        staleness_bound: int | None = None,
        replicas_to_aggregate: int | None = None,
        max_updates: int | None = None,
        ps_address: str | None = None,
        ps_port: int | None = None,
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
        staleness_compensation: StalenessCompensation | dict[str, Any] | bool | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self.mode = mode
        self.mode_spec = get_mode(mode)
        if sparse_values not in SPARSE_VALUES:
            raise ValueError(f"sparse_values must be one of {SPARSE_VALUES}, got {sparse_values!r}")
        if sparse_values != "float32" and mode != "adacomp":
            raise ValueError(f"sparse_values={sparse_values!r} sets how adacomp sends its values; mode={mode!r} "
                             "sends none (use compressor='fp16' for dense halves)")
        self.sparse_values = sparse_values
        self.mode_spec.make_compressor(compression, sparse_values)  # validates compression now, not in a worker
        if compressor != "none" and mode == "hogwild":
            raise ValueError("compressor= does not go with mode='hogwild': its workers share memory and send nothing")
        if compressor != "none" and (mode == "adacomp" or self.mode_spec.exchange == "elastic"):
            why = ("adacomp is top-k selection paired with the PS's staleness scaling; for another codec use "
                   "mode='asgd' with that compressor" if mode == "adacomp" else
                   f"{mode}'s elastic exchange moves the worker by exactly what the center receives, which a "
                   "lossy codec would break")
            raise ValueError(f"compressor={compressor!r} does not go with mode={mode!r}: {why}")
        self._compressor_options = {"fraction": compression, "bits": bits, "rank": rank,
                                    "error_feedback": error_feedback}
        make_compressor(compressor, **self._compressor_options)  # an unknown name or bad option fails here
        defaults = dict(self.mode_spec.defaults)
        push_every = push_every if push_every is not None else defaults.get("push_every", 1)
        tau = tau if tau is not None else defaults.get("tau", 1)
        alpha = alpha if alpha is not None else defaults.get("alpha", 0.5)
        for name, value in (("push_every", push_every), ("tau", tau), ("pull_every", pull_every or 1)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if staleness_bound is not None and staleness_bound < 0:
            raise ValueError(f"staleness_bound must be >= 0, got {staleness_bound}")
        if replicas_to_aggregate is not None and replicas_to_aggregate < 1:
            raise ValueError(f"replicas_to_aggregate must be >= 1, got {replicas_to_aggregate}")
        if max_updates is not None and max_updates < 1:
            raise ValueError(f"max_updates must be >= 1, got {max_updates}")
        if heartbeat_s == "auto":
            heartbeat_s = min(DEFAULT_HEARTBEAT_S, worker_timeout / 4)
        if heartbeat_s is not None and not 0 < heartbeat_s <= worker_timeout / 2:
            raise ValueError(f"heartbeat_s must be in (0, worker_timeout / 2 = {worker_timeout / 2:g}] so that one "
                             f"late beat does not make a live worker lost, got {heartbeat_s}")
        exchange = self.mode_spec.exchange
        if overlap is None:
            overlap = exchange == "overlap"
        elif overlap and exchange not in ("push", "overlap"):
            raise ValueError(f"overlap=True does not go with mode={mode!r}: its exchange ({exchange}) is not a push")
        elif not overlap and exchange == "overlap":
            raise ValueError(f"mode={mode!r} is defined by its overlap: for the same rounds without it, use "
                             f"mode={'sync' if mode == 'osp' else 'localsgd'!r}")
        if overlap and pull_every is not None:
            raise ValueError("overlap=True takes the model with every push's reply: it does not go with pull_every")
        if ps_address is not None and not ps_address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"ps_address must look like tcp://host:port, got {ps_address!r}")
        self.compression = compression
        self.compressor = compressor
        self.push_every = push_every
        self.pull_every = pull_every
        self.overlap = overlap
        self.tau = tau
        self.alpha = alpha
        self.staleness_bound = staleness_bound
        self.replicas_to_aggregate = replicas_to_aggregate
        self.max_updates = max_updates
        self.ps_address = ps_address
        self.ps_port = ps_port
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self.lost_timeout = lost_timeout
        self.heartbeat_s = heartbeat_s
        self.worker_timeout = worker_timeout
        self.resume_from = resume_from
        self.ps_run_dir = ps_run_dir
        self.ps_keys = ps_keys
        self.ps_insecure = ps_insecure
        if not 1 <= ps_threads <= 256:
            raise ValueError(f"ps_threads must be between 1 and 256, got {ps_threads}")
        self.ps_threads = ps_threads
        self.shm_pushes = shm_pushes
        self.staleness_compensation = resolve(staleness_compensation, mode, self.mode_spec.compensate)
        self._compensator = Compensator(self.staleness_compensation, 0)
        self._start_method = start_method
        self._num_nodes = 1
        self._client: PSClient | None = None
        self._ps_proc: subprocess.Popen | None = None
        self._ps_initialized = False
        self._stage = 0
        self._collective_seq = 0
        self._in_stage = False
        self._joined = False
        self._fitting = False
        self._failed = False
        self._ps_stats_at_exit: dict[str, Any] | None = None
        self._version = 0
        self._since_push = 0
        self._since_pull = 0
        self._local_steps = 0
        self._in_flight: threading.Thread | None = None
        self._in_flight_result: dict[str, Any] = {}
        self._overlapped_steps = 0
        self._overlap_trace: list[tuple[float, float | None, float]] = []
        self._shared_map: Any = None
        self._staleness = [0, 0, 0]  # sum, count, max over this worker's applied pushes
        self._own_guesses = [0, 0]  # models of an "own" reply made while waiting for it; of those, answered "own"
        self._compressor = self._new_compressor()
        self._base: dict[str, Tensor] = {}
        self._delta_buffers: dict[str, Tensor] = {}
        # whether those buffers and the base are in memory the PS maps: a push of weights the PS does not
        # take then cost a header; over the socket, the model's bytes, so only a lone worker sends them
        self._shared_buffers = False
        # whether _base holds the central model of version _version bit for bit (not after a push
        # answered without the model, whose worker keeps its own weights): only then may a push ask
        # the PS for an "own" reply
        self._base_is_central = False
        self._base_lent = False  # the PS may hold our base buffers as its model (a lent push of weights)
        # whether the next push may send the weights themselves (``PSClient.push(weights=True)``): in the
        # modes whose PS can take them, until it answers that another push came first; again after an
        # "own" reply
        self._weights_ok = self.mode_spec.folds_into_update

    def _new_compressor(self) -> Any:
        """A fresh compressor (empty residuals) for a fit: the mode's own for adacomp, else the chosen one."""
        if self.mode == "adacomp":
            return self.mode_spec.make_compressor(self.compression, self.sparse_values)
        return make_compressor(self.compressor, seed=self.global_rank if self.cluster_environment else 0,
                               **self._compressor_options)

    # -- Lightning plumbing (as DDP) ---------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = self.script_launcher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = self.process_launcher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for mode in ("asgd", "adacomp", "sync"):
            name = "async_ps" if mode == "asgd" else f"async_ps_{mode}"
            if name not in strategy_registry:
                strategy_registry.register(name, cls, description=f"plug_asgd parameter-server SGD, mode {mode}",
                                           mode=mode)

    # -- stage life cycle ------------------------------------------------------------------------

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
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._fitting = trainer is not None and trainer.state.fn == _FITTING
        self._stage += 1
        self._collective_seq = 0
        self._failed = False
        self._joined = False
        client = self._connect()
        welcome = client.hello(self._stage, self._fitting, timeout=self.connect_timeout, alive=self._ps_gone)
        self._ps_initialized = bool(welcome.get("initialized"))
        self._in_stage = True

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
            self._compressor = self._new_compressor()
            normalized = bool(self.optimizers) and all(normalizes_steps(o) for o in self.optimizers)
            self._compensator = Compensator(self.staleness_compensation, self.world_size - 1,
                                            scale=self.staleness_compensation.scale and not normalized)
            if self.staleness_compensation.mask_momentum and not isinstance(self._compressor, NoCompression):
                warn_unknown_optimizers(self.optimizers)

    def on_train_start(self) -> None:
        if self.mode == "eamsgd":
            for opt in self.optimizers:
                group = opt.param_groups[0] if opt.param_groups else {}
                if not (isinstance(opt, torch.optim.SGD) and group.get("nesterov") and group.get("momentum", 0) > 0):
                    raise ValueError("mode='eamsgd' is EASGD with Nesterov momentum on the workers: configure "
                                     "torch.optim.SGD(..., momentum=0.9, nesterov=True), or use mode='easgd'")
        self._join()

    def on_validation_start(self) -> None:
        self._refresh()

    def on_test_start(self) -> None:
        self._refresh()

    def on_predict_start(self) -> None:
        self._refresh()

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True

    def teardown(self) -> None:
        client = self._client
        if client is not None and self._in_stage:
            try:
                if self._fitting and self._joined and not self._failed and self._hogwild:
                    self.barrier("plug_asgd.fit_end")  # every worker's steps are in the shared model
                    shared.detach(self._synced_tensors())
                    self.barrier("plug_asgd.hogwild_detached")
                    self._drop_shared()
                elif self._fitting and self._joined and not self._failed:
                    self._flush()
                    client.hello(self._stage, training=False)  # no sync round waits for us any more
                    self.barrier("plug_asgd.fit_end")  # the final central model includes every worker
                    self._load(client.pull())
            finally:
                self._in_stage = False  # only now: the barriers above are collectives of this stage
                sender = self._in_flight
                if sender is not None:  # after a failure: the socket is the sender's until it is done
                    sender.join(5.0)
                    self._in_flight = None
                try:
                    if sender is not None and sender.is_alive():
                        raise PSUnreachableError("a push is still in flight")
                    # rank 0 stops the embedded PS as soon as every worker has left: keep its counters.
                    # After a failure (Ctrl-C stops the embedded PS too) this is a courtesy: a PS that
                    # went away must not hold the exit up for the client's lost_timeout.
                    self._ps_stats_at_exit = client.stats(timeout=_FAILED_EXIT_S if self._failed else None)
                    client.bye(self._stage)
                except (PSError, PSUnreachableError) as exc:
                    log.warning("could not say goodbye to the parameter server: %s", exc)
        self._joined = False
        super().teardown()

    # -- the parameter server --------------------------------------------------------------------

    @property
    def ps_endpoint(self) -> str:
        """The PS's address, ``tcp://host:port``, that the workers connect to (the embedded PS's or ``ps_address``)."""
        return self._endpoint()[0]

    def _endpoint(self) -> tuple[str, str | None]:
        """The address workers connect to, and the one rank 0 binds (None: an external PS)."""
        if self.ps_address is not None:
            return self.ps_address, None
        assert self.cluster_environment is not None
        env = self.cluster_environment
        host = env.main_address
        # Without torch.distributed the main port is free for the PS (Lightning chose it free), except
        # under torchrun, whose agent serves its store there.
        port = self.ps_port or env.main_port + (1 if isinstance(env, self.elastic_environment) else 0)
        address = f"tcp://{host}:{port}"
        return address, f"tcp://{socket.gethostbyname(host)}:{port}"

    def _connect(self) -> PSClient:
        if self._client is not None:
            return self._client
        address, bind = self._endpoint()
        if bind is None and (self.resume_from is not None or self._ps_checkpoint_callback() is not None):
            raise ValueError(f"the PS at {address} is external: PSCheckpoint and resume_from configure the "
                             "embedded PS only; give the external one `plug-asgd serve-ps --checkpoint-dir DIR` "
                             "or `--resume DIR` instead")
        if bind is not None:  # every rank refuses alike, instead of waiting for a PS that never starts
            check_bind(bind, self.ps_keys is not None, self.ps_insecure)
        if bind is not None and self.global_rank == 0:
            self._start_embedded_ps(bind)
        self._client = PSClient(address, rank=self.global_rank, world_size=self.world_size, mode=self.mode,
                                request_timeout=self.request_timeout, lost_timeout=self.lost_timeout,
                                heartbeat_s=self.heartbeat_s, keys=self.ps_keys)
        atexit.register(self._shutdown)
        return self._client

    def _ps_checkpoint_callback(self) -> Any:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        found = [cb for cb in (trainer.callbacks if trainer is not None else []) if isinstance(cb, ConfiguresPS)]
        return found[0] if found else None

    def _start_embedded_ps(self, bind: str) -> None:
        options: dict[str, Any] = {"parent_pid": os.getpid(), "max_updates": self.max_updates,
                                   "replicas_to_aggregate": self.replicas_to_aggregate, "resume": self.resume_from,
                                   "staleness_bound": self.staleness_bound, "worker_timeout": self.worker_timeout}
        checkpoint = self._ps_checkpoint_callback()
        if checkpoint is not None:
            options.update(checkpoint.ps_options())
        run_dir = self.ps_run_dir
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if run_dir is None and trainer is not None and trainer.loggers and trainer.log_dir is not None:
            run_dir = os.path.join(trainer.log_dir, "ps")
        options["run_dir"] = run_dir
        options["keys"] = self.ps_keys
        options["insecure"] = self.ps_insecure
        options["threads"] = self.ps_threads if self.ps_threads > 1 else None
        self._ps_proc = subprocess.Popen(embedded_command(bind, self.mode, **options), stdin=subprocess.DEVNULL)

    def _ps_gone(self) -> str | None:
        if self._ps_proc is not None and self._ps_proc.poll() is not None:
            return (f"the embedded parameter server exited with code {self._ps_proc.returncode} before "
                    "answering (its message is above); if the port is taken, pass ps_port=")
        return None

    def _shutdown(self, wait_for_workers: float = 30.0) -> None:
        """At exit: let the other workers finish with the PS, then stop it (rank 0) and close."""
        if self._hogwild and self._stage and self.cluster_environment is not None:
            self._drop_shared()  # a hogwild fit that failed leaves its shared file behind
        client, self._client = self._client, None
        if client is not None:
            if self._ps_proc is not None and self._ps_proc.poll() is None:
                deadline = time.monotonic() + wait_for_workers
                while time.monotonic() < deadline:
                    try:
                        if not client.stats(timeout=2.0)["workers"]:
                            break
                    except (PSError, PSUnreachableError):
                        break
                    time.sleep(0.1)
            client.close()
        if self._ps_proc is not None:
            self._ps_proc.terminate()
            try:
                self._ps_proc.wait(10)
            except subprocess.TimeoutExpired:
                self._ps_proc.kill()
                self._ps_proc.wait()
            self._ps_proc = None

    def comm_stats(self) -> dict[str, Any]:
        """This worker's counters: local steps, bytes up and down (measured on the wire), time spent
        waiting for the PS, the staleness of its pushes (updates of others folded in between its
        base version and its own update), and its guesses of an "own" reply (CPU spent on them)."""
        if self._client is None:
            return {}
        total, count, worst = self._staleness
        return {**self._client.counters.as_dict(), "local_steps": self._local_steps, "version": self._version,
                "staleness_mean": total / count if count else 0.0, "staleness_max": worst,
                "overlapped_steps": self._overlapped_steps, "overlap_trace": list(self._overlap_trace),
                "own_guesses": self._own_guesses[0], "own_guesses_right": self._own_guesses[1],
                "reconnections": self._client.reconnections}

    def ps_stats(self) -> dict[str, Any]:
        """The parameter server's global counters (version, pushes, bytes in and out, staleness).

        Between stages they are those this worker saw as it left the last one: the embedded PS
        stops once every worker has left, so asking it again could wait for a server that is gone."""
        if not self._in_stage and self._ps_stats_at_exit is not None:
            return dict(self._ps_stats_at_exit)
        if self._client is None:
            raise RuntimeError("not connected to a parameter server: run trainer.fit/test first")
        self._finish_in_flight()
        return self._client.stats()

    # -- synchronising the model with the PS -----------------------------------------------------

    def _synced_tensors(self) -> dict[str, Tensor]:
        """Floating-point parameters and buffers (BatchNorm statistics): what the PS holds."""
        module = self.lightning_module
        assert module is not None
        tensors = {n: p for n, p in module.named_parameters() if p.is_floating_point()}
        tensors.update((n, b) for n, b in module.named_buffers() if b.is_floating_point())
        return tensors

    @property
    def _hogwild(self) -> bool:
        return self.mode_spec.exchange == "shared"

    def _shared_path(self) -> Any:
        assert self.cluster_environment is not None
        return shared.shared_path(f"{self.cluster_environment.main_port}_{self._stage}")

    def _join_shared(self) -> None:
        """Hogwild: rank 0 puts its model in shared memory; every worker's tensors become views of it."""
        if self.num_nodes > 1 or self.root_device.type != "cpu":
            raise ValueError("mode='hogwild' shares memory between the processes of one machine: use "
                             "num_nodes=1 and accelerator='cpu'")
        tensors = self._synced_tensors()
        if self.global_rank == 0:
            shared.create(self._shared_path(), tensors)
        self.barrier("plug_asgd.hogwild_created")
        self._shared_map = shared.attach(self._shared_path(), tensors)

    def _drop_shared(self) -> None:
        self._shared_map = None
        if self.global_rank == 0:
            self._shared_path().unlink(missing_ok=True)

    def _join(self) -> None:
        """Start of a stage: offer our weights if the PS has none yet, then take the central ones."""
        if self._joined:
            return
        assert self._client is not None
        if self._hogwild:
            if self._fitting:
                self._join_shared()
            self._joined = True
            return
        if not self._ps_initialized:
            self._client.init({n: _to_numpy(t) for n, t in self._synced_tensors().items()})
            self._ps_initialized = True
        self._load(self._client.pull())
        self._joined = True

    def _refresh(self) -> None:
        if not self._joined:
            self._join()
            return
        if self._hogwild:  # the module already is the shared, central model
            return
        assert self._client is not None
        self._flush()
        self._load(self._client.pull())

    def _load(self, reply: ModelReply, ahead: bool = False) -> None:
        """Take the reply's model as weights and base: the central one, or (``ahead``) where it is heading."""
        tensors = self._synced_tensors()
        missing = sorted(set(tensors) - set(reply.tensors))
        if missing:
            raise RuntimeError(f"the parameter server's model lacks {missing[:5]}: is it serving another model? "
                               "Restart it, or point ps_address at the PS of this run")
        central = True
        if ahead and self._compensator.config.active:
            # where the model will be when our next update lands (a single local step per push only), plus
            # what the codec still holds back
            central = self._compensator.load(tensors, reply.tensors, reply.version,
                                             lookahead=self.push_every == 1 and self.pull_every is None,
                                             pending=self._compressor.pending if self._local_residual else None)
        else:
            self._compensator.forget()
            for name, t in tensors.items():
                assign(t, reply.tensors[name])
        for name, t in tensors.items():
            base = self._base.get(name)
            if base is None or base.shape != t.shape or base.device != t.device:
                self._base[name] = t.detach().clone()
            else:
                base.copy_(t.detach())
        self._based_on(reply)
        self._base_is_central = central

    def _based_on(self, reply: ModelReply, central: bool = True) -> None:
        """``_base`` is now version ``reply.version``: the central model itself, unless ``central`` is False."""
        self._base_is_central = central
        self._base_lent = False  # whatever the PS held of ours, it gave back before this reply
        self._version = reply.version
        if central:
            self._since_pull = 0
        self._stop_if(reply.stop)

    def _pull_due(self) -> bool:
        return self.pull_every is None or self._since_pull >= self.pull_every

    def _update(self, tensors: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, Tensor], bool]:
        """The update to push (``w - w_base``, encoded), the deltas, and whether the PS may answer "own".

        A dense float32 update is made in buffers kept across pushes (no 4.8 MB allocation per
        step for the recipe CNN; in memory the PS maps, when it offers that), free again once the
        PS has replied. Sent as it is, it can be answered "your base plus this" instead of the
        model (see ``PSClient.push``).
        """
        scale = self._scale()
        dense = self._dense(tensors)
        exact = dense and self._base_is_central and scale == 1.0
        if dense and not self._buffers_fit(tensors):
            self._delta_buffers = self._new_delta_buffers(tensors)
        update, deltas = {}, {}
        for name, t in tensors.items():
            if dense:
                deltas[name] = torch.sub(t.detach(), self._base[name], out=self._delta_buffers[name])
                if scale != 1.0:
                    deltas[name].mul_(scale)
                update[name] = _to_numpy(deltas[name])
            else:
                deltas[name] = t.detach() - self._base[name]
                delta = _to_numpy(deltas[name])
                update[name] = self._compressor.encode(name, delta * scale if scale != 1.0 else delta)
                if isinstance(update[name], Sparse):
                    self._compensator.mask(self.optimizers, t, update[name].indices)
        return update, deltas, exact

    @property
    def _local_residual(self) -> bool:
        """Whether the codec's residual goes into the worker's model (error feedback, not powersgd's)."""
        return bool(getattr(self._compressor, "local_residual", False))

    def _scale(self) -> float:
        """What the update is multiplied by: agn's ``1/steps`` and the staleness compensation's ``1/(1 + s)``."""
        steps = self._since_push if self.mode_spec.normalize and self._since_push else 1
        return self._compensator.update_scale() / steps

    def _dense(self, tensors: dict[str, Tensor]) -> bool:
        return isinstance(self._compressor, NoCompression) and all(t.dtype == torch.float32 for t in tensors.values())

    def _buffers_fit(self, tensors: dict[str, Tensor]) -> bool:
        buffers = self._delta_buffers
        return buffers.keys() == tensors.keys() and all(
            buffers[n].shape == t.shape and buffers[n].device == t.device for n, t in tensors.items())

    def _new_delta_buffers(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Buffers for dense updates: in memory the PS maps where it can (``shm_pushes``), else private.

        The base moves into that memory too: a push of weights (:meth:`_push_weights`) swaps the
        two sets, so both must be where the PS can read them.
        """
        if self.shm_pushes and self._client is not None and all(t.device.type == "cpu" for t in tensors.values()):
            shapes = {f"{kind}:{n}": (tuple(t.shape), np.float32) for n, t in tensors.items() for kind in "db"}
            shared = self._client.push_buffers(shapes)
            if shared is not None:
                for name in tensors:
                    base = torch.from_numpy(shared[f"b:{name}"])
                    if name in self._base:
                        base.copy_(self._base[name])
                    self._base[name] = base
                self._shared_buffers = True
                return {n: torch.from_numpy(shared[f"d:{n}"]) for n in tensors}
        self._shared_buffers = False
        return {n: torch.empty_like(t.detach()) for n, t in tensors.items()}

    def _push(self) -> None:
        """Send ``w - w_base`` (over the steps it spans, for agn/sagn); take the central model if a pull is due."""
        assert self._client is not None
        tensors = self._synced_tensors()
        want_model = self._pull_due()
        cheap_refusal = self._shared_buffers and self._client.shares_memory  # else a lone worker's only
        if (want_model and self._weights_ok and self._base_is_central and self._dense(tensors)
                and self._scale() == 1.0 and (cheap_refusal or self.world_size == 1)
                and self._push_weights(tensors)):
            return
        update, deltas, exact = self._update(tensors)
        self._since_push = 0
        base = self._version
        # not while the PS may still hold our base as its model (lent): the guess would write it during the push
        ask_own = want_model and exact and not self._base_lent

        def own_model() -> None:
            """The model an "own" reply means, base + update: the same float32 additions as the PS's."""
            with torch.no_grad():
                for name, t in tensors.items():
                    self._base[name].add_(deltas[name])
                    t.copy_(self._base[name])

        # Made while the PS folds the same sum, where the last push was answered "own" too. Where it was not
        # (another worker raced it), this one will most likely not be either: the whole model comes, and
        # replaces base and weights alike, so the guess would be two passes over the model for nothing,
        # on cores the PS and the other workers need.
        guess = ask_own and self._weights_ok
        reply = self._client.push(base, update, want_model="unless_own" if ask_own else want_model,
                                  while_waiting=own_model if guess else None)
        self._count_staleness(reply, base)
        self._own_guesses[0] += guess
        self._own_guesses[1] += guess and reply.own
        self._weights_ok = reply.own  # nothing raced this push: the next may well be a lone one too
        if reply.own:  # the central model is base + update
            if not guess:
                own_model()
            self._based_on(reply)
        elif want_model:
            self._load(reply, ahead=True)
        else:  # what was pushed is the PS's now; keep training from our own weights
            for name, t in tensors.items():
                self._base[name].copy_(t.detach())
            self._based_on(reply, central=False)

    def _count_staleness(self, reply: ModelReply, base: int) -> None:
        if reply.status == "applied":
            staleness = reply.version - base - 1
            self._compensator.observe(staleness)
            st = self._staleness
            st[0], st[1], st[2] = st[0] + staleness, st[1] + 1, max(st[2], staleness)

    def _push_weights(self, tensors: dict[str, Tensor]) -> bool:
        """Push ``w`` itself; False, with nothing folded, if the PS's model moved on since our base.

        For a lone worker the PS's new model is then ``w``, bit for bit: no ``w - base`` to
        compute here, no ``base + delta`` there and again here. ``w`` is copied into the update
        buffers (the PS reads them, or the socket sends them, while ``w`` is free to change), and
        on an "own" reply those buffers become the base: no copy back.
        """
        assert self._client is not None
        if not self._buffers_fit(tensors):
            self._delta_buffers = self._new_delta_buffers(tensors)
        sent = self._delta_buffers
        with torch.no_grad():
            for name, t in tensors.items():
                sent[name].copy_(t.detach())
        base = self._version
        lend = self._shared_buffers
        reply = self._client.push(base, {n: _to_numpy(b) for n, b in sent.items()}, want_model="unless_own",
                                  weights=True, lend=lend)
        if reply.status == "not_current":
            self._weights_ok = False
            self._base_lent = False
            return False
        self._since_push = 0
        self._count_staleness(reply, base)
        if reply.own:  # the PS's model is what we sent: it is our base now
            self._delta_buffers, self._base = self._base, sent
            self._based_on(reply)
            # lent: the PS may keep these buffers as its model until it answers our next push or pull;
            # nothing writes the base before such an answer but the guess of an "own" reply, which waits
            self._base_lent = lend
        else:  # the PS had stopped, or held the reply (ssp) while others pushed: the whole model came
            self._load(reply)
        return True

    def _pull_keeping_progress(self) -> None:
        """DOWNPOUR's fetch: ``w = central + (w - w_base)``, so steps not yet pushed are not lost."""
        assert self._client is not None
        reply = self._client.pull()
        for name, t in self._synced_tensors().items():
            pending = t.detach() - self._base[name]
            assign(self._base[name], reply.tensors[name])
            with torch.no_grad():
                t.copy_(self._base[name] + pending)
        self._based_on(reply)

    def _elastic_exchange(self) -> None:
        """EASGD: ``e = alpha * (w - center)``; the worker steps ``-e``, the center ``+e`` (pushed)."""
        assert self._client is not None
        reply = self._client.pull()
        elastic = {}
        for name, t in self._synced_tensors().items():
            center = torch.as_tensor(reply.tensors[name], dtype=t.dtype, device=t.device).reshape(t.shape)
            e = self.alpha * (t.detach() - center)
            with torch.no_grad():
                t.sub_(e)
            elastic[name] = self._compressor.encode(name, _to_numpy(e))
        self._since_push = 0
        done = self._client.push(reply.version, elastic, want_model=False)
        self._version = done.version
        self._stop_if(reply.stop or done.stop)

    def _push_overlapped(self) -> None:
        """``overlap``: finish the push in flight, then send this update from a background thread."""
        self._finish_in_flight()
        assert self._client is not None
        tensors = self._synced_tensors()
        update, deltas, exact = self._update(tensors)
        # what the reply's model is merged with: the weights sent, unless the PS answers "own"
        sent = None if exact else {n: t.detach().clone() for n, t in tensors.items()}
        client, base, result = self._client, self._version, self._in_flight_result
        result.clear()

        def send() -> None:
            try:
                result["reply"] = client.push(base, update, want_model="unless_own" if exact else True)
            except BaseException as exc:  # re-raised in the training thread
                result["error"] = exc
            result["done_at"] = time.monotonic()

        result["sent"], result["deltas"] = sent, deltas
        result["sent_at"], result["next_step_at"] = time.monotonic(), None
        self._since_push = 0
        self._in_flight = threading.Thread(target=send, name="plug_asgd-sender", daemon=True)
        self._in_flight.start()

    def _finish_in_flight(self) -> None:
        """Take the reply of the push in flight: ``w = central + (w - w_at_send)`` keeps the steps made since."""
        thread, self._in_flight = self._in_flight, None
        if thread is None:
            return
        thread.join()
        result = self._in_flight_result
        if "error" in result:
            raise result["error"]
        reply, sent = result["reply"], result["sent"]
        if len(self._overlap_trace) < 20:  # (sent, next step started, reply received): the overlap, measured
            self._overlap_trace.append((result["sent_at"], result["next_step_at"], result["done_at"]))
        if reply.own:  # central = base + what was sent: the weights sent plus the progress are the weights now
            with torch.no_grad():
                for name, delta in result["deltas"].items():
                    self._base[name].add_(delta)
        else:
            if sent is None:  # an "own" push raced, or duplicate: merge with the weights sent, base + delta
                sent = {n: self._base[n] + d for n, d in result["deltas"].items()}
            for name, t in self._synced_tensors().items():
                progress = t.detach() - sent[name]
                assign(self._base[name], reply.tensors[name])
                with torch.no_grad():
                    t.copy_(self._base[name] + progress)
        self._based_on(reply)

    def _stop_if(self, stop: bool) -> None:
        if stop and self._fitting and self.lightning_module is not None:
            self.lightning_module.trainer.should_stop = True

    def _flush(self) -> None:
        self._finish_in_flight()
        if self._fitting and self._joined and self._since_push:
            if self.mode_spec.exchange == "elastic":
                self._elastic_exchange()
            else:
                self._push()

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._in_flight is not None:
            if self._in_flight_result.get("next_step_at") is None:
                self._in_flight_result["next_step_at"] = time.monotonic()
            if self._in_flight.is_alive():
                self._overlapped_steps += 1  # this step computes while the last update is on its way
        if self._hogwild and self._fitting and self._compensator.scale:
            # the workers' steps all land in one model: each at 1/workers, as DDP averages them
            with scaled_step(optimizer, 1.0 / self.world_size):
                out = super().optimizer_step(optimizer, closure, model, **kwargs)
        else:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._local_steps += 1
        if self._joined and self._fitting and not self._hogwild:
            self._since_push += 1
            self._since_pull += 1
            if self.overlap:
                if self._since_push >= self.push_every:
                    self._push_overlapped()
            elif self.mode_spec.exchange == "elastic":
                if self._since_push >= self.tau:
                    self._elastic_exchange()
            elif self._since_push >= self.push_every:
                self._push()
            elif self.pull_every is not None and self._since_pull >= self.pull_every:
                self._pull_keeping_progress()
        return out

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The state dict with the central tensors: a checkpoint holds the central model."""
        state = super().lightning_module_state_dict()
        self._finish_in_flight()
        if self._client is not None and self._joined and not self._hogwild:
            central = self._client.pull().tensors
            for name, t in self._synced_tensors().items():
                state[name] = torch.tensor(central[name], dtype=t.dtype).reshape(t.shape)
        return state

    # -- collectives through the PS --------------------------------------------------------------

    def _collectives_active(self) -> bool:
        return self._client is not None and self._in_stage and self.world_size > 1

    def _gather(self, kind: str, obj: Any = None, tensors: dict[str, np.ndarray] | None = None) -> list[Any]:
        self._finish_in_flight()  # one request at a time on the socket
        assert self._client is not None
        seq = self._collective_seq
        self._collective_seq += 1
        return self._client.gather(self._stage, seq, obj, tensors, kind=kind)

    def barrier(self, name: str | None = None) -> None:
        if self._collectives_active():
            self._gather(f"barrier:{name or ''}")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._collectives_active():
            return obj
        mine = None
        if self.global_rank == src:
            try:
                msgpack.packb(obj, use_bin_type=True)
                mine = {"value": obj}
            except (TypeError, ValueError) as exc:
                mine = {"error": f"AsyncPSStrategy.broadcast sends msgpack data only (str, numbers, lists, "
                                 f"dicts, bytes, None); got {type(obj).__name__}: {exc}"}
        for rank, payload, _ in self._gather("broadcast", mine):
            if rank == src:
                if payload is None or "error" in payload:
                    raise TypeError(payload["error"] if payload else f"broadcast source rank {src} sent nothing")
                return payload["value"]
        raise RuntimeError(f"broadcast source rank {src} has left the stage")

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        if sync_grads:
            raise RuntimeError("all_gather(sync_grads=True) needs autograd across processes, which "
                               "AsyncPSStrategy does not provide")
        if not self._collectives_active():
            return tensor.unsqueeze(0)
        parts = [t["x"] for _, _, t in self._gather("all_gather", tensors={"x": _to_numpy(tensor)})]
        return torch.tensor(np.stack(parts), dtype=tensor.dtype, device=tensor.device)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce across workers during evaluation; during training the local value is returned."""
        if not isinstance(tensor, Tensor) or not self._collectives_active():
            return tensor
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.stage == _TRAINING:
            return tensor
        op = _op_name(reduce_op)
        parts = np.stack([t["x"] for _, _, t in self._gather(f"reduce:{op}", tensors={"x": _to_numpy(tensor)})])
        if op == "mean":
            result = parts.astype(np.float64).mean(axis=0)
        else:
            result = getattr(parts, op)(axis=0)
        return torch.tensor(result, dtype=tensor.dtype if op != "mean" or tensor.is_floating_point()
                            else torch.float32, device=tensor.device)

