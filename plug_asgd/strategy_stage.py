"""A stage of :class:`~plug_asgd.strategy.AsyncPSStrategy` with its PS, beside the strategy's life cycle: joining
the central model at a stage's start and taking it again at the next, the island's ranks kept on the leader's
weights, and the stage's end (its leaving, after a fit that went well, or its failure). A base of the strategy, as
:class:`~plug_asgd.strategy_surface.PSSurface` is; it reads the strategy's parts, which the strategy makes."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from plug_asgd.lightning_bridge.plumbing import FAILED_GRACE_S
from plug_asgd.placement.island import IslandLost
from plug_asgd.worker.phase import Phase
from plug_asgd.worker.tensors import synced_tensors

if TYPE_CHECKING:
    from plug_asgd.placement.connection import PSConnection
    from plug_asgd.placement.island import IslandGroup
    from plug_asgd.placement.ps_view import PSView
    from plug_asgd.placement.stage import Stage
    from plug_asgd.worker.exchange import Exchange


class StageSync:
    """The strategy's stage with its PS: join, refresh, the island's weights, the end of a stage."""

    stage: Stage
    connection: PSConnection
    ps: PSView
    _exchange: Exchange
    _island: IslandGroup | None
    _ps_initialized: bool
    lightning_module: Any
    island_leader: bool
    _stop_tuning: Callable[[], None]  # the strategy's: its thread tuner stopped
    end_launched_ranks: Callable[[float], None]  # DDPPlumbing's: the ranks this one launched ended

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._stop_tuning()
        # an island that lost a rank ends as a lost worker does: the PS goes on with the other islands
        stage = self.stage
        stage.failure = None if isinstance(exception, IslandLost) else f"{type(exception).__name__}: {exception}"
        if stage.phase is not Phase.IDLE:  # (an exception before the stage began, as the PS's, has nothing to end)
            stage.phase = Phase.FAILED

    def _leave_batches(self) -> None:
        if self.stage.phase is Phase.BATCHES:
            self.stage.phase = Phase.STAGE

    @override
    def teardown(self) -> None:
        stage = self.stage
        if self.connection.client is not None and stage.phase is not Phase.IDLE:
            failed = stage.phase is Phase.FAILED
            try:
                if stage.fitting and self._exchange.joined and not failed:
                    self._exchange.leave()
                    self._island_sync()  # the final central model on every rank of the island
            finally:
                stage.phase = Phase.IDLE  # only now: the barriers above are collectives of this stage
                # after a failure: the socket is a sender's until it is done, hence let_go first
                self.connection.goodbye(stage.number, failed, settle=self._exchange.let_go, failure=stage.failure)
            if self._island is not None and not failed:  # the PS's counters as the leader left, to its island
                self._island.broadcast_obj(self.connection.stats_at_exit)
        elif self._island is not None and stage.phase is not Phase.IDLE:  # an island's other ranks
            try:
                if stage.phase is not Phase.FAILED:
                    if stage.fitting and stage.joined:
                        self._island_sync()
                    self.ps.stats_at_exit = self._island.broadcast_obj(None)
            finally:
                stage.phase = Phase.IDLE
        self._exchange.joined = stage.joined = False
        if stage.failure is not None:  # as Lightning's launcher does where a rank fails: none trains on alone
            stage.failure = None
            self.end_launched_ranks(FAILED_GRACE_S)
        super().teardown()

    def _join(self) -> None:
        """Start of a stage: offer our weights if the PS has none yet, then take the central ones (an island's
        leader, which then sends them to its island)."""
        if not self.stage.joined:
            if self.island_leader:
                self._exchange.join(init=not self._ps_initialized)
                self._ps_initialized = True
            self.stage.joined = True
            self._island_sync()

    def _refresh(self) -> None:
        if not self.stage.joined:
            self._join()
        else:
            if self.island_leader:
                self._exchange.refresh()
            self._island_sync()

    def _island_sync(self) -> None:
        """The leader's weights on every rank of its island (all of them call it at the same point)."""
        if self._island is not None:
            self._island.send_weights(synced_tensors(self.lightning_module))

    def _request_stop(self) -> None:
        if self.stage.fitting and self.lightning_module is not None:
            self.lightning_module.trainer.should_stop = True
