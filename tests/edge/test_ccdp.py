"""CCDP mechanism: clipping bound, per-category noise scale, expected-batch normalisation, halted categories."""

from __future__ import annotations

import numpy as np
import pytest

from shared.errors import PrivacyBudgetError
from shared.iucn import IUCNCategory as Cat
from shared.privacy.accounting import epsilon_spent
from shared.privacy.events import DPSGDEvent

from edge_sdk.privacy.ccdp import (
    CCDPMechanism,
    active_categories,
    calibrate_category_noise,
    category_events,
    clip_per_example,
)
from edge_sdk.privacy.randomness import InsecureRandomnessWarning, SecureRandom, SeededRandom
from edge_sdk.privacy.sampling import eligible_mask, poisson_sample, poisson_sample_mask


class ZeroNoise:
    """A 'random source' with no randomness: uniforms 0 (every eligible record sampled), normals 0."""

    def random(self, size: int) -> np.ndarray:
        return np.zeros(size)

    def standard_normal(self, size) -> np.ndarray:
        return np.zeros(size)


def seeded(seed: int) -> SeededRandom:
    with pytest.warns(InsecureRandomnessWarning):
        return SeededRandom(seed)


def test_every_clipped_gradient_has_norm_at_most_c(rng: np.random.Generator) -> None:
    c = 0.7
    scales = np.geomspace(1e-3, 1e3, 64)
    grads = (rng.standard_normal((64, 257)) * scales[:, None] / np.sqrt(257)).astype(np.float32)
    clipped = clip_per_example(grads, c)
    norms_before = np.linalg.norm(grads.astype(np.float64), axis=1)
    norms_after = np.linalg.norm(clipped.astype(np.float64), axis=1)
    assert np.all(norms_after <= c)
    small = norms_before <= c
    assert small.any() and (~small).any()
    np.testing.assert_array_equal(clipped[small], grads[small])  # below C: untouched
    np.testing.assert_allclose(norms_after[~small], c, rtol=2e-5)  # above C: scaled to C (less a 1e-5 margin)
    cosine = np.sum(clipped * grads, axis=1) / (norms_after * norms_before)
    np.testing.assert_allclose(cosine, 1.0, rtol=1e-5)  # direction kept


@pytest.mark.parametrize("source", ["seeded", "secure"])
def test_noise_std_of_each_category_sum_is_z_times_c(source: str) -> None:
    c, z = 0.5, {Cat.CR: 3.0, Cat.VU: 1.2, Cat.LC: 0.6}
    noise = seeded(2024) if source == "seeded" else SecureRandom()
    mech = CCDPMechanism(clipping_norm=c, noise_multipliers=z, expected_batch_size=10.0, noise=noise)
    # One known example in CR and one in LC; VU has no example in the batch but must still be noised.
    grads = np.zeros((2, 5000), np.float32)
    grads[0, 0], grads[1, 1] = 3.0, 0.2  # clipped to 0.5 (norm 3 > C) and unchanged (0.2 <= C)
    cats = np.array([Cat.CR.rank, Cat.LC.rank])
    exact = np.zeros((3, 5000))
    exact[0, 0], exact[2, 1] = 0.5, 0.2
    draws = np.concatenate([mech.noisy_category_sums(grads, cats) - exact for _ in range(40)], axis=1)
    assert mech.categories == (Cat.CR, Cat.VU, Cat.LC)
    for k, cat in enumerate(mech.categories):
        assert abs(draws[k].std() / (z[cat] * c) - 1) < 0.02, cat
        assert abs(draws[k].mean()) < 5 * z[cat] * c / np.sqrt(draws.shape[1])
    # Independent across categories.
    assert abs(np.corrcoef(draws)[0, 1]) < 0.02


def test_normalised_by_expected_not_realised_batch() -> None:
    # Hand-worked: C = 1; g1 = (3, 4) has norm 5 -> (0.6, 0.8); g2 = (0.3, 0.4) has norm 0.5 -> unchanged.
    # Expected batch size q * N_active = 0.5 * 8 = 4 (the realised batch has 2): (0.9, 1.2) / 4 = (0.225, 0.3).
    mech = CCDPMechanism(clipping_norm=1.0, noise_multipliers={Cat.CR: 1.0, Cat.LC: 1.0}, expected_batch_size=4.0,
                         noise=ZeroNoise())
    out = mech.privatize(np.array([[3.0, 4.0], [0.3, 0.4]], np.float32), np.array([1, 5]))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.225, 0.3], rtol=2e-5)


def test_empty_batch_is_pure_noise_over_expected_size() -> None:
    mech = CCDPMechanism(clipping_norm=2.0, noise_multipliers={Cat.EN: 1.0}, expected_batch_size=5.0,
                         noise=seeded(1))
    out = mech.privatize(np.zeros((0, 20000), np.float32), np.zeros(0, np.int8))
    assert abs(out.std() - 2.0 / 5.0) < 0.02 * 0.4


def test_non_active_category_in_batch_is_refused() -> None:
    mech = CCDPMechanism(clipping_norm=1.0, noise_multipliers={Cat.LC: 1.0}, expected_batch_size=1.0,
                         noise=ZeroNoise())
    with pytest.raises(PrivacyBudgetError, match="not active"):
        mech.privatize(np.ones((2, 3), np.float32), np.array([Cat.LC.rank, Cat.CR.rank]))
    with pytest.raises(PrivacyBudgetError, match="halted"):
        CCDPMechanism(clipping_norm=1.0, noise_multipliers={}, expected_batch_size=1.0, noise=ZeroNoise())


def test_halted_category_records_are_never_sampled(rng: np.random.Generator) -> None:
    categories = rng.integers(1, 7, size=3000).astype(np.int8)
    eligible = eligible_mask(categories, [Cat.CR, Cat.EN])
    source = seeded(7)
    counts = np.zeros(3000)
    for _ in range(200):
        idx = poisson_sample(eligible, 0.9, source)
        assert not np.isin(categories[idx], [Cat.CR.rank, Cat.EN.rank]).any()
        counts[idx] += 1
    assert counts[~eligible].sum() == 0
    # Eligible records join at rate q: 200 * 0.9 = 180 on average (binomial sd ~ 4.2 each; mean over ~2000).
    assert abs(counts[eligible].mean() - 180) < 1.0
    assert poisson_sample_mask(eligible, 1.0, source).tolist() == eligible.tolist()


def test_active_categories_come_from_config_not_batch() -> None:
    assert active_categories([Cat.LC, Cat.CR, Cat.NT, Cat.CR], [Cat.NT]) == (Cat.CR, Cat.LC)


def test_calibration_stays_inside_each_budget_and_orders_noise() -> None:
    budgets = {Cat.CR: 0.5, Cat.LC: 2.0, Cat.NE: 4.0}
    z = calibrate_category_noise(budgets=budgets, active=[Cat.CR, Cat.LC], target_delta=1e-5, sampling_rate=0.05,
                                 steps=100)
    assert set(z) == {Cat.CR, Cat.LC} and z[Cat.CR] > z[Cat.LC] > 0
    for cat, zc in z.items():
        eps = epsilon_spent([DPSGDEvent(zc, 0.05, 100)], target_delta=1e-5)
        assert budgets[cat] * 0.97 <= eps <= budgets[cat]
    events = category_events(z, sampling_rate=0.05, steps_run=10)
    assert events == {c: DPSGDEvent(zc, 0.05, 10) for c, zc in z.items()}
    with pytest.raises(PrivacyBudgetError, match="no epsilon budget for active category EN"):
        calibrate_category_noise(budgets=budgets, active=[Cat.EN], target_delta=1e-5, sampling_rate=0.05, steps=10)


def test_implicit_and_materialised_gradients_give_the_same_step() -> None:
    from edge_sdk.privacy.per_example import MaterialisedGradients

    class Implicit(MaterialisedGradients):  # the interface a ghost-clipping backend implements
        def weighted_sum(self, weights):
            return np.stack([sum(w * g for w, g in zip(row, self.grads)) for row in weights]).astype(np.float32)

    grads = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 2.0]], np.float32)
    cats = np.array([1, 5, 1])
    mech = CCDPMechanism(clipping_norm=1.0, noise_multipliers={Cat.CR: 1.0, Cat.LC: 1.0}, expected_batch_size=4.0,
                         noise=ZeroNoise())
    # (0.6, 0.8) + (0.3, 0.4) + (0, 1) = (0.9, 2.2); / 4 = (0.225, 0.55)
    np.testing.assert_allclose(mech.privatize(Implicit(grads), cats), [0.225, 0.55], rtol=2e-5)
    np.testing.assert_allclose(mech.privatize(grads, cats), [0.225, 0.55], rtol=2e-5)
