"""The C selection pass (plug_asgd.compressors.native): a hand count of what it keeps, and the same indices, values
and residuals as numpy's pass wherever the sparse codecs use it, bit for bit."""

from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from plug_asgd.compressors import TopKResidual, native
from plug_asgd.compressors.difference import CHUNK, FACTORS, SAMPLE, largest_differences, sample_threshold

NAN = float("nan")


@pytest.fixture
def numpy_only(monkeypatch):
    """The library as on a machine without a C compiler: numpy's pass."""
    monkeypatch.setattr(native, "library", lambda: None)


def test_a_machine_with_a_c_compiler_has_the_pass():
    # CI's machine and this one have cc: the tests below then compare two implementations, not one with itself
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the library uses numpy's pass (what test_..._without_the_pass checks)")
    assert native.library() is not None


def _library_or_skip():
    if native.library() is None:
        pytest.skip("no C compiler here")


def test_the_pass_keeps_what_is_not_below_the_threshold_nan_included_counted_by_hand():
    _library_or_skip()
    w = np.array([0.5, -2.0, 0.25, 1.0, NAN, -0.5, 0.0, 3.0] * 5, dtype=np.float32)  # 40 values: 2 blocks and a half
    c = np.zeros_like(w)
    count, idx, val = native.above(0.5, w, c, None, 1.0, native.DIFFERENCE, cap=100)
    # per 8: 0.5 (not below 0.5), -2.0, 1.0, NaN, -0.5, 3.0 are kept; 0.25 and 0.0 are not
    expected = [i + 8 * r for r in range(5) for i in (0, 1, 3, 4, 5, 7)]
    assert count == 30 and idx.tolist() == expected
    np.testing.assert_array_equal(val, w[expected])
    # a cap: all are counted, the first kept
    count, idx, val = native.above(0.5, w, c, None, 1.0, native.DIFFERENCE, cap=7)
    assert count == 30 and idx.tolist() == expected[:7]
    # 43 values: 5 vectors of 8 and a tail of 3 (0.5, -2.0 kept at 40 and 41), the cap reached before it or in it
    w43, c43 = np.concatenate([w, w[:3]]), np.zeros(43, np.float32)
    for cap, kept in ((100, 32), (31, 31), (30, 30), (29, 29)):
        count, idx, val = native.above(0.5, w43, c43, None, 1.0, native.DIFFERENCE, cap=cap)
        assert count == 32 and idx.tolist() == [*expected, 40, 41][:kept], cap
        np.testing.assert_array_equal(val, w43[idx])
    # scaled by 0.25 and added into a residual of 1.0 each: v = 1 + (w - c) / 4, written back
    r = np.ones_like(w)
    count, idx, val = native.above(1.2, w, c, r, 0.25, native.ADDED, cap=100)
    v = np.ones_like(w) + w * np.float32(0.25)
    np.testing.assert_array_equal(r, v)
    keep = [i for i in range(40) if not abs(v[i]) < 1.2]  # 1.25 (w=1), NaN, 1.75 (w=3)
    assert count == 15 and idx.tolist() == keep
    # the residual as it is
    count, idx, _ = native.above(1.2, None, None, r, 1.0, native.MADE, cap=100)
    assert idx.tolist() == keep


def _pair(n: int, seed: int, spread: float = 1e-3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(n).astype(np.float32)
    return w, (w + rng.standard_normal(n).astype(np.float32) * np.float32(spread))


def _same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


# sizes past SAMPLED_FROM (the sampled path, where the pass runs), one not a multiple of the block; fractions of
# AdaComp and topk, and one that lets through more than a quarter (the whole is then partitioned)
@pytest.mark.parametrize("n, fraction", [(2 * CHUNK + 13, 0.01), (300_000, 0.0033), (300_000, 0.05)])
@pytest.mark.parametrize("kind", ["difference", "residual", "scaled residual"])
def test_the_pass_selects_the_same_bits_as_numpys(n, fraction, kind, monkeypatch):
    _library_or_skip()
    w, c = _pair(n, seed=n)
    w[7] = NAN  # chosen by both, as argpartition ranks NaN largest
    k = math.ceil(fraction * n)
    kept = np.random.default_rng(1).standard_normal(n).astype(np.float32) * np.float32(1e-3)
    scale = 0.5 if kind == "scaled residual" else 1.0

    def select() -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        residual = kept.copy() if kind != "difference" else None
        indices, values = largest_differences(w, c, k, residual=residual, scale=scale)
        return indices, values, residual

    ours = select()
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        theirs = select()
    for a, b in zip(ours, theirs, strict=True):
        if a is None:
            assert b is None
        else:
            _same_bits(a, b)


def test_a_sample_that_misjudged_the_threshold_is_read_again_from_the_residual_made(monkeypatch):
    # |w - c| is 1 at the sample's positions and below 1e-3 elsewhere: both sampled thresholds are 1, which lets
    # through the 8,192 sampled coordinates, fewer than k. The second pass reads the residual the first wrote
    # (MADE), and the whole is then partitioned from it: the same bits as numpy's passes, and the top k of v
    _library_or_skip()
    n, k = 400_000, 20_000
    w, c = _pair(n, seed=3)
    stride = n // SAMPLE
    w[::stride] = c[::stride] + np.float32(1.0)
    sample = np.abs(w[::stride] - c[::stride])
    assert all(sample_threshold(sample, n, k, f) == 1.0 for f in FACTORS)
    assert np.count_nonzero(np.abs(w - c) >= 1.0) < k
    ours_r, theirs_r = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.float32)
    ours = largest_differences(w, c, k, residual=ours_r)
    monkeypatch.setattr(native, "library", lambda: None)
    theirs = largest_differences(w, c, k, residual=theirs_r)
    for a, b in zip((*ours, ours_r), (*theirs, theirs_r), strict=True):
        _same_bits(a, b)
    v = w - c
    # the top k, values tied with the k-th at the lowest indices: a stable sort of -|v| ranks them so
    assert ours[0].tolist() == np.sort(np.argsort(-np.abs(v), kind="stable")[:k]).tolist()


def test_topk_with_its_residual_in_the_model_sends_the_same_as_without_the_pass(monkeypatch):
    _library_or_skip()
    w, c = _pair(1 << 18, seed=5)
    codec = TopKResidual(0.01)
    sent = codec.encode_difference("w", w, c, implicit_residual=True)
    monkeypatch.setattr(native, "library", lambda: None)
    again = TopKResidual(0.01).encode_difference("w", w, c, implicit_residual=True)
    _same_bits(sent.indices, again.indices)
    _same_bits(sent.values, again.values)


def test_without_the_pass_the_selection_is_numpys(numpy_only):
    w, c = _pair(2 * CHUNK, seed=9)
    indices, values = largest_differences(w, c, 100)
    v = w - c
    assert indices.tolist() == sorted(np.argsort(-np.abs(v), kind="stable")[:100].tolist())
    np.testing.assert_array_equal(values, v[indices])


def test_without_a_cache_folder_or_a_compiler_numpy_does_it(monkeypatch, tmp_path):
    # a process without a home folder (Path.home raises), then one whose compiler is missing: no library, no error
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("PLUG_ASGD_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", no_home)
    monkeypatch.setattr(native, "_loaded", [])
    assert native.library() is None
    monkeypatch.setattr(native, "_loaded", [])
    monkeypatch.setenv("PLUG_ASGD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert native.library() is None and not list(tmp_path.glob("*.so"))
    w, c = _pair(2 * CHUNK, seed=2)
    indices, _ = largest_differences(w, c, 50)
    assert indices.size == 50



def test_without_a_compiler_a_process_warns_once_saying_what_to_install(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PLUG_ASGD_CACHE", str(tmp_path))
    monkeypatch.delenv("PLUG_ASGD_NATIVE", raising=False)
    monkeypatch.setattr(native, "find_compiler", lambda: None)
    monkeypatch.setattr(native, "_loaded", [])
    with caplog.at_level(logging.INFO, logger=native.log.name):
        assert native.library() is None
        assert native.library() is None  # the codecs call it at every pass: said once
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert "no C compiler" in warned[0] and "apt-get install gcc" in warned[0] and "PLUG_ASGD_NATIVE=0" in warned[0]
    # numpy chosen: nothing to warn of
    caplog.clear()
    monkeypatch.setattr(native, "_loaded", [])
    monkeypatch.setenv("PLUG_ASGD_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger=native.log.name):
        assert native.library() is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_another_compiler_gets_a_library_of_its_own_in_the_cache(monkeypatch, tmp_path):
    texts = native.sources()
    gcc = "/usr/bin/cc\n/usr/bin/x86_64-linux-gnu-gcc-12\ncc (Debian 12.2.0-14) 12.2.0"
    clang = "/usr/bin/cc\n/usr/lib/llvm-16/bin/clang\nDebian clang version 16.0.6"
    assert native.cached_path(tmp_path, texts, gcc) != native.cached_path(tmp_path, texts, clang)
    assert native.cached_path(tmp_path, texts, gcc) == native.cached_path(tmp_path, texts, gcc)
    # library() looks for its file under the compiler it finds: each identity builds at its own path
    built: list[Path] = []

    def build(target: Path, texts: dict, compiler: str) -> None:
        built.append(target)
        raise OSError("not built in this test")

    monkeypatch.setenv("PLUG_ASGD_CACHE", str(tmp_path))
    monkeypatch.delenv("PLUG_ASGD_NATIVE", raising=False)
    monkeypatch.setattr(native, "find_compiler", lambda: "/usr/bin/cc")
    monkeypatch.setattr(native, "build", build)
    for identity in (gcc, clang):
        monkeypatch.setattr(native, "compiler_identity", lambda compiler, identity=identity: identity)
        monkeypatch.setattr(native, "_loaded", [])
        assert native.library() is None
    assert built == [native.cached_path(tmp_path, texts, gcc), native.cached_path(tmp_path, texts, clang)]


@pytest.mark.integration  # runs the compiler (a fake one) for its --version
def test_a_compilers_identity_is_its_path_and_the_first_line_of_its_version(tmp_path):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'fakecc (Build 7) 1.2.3'\necho 'Copyright nobody'\n")
    cc.chmod(0o755)
    assert native.compiler_identity(str(cc)).splitlines() == [str(cc), str(cc.resolve()), "fakecc (Build 7) 1.2.3"]
    assert native.compiler_identity(str(tmp_path / "gone")).splitlines() == [str(tmp_path / "gone")] * 2

def test_arrays_of_other_sizes_are_not_read_past_their_end():
    _library_or_skip()
    w, c = np.zeros(100, np.float32), np.zeros(99, np.float32)
    assert native.above(0.5, w, c, None, 1.0, native.DIFFERENCE, cap=10) is None
    assert native.above(0.5, w, w, c, 1.0, native.ADDED, cap=10) is None
    assert native.above(0.5, None, None, None, 1.0, native.MADE, cap=10) is None


def test_arrays_the_pass_cannot_read_go_to_numpy():
    assert native.usable(np.zeros(4, np.float32), None)
    assert not native.usable(np.zeros(4, np.float64))
    assert not native.usable(np.zeros((2, 2), np.float32))
    assert not native.usable(np.zeros(8, np.float32)[::2])


@pytest.mark.parametrize("bits", [8, 16, 4])
def test_qsgds_decoding_gives_the_same_bits_as_numpys_and_a_level_by_hand(bits, monkeypatch):
    from plug_asgd.compressors import QSGD, decode

    _library_or_skip()
    rng = np.random.default_rng(bits)
    x = rng.standard_normal(100_003).astype(np.float32)
    x[::7] = 0.0  # level 0 with either sign decodes to +0.0, as numpy's integers make it
    x[1::7] = -0.0
    sent = QSGD(bits=bits, seed=2).encode("w", x)
    ours = decode(sent, np.float32)
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        theirs = decode(sent, np.float32)
    _same_bits(ours, theirs)
    # by hand: 3 and -4 are levels 9 and 12 of 15 of the norm 5 (4 bits); 8 bits: 153 and 204 of 255
    exact = QSGD(bits=bits).encode("w", np.array([3.0, -4.0, 0.0, -0.0], dtype=np.float32))
    assert decode(exact, np.float32).view(np.uint32).tolist() == np.array(
        [3.0, -4.0, 0.0, 0.0], dtype=np.float32).view(np.uint32).tolist()


def test_a_sparse_fold_adds_the_same_bits_as_numpys_fancy_indexing_and_refuses_what_it_cannot_check():
    _library_or_skip()
    rng = np.random.default_rng(4)
    target = rng.standard_normal((300, 700)).astype(np.float32)
    indices = np.sort(rng.choice(target.size, size=5000, replace=False)).astype(np.int64)
    values = rng.standard_normal(5000).astype(np.float32)
    expected = target.copy()
    expected.reshape(-1)[indices] += values
    assert native.scatter_add(target, indices, values)
    _same_bits(target, expected)
    # a hand count: 1 + 2 at 0, 5 + -1 at 3
    small = np.array([1.0, 0.0, 0.0, 5.0], dtype=np.float32)
    assert native.scatter_add(small, np.array([0, 3]), np.array([2.0, -1.0], dtype=np.float32))
    assert small.tolist() == [3.0, 0.0, 0.0, 4.0]
    # indices that do not ascend strictly within the target: refused, nothing written (numpy's path decides)
    for bad in ([3, 0], [0, 0], [0, 4], [-1, 2]):
        before = small.copy()
        assert not native.scatter_add(small, np.array(bad, dtype=np.int64), np.ones(2, dtype=np.float32))
        _same_bits(small, before)
    # arrays it does not read as they are
    assert not native.scatter_add(small.astype(np.float64), np.array([0, 1]), np.ones(2, dtype=np.float32))
    assert not native.scatter_add(small, np.array([0, 1], dtype=np.int32), np.ones(2, dtype=np.float32))
    assert not native.scatter_add(np.zeros((4, 4), np.float32)[:, 0], np.array([0, 1]), np.ones(2, np.float32))


def test_the_ps_fold_and_the_held_model_add_a_sparse_update_in_the_library_and_without_it_alike(monkeypatch):
    from plug_asgd.modes.fold import _add_into
    from plug_asgd.protocol.wire import Sparse
    from plug_asgd.worker.held_model import HeldModel

    _library_or_skip()
    rng = np.random.default_rng(6)
    base = rng.standard_normal((64, 1000)).astype(np.float32)
    sent = Sparse(indices=np.sort(rng.choice(base.size, 900, replace=False)).astype(np.int64),
                  values=rng.standard_normal(900).astype(np.float32), shape=base.shape)

    def both() -> tuple[np.ndarray, np.ndarray]:
        folded = base.copy()
        _add_into(folded, sent, 0.5)  # the PS, at a staleness scale
        held = HeldModel()
        held.keep("m", 1, {"w": base.copy()})
        held.add({"w": sent}, 2)  # the worker answered "own"
        return folded, held.tensors["w"]

    ours = both()
    monkeypatch.setattr(native, "library", lambda: None)
    theirs = both()
    for a, b in zip(ours, theirs, strict=True):
        _same_bits(a, b)


def test_a_dense_fold_out_of_place_adds_numpys_bits_and_finds_what_is_not_finite():
    _library_or_skip()
    rng = np.random.default_rng(5)
    u, c = rng.standard_normal(100_003).astype(np.float32), rng.standard_normal(100_003).astype(np.float32)
    for scale in (1.0, 0.37):
        out = np.empty_like(u)
        assert native.add_finite(u, c, out, scale) is True
        want = u + c if scale == 1.0 else u * np.float32(scale) + c
        _same_bits(out, want)
    for bad in (NAN, float("inf"), -float("inf"), 3e38):  # 3e38 + 3e38 overflows float32
        v = u.copy()
        v[77_777] = bad
        w = c.copy()
        w[77_777] = 3e38
        assert native.add_finite(v, w, np.empty_like(u), 1.0) is False
    assert native.add_finite(u, c[:-1], np.empty_like(u), 1.0) is None  # sizes differ: numpy's path says why
    assert native.add_finite(u.astype(np.float64), c, np.empty_like(u), 1.0) is None


def test_a_residual_accumulates_in_c_with_numpys_bits(monkeypatch):
    from plug_asgd.compressors.difference import accumulate

    _library_or_skip()
    rng = np.random.default_rng(6)
    w, c, r = (rng.standard_normal(CHUNK * 2 + 5).astype(np.float32) for _ in range(3))
    for scale in (1.0, 0.37):
        ours = accumulate(r.copy(), w, c, scale)
        with monkeypatch.context() as m:
            m.setattr(native, "library", lambda: None)
            theirs = accumulate(r.copy(), w, c, scale)
        _same_bits(ours, theirs)
        want = r + (w - c) if scale == 1.0 else r + (w - c) * np.float32(scale)
        _same_bits(ours, want)
