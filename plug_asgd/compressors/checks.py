"""What a codec checks: a tensor as it arrives, before its decoder reads it, and a knob where the codec is built.

The lowest module of the codecs: :mod:`.base` (a codec that sends no ``Packed``), :mod:`.decoding` and each
family's ``decode_packed`` refuse what no codec could have sent with :func:`bad_payload`.
"""

from __future__ import annotations

import math

import numpy as np

from plug_asgd.protocol.wire import Packed, WireError


def bad_payload(message: str) -> WireError:
    """The error a tensor that no codec could have sent is refused with (code ``bad_payload``), to be raised.

    Args:
        message: what is wrong with it, for the sender.
    """
    return WireError("bad_payload", message)


def check_meta(p: Packed, *keys: str) -> None:
    """Refuse ``p`` unless its meta holds exactly ``keys``.

    Args:
        p: the tensor as it arrived.
        *keys: the meta keys its codec sends.

    Raises:
        WireError: ``bad_payload``, where a key is missing or one more is there.
    """
    if set(p.meta) != set(keys):
        raise bad_payload(f"codec {p.codec!r} takes meta {sorted(keys)}, got {sorted(p.meta)}")


def meta_int(p: Packed, key: str, low: int, high: int) -> int:
    """``p.meta[key]``, refused unless an integer in ``low..high``.

    Args:
        p: the tensor as it arrived (its meta's keys checked already: :func:`check_meta`).
        key: the meta key.
        low: the least value allowed.
        high: the greatest value allowed.

    Raises:
        WireError: ``bad_payload``, where the value is no integer (a bool neither) or out of range.
    """
    value = p.meta[key]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise bad_payload(f"codec {p.codec!r}: {key} must be an integer in {low}..{high}, got {value!r}")
    return value


def meta_scale(p: Packed, key: str) -> float:
    """``p.meta[key]`` as a float, refused unless a finite number ``>= 0`` (a norm, a mean magnitude).

    Args:
        p: the tensor as it arrived (its meta's keys checked already: :func:`check_meta`).
        key: the meta key.

    Raises:
        WireError: ``bad_payload``, where the value is no number, not finite or negative.
    """
    value = p.meta[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise bad_payload(f"codec {p.codec!r}: {key} must be a finite number >= 0, got {value!r} (has the "
                          "worker's training diverged?)")
    return float(value)


def packed_arrays(p: Packed, count: int) -> tuple[np.ndarray, ...]:
    """``p``'s arrays as numpy arrays, refused unless there are ``count`` of them.

    Args:
        p: the tensor as it arrived.
        count: how many arrays its codec sends.

    Raises:
        WireError: ``bad_payload``, where there are more or fewer.
    """
    if len(p.arrays) != count:
        raise bad_payload(f"codec {p.codec!r} sends {count} array(s), got {len(p.arrays)}")
    return tuple(np.asarray(a) for a in p.arrays)


def expect(p: Packed, what: str, array: np.ndarray, dtypes: frozenset[str] | set[str], shape: tuple[int, ...]) -> None:
    """Refuse ``p`` unless ``array``, one of its arrays, has one of ``dtypes`` and the shape ``shape``.

    Args:
        p: the tensor as it arrived.
        what: what the array holds (``"the signs"``), for the message.
        array: the array checked.
        dtypes: the dtype names allowed.
        shape: the shape required.

    Raises:
        WireError: ``bad_payload``, where its dtype or shape is another.
    """
    if array.dtype.name not in dtypes or array.shape != shape:
        raise bad_payload(f"codec {p.codec!r}: {what} must be {'|'.join(sorted(dtypes))}{list(shape)}, got "
                          f"{array.dtype.name}{list(array.shape)}")


def check_int(what: str, value: int, low: int, high: int | None = None) -> int:
    """``value`` as an int, refused unless an integer in ``[low, high]``: a codec's knob, checked where it is built.

    Args:
        what: the knob's name, for the message.
        value: the value given.
        low: the least value allowed.
        high: the greatest value allowed; None: no bound.

    Raises:
        ValueError: where ``value`` is no integer (a bool neither) or out of range.
    """
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low or (
            high is not None and value > high):
        raise ValueError(f"{what} must be an integer in [{low}, {high if high is not None else 'inf'}], got {value!r}")
    return int(value)
