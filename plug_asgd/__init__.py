"""plug_asgd: asynchronous and compressed parameter-server SGD for any Lightning model.

``Trainer(strategy=AsyncPSStrategy(mode="adacomp"))`` or ``Trainer(strategy="async_ps")``:
importing this package registers the strategy names ``async_ps``, ``async_ps_adacomp`` and
``async_ps_sync`` with Lightning.
"""

from plug_asgd.strategy import AsyncPSStrategy  # noqa: I001 (first: it registers the strategy names)
from plug_asgd.callbacks import CommunicationMonitor, PSCheckpoint, Supervisor, load_central_weights
from plug_asgd.compressors import BF16, FP16, QSGD, Codec, NoCompression, PowerSGD, RandomK, Sign, TopK
from plug_asgd.modes import AGN, EAMSGD, EASGD, LOSP, OSP, SAGN, SSP, AdaComp, Asgd, Downpour, DynSGD, Hogwild, LocalSGD
from plug_asgd.modes import Mode, Sync
from plug_asgd.staleness import StalenessCompensation

__all__ = ["AGN", "BF16", "EAMSGD", "EASGD", "FP16", "LOSP", "OSP", "QSGD", "SAGN", "SSP", "AdaComp", "Asgd",
           "AsyncPSStrategy", "Codec", "CommunicationMonitor", "Downpour", "DynSGD", "Hogwild", "LocalSGD", "Mode",
           "NoCompression", "PSCheckpoint", "PowerSGD", "RandomK", "Sign", "StalenessCompensation", "Supervisor",
           "Sync", "TopK", "load_central_weights"]
__version__ = "0.1.0"
