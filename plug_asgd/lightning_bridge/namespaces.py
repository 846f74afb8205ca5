"""The two Lightning namespaces: ``pytorch_lightning`` and the ``lightning`` package's ``lightning.pytorch``.

Lightning ships one framework under two names whose classes are distinct: a
``lightning.pytorch.Trainer`` refuses a ``pytorch_lightning`` strategy. plug_asgd's strategy and
callbacks are written once, free of either name (:class:`LightningBound` subclasses);
``plug_asgd.pytorch_lightning`` and ``plug_asgd.lightning`` make each a subclass of that
namespace's ``ParallelStrategy`` or ``Callback``. Creating one of the classes written once
(``AsyncPSStrategy(...)``) gives an instance of its subclass for the namespace the program
imported, the way ``pathlib.Path(...)`` gives a ``PosixPath``. This module imports neither.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from typing import Any

# each namespace and the plug_asgd module that holds its classes
BINDINGS = {"pytorch_lightning": "plug_asgd.pytorch_lightning", "lightning.pytorch": "plug_asgd.lightning"}


def in_use() -> str:
    """The Lightning namespace this program imported; if neither yet, the installed one (pytorch_lightning first).

    Raises:
        RuntimeError: both namespaces are imported, so which Trainer the program uses is unknown.
        ModuleNotFoundError: neither is installed.
    """
    imported = [ns for ns in BINDINGS if ns in sys.modules]
    if len(imported) > 1:
        raise RuntimeError("both pytorch_lightning and lightning are imported, so plug_asgd cannot tell which "
                           "Trainer you use: import the classes from plug_asgd.pytorch_lightning (for "
                           "pytorch_lightning.Trainer) or plug_asgd.lightning (for lightning.Trainer)")
    if imported:
        return imported[0]
    for ns in BINDINGS:
        if importlib.util.find_spec(ns.partition(".")[0]) is not None:
            return ns
    raise ModuleNotFoundError("plug_asgd needs Lightning: pip install pytorch-lightning (or lightning)")


def bound(cls: type, namespace: str) -> type:
    """``cls`` (a class written once) as a class of ``namespace``.

    Args:
        cls: the class written once (``AsyncPSStrategy``, a callback, or a user's subclass of one).
        namespace: ``"pytorch_lightning"`` or ``"lightning.pytorch"`` (a key of :data:`BINDINGS`).

    Raises:
        TypeError: the namespace's module has no subclass of ``cls`` by its name (a user's subclass of a class
            written once must subclass the namespace's class instead).
    """
    made = getattr(importlib.import_module(BINDINGS[namespace]), cls.__name__, None)
    if not (isinstance(made, type) and issubclass(made, cls)):
        raise TypeError(f"{cls.__qualname__} has no {namespace} class: subclass {cls.__name__} from "
                        f"{BINDINGS[namespace]} instead")
    return made


class LightningBound:
    """Base of a class written once for both namespaces; creating it gives its class for the namespace in use."""

    lightning_namespace: str | None = None  # set by the classes of plug_asgd.pytorch_lightning / plug_asgd.lightning

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.lightning_namespace is None:
            cls = bound(cls, in_use())
        return object.__new__(cls)


class _AfterImport(MetaPathFinder):
    """Calls ``then(name)`` right after the module ``name`` has been executed, once (a post-import hook)."""

    def __init__(self, names: set[str], then: Callable[[str], None]) -> None:
        self.pending, self.then = names, then

    def find_spec(self, name: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if name not in self.pending:
            return None
        self.pending.discard(name)
        if not self.pending:
            sys.meta_path.remove(self)
        spec = next((s for f in sys.meta_path if f is not self and hasattr(f, "find_spec")
                     for s in [f.find_spec(name, path, target)] if s is not None), None)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            self.then(name)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's loader only
        return spec


def register_strategies() -> None:
    """Registers the strategy names with each namespace: now if it is imported, else as soon as it is."""
    waiting = set()
    for namespace, binding in BINDINGS.items():
        if namespace in sys.modules:
            importlib.import_module(binding)  # registers its names
        else:
            waiting.add(namespace)
    if waiting and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(waiting, lambda namespace: importlib.import_module(BINDINGS[namespace])))
