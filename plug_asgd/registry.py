"""Keras-style lookup shared by the mode and codec registries: a name, a configured object, or a dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def get(value: str | T | Mapping[str, Any], base: type[T], registry: Mapping[str, type[T]], what: str) -> T:
    """``value`` as an instance of ``base``: itself, the class named (its defaults), or ``{"name": ..., **knobs}``."""
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
