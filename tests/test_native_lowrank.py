"""PowerSGD's decoding in C (plug_asgd/compressors/kernels/lowrank.c) gives the bits numpy's path gives, and both
follow the rule written down in plug_asgd.compressors.lowrank.low_rank_product, checked here by hand: each value's
products added in order, every product and sum rounded to float32."""

from __future__ import annotations

import numpy as np
import pytest

from plug_asgd.compressors import PowerSGD, decode, native
from plug_asgd.compressors.lowrank import low_rank_product


def _factors(n: int, m: int, r: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, r)).astype(np.float32), rng.standard_normal((m, r)).astype(np.float32)


def _numpy_only(monkeypatch, p, q):
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        return low_rank_product(p, q)


def _by_hand(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    out = np.empty((p.shape[0], q.shape[0]), np.float32)
    for i in range(p.shape[0]):
        for j in range(q.shape[0]):
            acc = np.float32(p[i, 0] * q[j, 0])
            for k in range(1, p.shape[1]):
                acc = np.float32(acc + np.float32(p[i, k] * q[j, k]))
            out[i, j] = acc
    return out


@pytest.mark.parametrize("n, m, r", [(3, 5, 1), (7, 9, 2), (13, 11, 4), (6, 40, 5)])
def test_the_product_is_the_ordered_float32_sum_by_hand(monkeypatch, n, m, r):
    p, q = _factors(n, m, r, n * m)
    hand = _by_hand(p, q)
    assert np.array_equal(_numpy_only(monkeypatch, p, q), hand)
    assert np.array_equal(low_rank_product(p, q), hand)
    if r >= 3:  # another order of three or more terms gives other bits somewhere: the rule is not vacuous
        assert not np.array_equal(_by_hand(p[:, ::-1], q[:, ::-1]), hand)


@pytest.mark.parametrize("n, m, r", [(1673, 1673, 4), (300, 1000, 8), (513, 257, 3), (2, 3, 1)])
def test_c_and_numpy_give_the_same_bits(monkeypatch, n, m, r):
    if native.library() is None:
        pytest.skip("no C compiler here")
    p, q = _factors(n, m, r, r)
    p[0, 0], q[0, 0] = 1e30, 1e30  # an overflow to Inf, the same on both paths
    with np.errstate(over="ignore"):
        c, numpy_path = low_rank_product(p, q), _numpy_only(monkeypatch, p, q)
    assert c.dtype == np.float32 and c.shape == (n, m)
    assert np.array_equal(c.view(np.uint32), numpy_path.view(np.uint32))
    assert np.isinf(c[0, 0])
    np.testing.assert_allclose(c[1:], (p[1:].astype(np.float64) @ q.T.astype(np.float64)).astype(np.float32)[:, :],
                               rtol=1e-4, atol=1e-4 * r)


def test_the_codecs_decoding_is_the_product_on_either_path(monkeypatch):
    x = np.random.default_rng(3).standard_normal((64, 3, 16)).astype(np.float32)
    sent = PowerSGD(rank=4).encode("w", x)
    p, q = sent.arrays
    expected = _by_hand(p, q).reshape(x.shape)
    assert np.array_equal(decode(sent, np.float32), expected)
    with monkeypatch.context() as m:
        m.setattr(native, "library", lambda: None)
        assert np.array_equal(decode(sent, np.float32), expected)
    # float64 factors (a float64 update's) decode by the same rule, in float64
    wide = PowerSGD(rank=2).encode("w", x.astype(np.float64))
    p64, q64 = wide.arrays
    assert p64.dtype == np.float64
    got = decode(wide, np.float64)
    by_hand = (p64[:, :1] * q64[:, 0] + p64[:, 1:2] * q64[:, 1]).reshape(x.shape)
    assert np.array_equal(got, by_hand)
