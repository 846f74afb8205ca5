"""AdaComp's worker half: the exact top fraction per layer, and nothing lost to the residual."""

import math

import numpy as np
import pytest

from plug_asgd.compressors import NoCompression, TopKResidual
from plug_asgd.protocol.wire import Sparse, encode, sparse_wire_bytes


def test_selects_exactly_the_largest_magnitudes_per_layer():
    rng = np.random.default_rng(1)
    layers = {"conv": rng.standard_normal((32, 1, 3, 3)).astype(np.float32),  # 288 values
              "fc": rng.standard_normal((1000,)).astype(np.float32)}
    comp = TopKResidual(0.05)
    for name, delta in layers.items():
        sent = comp.encode(name, delta)
        k = math.ceil(0.05 * delta.size)  # 15 of 288, 50 of 1000
        expected = np.sort(np.argsort(-np.abs(delta.reshape(-1)), kind="stable")[:k])
        assert isinstance(sent, Sparse) and sent.shape == delta.shape
        np.testing.assert_array_equal(sent.indices, expected)
        np.testing.assert_array_equal(sent.values, delta.reshape(-1)[expected])


@pytest.mark.parametrize("case", ["normal", "mostly_zero", "ties", "nan", "sorted"])
def test_a_large_layer_sends_exactly_its_largest_magnitudes_too(case):
    """A layer of 65,536 or more values, of which at most 1/16 are asked for, is chosen among those above a sampled
    threshold (plug_asgd.compressors.sparse._top_k): the same set as a full sort, whatever the values."""
    rng = np.random.default_rng(3)
    delta = rng.standard_normal(300_000).astype(np.float32)
    if case == "mostly_zero":
        delta[rng.random(delta.size) < 0.995] = 0  # fewer nonzeros than the 3,000 asked for: all of them go
    elif case == "ties":
        delta = np.round(delta, 1)  # a few dozen distinct magnitudes: the sample's threshold sits on a tie
    elif case == "nan":
        delta[[7, 150_001]] = np.nan  # argpartition's largest; the PS refuses them, saying so
    elif case == "sorted":
        delta = np.sort(np.abs(delta))  # the largest all at the end, where a strided sample is thin
    sent = TopKResidual(0.01).encode("fc", delta)
    k = math.ceil(0.01 * delta.size)
    order = np.argsort(-np.nan_to_num(np.abs(delta), nan=np.inf), kind="stable")[:k]
    expected = np.sort(order[delta[order] != 0])
    if case == "ties":  # which of the tied values goes is free: the magnitudes sent are the same
        np.testing.assert_array_equal(np.sort(np.abs(sent.values)), np.sort(np.abs(delta[expected])))
        assert sent.nnz == k
    else:
        np.testing.assert_array_equal(sent.indices, expected)
    if case == "nan":
        assert {7, 150_001} <= set(sent.indices.tolist())


def test_sent_plus_residual_is_exactly_the_update_over_several_steps():
    rng = np.random.default_rng(2)
    comp = TopKResidual(0.01)
    carried = np.zeros(5000, np.float32)
    for _ in range(4):
        delta = rng.standard_normal(5000).astype(np.float32)
        want = delta + carried  # what the worker owes the PS this step
        sent = comp.encode("w", delta)
        residual = comp.residuals["w"]
        np.testing.assert_array_equal(sent.to_dense() + residual, want)
        assert sent.nnz == 50
        assert np.all(residual[sent.indices] == 0)
        # every sent magnitude is >= every kept one
        assert np.abs(sent.values).min() >= np.abs(residual).max()
        carried = residual


def test_zeros_are_not_sent_and_small_layers_send_at_least_one():
    comp = TopKResidual(0.01)
    sent = comp.encode("bias", np.array([0, 0, 3, 0], np.float32))
    np.testing.assert_array_equal(sent.indices, [2])
    assert comp.encode("frozen", np.zeros(10, np.float32)).nnz == 0


def test_wire_size_matches_the_docstring_formula():
    comp = TopKResidual(0.01)
    delta = np.random.default_rng(3).standard_normal((9216, 128)).astype(np.float32)
    sent = comp.encode("fc", delta)
    frames = encode("push", None, {"fc": sent})
    payload = sum(len(memoryview(f).cast("B")) for f in frames[1:])
    assert sent.nnz == math.ceil(0.01 * 9216 * 128) == 11797
    assert payload == 4 * 18 + 6 * 11797 == sparse_wire_bytes(9216 * 128, 11797)
    assert payload * 60 < delta.nbytes  # 70,854 bytes instead of 4,718,592


def test_half_values_keep_their_rounding_in_the_residual_and_cost_four_bytes_each():
    rng = np.random.default_rng(4)
    comp = TopKResidual(0.01, values="float16")
    carried = np.zeros((9216, 128), np.float32)
    for _ in range(3):
        delta = (rng.standard_normal((9216, 128)) * 1e-3).astype(np.float32)
        want = (delta + carried).reshape(-1)
        sent = comp.encode("fc", delta)
        residual = comp.residuals["fc"]
        assert sent.values.dtype == np.float16 and sent.nnz == 11797
        # each value is the half nearest the chosen coordinate; what rounding lost stays, exactly
        np.testing.assert_array_equal(sent.values, want[sent.indices].astype(np.float16))
        np.testing.assert_array_equal(sent.to_dense().reshape(-1).astype(np.float32) + residual, want)
        kept, chosen = np.abs(residual[sent.indices]), np.abs(want[sent.indices])
        assert np.all(kept <= chosen * 2.0**-11 + 2.0**-25)  # half a unit in the last place of a half
        carried = residual.reshape(delta.shape)
    frames = encode("push", None, {"fc": sent})
    payload = sum(len(memoryview(f).cast("B")) for f in frames[1:])
    assert payload == 4 * 18 + 4 * 11797 == sparse_wire_bytes(9216 * 128, 11797, itemsize=2)
    with pytest.raises(ValueError, match="values must be one of"):
        TopKResidual(0.01, values="int8")


def test_fraction_is_validated_and_none_passes_through():
    with pytest.raises(ValueError):
        TopKResidual(0.0)
    with pytest.raises(ValueError):
        TopKResidual(1.5)
    d = np.ones(3, np.float32)
    assert NoCompression().encode("x", d) is d
