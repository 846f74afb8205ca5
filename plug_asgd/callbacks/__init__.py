"""Keras-style callbacks for parameter-server training: watch, keep and measure the central model.

- :class:`Supervisor` evaluates the *central* model while the workers train, in a thread of
  rank 0 with its own connection to the PS, so no training loop waits for it.
- :class:`PSCheckpoint` has the PS write its whole state (not a worker's copy) atomically.
- :class:`CommunicationMonitor` records, per worker, what it computed and what it sent.

They work with :class:`~plug_asgd.strategy.AsyncPSStrategy` only, one module each. Written once for both Lightning
namespaces, as the strategy (``plug_asgd.lightning_bridge.namespaces``): each is a ``Callback`` of the namespace in use.
"""

from plug_asgd.callbacks.communication_monitor import CommunicationMonitor
from plug_asgd.callbacks.ps_checkpoint import PSCheckpoint, load_central_weights
from plug_asgd.callbacks.supervisor import Supervisor, classification_metrics

__all__ = ["CommunicationMonitor", "PSCheckpoint", "Supervisor", "classification_metrics", "load_central_weights"]
