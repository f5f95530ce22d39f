"""Streaming FedAvg and server SGD against hand-worked numbers."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from shared.errors import ConfigError

from coordinator.optimizers.server_sgd import ServerSGD, sgd_step
from coordinator.strategies import fedavg
from coordinator.strategies.fedavg import FedAvg, add_weighted, merge, new_running_sum, weighted_mean


def test_streaming_fedavg_equals_hand_computed_weighted_mean():
    # Prepare: three sites, N = 1, 3, 6 (total 10)
    template = {"w": np.zeros((2,), np.float32), "b": np.zeros((), np.float32)}
    deltas = [({"w": np.array([1.0, 2.0], np.float32), "b": np.array(10.0, np.float32)}, 1),
              ({"w": np.array([4.0, 0.0], np.float32), "b": np.array(0.0, np.float32)}, 3),
              ({"w": np.array([-1.0, 1.0], np.float32), "b": np.array(5.0, np.float32)}, 6)]
    strategy = FedAvg()
    # Execute
    strategy.begin_round(template)
    for i, (d, n) in enumerate(deltas):
        strategy.accumulate(f"s{i}", d, num_examples=n)
    avg = strategy.aggregate()
    # Assert: w = (1*1 + 3*4 + 6*-1)/10 = 0.7, (1*2 + 0 + 6*1)/10 = 0.8; b = (10 + 0 + 30)/10 = 4.0
    np.testing.assert_allclose(avg["w"], [0.7, 0.8], rtol=1e-6)
    np.testing.assert_allclose(avg["b"], 4.0, rtol=1e-6)
    assert avg["w"].dtype == np.float32 and strategy.count == 3


def test_running_sum_keeps_one_buffer_per_tensor_not_K_updates():
    acc = new_running_sum({"w": np.zeros((1000,), np.float32)})
    for k in range(50):
        add_weighted(acc, {"w": np.full((1000,), float(k), np.float32)}, 1.0)
    assert list(acc.sums) == ["w"] and acc.sums["w"].shape == (1000,)
    assert acc.count == 50 and acc.total_weight == 50
    np.testing.assert_allclose(weighted_mean(acc)["w"], np.full(1000, 24.5))


def test_partial_sums_merge_associatively():
    t = {"w": np.zeros((3,), np.float32)}
    a, b, whole = new_running_sum(t), new_running_sum(t), new_running_sum(t)
    for acc, d, n in ((a, 1.0, 2), (b, 4.0, 1), (b, 7.0, 3)):
        add_weighted(acc, {"w": np.full(3, d, np.float32)}, n)
        add_weighted(whole, {"w": np.full(3, d, np.float32)}, n)
    np.testing.assert_allclose(weighted_mean(merge(a, b))["w"], weighted_mean(whole)["w"])
    np.testing.assert_allclose(weighted_mean(whole)["w"], (2 + 4 + 21) / 6)


def test_bad_inputs_are_refused():
    acc = new_running_sum({"w": np.zeros((2,), np.float32)})
    with pytest.raises(ValueError, match="no update"):
        weighted_mean(acc)
    with pytest.raises(ValueError, match="shape"):
        add_weighted(acc, {"w": np.zeros((3,), np.float32)}, 1.0)
    with pytest.raises(ValueError, match="names"):
        add_weighted(acc, {"v": np.zeros((2,), np.float32)}, 1.0)
    with pytest.raises(ValueError, match="weight"):
        add_weighted(acc, {"w": np.zeros((2,), np.float32)}, 0.0)


def _float64_reference(deltas, weights):
    """The running sum computed the plain way, one full-size float64 product per tensor and site."""
    ref = {k: np.zeros(np.shape(v), np.float64) for k, v in deltas[0].items()}
    for d, w in zip(deltas, weights):
        for k in ref:
            ref[k] = ref[k] + float(w) * np.asarray(d[k]).astype(np.float64)
    return ref


def test_add_weighted_equals_a_float64_reference_sum_to_the_last_bit():
    # Prepare: a tensor of several scratch slices plus a remainder, a strided (transposed) delta, a float64 delta, a
    # 0-d and an empty tensor; values over 16 decades and weights that are not small integers, so that a product
    # rounded in float32 (or a fused multiply-add) would show in the last bits
    rng = np.random.default_rng(22)
    chunk = fedavg._CHUNK
    shapes = {"big": (3 * chunk + 17,), "mat": (300, 257), "wide": (5, 7), "scalar": (), "empty": (0, 4)}

    def delta(seed):
        r = np.random.default_rng(seed)
        d = {k: (r.standard_normal(s) * 10.0 ** r.uniform(-8, 8, s)).astype(np.float32) for k, s in shapes.items()}
        d["mat"] = np.ascontiguousarray(d["mat"].T).T  # same values, Fortran order: not C-contiguous
        d["wide"] = d["wide"].astype(np.float64) * (1 + 1e-12)  # a float64 delta is taken as it is
        return d

    deltas = [delta(s) for s in range(5)]
    weights = [1.0, 3.0, 0.1, 1e6 + 1.0, float(rng.uniform(0.5, 2.0))]
    template = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    acc = new_running_sum(template)
    # Execute
    for d, w in zip(deltas, weights):
        add_weighted(acc, d, w)
    # Assert: equal bit for bit, still float64 and in place
    ref = _float64_reference(deltas, weights)
    for k in shapes:
        assert acc.sums[k].dtype == np.float64 and acc.sums[k].shape == shapes[k]
        np.testing.assert_array_equal(acc.sums[k], ref[k], strict=True)
    assert not deltas[0]["mat"].flags.c_contiguous
    # ...and the comparison has teeth: products rounded in float32 give other bits
    rounded32 = sum(np.float32(w) * d["big"] for d, w in zip(deltas, weights))
    assert not np.array_equal(rounded32.astype(np.float64), ref["big"])


def test_add_weighted_into_a_non_contiguous_running_sum():
    acc = new_running_sum({"w": np.zeros((4, 3), np.float32)})
    acc.sums["w"] = np.zeros((3, 4), np.float64).T  # e.g. a partial sum handed over in another memory order
    deltas = [{"w": np.arange(12, dtype=np.float32).reshape(4, 3) * 0.1}, {"w": np.full((4, 3), 1 / 3, np.float32)}]
    for d, w in zip(deltas, (7.0, 0.3)):
        add_weighted(acc, d, w)
    np.testing.assert_array_equal(acc.sums["w"], _float64_reference(deltas, (7.0, 0.3))["w"])


def test_add_weighted_allocates_no_model_sized_temporary():
    # Prepare: one 1M-parameter tensor, 8 MB as float64 (the old code made two such temporaries per update)
    n = 1_000_000
    acc = new_running_sum({"w": np.zeros(n, np.float32)})
    d = {"w": np.linspace(-1, 1, n, dtype=np.float32)}
    # Execute: numpy reports its buffers to tracemalloc
    tracemalloc.start()
    try:
        add_weighted(acc, d, 3.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Assert: the scratch slice and small objects only
    assert peak < fedavg._CHUNK * 8 + 128 * 1024 < n * 8 // 8
    np.testing.assert_array_equal(acc.sums["w"], 3.0 * d["w"].astype(np.float64))


def test_a_refused_delta_leaves_the_running_sum_unchanged():
    acc = new_running_sum({"a": np.zeros((2,), np.float32), "b": np.zeros((2,), np.float32)})
    add_weighted(acc, {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}, 2.0)
    with pytest.raises(ValueError, match="shape"):
        add_weighted(acc, {"a": np.ones(2, np.float32), "b": np.ones(3, np.float32)}, 5.0)
    np.testing.assert_array_equal(acc.sums["a"], [2.0, 2.0])  # not 7: checked before anything was added
    assert acc.count == 1 and acc.total_weight == 2.0


def test_server_sgd_step():
    w = {"w": np.array([1.0, 2.0], np.float32)}
    d = {"w": np.array([0.5, -1.0], np.float32)}
    np.testing.assert_allclose(ServerSGD(1.0).step(w, d)["w"], [1.5, 1.0])  # server_lr 1 = FedAvg
    np.testing.assert_allclose(sgd_step(w, d, 0.5)["w"], [1.25, 1.5])
    assert ServerSGD(2.0).step(w, d)["w"].dtype == np.float32
    with pytest.raises(ConfigError, match="server_learning_rate"):
        ServerSGD(0.0)
