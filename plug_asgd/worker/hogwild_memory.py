"""Tensors in one shared-memory file, for Hogwild (Niu et al., NIPS 2011) workers on one machine.

Rank 0 writes the initial tensors to a temporary file in ``/dev/shm`` and renames it into place;
every worker maps the file and rebinds its parameters to views of it, so each optimizer step
writes straight into the one shared model, without locks. The layout (each tensor at a
64-byte-aligned offset, in the module's order) is computed the same way by every worker from
its own module, so nothing but the file's name needs to be agreed on.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

_ALIGN = 64


def shared_path(tag: str) -> Path:
    """Where the shared model of a run lives (``/dev/shm`` when the machine has it).

    Args:
        tag: what names the run's file, the same on every worker of the run and unlike any other run's.
    """
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    return base / f"plug_asgd_hogwild_{tag}"


def _layout(tensors: dict[str, Tensor]) -> tuple[dict[str, tuple[int, np.dtype]], int]:
    offsets, pos = {}, 0
    for name, t in tensors.items():
        dtype = np.dtype(str(t.dtype).removeprefix("torch."))
        offsets[name] = (pos, dtype)
        pos += -(-t.numel() * dtype.itemsize // _ALIGN) * _ALIGN
    return offsets, max(pos, _ALIGN)


def create(path: Path, tensors: dict[str, Tensor]) -> None:
    """Write ``tensors`` into a new shared file at ``path`` (atomically: temp name, then rename).

    Args:
        path: where the file goes (see :func:`shared_path`); one already there is replaced.
        tensors: the initial model, by name, in the module's order (which fixes the layout).
    """
    offsets, size = _layout(tensors)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    mm = np.memmap(tmp, dtype=np.uint8, mode="w+", shape=(size,))
    for name, t in tensors.items():
        start, dtype = offsets[name]
        view = mm[start:start + t.numel() * dtype.itemsize].view(dtype)
        view[:] = t.detach().cpu().reshape(-1).numpy()
    mm.flush()
    del mm
    os.replace(tmp, path)


def attach(path: Path, tensors: dict[str, Tensor]) -> np.memmap:
    """Rebind each tensor's storage to its slice of the shared file; keep the returned map alive.

    Args:
        path: the shared file that :func:`create` wrote.
        tensors: this worker's parameters and buffers, by name, in the module's order; each is rebound in place.

    Raises:
        RuntimeError: where the file is missing or its size is not what ``tensors``' layout needs.
    """
    offsets, size = _layout(tensors)
    if not path.exists() or path.stat().st_size != size:
        raise RuntimeError(f"shared model {path} is missing or has another layout: do all workers train the "
                           "same model on this machine?")
    mm = np.memmap(path, dtype=np.uint8, mode="r+", shape=(size,))
    for name, t in tensors.items():
        start, dtype = offsets[name]
        view = mm[start:start + t.numel() * dtype.itemsize].view(dtype).reshape(tuple(t.shape))
        t.data = torch.from_numpy(view)
    return mm


def detach(tensors: dict[str, Tensor]) -> None:
    """Give each tensor private storage again, holding the shared model's current values.

    Args:
        tensors: the tensors that :func:`attach` rebound.
    """
    for t in tensors.values():
        t.data = t.data.clone()
