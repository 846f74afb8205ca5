"""Hogwild's exchange: the workers of one machine step one model in shared memory; nothing is pushed."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from typing_extensions import override

from plug_asgd.worker import hogwild_memory as shared
from plug_asgd.worker.compensation import nesterov_form, scaled_step
from plug_asgd.worker.exchange.base import Exchange


class SharedExchange(Exchange):
    """Rank 0 puts its model in shared memory and every worker's tensors become views of it; the PS only
    serves Lightning's barriers. Each step is scaled by ``1/workers`` where the compensation scales.

    Args:
        *args: :class:`Exchange`'s positional arguments (the mode).
        **kwargs: :class:`Exchange`'s keyword arguments (codec, compensation, shm_pushes).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shared_map: Any = None

    @override
    def join(self, init: bool) -> None:
        if self._link.fitting:
            self._join_shared()
        self.joined = True

    @override
    def refresh(self) -> None:
        """The module already is the shared, central model. During a fit every worker first stops stepping it
        (a barrier): all then evaluate, and a checkpoint holds, the same model (without it, a worker still
        training moved the model under another's validation: tests/test_features.py saw it)."""
        self.wait_for_the_others()

    @override
    def after_step(self) -> None:
        """Nothing to push: the step landed in the shared model itself (``step`` is this exchange's own)."""

    @override
    def send(self) -> None:
        """Nothing to send, as for :meth:`after_step`."""

    @override
    def step(self, run: Callable[[], Any], optimizer: Any) -> Any:
        fitting = self._link.fitting
        # the workers' steps all land in one model: each at 1/workers, as DDP averages them
        factor = 1.0 / self._link.world_size if fitting and self.compensator.scale else 1.0
        form = nesterov_form(optimizer) if fitting and self.nesterov_steps else nullcontext()
        with scaled_step(optimizer, factor), form:
            out = run()
        self.local_steps += 1
        return out

    @override
    def leave(self) -> None:
        link = self._link
        link.barrier("plug_asgd.fit_end")  # every worker's steps are in the shared model
        shared.detach(link.tensors())
        link.barrier("plug_asgd.hogwild_detached")
        self._drop_shared()

    @override
    def close(self) -> None:
        super().close()
        if self.link is not None:
            self._drop_shared()  # a hogwild fit that failed leaves its shared file behind

    @override
    def central_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return state

    def _path(self) -> Path:
        return shared.shared_path(self._link.shared_tag)

    def _join_shared(self) -> None:
        link = self._link
        if not link.one_cpu_machine:
            raise ValueError("mode='hogwild' shares memory between the processes of one machine: use "
                             "num_nodes=1 and accelerator='cpu'")
        tensors = link.tensors()
        if link.rank == 0:
            shared.create(self._path(), tensors)
        link.barrier("plug_asgd.hogwild_created")
        self.shared_map = shared.attach(self._path(), tensors)

    def _drop_shared(self) -> None:
        self.shared_map = None
        if self._link.rank == 0:
            self._path().unlink(missing_ok=True)
