"""The float32 summation bound the backends use to turn cheap float32 squared norms into upper bounds (Higham 2002,
Lemma 3.1): the closed form, and float32 sums that never exceed it, including inputs built to round badly."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from edge_sdk.backends.factored import _squared_rows
from edge_sdk.privacy.per_example import FLOAT32_UNIT_ROUNDOFF, summation_error_bound


def test_closed_form():
    u = 2.0 ** -24
    assert FLOAT32_UNIT_ROUNDOFF == u == np.finfo(np.float32).eps / 2
    assert summation_error_bound(1280) == pytest.approx(1280 * u / (1 - 1280 * u), rel=1e-15)
    assert summation_error_bound(0) == 0.0
    with pytest.raises(ValueError):
        summation_error_bound(2 ** 24)


def _exact_squared_norms(rows: np.ndarray) -> list[Fraction]:
    return [sum((Fraction(float(v)) ** 2 for v in row), Fraction(0)) for row in rows]


@pytest.mark.parametrize("n", [3, 257, 1280])
def test_raised_float32_sums_are_upper_bounds_of_the_exact_squared_norms(n):
    rng = np.random.default_rng(n)
    rows = [rng.uniform(0, 6, n), rng.standard_normal(n) * 1e3,
            np.full(n, 1 + 2 ** -12),                       # every square rounds, the same way
            np.concatenate([[2.0 ** 12], np.full(n - 1, 2.0 ** -1)])]  # small terms swallowed by a large one
    arr = np.asarray(rows, dtype=np.float32)
    exact = _exact_squared_norms(arr)
    numpy_bounds = _squared_rows(arr)
    flat = torch.as_tensor(arr)
    torch_bounds = (flat.square().sum(dim=1).to(torch.float64) * (1 + summation_error_bound(n))).numpy()
    for got_np, got_torch, want in zip(numpy_bounds, torch_bounds, exact):
        assert Fraction(float(got_np)) >= want and Fraction(float(got_torch)) >= want
        assert float(got_np) <= float(want) * (1 + 2 * summation_error_bound(n))
