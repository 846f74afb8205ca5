"""plug_asgd: asynchronous and compressed parameter-server SGD for any Lightning model.

``Trainer(strategy=AsyncPSStrategy(mode="adacomp"))`` or ``Trainer(strategy="async_ps")``, with
``pytorch_lightning`` or ``lightning`` (``plug_asgd.lightning_bridge.namespaces``). Importing this package imports
no Lightning and none of its modules: the names below load on first use, and the strategy names
``async_ps``, ``async_ps_adacomp`` and ``async_ps_sync`` are registered with each Lightning
namespace as soon as both it and plug_asgd are imported, in either order.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from plug_asgd.lightning_bridge import namespaces

__all__ = ["AGN", "AdaComp", "Asgd", "AsyncDiLoCo", "AsyncPSStrategy", "BF16", "Codec", "CommunicationMonitor",
           "DiLoCo", "Downpour", "DynSGD", "EAMSGD", "EASGD", "FP16", "Hogwild", "LOSP", "LocalSGD", "Mode",
           "NoCompression", "OSP", "OuterOptimizer", "PSCheckpoint", "PowerSGD", "QSGD", "RandomK", "SAGN", "SSP",
           "Sign", "StalenessCompensation", "Supervisor", "Sync", "TopK", "load_central_weights"]
__version__ = "0.1.0"  # the version's one place: pyproject.toml reads it ([tool.setuptools.dynamic])

_HOME = {"AsyncPSStrategy": "plug_asgd.strategy", "CommunicationMonitor": "plug_asgd.callbacks",
         "PSCheckpoint": "plug_asgd.callbacks", "Supervisor": "plug_asgd.callbacks",
         "load_central_weights": "plug_asgd.callbacks", "StalenessCompensation": "plug_asgd.worker.compensation",
         **dict.fromkeys(("AGN", "AsyncDiLoCo", "EAMSGD", "EASGD", "LOSP", "OSP", "SAGN", "SSP", "AdaComp", "Asgd",
                          "DiLoCo", "Downpour", "DynSGD", "Hogwild", "LocalSGD", "Mode", "OuterOptimizer", "Sync"),
                         "plug_asgd.modes"),
         **dict.fromkeys(("BF16", "FP16", "QSGD", "Codec", "NoCompression", "PowerSGD", "RandomK", "Sign", "TopK"),
                         "plug_asgd.compressors")}

if TYPE_CHECKING:
    from plug_asgd.callbacks import CommunicationMonitor, PSCheckpoint, Supervisor, load_central_weights
    from plug_asgd.compressors import BF16, FP16, QSGD, Codec, NoCompression, PowerSGD, RandomK, Sign, TopK
    from plug_asgd.modes import (
        AGN,
        EAMSGD,
        EASGD,
        LOSP,
        OSP,
        SAGN,
        SSP,
        AdaComp,
        Asgd,
        AsyncDiLoCo,
        DiLoCo,
        Downpour,
        DynSGD,
        Hogwild,
        LocalSGD,
        Mode,
        OuterOptimizer,
        Sync,
    )
    from plug_asgd.strategy import AsyncPSStrategy
    from plug_asgd.worker.compensation import StalenessCompensation


def __getattr__(name: str) -> Any:  # PEP 562: the public names, imported when first used
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'plug_asgd' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


namespaces.register_strategies()
