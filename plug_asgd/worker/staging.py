"""Staging a worker's tensors for the PS: numpy views on the CPU, pinned host buffers on a GPU.

A worker hands its model to the client as numpy arrays and takes the PS's arrays back into it.
On the CPU those arrays are the tensors' own memory (:func:`~plug_asgd.worker.tensors.to_numpy`,
:func:`~plug_asgd.worker.tensors.assign`): nothing is copied or allocated. On a CUDA device, a
``.cpu()`` per tensor would be a synchronous copy into freshly allocated pageable memory, one
stall of the host per tensor. :class:`Staging` keeps one pinned host buffer per tensor instead,
allocated once, issues every copy of a batch with ``non_blocking=True`` and waits once. Where the PS
maps the worker's memory (``shm_pushes``), a dense push's host buffers are that memory, pinned in place
(:meth:`Staging.share_out`): one device-to-host copy, and the PS reads the push where it landed.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from plug_asgd.worker.tensors import assign, to_numpy

log = logging.getLogger("plug_asgd.strategy")


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


def cuda_pin(start: int, size: int) -> Callable[[], None] | None:
    """Page-lock the host memory ``[start, start + size)`` in place (``cudaHostRegister``), so that copies from the
    device into it run asynchronously, at the link's speed; the function that unlocks it, or None where CUDA
    refused (the copies then go through the driver's bounce buffer: slower, the same bytes).

    Args:
        start: the first byte's address, page-aligned.
        size: the number of bytes, a whole number of pages.
    """
    cudart = torch.cuda.cudart()
    try:
        torch.cuda.check_error(cudart.cudaHostRegister(start, size, 0))
    except RuntimeError as exc:  # torch.cuda.CudaError
        _clear_last_cuda_error()
        log.info("pushing from unpinned shared memory: CUDA would not pin it (%s)", exc)
        return None

    def unpin() -> None:  # call it while the memory is still mapped
        try:
            torch.cuda.check_error(cudart.cudaHostUnregister(start))
        except RuntimeError:  # torch.cuda.CudaError: its error left set as a refused register's would be
            _clear_last_cuda_error()
            raise

    return unpin


def _clear_last_cuda_error() -> None:
    """Read (and so reset) CUDA's last error, which a refused ``cudaHostRegister`` or ``cudaHostUnregister`` leaves
    behind and torch's next kernel launch would otherwise raise as its own: through the runtime library torch
    loaded, where it is found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line.rsplit("/", 1)[-1]}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError) as exc:
        log.info("could not reset CUDA's last error (%s)", exc)


class Staging:
    """Moves a worker's tensors to numpy arrays and back, a batch (a model's worth) at a time.

    CPU tensors as before: :meth:`to_host` returns views of them, :meth:`load` writes into them.
    CUDA tensors go through pinned host buffers kept by name, allocated once per shape and dtype
    and reused by every later batch. The arrays :meth:`to_host` returns are those buffers: valid
    until its next call, which the exchange makes only once the PS has answered the push that sent
    them (an overlapped push's thread is joined first).

    A dense push's buffers can be memory the PS maps (:meth:`share_out`): two sets, each push
    (``shared=True``) filling the one the push before it did not, so that the PS may keep a push's
    buffers as its model (a lent push of weights) until it has answered the next one.

    ``staged``, ``pin``, ``mark`` and ``pin_range`` are seams for tests without a GPU: which devices are
    staged (CUDA), whether the buffers are pinned (where CUDA is available), what records the end of a
    batch of copies (a CUDA event on the device's current stream) and what pins shared memory in place.

    Args:
        staged: whether a tensor on a device goes through a host buffer (default: a CUDA device).
        pin: whether the host buffers are pinned; None: where CUDA is available.
        mark: records the end of the copies queued so far on a device, to wait on (default: a CUDA event).
        pin_range: pins host memory in place, returning its unpinning (None where it could not).
    """

    def __init__(self, *, staged: Callable[[torch.device], bool] = on_cuda, pin: bool | None = None,
                 mark: Callable[[torch.device], Waitable] = cuda_mark,
                 pin_range: Callable[[int, int], Callable[[], None] | None] = cuda_pin) -> None:
        self.staged = staged
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.mark, self.pin_range = mark, pin_range
        self._out: dict[str, Tensor] = {}  # device -> host: what pushes are sent from
        self._in: dict[str, Tensor] = {}  # host -> device: what replies are loaded from
        self._in_flight: list[Waitable] = []  # the last load's copies out of ``_in``, maybe not done yet
        self._shared: list[dict[str, Tensor]] = []  # the PS's memory for dense pushes: two sets, or none
        self._turn = 0  # the set the next shared batch fills
        self._unpin: Callable[[], None] | None = None
        self.allocations = 0  # buffers allocated so far (a test's and a benchmark's count)

    @property
    def shares_out(self) -> bool:
        """Whether dense pushes are staged in memory the PS maps."""
        return bool(self._shared)

    def share_out(self, sets: Sequence[Mapping[str, np.ndarray]]) -> None:
        """Stage dense pushes (``to_host(shared=True)``) in these two sets of float32 arrays, in turn: memory the PS
        maps, pinned in place where the buffers are pinned. Replaces (and unpins) any sets shared before.

        Args:
            sets: two mappings of tensor name to a C-contiguous float32 array, all in one mapped segment.

        Raises:
            ValueError: where there are not two sets.
        """
        if len(sets) != 2:
            raise ValueError(f"share_out takes two sets of buffers, used in turn; got {len(sets)}")
        self.release()
        arrays = [a for s in sets for a in s.values()]
        if self.pin and arrays:  # one range over the segment's buffers, widened to whole pages (all mapped)
            start = min(a.ctypes.data for a in arrays) // mmap.PAGESIZE * mmap.PAGESIZE
            end = -(-max(a.ctypes.data + a.nbytes for a in arrays) // mmap.PAGESIZE) * mmap.PAGESIZE
            self._unpin = self.pin_range(start, end - start)
        self._shared = [{n: torch.from_numpy(a) for n, a in s.items()} for s in sets]
        self._turn = 0

    def release(self) -> None:
        """Stop staging in shared memory, unpinning it (the exchange's end, or new sets)."""
        unpin, self._unpin = self._unpin, None
        try:
            if unpin is not None:  # while ``_shared`` still holds the sets: it may hold the last reference to the
                unpin()  # mapping, which goes with it (cudaHostUnregister on memory no longer mapped)
        except RuntimeError as exc:  # torch.cuda.CudaError: the memory stays pinned until the process ends
            log.info("could not unpin the shared push memory (%s)", exc)
        finally:
            self._shared = []

    def to_host(self, tensors: Mapping[str, Tensor], shared: bool = False) -> dict[str, np.ndarray]:
        """Each tensor's values as a numpy array (bfloat16 as float32): a view on the CPU, a pinned buffer
        on CUDA, filled by non-blocking copies and waited for once, before any array is handed out.

        Args:
            tensors: the tensors to read, by name; none is changed.
            shared: a dense push: staged in the PS's memory, where :meth:`share_out` gave some, in the set the
                last such batch did not fill.
        """
        arrays, ready = self.copy_out(tensors, shared)
        ready()
        return arrays

    def copy_out(self, tensors: Mapping[str, Tensor], shared: bool = False
                 ) -> tuple[dict[str, np.ndarray], Callable[[], None]]:
        """:meth:`to_host`'s arrays before its wait, and the wait: call it before an array is read (from the
        push's thread, say, so that the training thread goes on queueing the next step meanwhile).

        Args:
            tensors: the tensors to read, by name; none is changed.
            shared: a dense push (:meth:`to_host`).
        """
        out: dict[str, np.ndarray | Tensor] = {}
        devices: list[torch.device] = []
        kept = self._shared[self._turn] if shared and self._shared else {}
        with torch.no_grad():
            for name, t in tensors.items():
                if not self.staged(t.device):
                    out[name] = to_numpy(t)
                    continue
                buf = kept.get(name)
                if buf is None or buf.shape != t.shape or t.dtype not in (torch.float32, torch.bfloat16):
                    buf = self._buffer(self._out, name, t)
                buf.copy_(t.detach(), non_blocking=True)  # bfloat16 is converted on the device first
                out[name] = buf
                if t.device not in devices:
                    devices.append(t.device)
        if kept:
            self._turn = 1 - self._turn
        marks = [self.mark(d) for d in devices]

        def ready() -> None:  # one wait for the whole batch: the copies run back to back, the host stalls once
            for wait in marks:
                wait.synchronize()

        return {n: a.numpy() if isinstance(a, Tensor) else a for n, a in out.items()}, ready

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
