"""plug_asgd: asynchronous and compressed parameter-server SGD for any Lightning model.

``Trainer(strategy=AsyncPSStrategy(mode="adacomp"))`` or ``Trainer(strategy="async_ps")``:
importing this package registers the strategy names ``async_ps``, ``async_ps_adacomp`` and
``async_ps_sync`` with Lightning.
"""

from plug_asgd.strategy import AsyncPSStrategy  # noqa: I001 (first: it registers the strategy names)
from plug_asgd.callbacks import CommunicationMonitor, PSCheckpoint, Supervisor, load_central_weights
from plug_asgd.staleness import StalenessCompensation

__all__ = ["AsyncPSStrategy", "CommunicationMonitor", "PSCheckpoint", "StalenessCompensation", "Supervisor",
           "load_central_weights"]
__version__ = "0.1.0"
