"""Keras-style lookup shared by the mode and codec registries: a name, a configured object, or a dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def get(value: str | T | Mapping[str, Any], base: type[T], registry: Mapping[str, type[T]], what: str) -> T:
    """``value`` as an instance of ``base``: itself, the class named (its defaults), or ``{"name": ..., **knobs}``.

    Args:
        value: an instance of ``base`` (returned as it is), a registered name, or a mapping of ``"name"`` and the
            knobs to build it with (as a YAML file gives it).
        base: the class every entry of ``registry`` derives from (``Mode``, ``Codec``).
        registry: the registered classes by name.
        what: what is looked up (``"mode"``, ``"compressor"``), for the error messages.

    Raises:
        TypeError: where ``value`` is neither a ``base``, a name nor a mapping.
        ValueError: where the name is not registered, or the class refuses the knobs given.
    """
    if isinstance(value, base):
        return value
    if isinstance(value, str):
        name, knobs = value, {}
    elif isinstance(value, Mapping):
        knobs = dict(value)
        name = knobs.pop("name", None)
    else:
        raise TypeError(f"{what} must be a name, a {base.__name__} or a dict with a 'name', got {value!r}")
    cls = registry.get(name)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown {what} {name!r}; choose one of: {', '.join(registry)}")
    try:
        return cls(**knobs)
    except TypeError as exc:
        raise ValueError(f"{what} {name!r}: {exc}") from None
