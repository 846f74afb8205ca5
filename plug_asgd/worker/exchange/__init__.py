"""The worker's exchange with the PS, one small class per kind: a mode's ``exchange`` names its class.

``push`` (:class:`PushExchange`), ``overlap`` (:class:`OverlapExchange`), ``fragments``
(:class:`FragmentExchange`, streaming DiLoCo), ``elastic`` (:class:`ElasticExchange`), ``shared``
(:class:`SharedExchange`, hogwild). The strategy hands an exchange a :class:`Link` at the start of
each stage and calls it after each local step.
"""

from __future__ import annotations

from typing import Any

from plug_asgd.modes import Mode
from plug_asgd.worker.exchange.base import Exchange
from plug_asgd.worker.exchange.elastic import ElasticExchange
from plug_asgd.worker.exchange.fragments import FragmentExchange
from plug_asgd.worker.exchange.hogwild import SharedExchange
from plug_asgd.worker.exchange.link import Link
from plug_asgd.worker.exchange.overlap import OverlapExchange
from plug_asgd.worker.exchange.push import PushExchange

__all__ = ["EXCHANGES", "ElasticExchange", "Exchange", "FragmentExchange", "Link", "OverlapExchange", "PushExchange",
           "SharedExchange", "make_exchange"]

EXCHANGES: dict[str, type[Exchange]] = {"push": PushExchange, "overlap": OverlapExchange,
                                        "fragments": FragmentExchange, "elastic": ElasticExchange,
                                        "shared": SharedExchange}


def make_exchange(mode: Mode, **kwargs: Any) -> Exchange:
    """The exchange ``mode`` trades its model with (``kwargs``: :class:`Exchange`'s).

    Args:
        mode: the configured mode; its ``exchange`` names the class (``EXCHANGES``).
        **kwargs: :class:`Exchange`'s keyword arguments (codec, compensation, shm_pushes).
    """
    return EXCHANGES[mode.exchange](mode, **kwargs)
