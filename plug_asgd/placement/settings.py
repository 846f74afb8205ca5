"""The strategy's parameter-server arguments: checked once, where the strategy is built, and kept as one value.

:class:`PSSettings` is what :class:`~plug_asgd.placement.connection.PSConnection` and
:func:`~plug_asgd.placement.ps_launcher.ps_config` read; both import it from here. Imports neither Lightning namespace.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from plug_asgd.ps import DEFAULT_WORKER_TIMEOUT, PSConfig
from plug_asgd.worker.client import DEFAULT_HEARTBEAT_S


def check_arguments(*, max_updates: int | None, heartbeat_s: float | str | None, worker_timeout: float,
                    ps_address: str | Sequence[str] | None, ps_threads: int, **ps_options: Any) -> float | None:
    """Refuses the strategy's PS arguments that are out of range; returns ``heartbeat_s`` with ``"auto"`` resolved.

    Args:
        max_updates: the PS stops every worker after this many updates (None: never); at least 1.
        heartbeat_s: seconds between a worker's heartbeats, ``"auto"`` (``min(2, worker_timeout / 4)``) or None
            (none); at most half of ``worker_timeout``, so that one late beat does not make a live worker lost.
        worker_timeout: seconds of silence after which the PS declares a worker lost.
        ps_address: an external PS's ``tcp://`` or ``ipc://`` address, or one per shard (None: embedded).
        ps_threads: the embedded PS's fold threads, 1 to 256.
        **ps_options: fields of :class:`PSConfig` by name (``downlink_fraction=...``), checked as the PS checks
            them.

    Raises:
        ValueError: an argument out of range, or an address that is not ``tcp://`` or ``ipc://``.
    """
    for name, value in ps_options.items():
        PSConfig.check(name, value)
    PSConfig.check_downlink(ps_options.get("downlink_fraction"), ps_options.get("downlink_codec"))
    if max_updates is not None and max_updates < 1:
        raise ValueError(f"max_updates must be >= 1, got {max_updates}")
    if heartbeat_s == "auto":
        heartbeat_s = min(DEFAULT_HEARTBEAT_S, worker_timeout / 4)
    if heartbeat_s is not None and not 0 < heartbeat_s <= worker_timeout / 2:  # type: ignore[operator]
        raise ValueError(f"heartbeat_s must be in (0, worker_timeout / 2 = {worker_timeout / 2:g}] so that one "
                         f"late beat does not make a live worker lost, got {heartbeat_s}")
    for address in [ps_address] if isinstance(ps_address, str) else ps_address or []:
        if not isinstance(address, str) or not address.startswith(("tcp://", "ipc://")):
            raise ValueError(f"ps_address must look like tcp://host:port (or be a list of such, one per shard), "
                             f"got {address!r}")
    if not 1 <= ps_threads <= 256:
        raise ValueError(f"ps_threads must be between 1 and 256, got {ps_threads}")
    return heartbeat_s  # type: ignore[return-value]


@dataclass(frozen=True)
class PSSettings:
    """The strategy's parameter-server arguments, checked once when built (``AsyncPSStrategy``'s Args say each).

    Attributes:
        ps_address: an external PS's address, or one per shard; None: an embedded PS.
        ps_port: the embedded PS's port (None: the cluster's main port, + 1 under torchrun).
        ps_shards: embedded shards, a count or ``"per_node"``; None: one PS.
        max_updates: the PS stops every worker after this many updates.
        connect_timeout: seconds to wait for the PS's first answer.
        request_timeout: seconds to wait for any reply.
        lost_timeout: seconds to wait for a PS whose connection dropped.
        heartbeat_s: seconds between heartbeats, ``"auto"`` or None.
        worker_timeout: seconds of silence after which the embedded PS declares a worker lost.
        resume_from: a PS checkpoint file or folder the embedded PS starts from.
        ps_run_dir: where the embedded PS writes its metrics.
        ps_keys: CURVE keys folder.
        ps_insecure: let the embedded PS listen beyond loopback without keys.
        ps_threads: the embedded PS's fold threads.
        delta_replies: replies carry only what changed, where that is less.
        downlink_fraction: the share of each tensor a reply carries (None: all).
        downlink_bound: every coordinate off by more than this is sent too.
        downlink_codec: replies to pushes carry every difference so coded (``"fp16"``, ``"int8"``, ``"int4"``;
            None: exact).
        ps_standby: node 1's local rank 0 runs a hot standby of each embedded PS
            (:mod:`plug_asgd.placement.standby_launcher`).
        failover_timeout: seconds of the PS's silence after which its standby may lead.
        heartbeat_seconds: ``heartbeat_s`` with ``"auto"`` resolved against ``worker_timeout`` (not an argument).

    Raises:
        ValueError: an argument out of range (:func:`check_arguments`); ``ps_standby`` beside an external PS or
            ``ps_shards="per_node"``.
    """

    ps_address: str | list[str] | None = None
    ps_port: int | None = None
    ps_shards: int | Literal["per_node"] | None = None
    max_updates: int | None = None
    connect_timeout: float = 60.0
    request_timeout: float = 600.0
    lost_timeout: float = 60.0
    heartbeat_s: float | Literal["auto"] | None = "auto"
    worker_timeout: float = DEFAULT_WORKER_TIMEOUT
    resume_from: str | os.PathLike[str] | None = None
    ps_run_dir: str | os.PathLike[str] | None = None
    ps_keys: str | os.PathLike[str] | None = None
    ps_insecure: bool = False
    ps_threads: int = 1
    delta_replies: bool = True
    downlink_fraction: float | None = None
    downlink_bound: float | None = None
    downlink_codec: str | None = None
    ps_standby: bool = False
    failover_timeout: float = 3.0

    heartbeat_seconds: float | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        seconds = check_arguments(max_updates=self.max_updates, heartbeat_s=self.heartbeat_s,
                                  worker_timeout=self.worker_timeout, ps_address=self.ps_address,
                                  ps_threads=self.ps_threads, downlink_fraction=self.downlink_fraction,
                                  downlink_bound=self.downlink_bound, downlink_codec=self.downlink_codec,
                                  failover_timeout=self.failover_timeout)
        if self.ps_standby and (self.ps_address is not None or self.ps_shards == "per_node"):
            raise ValueError("ps_standby=True starts a standby of the embedded PS (or of each of ps_shards=N): "
                             + ("an external PS (ps_address=) gets one from `plug-asgd serve-ps --standby-of ADDR`"
                                if self.ps_address is not None else
                                "with ps_shards='per_node' no node is left to hold the shards' standbys; use "
                                "ps_shards=N (every shard on node 0, their standbys on node 1)"))
        object.__setattr__(self, "heartbeat_seconds", seconds)

    @property
    def downlink(self) -> dict[str, float | str | None]:
        """The downlink's options, as :class:`~plug_asgd.ps.PSConfig` names them."""
        return {"downlink_fraction": self.downlink_fraction, "downlink_bound": self.downlink_bound,
                "downlink_codec": self.downlink_codec}
