"""Update codecs: what of a worker's update goes on the wire, and how the parameter server reads it.

A codec (a :class:`Codec`: :class:`TopK`, :class:`PowerSGD`, ...) turns one tensor's update into
what is sent (a dense array, a :class:`~plug_asgd.protocol.wire.Sparse` or a :class:`~plug_asgd.protocol.wire.Packed`);
a worker encodes with :meth:`Codec.encoder`, a fresh copy that keeps per-tensor state (the residual
of error feedback, PowerSGD's warm-started factor). The parameter server turns what arrives back
into something it can fold in with :func:`decode`. :func:`get` takes a name, a configured codec or
a dict; :func:`codec_table` is the family as docs/modes.md shows it. One file per family: ``sparse``,
``cast``, ``quantize``, ``lowrank``. Everything here is numpy: the PS never imports torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from plug_asgd import registry
from plug_asgd.compressors.base import Codec, Compressor, NoCompression
from plug_asgd.compressors.cast import BF16, FP16, bf16_bits
from plug_asgd.compressors.decoding import decode, slice_packed
from plug_asgd.compressors.error_feedback import ErrorFeedback
from plug_asgd.compressors.lowrank import PowerSGD
from plug_asgd.compressors.quantize import QSGD, Sign
from plug_asgd.compressors.registered import COMPRESSORS
from plug_asgd.compressors.sparse import SPARSE_VALUES, RandomK, TopK, TopKResidual, largest_magnitudes

__all__ = ["BF16", "COMPRESSORS", "FP16", "QSGD", "SPARSE_VALUES", "Codec", "Compressor", "ErrorFeedback",
           "NoCompression", "PowerSGD", "RandomK", "Sign", "TopK", "TopKResidual", "bf16_bits", "codec_table",
           "decode", "get", "largest_magnitudes", "slice_packed"]

CodecLike = str | Codec | Mapping[str, Any]


def get(codec: CodecLike) -> Codec:
    """The codec ``codec`` stands for: a name of :data:`COMPRESSORS` (its defaults), a configured
    instance (itself), or a dict ``{"name": ..., **knobs}`` (as a YAML file gives it).

    Args:
        codec: a registered name (``"topk"``), a configured :class:`Codec`, or a mapping of ``"name"`` and knobs.
    """
    return registry.get(codec, Codec, COMPRESSORS, "compressor")


def codec_table() -> str:
    """The registered codecs as a Markdown table (docs/modes.md's): name, class, knobs, what is sent, its bytes."""
    rows = ["| compressor | class | knobs (defaults) | what is sent | frame bytes | error feedback by default |",
            "|---|---|---|---|---|---|"]
    for name, cls in COMPRESSORS.items():
        knobs = ", ".join(f"`{k}` ({'auto' if p.default is None else repr(p.default)})"
                          for k, p in inspect.signature(cls).parameters.items() if k != "error_feedback")
        rows.append(f"| `{name}` | `{cls.__name__}` | {knobs or 'none'} | {cls.sends} | `{cls.wire_formula}` | "
                    f"{'yes' if cls.error_feedback_by_default else 'no'} |")
    return "\n".join(rows) + "\n"
