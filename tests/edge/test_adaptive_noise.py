"""Adaptive grouped noise (docs/radiomap.md, "The mechanism"): shares sum to 1, per-group noise std matches its share,
the floor holds whatever the allocator outputs, the clipping bound holds, and the stated (eps, delta) agrees with the
Gaussian mechanism's exact privacy profile (Balle and Wang 2018, Thm. 8) computed here by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq
from scipy.stats import norm

from shared.models.radio_unet import GroupLayout
from shared.privacy.accounting import epsilon_spent

from edge_sdk.privacy.adaptive_noise import (
    DEFENCES,
    AdaptiveGroupedNoise,
    clip_update,
    floored_shares,
    steered_shares,
    uniform_shares,
    upload_statistics,
)
from edge_sdk.privacy.randomness import SecureRandom

# A small layout shaped like the RadioUNet's: two tiny sensitive groups and two large residual groups.
SIZES = (40, 3000, 60, 5000)


def small_layout() -> GroupLayout:
    index = np.concatenate([np.full(n, g, dtype=np.int64) for g, n in enumerate(SIZES)])
    index = index[np.random.default_rng(0).permutation(index.size)]  # groups interleave, as in a real model
    return GroupLayout(names=("stage1/transmitter", "stage1/residual", "stage2/transmitter", "stage2/residual"),
                       index=index, stage=(1, 1, 2, 2), sensitive=(True, False, True, False))


class Fixed:
    """A 'random source' that hands out the given normal draws in order (to reproduce the mechanism by hand)."""

    def __init__(self, draws: list[np.ndarray]) -> None:
        self.draws = list(draws)

    def random(self, size: int) -> np.ndarray:  # pragma: no cover - the mechanism draws no uniforms
        raise AssertionError("no uniforms expected")

    def standard_normal(self, size) -> np.ndarray:
        return self.draws.pop(0)


def one_hot_allocator(group: int):
    def allocate(stats: np.ndarray) -> np.ndarray:
        out = np.zeros(stats.shape[0])
        out[group] = 1.0
        return out
    return allocate


@given(st.lists(st.floats(min_value=0.0, max_value=1e3), min_size=4, max_size=4).filter(lambda v: sum(v) > 0),
       st.floats(min_value=0.01, max_value=1.0))
@settings(max_examples=200, deadline=None)
def test_shares_sum_to_one_and_respect_the_floor(raw, phi):
    layout = small_layout()
    p = np.asarray(raw) / sum(raw)
    a = floored_shares(p, layout, phi)
    assert a.sum() == pytest.approx(1.0, abs=1e-12)
    d = sum(SIZES)
    for g, n in enumerate(SIZES):
        assert a[g] >= phi * n / d - 1e-15
    assert uniform_shares(layout).sum() == pytest.approx(1.0)
    assert steered_shares(layout).sum() == pytest.approx(1.0)
    # steered: all budget on the two sensitive groups, in proportion to their sizes
    np.testing.assert_allclose(steered_shares(layout), [40 / 100, 0, 60 / 100, 0])


@pytest.mark.parametrize("defence", ["uniform", "steered-uniform", "adaptive"])
def test_per_group_noise_std_matches_its_share(defence):
    layout = small_layout()
    z, c, phi = 3.0, 0.5, 0.4
    # an allocator that puts 70 % on stage 2's sensitive group: the expected std below is worked from the closed
    # form sigma_g^2 = a_g * d (z C)^2 / d_g with a = phi d_g / d + (1 - phi) p
    p = np.array([0.1, 0.1, 0.7, 0.1])
    mech = AdaptiveGroupedNoise(layout=layout, defence=defence, clipping_norm=c, noise_multiplier=z,
                                floor_fraction=phi, allocator=lambda s: p)
    d = sum(SIZES)
    if defence == "uniform":
        expected = np.full(4, z * c)
    elif defence == "steered-uniform":
        expected = np.array([math.sqrt(d * (z * c) ** 2 / 100), 0.0, math.sqrt(d * (z * c) ** 2 / 100), 0.0])
    else:
        expected = np.array([math.sqrt((phi * n / d + (1 - phi) * p[g]) * d * (z * c) ** 2 / n)
                             for g, n in enumerate(SIZES)])
    rng = SecureRandom()
    # 1,000 draws: >= 40,000 samples in the smallest group, so the sample std's relative standard error is
    # 1 / sqrt(2 * 40,000) = 0.35 % and the 2 % tolerance is almost 6 standard errors
    draws = 1000
    samples = np.stack([mech.privatise(np.zeros(d), round_index=1, total_rounds=10, noise=rng).update
                        for _ in range(draws)]).astype(np.float64)
    for g in range(4):
        values = samples[:, layout.index == g]
        measured = values.std()
        if expected[g] == 0:
            assert measured == 0
        else:
            assert measured == pytest.approx(expected[g], rel=0.02), layout.names[g]
    # total variance is the fixed budget B = d (zC)^2 for every noisy defence
    assert float((np.asarray(SIZES) * expected ** 2).sum()) == pytest.approx(d * (z * c) ** 2)


@pytest.mark.parametrize("group", range(4))
def test_floor_holds_whatever_the_allocator_outputs(group):
    layout = small_layout()
    z, c, phi = 3.0, 1.0, 0.5
    mech = AdaptiveGroupedNoise(layout=layout, defence="adaptive", clipping_norm=c, noise_multiplier=z,
                                floor_fraction=phi, allocator=one_hot_allocator(group))
    floor = math.sqrt(phi) * z * c
    assert mech.floor_std == pytest.approx(floor)
    rng = SecureRandom()
    d = sum(SIZES)
    samples = np.stack([mech.privatise(np.zeros(d), round_index=0, total_rounds=5, noise=rng).update
                        for _ in range(1000)]).astype(np.float64)
    out = mech.privatise(np.zeros(d), round_index=0, total_rounds=5, noise=rng)
    assert np.all(out.noise_std >= floor * (1 - 1e-12))
    for g in range(4):
        measured = samples[:, layout.index == g].std()
        assert measured >= floor * 0.98, layout.names[g]
        if g != group:  # groups the allocator gave nothing get exactly the floor
            assert measured == pytest.approx(floor, rel=0.02)


def test_the_allocator_sees_only_the_floor_noised_update():
    layout = small_layout()
    d, z, c, phi = sum(SIZES), 2.0, 1.0, 0.5
    u = np.random.default_rng(1).normal(size=d) * 0.01
    eps1, eps2 = np.random.default_rng(2).normal(size=d), np.random.default_rng(3).normal(size=d)
    seen = []

    def recording(stats):
        seen.append(stats)
        return np.full(4, 0.25)

    mech = AdaptiveGroupedNoise(layout=layout, defence="adaptive", clipping_norm=c, noise_multiplier=z,
                                floor_fraction=phi, allocator=recording)
    out = mech.privatise(u, round_index=3, total_rounds=10, noise=Fixed([eps1, eps2]))
    floor = math.sqrt(phi) * z * c
    y = clip_update(u, c)[0] + floor * eps1
    np.testing.assert_array_equal(seen[0], upload_statistics(y, layout, floor_std=floor, clipping_norm=c,
                                                             round_index=3, total_rounds=10))
    # and the release is y plus the extra noise of the floored shares
    a = 0.5 * np.asarray(SIZES) / d + 0.5 * 0.25
    extra = np.sqrt(a * d * (z * c) ** 2 / np.asarray(SIZES) - floor ** 2)
    np.testing.assert_allclose(out.update, (y + extra[layout.index] * eps2).astype(np.float32), rtol=1e-6)


@given(st.floats(min_value=1e-3, max_value=1e6), st.floats(min_value=1e-3, max_value=10.0),
       st.integers(min_value=0, max_value=2**31))
@settings(max_examples=200, deadline=None)
def test_clipping_bound_holds(scale, c, seed):
    u = np.random.default_rng(seed).normal(size=257) * scale
    clipped, before = clip_update(u, c)
    assert np.linalg.norm(clipped) <= c
    assert before == pytest.approx(np.linalg.norm(u))
    if before <= c:
        np.testing.assert_array_equal(clipped, u)
    else:  # direction kept
        np.testing.assert_allclose(clipped / np.linalg.norm(clipped), u / before, rtol=1e-9, atol=1e-12)


def test_clip_only_and_none():
    layout = small_layout()
    d = sum(SIZES)
    u = np.full(d, 1.0)
    clip = AdaptiveGroupedNoise(layout=layout, defence="clip-only", clipping_norm=2.0, noise_multiplier=3.0)
    out = clip.privatise(u, round_index=0, total_rounds=1, noise=SecureRandom())
    assert np.linalg.norm(out.update.astype(np.float64)) <= 2.0 * (1 + 1e-6)
    assert out.norm_before_clipping == pytest.approx(math.sqrt(d))
    none = AdaptiveGroupedNoise(layout=layout, defence="none", clipping_norm=2.0, noise_multiplier=3.0)
    np.testing.assert_array_equal(none.privatise(u, round_index=0, total_rounds=1, noise=SecureRandom()).update, u)


def gaussian_epsilon(sigma_over_sensitivity: float, delta: float) -> float:
    """The exact eps(delta) of the Gaussian mechanism (Balle and Wang 2018, Thm. 8), by root finding on
    delta(eps) = Phi(1/(2s) - eps s) - e^eps Phi(-1/(2s) - eps s), s = sigma / sensitivity."""
    s = sigma_over_sensitivity

    def gap(eps: float) -> float:
        return norm.cdf(1 / (2 * s) - eps * s) - math.exp(eps) * norm.cdf(-1 / (2 * s) - eps * s) - delta

    return brentq(gap, 0.0, 100.0)


@pytest.mark.parametrize("defence,phi", [("uniform", 1.0), ("adaptive", 0.5), ("adaptive", 0.25)])
def test_the_stated_epsilon_is_the_gaussian_mechanism_at_the_floor(defence, phi):
    layout = small_layout()
    z, c, delta = 3.0, 0.7, 1e-5
    mech = AdaptiveGroupedNoise(layout=layout, defence=defence, clipping_norm=c, noise_multiplier=z,
                                floor_fraction=phi, allocator=lambda s: np.full(4, 0.25))
    event = mech.dp_event()
    # sensitivity 2C (any two clipped updates), standard deviation sqrt(phi) z C
    assert event.noise_multiplier == pytest.approx(math.sqrt(phi) * z * c / (2 * c), rel=1e-15)
    assert (event.sampling_rate, event.steps) == (1.0, 1)
    exact = gaussian_epsilon(math.sqrt(phi) * z / 2, delta)
    assert epsilon_spent([event], target_delta=delta, accountant="pld") == pytest.approx(exact, rel=0.01)
    assert epsilon_spent([event], target_delta=delta, accountant="rdp") >= exact  # RDP is an upper bound


@pytest.mark.parametrize("defence", ["none", "clip-only", "steered-uniform"])
def test_defences_without_a_guarantee_state_none(defence):
    mech = AdaptiveGroupedNoise(layout=small_layout(), defence=defence, clipping_norm=1.0, noise_multiplier=3.0)
    assert mech.dp_event() is None


def test_bad_settings_are_refused():
    layout = small_layout()
    with pytest.raises(ValueError, match="defence"):
        AdaptiveGroupedNoise(layout=layout, defence="gaussian", clipping_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="allocator"):
        AdaptiveGroupedNoise(layout=layout, defence="adaptive", clipping_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="floor_fraction"):
        AdaptiveGroupedNoise(layout=layout, defence="uniform", clipping_norm=1.0, noise_multiplier=1.0,
                             floor_fraction=0.0)
    with pytest.raises(ValueError, match="clipping_norm"):
        AdaptiveGroupedNoise(layout=layout, defence="uniform", clipping_norm=0.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="allocator shares"):
        floored_shares(np.array([0.5, 0.5, 0.5, 0.5]), layout, 0.5)
    assert set(DEFENCES) == {"none", "clip-only", "uniform", "steered-uniform", "adaptive", "grouped-clipping"}
