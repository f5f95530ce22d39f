"""The grouped-clipping defence: per-group norms from a public profile, the noise that gives
uniform's privacy profile exactly, checked against the whitened-sensitivity formula by hand, against a numerical
optimiser for the least total variance, and against the released noise reproduced draw by draw."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize

from shared.protocol import RadioTask
from shared.privacy.events import DPSGDEvent

from edge_sdk.privacy.adaptive_noise import (AdaptiveGroupedNoise, clip_groups, clipping_profile,
                                             grouped_clipping_noise_std, grouped_clipping_norms)
from tests.edge.test_adaptive_noise import SIZES, Fixed, small_layout

PROFILE = np.array([0.5, 2.0, 0.1, 4.0])


def test_norms_share_the_whole_clipping_norm_in_the_profiles_proportions():
    c = grouped_clipping_norms(PROFILE, 0.005)
    assert float(np.sum(c ** 2)) == pytest.approx(0.005 ** 2, rel=1e-12)
    np.testing.assert_allclose(c / c[0], PROFILE / PROFILE[0], rtol=1e-12)
    with pytest.raises(ValueError):
        grouped_clipping_norms(np.array([1.0, 0.0, 1.0, 1.0]), 0.005)


def test_the_noise_gives_uniforms_whitened_sensitivity_with_the_least_total_variance():
    layout = small_layout()
    z, c = 3.0, grouped_clipping_norms(PROFILE, 0.005)
    sigma = grouped_clipping_noise_std(c, layout, noise_multiplier=z)
    d = np.asarray(SIZES, float)
    # whitened sensitivity 2 sqrt(sum (C_g / sigma_g)^2) = 2 / z: the Gaussian mechanism of uniform at z
    assert 2 * np.sqrt(np.sum((c / sigma) ** 2)) == pytest.approx(2 / z, rel=1e-12)
    # minimise sum_g d_g s_g^2 subject to sum_g C_g^2 / s_g^2 = 1 / z^2 numerically (log-parametrised)
    def total(log_s):
        return float(np.sum(d * np.exp(2 * log_s))) / 1e-6
    cons = {"type": "eq", "fun": lambda log_s: (np.sum(c ** 2 * np.exp(-2 * log_s)) - 1 / z ** 2) * z ** 2}
    with np.errstate(over="ignore"):  # the optimiser's line search may probe far-off points
        res = minimize(total, np.log(np.full(4, z * 0.005)), constraints=[cons], method="SLSQP",
                       options={"ftol": 1e-14, "maxiter": 500})
    assert res.success
    np.testing.assert_allclose(np.exp(res.x), sigma, rtol=1e-3)
    # one group: uniform's z C
    one = grouped_clipping_noise_std(np.array([0.005]), type(layout)(names=("all",), index=np.zeros(7, np.int64),
                                                                     stage=(1,), sensitive=(True,)),
                                     noise_multiplier=z)
    assert one[0] == pytest.approx(z * 0.005, rel=1e-12)


def test_each_group_is_clipped_to_its_own_norm():
    layout = small_layout()
    rng = np.random.default_rng(3)
    u = rng.normal(size=layout.dimension)
    c = grouped_clipping_norms(PROFILE, 0.005)
    out, before = clip_groups(u, layout, c)
    assert before == pytest.approx(np.linalg.norm(u))
    for g in range(4):
        assert np.linalg.norm(out[layout.index == g]) <= c[g]
    small = u * 1e-9  # already inside every ball: unchanged
    np.testing.assert_array_equal(clip_groups(small, layout, c)[0], small)


def test_the_release_is_the_group_clipped_update_plus_each_groups_noise_and_states_uniforms_event():
    layout = small_layout()
    rng = np.random.default_rng(4)
    u = rng.normal(size=layout.dimension)
    draw = rng.normal(size=layout.dimension)
    mech = AdaptiveGroupedNoise(layout=layout, defence="grouped-clipping", clipping_norm=0.005, noise_multiplier=3.0,
                                clipping_profile=PROFILE)
    out = mech.privatise(u, round_index=1, total_rounds=10, noise=Fixed([draw]))
    c = grouped_clipping_norms(PROFILE, 0.005)
    sigma = grouped_clipping_noise_std(c, layout, noise_multiplier=3.0)
    expected = clip_groups(u, layout, c)[0] + sigma[layout.index] * draw
    np.testing.assert_allclose(out.update, expected.astype(np.float32), rtol=1e-6)
    np.testing.assert_allclose(mech.clipped(u), clip_groups(u, layout, c)[0])
    assert mech.dp_event() == DPSGDEvent(1.5, 1.0, 1)
    assert RadioTask(defence="grouped-clipping", noise_multiplier=3.0).floor_noise_multiplier() == 1.5
    with pytest.raises(ValueError, match="clipping profile"):
        AdaptiveGroupedNoise(layout=layout, defence="grouped-clipping", clipping_norm=0.005,
                             noise_multiplier=3.0).privatise(u, round_index=1, total_rounds=10, noise=Fixed([draw]))


def test_the_profile_is_the_median_group_norm_of_the_public_updates():
    layout = small_layout()
    updates = np.zeros((3, layout.dimension))
    for k, scale in enumerate((1.0, 2.0, 5.0)):
        updates[k, layout.index == 1] = scale / np.sqrt(SIZES[1])  # group 1 norms 1, 2, 5 -> median 2
        updates[k, layout.index == 3] = 3.0 / np.sqrt(SIZES[3])    # group 3 norm 3 each
    m = clipping_profile(updates, layout)
    np.testing.assert_allclose(m[[1, 3]], [2.0, 3.0], rtol=1e-12)
    np.testing.assert_allclose(m[[0, 2]], [3e-3, 3e-3], rtol=1e-12)  # zero groups floored at 1e-3 of the largest
