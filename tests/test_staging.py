"""plug_asgd.worker.staging: a worker's tensors to numpy and back. No GPU here, so the CUDA path is driven on CPU
tensors through the seams (``staged``: which devices go through buffers; ``pin``; ``mark``: what records
the end of a batch of copies and is waited on), with every aten copy recorded with its non_blocking flag."""

from __future__ import annotations

import logging
import mmap
import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plug_asgd.modes import EASGD, Asgd, Downpour, Mode
from plug_asgd.protocol import push_memory
from plug_asgd.worker import staging as staging_module
from plug_asgd.worker.compensation import OFF, Compensator, StalenessCompensation
from plug_asgd.worker.exchange import Exchange, Link, make_exchange
from plug_asgd.worker.staging import Staging
from tests.test_mode_rounds import LocalPS, StubClient


class Marks:
    """A fake CUDA event factory: logs each mark made and each wait, by the mark's number."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.made = 0
        self.waits = 0
        self.on_wait = lambda: None

    def __call__(self, device: torch.device) -> Mark:
        self.made += 1
        self.log.append(("mark", self.made))
        return Mark(self, self.made)


class Mark:
    def __init__(self, marks: Marks, number: int) -> None:
        self.marks, self.number = marks, number

    def synchronize(self) -> None:
        self.marks.waits += 1
        self.marks.log.append(("wait", self.number))
        self.marks.on_wait()


class CopySpy(TorchDispatchMode):
    """Records every aten copy (``copy_``, ``_to_copy``) with its non_blocking flag and the storages involved."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            self.log.append(("copy", bool(non_blocking), args[0].untyped_storage().data_ptr(),
                             args[1].untyped_storage().data_ptr()))
        elif func is torch.ops.aten._to_copy.default:
            self.log.append(("to_copy", bool(kwargs.get("non_blocking", False)), args[0].untyped_storage().data_ptr(),
                             None))
        return func(*args, **kwargs)


def device_path(log: list) -> tuple[Staging, Marks]:
    """A Staging that takes every tensor, CPU ones included, through its buffers (what it does on CUDA)."""
    marks = Marks(log)
    return Staging(staged=lambda device: True, pin=False, mark=marks), marks


def model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(3, 4, generator=g, requires_grad=True), "b": torch.randn(4, generator=g),
            "h": torch.randn(5, generator=g).to(torch.bfloat16)}


def buffer_ptrs(staging: Staging) -> set[int]:
    return {b.untyped_storage().data_ptr() for b in [*staging._out.values(), *staging._in.values()]}


# -- the CPU path: what it was ------------------------------------------------------------------------


def test_cpu_tensors_are_handed_out_as_views_of_their_own_memory_and_written_in_place():
    staging = Staging()
    tensors = model()
    out = staging.to_host(tensors)
    assert np.shares_memory(out["w"], tensors["w"].detach().numpy())  # no copy, as tensors.to_numpy
    assert np.shares_memory(out["b"], tensors["b"].numpy())
    assert out["h"].dtype == np.float32 and out["h"].tolist() == tensors["h"].float().tolist()  # numpy has no bf16
    ptr = tensors["w"].data_ptr()
    new = {"w": np.full((12,), 2.5, np.float32), "b": np.arange(4, dtype=np.float32),
           "h": np.array([1.0, 1.00390625, 3.0, -2.0, 0.5], np.float32)}
    staging.load(tensors, new)
    assert tensors["w"].data_ptr() == ptr and tensors["w"].tolist() == [[2.5] * 4] * 3  # in place, reshaped
    assert tensors["b"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert tensors["h"].tolist() == torch.tensor(new["h"]).to(torch.bfloat16).tolist()
    assert staging.allocations == 0 and not staging._out and not staging._in


def test_cpu_path_issues_no_torch_copy_either_way():
    log: list = []
    staging, tensors = Staging(), model()
    with CopySpy(log):
        staging.to_host({"w": tensors["w"], "b": tensors["b"]})
        staging.load({"w": tensors["w"], "b": tensors["b"]},
                     {"w": np.ones(12, np.float32), "b": np.ones(4, np.float32)})
    assert log == []  # views both ways: nothing copied by torch, nothing allocated


# -- the CUDA path, through the seams ----------------------------------------------------------------


def test_each_tensor_gets_one_buffer_allocated_once_and_reused_by_every_later_batch():
    log: list = []
    staging, _ = device_path(log)
    tensors = model()
    first = staging.to_host(tensors)
    assert not np.shares_memory(first["w"], tensors["w"].detach().numpy())  # staged: the buffer, not the tensor
    addresses = {n: a.ctypes.data for n, a in first.items()}
    with torch.no_grad():
        for t in tensors.values():
            t.mul_(-3)
    second = staging.to_host(tensors)
    assert {n: a.ctypes.data for n, a in second.items()} == addresses
    assert staging.allocations == 3
    for name, t in tensors.items():
        assert np.array_equal(second[name], t.detach().float().numpy())
    assert second["h"].dtype == np.float32
    # loads: buffers of their own (a push in flight may still be reading the push's), allocated once too
    for k in range(3):
        staging.load(tensors, {n: np.full(tuple(t.shape), k, np.float32) for n, t in tensors.items()})
    assert staging.allocations == 6
    assert len(buffer_ptrs(staging)) == 6


def test_a_push_batch_queues_every_copy_non_blocking_then_waits_once_before_handing_out():
    log: list = []
    staging, marks = device_path(log)
    tensors = model()
    with CopySpy(log):
        staging.to_host(tensors)  # allocations happen here, outside the assertions below
        del log[:]
        marks.waits = 0
        out = staging.to_host(tensors)
    buffers = buffer_ptrs(staging)
    copies = [e for e in log if e[0] in ("copy", "to_copy")]
    assert len(copies) == 3 and all(e[0] == "copy" and e[1] for e in copies)  # non_blocking, no .cpu()
    assert all(e[2] in buffers for e in copies)  # into the kept buffers
    assert log[3:] == [("mark", 2), ("wait", 2)]  # after the last copy: one mark, one wait, for the batch
    assert marks.waits == 1
    assert np.array_equal(out["w"], tensors["w"].detach().numpy())


@pytest.mark.skipif(not push_memory.available(), reason="no sealed shared memory here (Linux's memfd)")
def test_dense_pushes_fill_the_ps_memory_in_turn_pinned_once_over_whole_pages():
    """share_out: the two sets a segment holds (as the PS maps them), pinned as one page-aligned range; each
    shared batch fills the set the last one did not, so a lent set is never written before the next answer."""
    log: list = []
    pins: list = []
    staging = Staging(staged=lambda device: True, pin=True, mark=Marks(log),
                      pin_range=lambda start, size: pins.append((start, size)) or (lambda: pins.append("unpin")))
    tensors = model()
    shapes = {f"{kind}:{n}": (tuple(t.shape), np.float32) for n, t in tensors.items() for kind in "db"}
    segment = push_memory.PushSegment(shapes)
    sets = [{n: segment.buffers[f"{kind}:{n}"] for n in tensors} for kind in "db"]
    staging.share_out(sets)
    assert staging.shares_out and len(pins) == 1
    start, size = pins[0]
    first = min(a.ctypes.data for s in sets for a in s.values())
    last = max(a.ctypes.data + a.nbytes for s in sets for a in s.values())
    assert start % mmap.PAGESIZE == 0 and size % mmap.PAGESIZE == 0
    assert start <= first < start + mmap.PAGESIZE and last <= start + size < last + mmap.PAGESIZE
    turns = []
    for k in range(3):
        with torch.no_grad():
            for t in tensors.values():
                t.fill_(k)
        out = staging.to_host(tensors, shared=True)
        turns.append(next(i for i, s in enumerate(sets) if np.shares_memory(out["w"], s["w"])))
        assert all(segment.offset(a) is not None for a in out.values())  # sent by offset, not as bytes
        assert all(a.tolist() == np.full(a.shape, k, np.float32).tolist() for a in out.values())
    assert turns == [0, 1, 0]
    staging.pin = False  # (no pinned allocator without CUDA, for the private buffers below)
    private = staging.to_host(tensors)  # not a push: the kept pinned buffers, and the turn stays
    assert all(segment.offset(a) is None for a in private.values())
    assert np.shares_memory(staging.to_host(tensors, shared=True)["w"], sets[1]["w"])
    assert sets[0]["b"].tolist() == [2.0] * 4  # the set lent last stays as it was written
    staging.release()
    assert pins[1:] == ["unpin"] and not staging.shares_out
    assert staging.to_host(tensors, shared=True)["w"].ctypes.data not in {a.ctypes.data for a in sets[0].values()}



def mapped_sets() -> tuple[list[dict[str, np.ndarray]], weakref.ref]:
    """Two sets of float32 arrays in one mapping of their own (as a push segment's), and a weak reference to the
    mapping: it is unmapped once the last array over it goes."""
    memory = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    mapping = weakref.ref(memory)
    whole = np.frombuffer(memory, dtype=np.float32)
    return [{"w": whole[:12], "b": whole[16:20]}, {"w": whole[32:44], "b": whole[48:52]}], mapping


def test_release_unpins_the_shared_memory_while_the_staging_still_holds_it_mapped():
    """The staging may hold the last reference to the PS's memory (the client let its segment go): the unpinning
    (cudaHostUnregister) must run before the sets, and the mapping with them, go."""
    sets, mapping = mapped_sets()
    seen: list[bool] = []

    def still_mapped() -> None:
        memory = mapping()
        seen.append(memory is not None and not memory.closed)

    staging = Staging(staged=lambda device: True, pin=True, mark=Marks([]),
                      pin_range=lambda start, size: still_mapped)
    staging.share_out(sets)
    del sets
    assert mapping() is not None  # the staging's sets alone hold it now
    staging.release()
    assert seen == [True]  # unpinned while mapped
    assert mapping() is None and not staging.shares_out  # then let go


class FakeRuntime:
    """CUDA's runtime as ``cuda_pin`` calls it: each call logged, each answering the code it is set to."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.register = self.unregister = 0  # cudaSuccess

    def cudaHostRegister(self, start: int, size: int, flags: int) -> int:
        self.calls.append("register")
        return self.register

    def cudaHostUnregister(self, start: int) -> int:
        self.calls.append("unregister")
        return self.unregister


@pytest.fixture
def fake_cuda(monkeypatch) -> tuple[FakeRuntime, list[list[str]]]:
    """``torch.cuda``'s runtime and error check faked; each reset of CUDA's last error logged with the calls made
    before it."""
    runtime = FakeRuntime()
    cleared: list[list[str]] = []

    def check_error(code: int) -> None:
        if code != 0:
            raise RuntimeError(f"CUDA error {code}")  # (torch.cuda.CudaError is a RuntimeError)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    monkeypatch.setattr(torch.cuda, "check_error", check_error)
    monkeypatch.setattr(staging_module, "_clear_last_cuda_error", lambda: cleared.append(list(runtime.calls)))
    return runtime, cleared


def test_a_refused_unpinning_clears_cudas_last_error_and_is_logged_not_raised(fake_cuda, caplog):
    runtime, cleared = fake_cuda
    runtime.unregister = 713  # cudaErrorHostMemoryNotRegistered
    sets, _ = mapped_sets()
    staging = Staging(staged=lambda device: True, pin=True, mark=Marks([]))  # pinned by cuda_pin, the default
    staging.share_out(sets)
    assert runtime.calls == ["register"] and cleared == []
    with caplog.at_level(logging.INFO, logger=staging_module.log.name):
        staging.release()
    assert cleared == [["register", "unregister"]]  # read back once, right after the refused call
    assert "could not unpin the shared push memory" in caplog.text and not staging.shares_out


def test_a_refused_pinning_clears_cudas_last_error_and_nothing_is_unpinned(fake_cuda):
    runtime, cleared = fake_cuda
    runtime.register = 1  # cudaErrorInvalidValue
    sets, _ = mapped_sets()
    staging = Staging(staged=lambda device: True, pin=True, mark=Marks([]))
    staging.share_out(sets)
    assert cleared == [["register"]] and staging.shares_out  # staged there all the same, unpinned
    staging.release()
    assert runtime.calls == ["register"] and cleared == [["register"]]

def test_a_batch_copied_out_is_waited_for_only_when_its_reader_asks():
    log: list = []
    staging, marks = device_path(log)
    arrays, ready = staging.copy_out(model())
    assert [e for e in log if e[0] == "wait"] == [] and marks.made == 1
    ready()
    assert log[-1] == ("wait", 1) and marks.waits == 1
    assert np.array_equal(arrays["b"], model()["b"].numpy())


def test_a_load_queues_non_blocking_copies_without_waiting_and_the_next_load_waits_for_them_first():
    log: list = []
    staging, marks = device_path(log)
    tensors = model()
    first = {n: np.full(tuple(t.shape), 1.5, np.float32) for n, t in tensors.items()}
    second = {n: np.full(tuple(t.shape), -0.25, np.float32) for n, t in tensors.items()}
    seen_at_wait: list[dict[str, list]] = []
    marks.on_wait = lambda: seen_at_wait.append({n: b.numpy().tolist() for n, b in staging._in.items()})
    with CopySpy(log):
        staging.load(tensors, first)
        assert marks.waits == 0  # nothing to wait for: the copies run while the host goes on
        assert [e[0] for e in log] == ["copy", "copy", "copy", "mark"]
        assert all(e[1] and e[3] in buffer_ptrs(staging) for e in log[:3])  # non_blocking, out of the buffers
        del log[:]
        staging.load(tensors, second)
    # the first thing the second load does: wait for the first's copies, before writing their buffers
    assert log[0] == ("wait", 1) and [e[0] for e in log[1:]] == ["copy", "copy", "copy", "mark"]
    assert marks.waits == 1
    assert seen_at_wait == [{n: np.full(tuple(t.shape), 1.5).tolist() for n, t in tensors.items()}]
    for t in tensors.values():
        assert t.float().flatten().tolist() == [-0.25] * t.numel()


def test_values_make_the_round_trip_exactly_bfloat16_as_torch_rounds_it():
    log: list = []
    staging, _ = device_path(log)
    tensors = model()
    arrays = {n: np.random.default_rng(1).standard_normal(tuple(t.shape)).astype(np.float32)
              for n, t in tensors.items()}
    staging.load(tensors, arrays)
    back = staging.to_host(tensors)
    for name in ("w", "b"):
        assert back[name].tobytes() == arrays[name].tobytes()
    assert tensors["h"].dtype == torch.bfloat16
    assert torch.equal(tensors["h"], torch.from_numpy(arrays["h"]).to(torch.bfloat16))
    assert back["h"].tobytes() == tensors["h"].float().numpy().tobytes()
    # the CPU path gives the same bits
    plain = model()
    Staging().load(plain, arrays)
    for name, t in plain.items():
        assert torch.equal(t, tensors[name])


def test_a_tensor_that_changes_shape_or_dtype_gets_a_new_buffer():
    staging, _ = device_path([])
    staging.to_host({"w": torch.ones(4)})
    staging.to_host({"w": torch.ones(4)})
    assert staging.allocations == 1
    out = staging.to_host({"w": torch.arange(6.0).reshape(2, 3)})
    assert staging.allocations == 2 and out["w"].shape == (2, 3) and out["w"].tolist() == [[0, 1, 2], [3, 4, 5]]
    out = staging.to_host({"w": torch.arange(6, dtype=torch.float64).reshape(2, 3)})
    assert staging.allocations == 3 and out["w"].dtype == np.float64


def test_pinning_follows_cuda_and_the_default_stages_only_cuda_tensors():
    staging = Staging()
    assert staging.pin == torch.cuda.is_available()
    assert not staging.staged(torch.device("cpu"))
    assert staging.staged(torch.device("cuda", 0))  # taken only where a tensor lies there, i.e. CUDA works


def test_the_look_ahead_puts_tensors_it_cannot_write_in_place_through_the_staging_in_one_batch():
    log: list = []
    staging, marks = device_path(log)
    comp = Compensator(StalenessCompensation(), prior_staleness=0)
    comp.observe(2)
    t = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.bfloat16)}
    c1 = {"a": np.array([1.0, 2.0, 3.0], np.float32), "b": np.array([0.5, 0.5], np.float32)}
    c2 = {"a": np.array([3.0, 2.0, 1.0], np.float32), "b": np.array([1.0, 0.0], np.float32)}
    assert comp.load(t, c1, version=10, staging=staging)
    assert log == [("mark", 1)]  # the first load: one batch, not waited for
    del log[:]
    with CopySpy(log):
        assert not comp.load(t, c2, version=12, staging=staging)  # 2 versions ahead at 1 per version
    copies = [e for e in log if e[0] in ("copy", "to_copy")]
    assert len(copies) == 2 and all(e[1] for e in copies)
    assert [e for e in log if e[0] in ("mark", "wait")] == [("wait", 1), ("mark", 2)]
    # c2 + 1 * (c2 - c1)
    assert t["a"].tolist() == [5.0, 2.0, -1.0] and t["b"].tolist() == [1.5, -0.5]


# -- the exchanges: the CUDA path gives the CPU path's bits ----------------------------------------


def run_rounds(mode: Mode, compensation: StalenessCompensation, staged: bool,
               dtype: torch.dtype) -> tuple[list, list, Marks]:
    """Two workers take turns: 6 local steps each, the exchange pushing/pulling as ``mode`` says."""
    log: list = []
    ps = LocalPS(mode, frozenset({0, 1}))
    ws, exchanges, marks = [], [], Marks(log)
    for rank, start in ((0, [1.0, -2.0]), (1, [0.0, 0.0])):
        w = torch.tensor(start, dtype=dtype)
        exchange: Exchange = make_exchange(mode, compensation=compensation)
        if staged:
            exchange.staging = Staging(staged=lambda device: True, pin=False, mark=marks)
        exchange.attach(Link(client=StubClient(ps, rank), tensors=lambda w=w: {"w": w}, rank=rank, world_size=2,
                             stage=1, fitting=True, barrier=lambda name: None, stop=lambda: None))
        exchange.start_fit([], rank, 2)
        exchange.join(init=False)
        ws.append(w)
        exchanges.append(exchange)
    for k in range(6):
        for rank, (exchange, w) in enumerate(zip(exchanges, ws, strict=True)):
            def run(w=w, step=(0.5 + 0.01 * k, -0.25 * rank)) -> None:
                with torch.no_grad():
                    w.add_(torch.tensor(step, dtype=w.dtype))
            exchange.step(run, None)
    for exchange in exchanges:
        exchange.flush()
    return [w.float().tolist() for w in ws], [(r, b, u.tolist()) for r, b, u in ps.pushes], marks


@pytest.mark.parametrize("mode, compensation", [
    (Asgd(), StalenessCompensation()), (Asgd(overlap=True), OFF), (Downpour(push_every=3, pull_every=2), OFF),
    (EASGD(tau=2, alpha=0.25), OFF)], ids=["asgd", "overlap", "downpour", "easgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_exchange_gives_the_same_bits_through_the_staging_buffers_as_through_views(mode, compensation, dtype):
    # bfloat16: not written in place on the CPU either, so the look-ahead's values go through the staging too
    plain = run_rounds(mode, compensation, staged=False, dtype=dtype)
    staged = run_rounds(mode, compensation, staged=True, dtype=dtype)
    assert staged[0] == plain[0] and staged[1] == plain[1]
    assert len(plain[1]) >= 4  # pushes were made
    marks = staged[2]
    assert marks.made > 0  # the exchange did go through the staging
    # a wait is only ever for a batch (a push's copies, or the load before the next one's), never per tensor
    assert marks.waits <= marks.made


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on the project's own machines)")
def test_on_a_gpu_the_buffers_are_pinned_kept_and_the_values_exact():
    staging = Staging()
    tensors = {n: t.detach().cuda() for n, t in model().items()}
    out = staging.to_host(tensors)
    assert all(b.is_pinned() for b in staging._out.values())
    for name, t in tensors.items():
        assert out[name].tobytes() == t.float().cpu().numpy().tobytes()
    arrays = {n: np.full(tuple(t.shape), 0.75, np.float32) for n, t in tensors.items()}
    staging.load(tensors, arrays)
    staging.load(tensors, {n: a * 2 for n, a in arrays.items()})
    assert all(b.is_pinned() for b in staging._in.values()) and staging.allocations == 6
    for t in tensors.values():
        assert t.float().flatten().tolist() == [1.5] * t.numel()  # the stream ordered the copy before the read


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on the project's own machines)")
def test_on_a_gpu_the_ps_memory_is_pinned_in_place_filled_exactly_and_unpinned_at_release():
    staging = Staging()
    tensors = {n: t.detach().cuda() for n, t in model().items()}
    segment = push_memory.PushSegment({f"{k}:{n}": (tuple(t.shape), np.float32) for n, t in tensors.items()
                                       for k in "db"})
    sets = [{n: segment.buffers[f"{k}:{n}"] for n in tensors} for k in "db"]
    staging.share_out(sets)
    assert all(torch.from_numpy(a).is_pinned() for s in sets for a in s.values())
    for turn in (0, 1):
        out = staging.to_host(tensors, shared=True)
        for name, t in tensors.items():
            assert np.shares_memory(out[name], sets[turn][name])
            assert out[name].tobytes() == t.float().cpu().numpy().tobytes()
    staging.release()
    assert not any(torch.from_numpy(a).is_pinned() for s in sets for a in s.values())
