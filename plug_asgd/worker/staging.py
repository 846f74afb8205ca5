"""Staging a worker's tensors for the PS: numpy views on the CPU, pinned host buffers on a GPU.

A worker hands its model to the client as numpy arrays and takes the PS's arrays back into it.
On the CPU those arrays are the tensors' own memory (:func:`~plug_asgd.worker.tensors.to_numpy`,
:func:`~plug_asgd.worker.tensors.assign`): nothing is copied or allocated. On a CUDA device, a
``.cpu()`` per tensor would be a synchronous copy into freshly allocated pageable memory, one
stall of the host per tensor. :class:`Staging` keeps one pinned host buffer per tensor instead,
allocated once, issues every copy of a batch with ``non_blocking=True`` and waits once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from plug_asgd.worker.tensors import assign, to_numpy


class Waitable(Protocol):
    """What :class:`Staging` waits on: a CUDA event recorded after a batch of copies."""

    def synchronize(self) -> None:
        """Block the host until every copy queued before the mark was recorded is done."""
        ...


def on_cuda(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through pinned buffers (a CUDA device; nothing else is pinned).

    Args:
        device: where a tensor to stage lives.
    """
    return device.type == "cuda"


def cuda_mark(device: torch.device) -> Waitable:
    """An event recorded now on ``device``'s current stream, the one ``copy_`` queues its copies on:
    done once every copy queued there before it is.

    Args:
        device: the CUDA device whose copies are waited for.
    """
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class Staging:
    """Moves a worker's tensors to numpy arrays and back, a batch (a model's worth) at a time.

    CPU tensors as before: :meth:`to_host` returns views of them, :meth:`load` writes into them.
    CUDA tensors go through pinned host buffers kept by name, allocated once per shape and dtype
    and reused by every later batch. The arrays :meth:`to_host` returns are those buffers: valid
    until its next call, which the exchange makes only once the PS has answered the push that sent
    them (an overlapped push's thread is joined first).

    ``staged``, ``pin`` and ``mark`` are seams for tests without a GPU: which devices are staged
    (CUDA), whether the buffers are pinned (where CUDA is available) and what records the end of a
    batch of copies (a CUDA event on the device's current stream).

    Args:
        staged: whether a tensor on a device goes through a host buffer (default: a CUDA device).
        pin: whether the host buffers are pinned; None: where CUDA is available.
        mark: records the end of the copies queued so far on a device, to wait on (default: a CUDA event).
    """

    def __init__(self, *, staged: Callable[[torch.device], bool] = on_cuda, pin: bool | None = None,
                 mark: Callable[[torch.device], Waitable] = cuda_mark) -> None:
        self.staged = staged
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.mark = mark
        self._out: dict[str, Tensor] = {}  # device -> host: what pushes are sent from
        self._in: dict[str, Tensor] = {}  # host -> device: what replies are loaded from
        self._in_flight: list[Waitable] = []  # the last load's copies out of ``_in``, maybe not done yet
        self.allocations = 0  # buffers allocated so far (a test's and a benchmark's count)

    def to_host(self, tensors: Mapping[str, Tensor]) -> dict[str, np.ndarray]:
        """Each tensor's values as a numpy array (bfloat16 as float32): a view on the CPU, a pinned buffer
        on CUDA, filled by non-blocking copies and waited for once, before any array is handed out.

        Args:
            tensors: the tensors to read, by name; none is changed.
        """
        out: dict[str, np.ndarray | Tensor] = {}
        devices: list[torch.device] = []
        with torch.no_grad():
            for name, t in tensors.items():
                if not self.staged(t.device):
                    out[name] = to_numpy(t)
                    continue
                buf = self._buffer(self._out, name, t)
                buf.copy_(t.detach(), non_blocking=True)  # bfloat16 is converted on the device first
                out[name] = buf
                if t.device not in devices:
                    devices.append(t.device)
        # one wait for the whole batch: the copies run back to back on the stream, the host stalls once
        for wait in [self.mark(d) for d in devices]:
            wait.synchronize()
        return {n: a.numpy() if isinstance(a, Tensor) else a for n, a in out.items()}

    def load(self, targets: Mapping[str, Tensor], arrays: Mapping[str, np.ndarray]) -> None:
        """Copy ``arrays[name]`` into each target in place (parameters keep their identity for the optimizer).

        On CUDA: the arrays go into pinned buffers, then to the device with non-blocking copies, which
        are not waited for. The next forward cannot read a parameter before its copy is done: the copy
        is queued on the device's current stream, and so are the kernels that follow it (as is any
        ``copy_`` to or from the parameter later, a checkpoint's ``.cpu()`` included). What must wait is
        the host, before it writes a pinned buffer that a copy may still be reading: the next load
        waits for this one's copies first (an event, long done by then: a step ran in between).

        Args:
            targets: the tensors to overwrite, by name.
            arrays: their new values, by the same names, each of its target's number of elements.
        """
        staged = [(n, t) for n, t in targets.items() if self.staged(t.device)]
        for name, t in targets.items():
            if not self.staged(t.device):
                assign(t, arrays[name])
        if not staged:
            return
        for wait in self._in_flight:
            wait.synchronize()
        self._in_flight = []
        devices: list[torch.device] = []
        with torch.no_grad():
            for name, t in staged:
                buf = self._buffer(self._in, name, t)
                buf.numpy()[...] = np.asarray(arrays[name]).reshape(buf.shape)
                t.copy_(buf, non_blocking=True)  # to bfloat16 on the device, where the target is bfloat16
                if t.device not in devices:
                    devices.append(t.device)
        self._in_flight = [self.mark(d) for d in devices]

    def _buffer(self, buffers: dict[str, Tensor], name: str, t: Tensor) -> Tensor:
        """``name``'s host buffer for ``t``: the one kept, unless ``t``'s shape or dtype changed."""
        dtype = torch.float32 if t.dtype == torch.bfloat16 else t.dtype  # numpy has no bfloat16
        buf = buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != dtype:
            buf = buffers[name] = torch.empty(t.shape, dtype=dtype, pin_memory=self.pin)
            self.allocations += 1
        return buf
