"""The codecs registered by name, below the codec base class: what the parameter server decodes by.

:class:`~plug_asgd.compressors.base.Codec` registers each subclass that has a ``name`` here, and marks whether it
sends ``Packed`` tensors (defines its own ``decode_packed``). The decoding (:mod:`.decoding`) reads this table
without importing the base class, so the base class can import the error feedback that decodes what it sent.
"""

from __future__ import annotations

from typing import Any

# Codec subclasses by name (typed loosely: this module lies below the base class and imports nothing of it)
COMPRESSORS: dict[str, type[Any]] = {}


def packed_codecs() -> dict[str, type[Any]]:
    """The registered codecs that send ``Packed`` tensors (those that define ``decode_packed``), by name."""
    return {n: c for n, c in COMPRESSORS.items() if c.sends_packed}
