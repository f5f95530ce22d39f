"""The float32 summation bound the backends use to turn cheap float32 squared norms into upper bounds (Higham 2002,
Lemma 3.1): the closed form, and float32 sums that never exceed it, including inputs built to round badly; the
input norms measured once per record (TrainingInputs), and that the backends use them only for the input layer."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from edge_sdk.backends.factored import _squared_rows
from edge_sdk.privacy.per_example import FLOAT32_UNIT_ROUNDOFF, summation_error_bound
from tests.gateway_backend import needs_torch


def test_closed_form():
    u = 2.0 ** -24
    assert FLOAT32_UNIT_ROUNDOFF == u == np.finfo(np.float32).eps / 2
    assert summation_error_bound(1280) == pytest.approx(1280 * u / (1 - 1280 * u), rel=1e-15)
    assert summation_error_bound(0) == 0.0
    with pytest.raises(ValueError):
        summation_error_bound(2 ** 24)


def _exact_squared_norms(rows: np.ndarray) -> list[Fraction]:
    return [sum((Fraction(float(v)) ** 2 for v in row), Fraction(0)) for row in rows]


def _rows_that_round_badly(n: int) -> np.ndarray:
    rng = np.random.default_rng(n)
    rows = [rng.uniform(0, 6, n), rng.standard_normal(n) * 1e3,
            np.full(n, 1 + 2 ** -12),                       # every square rounds, the same way
            np.concatenate([[2.0 ** 12], np.full(n - 1, 2.0 ** -1)])]  # small terms swallowed by a large one
    return np.asarray(rows, dtype=np.float32)


@pytest.mark.parametrize("n", [3, 257, 1280])
def test_raised_float32_sums_are_upper_bounds_of_the_exact_squared_norms(n):
    arr = _rows_that_round_badly(n)
    exact = _exact_squared_norms(arr)
    for got_np, want in zip(_squared_rows(arr), exact):
        assert Fraction(float(got_np)) >= want
        assert float(got_np) <= float(want) * (1 + 2 * summation_error_bound(n))


@needs_torch
@pytest.mark.parametrize("n", [3, 257, 1280])
def test_raised_float32_sums_of_torch_are_upper_bounds_too(n):
    import torch

    arr = _rows_that_round_badly(n)
    flat = torch.as_tensor(arr)
    torch_bounds = (flat.square().sum(dim=1).to(torch.float64) * (1 + summation_error_bound(n))).numpy()
    for got_torch, want in zip(torch_bounds, _exact_squared_norms(arr)):
        assert Fraction(float(got_torch)) >= want


def test_training_inputs_measure_each_record_once_with_an_upper_bound():
    from edge_sdk.training import TrainingInputs

    rng = np.random.default_rng(5)
    feats = rng.uniform(0, 6, (3, 1280)).astype(np.float32)
    centre = feats.mean(axis=0).astype(np.float32)
    prepared = TrainingInputs(_Records(feats), centre)
    np.testing.assert_array_equal(prepared.features, feats - centre)
    for got, want in zip(prepared.input_sq_norms, _exact_squared_norms(feats - centre)):
        assert Fraction(float(got)) >= want and float(got) <= float(want) * (1 + 1e-12)


class _Records:
    def __init__(self, features):
        self.features, self.labels = features, np.arange(len(features))
        self.categories = np.full(len(features), 6, np.int8)

    def __len__(self):
        return len(self.labels)


@needs_torch
@pytest.mark.parametrize("adapter_width,scope", [(0, "all"), (8, "all"), (8, "head")])
def test_cached_input_norms_change_nothing_but_the_cost(adapter_width, scope):
    from edge_sdk.backends.torch_backend import TorchBackend
    from shared.models.kinds import model_spec

    rng = np.random.default_rng(adapter_width)
    spec = model_spec("head", 4, adapter_width=adapter_width)
    backend = TorchBackend(model=spec, scope=scope)
    backend.set_weights(spec.initial_weights(2, head_init="uniform"))
    x = rng.uniform(0, 6, (7, 1280)).astype(np.float32)
    y = rng.integers(0, 4, 7)
    measured = backend.per_example(x, y)
    exact_sq = np.einsum("ij,ij->i", x.astype(np.float64), x.astype(np.float64))
    cached = backend.per_example(x, y, input_sq_norms=exact_sq)
    np.testing.assert_allclose(cached.norms, measured.norms, rtol=1e-4)
    w = rng.uniform(0, 1, (2, 7)).astype(np.float32)
    np.testing.assert_array_equal(cached.weighted_sum(w), measured.weighted_sum(w))
    # a wrong cache must never be used for a layer that does not read the input (psi behind a frozen adapter)
    wrong = backend.per_example(x, y, input_sq_norms=np.zeros(7))
    if adapter_width and scope == "head":
        np.testing.assert_array_equal(wrong.norms, measured.norms)
    else:
        assert np.all(wrong.norms < measured.norms)  # the cache is what the input layer's norm used
