"""plug_asgd for ``import pytorch_lightning as pl``: the strategy and callbacks as ``pytorch_lightning`` classes.

``plug_asgd.AsyncPSStrategy(...)`` (and the callbacks) give these when the program imported
``pytorch_lightning``; import them from here when it imported ``lightning`` too. Importing this
module registers the strategy names (``async_ps``, ...) with ``pytorch_lightning``.
``plug_asgd/lightning.py`` is this file with the namespace renamed (a test keeps them so).
"""

from pytorch_lightning.callbacks import Callback
from pytorch_lightning.plugins.environments import TorchElasticEnvironment
from pytorch_lightning.strategies import ParallelStrategy, StrategyRegistry
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from plug_asgd import callbacks, strategy
from plug_asgd.callbacks import load_central_weights
from plug_asgd.worker.compensation import StalenessCompensation

__all__ = ["AsyncPSStrategy", "CommunicationMonitor", "PSCheckpoint", "StalenessCompensation", "Supervisor",
           "load_central_weights"]
NAMESPACE = "pytorch_lightning"


class AsyncPSStrategy(strategy.AsyncPSStrategy, ParallelStrategy):
    """``pytorch_lightning``'s :class:`plug_asgd.strategy.AsyncPSStrategy`, with the original's docstring."""

    __doc__ = strategy.AsyncPSStrategy.__doc__
    lightning_namespace = NAMESPACE
    script_launcher = _SubprocessScriptLauncher
    process_launcher = _MultiProcessingLauncher
    elastic_environment = TorchElasticEnvironment


class Supervisor(callbacks.Supervisor, Callback):
    """``pytorch_lightning``'s :class:`plug_asgd.callbacks.Supervisor`, with the original's docstring."""

    __doc__ = callbacks.Supervisor.__doc__
    lightning_namespace = NAMESPACE


class PSCheckpoint(callbacks.PSCheckpoint, Callback):
    """``pytorch_lightning``'s :class:`plug_asgd.callbacks.PSCheckpoint`, with the original's docstring."""

    __doc__ = callbacks.PSCheckpoint.__doc__
    lightning_namespace = NAMESPACE


class CommunicationMonitor(callbacks.CommunicationMonitor, Callback):
    """``pytorch_lightning``'s :class:`plug_asgd.callbacks.CommunicationMonitor`, with the original's docstring."""

    __doc__ = callbacks.CommunicationMonitor.__doc__
    lightning_namespace = NAMESPACE


AsyncPSStrategy.register_strategies(StrategyRegistry)
