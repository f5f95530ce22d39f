"""Streaming FedAvg and server SGD against hand-worked numbers."""

from __future__ import annotations

import numpy as np
import pytest

from shared.errors import ConfigError

from coordinator.optimizers.server_sgd import ServerSGD, sgd_step
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


def test_server_sgd_step():
    w = {"w": np.array([1.0, 2.0], np.float32)}
    d = {"w": np.array([0.5, -1.0], np.float32)}
    np.testing.assert_allclose(ServerSGD(1.0).step(w, d)["w"], [1.5, 1.0])  # server_lr 1 = FedAvg
    np.testing.assert_allclose(sgd_step(w, d, 0.5)["w"], [1.25, 1.5])
    assert ServerSGD(2.0).step(w, d)["w"].dtype == np.float32
    with pytest.raises(ConfigError, match="server_learning_rate"):
        ServerSGD(0.0)
