"""plug_asgd for ``import lightning as L``: the strategy and callbacks as ``lightning.pytorch`` classes.

``plug_asgd.AsyncPSStrategy(...)`` (and the callbacks) give these when the program imported
``lightning``; import them from here when it imported ``pytorch_lightning`` too. Importing this
module registers the strategy names (``async_ps``, ...) with ``lightning.pytorch``.
It is ``plug_asgd/pytorch_lightning.py`` with the namespace renamed (a test keeps them so).
"""

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from plug_asgd import callbacks, strategy
from plug_asgd.callbacks import load_central_weights
from plug_asgd.worker.compensation import StalenessCompensation

__all__ = ["AsyncPSStrategy", "CommunicationMonitor", "PSCheckpoint", "StalenessCompensation", "Supervisor",
           "load_central_weights"]
NAMESPACE = "lightning.pytorch"


class AsyncPSStrategy(strategy.AsyncPSStrategy, ParallelStrategy):
    """``lightning.pytorch``'s :class:`plug_asgd.strategy.AsyncPSStrategy`, with the original's docstring."""

    __doc__ = strategy.AsyncPSStrategy.__doc__
    lightning_namespace = NAMESPACE
    script_launcher = _SubprocessScriptLauncher
    process_launcher = _MultiProcessingLauncher
    elastic_environment = TorchElasticEnvironment


class Supervisor(callbacks.Supervisor, Callback):
    """``lightning.pytorch``'s :class:`plug_asgd.callbacks.Supervisor`, with the original's docstring."""

    __doc__ = callbacks.Supervisor.__doc__
    lightning_namespace = NAMESPACE


class PSCheckpoint(callbacks.PSCheckpoint, Callback):
    """``lightning.pytorch``'s :class:`plug_asgd.callbacks.PSCheckpoint`, with the original's docstring."""

    __doc__ = callbacks.PSCheckpoint.__doc__
    lightning_namespace = NAMESPACE


class CommunicationMonitor(callbacks.CommunicationMonitor, Callback):
    """``lightning.pytorch``'s :class:`plug_asgd.callbacks.CommunicationMonitor`, with the original's docstring."""

    __doc__ = callbacks.CommunicationMonitor.__doc__
    lightning_namespace = NAMESPACE


AsyncPSStrategy.register_strategies(StrategyRegistry)
