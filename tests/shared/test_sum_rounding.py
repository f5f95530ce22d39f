"""The float steps before quantisation (shared.privacy.sum_rounding): a worst case in which casting the clipped sum
to float32 moves the quantised sum by more than the accounting's ``C_c scale + sqrt(d)``, while the gateway's
float64 path (the real ``clipped_sum_locally``) stays within it; every check in exact integer arithmetic."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from shared.errors import ConfigError
from shared.iucn import IUCNCategory as Cat
from shared.privacy.sum_rounding import margin, secagg_clipping_norms
from shared.protocol import SecAggSettings, TrainingTask, canonical_flatten
from shared.secagg import max_power_of_two_scale, quantise

from edge_sdk.backends.base import ParameterSpec
from edge_sdk.data.camtrap_dp import LocalDataset
from edge_sdk.privacy.ccdp import clip_factors_from_norms
from edge_sdk.privacy.per_example import MaterialisedGradients
from edge_sdk.training import clipped_sum_locally
from tests.edge.test_training import FakeBackend

D = 4  # vector length; sqrt(d) = 2 exactly
BOX = 2.0
SCALE = max_power_of_two_scale(num_sites=2, max_abs_value=BOX, modulus_bits=32)
# p: tiny; its float32 sum with r lies just above a float32 midpoint (0.5 + 2^-25 + 2^-40 rounds up to 0.5 + 2^-24)
P = np.full(D, 2.0 ** -25 + 2.0 ** -40, dtype=np.float32)
R = np.full(D, 0.5, dtype=np.float32)  # norm exactly 1
# the clipping norm: r's norm bound plus the margin of a two-record site, so r is clipped by nothing (factor 1)
C_C = 1.0 + 2.0 ** -40


def settings() -> SecAggSettings:
    return SecAggSettings(site_ids=("a", "b"), threshold=2, vector_length=D, max_abs_value=BOX, scale=SCALE)


def signed(q: np.ndarray) -> list[int]:
    """The integers a quantised vector holds (two's complement mod 2^32)."""
    return [int(v) - (1 << 32) if int(v) >= 1 << 31 else int(v) for v in q]


def within_allowance(q_d: np.ndarray, q_d2: np.ndarray, clipping_norm: float) -> tuple[bool, int, Fraction]:
    """||q(D') - q(D)||^2 as an integer against (C_c scale + sqrt(d))^2 as an exact fraction."""
    squared = sum((a - b) ** 2 for a, b in zip(signed(q_d2), signed(q_d)))
    allowance = (Fraction(clipping_norm) * Fraction(SCALE) + math.isqrt(D)) ** 2
    return squared <= allowance, squared, allowance


def test_the_construction_is_what_it_claims() -> None:
    assert SCALE == 2.0 ** 28 and math.isqrt(D) ** 2 == D
    assert float(np.float32(np.float64(R[0]) + np.float64(P[0]))) == 0.5 + 2.0 ** -24  # float32 rounds up
    assert np.float64(R[0]) + np.float64(P[0]) == 0.5 + 2.0 ** -25 + 2.0 ** -40  # float64 is exact here
    m = margin(num_records=2, clipping_norm=C_C, vector_length=D, scale=SCALE, max_abs_value=BOX)
    norm_bound = MaterialisedGradients(np.stack([P, R])).norms[1]
    assert norm_bound < C_C - m  # r is not clipped: it enters at its full norm, 1


def test_a_float32_cast_before_quantising_exceeds_the_allowance_and_float64_does_not() -> None:
    params = settings().params("f", 0)
    grads = {"D": MaterialisedGradients(P[None, :]), "D'": MaterialisedGradients(np.stack([P, R]))}
    norms = secagg_clipping_norms({Cat.NE: C_C}, num_records=2, clipping_norm=C_C, vector_length=D, scale=SCALE,
                                  max_abs_value=BOX)
    q = {}
    for dtype in (np.float32, np.float64):
        for name, g in grads.items():
            factors = clip_factors_from_norms(g.norms, norms[Cat.NE])
            assert np.all(factors == 1.0)
            total = g.weighted_sum(factors[None, :], dtype=dtype).reshape(-1)
            q[dtype, name] = quantise(canonical_flatten({"w": total}, dtype=dtype), params)
    ok32, sq32, allowance = within_allowance(q[np.float32, "D"], q[np.float32, "D'"], C_C)
    ok64, sq64, _ = within_allowance(q[np.float64, "D"], q[np.float64, "D'"], C_C)
    # float32: each coordinate moves by 2^27 + 8 (8 grid units too many), ||.|| = 2^28 + 16 > 2^28 + 2 (+ 2^-12)
    assert not ok32 and sq32 == 4 * (2 ** 27 + 8) ** 2
    # float64: each coordinate moves by 2^27 = s * 0.5, ||.|| = 2^28 = s ||r||
    assert ok64 and sq64 == 4 * (2 ** 27) ** 2 and sq64 < allowance


class FourBackend(FakeBackend):
    """FakeBackend with four parameters: the gradient of a record is its four feature values."""

    @property
    def parameter_layout(self):
        return (ParameterSpec("w", (D,), 0),)


class Everyone:
    def random(self, size):
        return np.zeros(size)

    def standard_normal(self, size):
        return np.zeros(size)


def test_the_gateways_clipped_sum_is_float64_and_stays_within_the_allowance() -> None:
    # the real clipped_sum_locally on the same records, as the Global DP client quantises it
    task = TrainingTask(federation_id="f", round=0, model_hash="0" * 64, local_steps=1, expected_batch_size=64,
                        learning_rate=1.0, clipping_norm=C_C, target_delta=1e-5, planned_rounds=2, privacy="global",
                        budgets={Cat.NE: 2.0}, noise_multiplier=3.0, secagg=settings())
    params = settings().params("f", 0)

    def quantised(rows: np.ndarray) -> np.ndarray:
        data = LocalDataset(labels=np.zeros(len(rows), np.int64), categories=np.full(len(rows), Cat.NE.rank, np.int8),
                            media_ids=tuple(f"m{i}" for i in range(len(rows))), features=rows)
        part = clipped_sum_locally(backend=FourBackend(), dataset=data, task=task,
                                   global_weights={"w": np.zeros(D, np.float32)}, site_categories=[Cat.NE],
                                   randomness=Everyone())
        assert part.batch_size == len(rows) and part.gradient_sum["w"].dtype == np.float64
        return quantise(canonical_flatten(part.gradient_sum, dtype=np.float64), params)

    ok, squared, _ = within_allowance(quantised(P[None, :]), quantised(np.stack([P, R])), C_C)
    # within the allowance, and below the unclipped distance: the record is clipped at C_c less the margin for the
    # public bound of MAX_SUMMED_RECORDS terms
    assert ok and squared < 4 * (2 ** 27) ** 2


def test_margin_closed_form_and_the_numbers_the_docstring_gives() -> None:
    u = 2.0 ** -53
    n = 5001
    want = (2 * n * (n * u / (1 - n * u)) * (1 + 16 * u) + 16 * u) * 1.0 + 2 * math.sqrt(12_810) * (u * 1024
                                                                                                  + 2.0 ** -1075 / 2 ** 17)
    got = margin(num_records=5000, clipping_norm=1.0, vector_length=12_810, scale=2.0 ** 17, max_abs_value=1024.0)
    assert got == want and 5.5e-9 < got < 5.7e-9 and 7e-4 < got * 2 ** 17 < 7.5e-4
    assert 2.1e-4 < margin(num_records=10 ** 6, clipping_norm=1.0, vector_length=12_810, scale=2.0 ** 17,
                           max_abs_value=1024.0) < 2.3e-4
    # the float32 path of the same settings: s gamma_B B C per sum, B = 1024 records
    g32 = 1024 * 2.0 ** -24 / (1 - 1024 * 2.0 ** -24)
    assert 8_190 < 2 ** 17 * g32 * 1024 < 8_200
    norms = secagg_clipping_norms({Cat.CR: 0.2, Cat.NE: 1.0}, num_records=5000, clipping_norm=1.0,
                                  vector_length=12_810, scale=2.0 ** 17, max_abs_value=1024.0)
    assert norms == {Cat.CR: 0.2 - got, Cat.NE: 1.0 - got}
    with pytest.raises(ConfigError, match="reaches the clipping norm"):
        secagg_clipping_norms({Cat.CR: 1e-9}, num_records=10 ** 6, clipping_norm=1.0, vector_length=12_810,
                              scale=2.0 ** 17, max_abs_value=1024.0)
    with pytest.raises(ConfigError, match="float64 rounding margin"):
        margin(num_records=-1, clipping_norm=1.0, vector_length=4, scale=1.0, max_abs_value=1.0)
