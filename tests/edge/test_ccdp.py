"""CCDP mechanism: clipping bound, per-category noise scale, expected-batch normalisation, halted categories."""

from __future__ import annotations

import logging

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


def _mixed_batch(rng: np.random.Generator, d: int = 300):
    """12 examples over four active categories, norms from far below to far above C = 0.8 (so some are clipped)."""
    scales = np.geomspace(0.05, 20.0, 12)
    grads = (rng.standard_normal((12, d)) * scales[:, None] / np.sqrt(d)).astype(np.float32)
    cats = np.array([Cat.CR.rank, Cat.EN.rank, Cat.VU.rank, Cat.LC.rank] * 3)
    z = {Cat.CR: 2.5, Cat.EN: 1.7, Cat.VU: 1.1, Cat.LC: 0.6, Cat.NE: 0.4}  # NE active, absent from the batch
    return grads, cats, z


@pytest.mark.parametrize("implicit", [False, True])
def test_fast_path_equals_reference_without_noise(rng: np.random.Generator, implicit: bool) -> None:
    from edge_sdk.privacy.per_example import MaterialisedGradients

    grads, cats, z = _mixed_batch(rng)
    mech = CCDPMechanism(clipping_norm=0.8, noise_multipliers=z, expected_batch_size=7.5, noise=ZeroNoise())
    given = MaterialisedGradients(grads) if implicit else grads
    fast, ref = mech.privatize(given, cats), mech.privatize_reference(given, cats)
    assert fast.dtype == ref.dtype == np.float32 and fast.shape == ref.shape == (300,)
    np.testing.assert_allclose(fast, ref, atol=1e-6, rtol=0)
    # ... and both equal the hand formula sum_i clip(g_i) / (q N).
    np.testing.assert_allclose(fast, clip_per_example(grads, 0.8).astype(np.float64).sum(0) / 7.5, atol=1e-6)
    # "z tiny" instead of an injected zero source: still the same vector to 1e-6.
    tiny = CCDPMechanism(clipping_norm=0.8, noise_multipliers={c: 1e-9 for c in z}, expected_batch_size=7.5,
                         noise=SecureRandom())
    np.testing.assert_allclose(tiny.privatize(grads, cats), tiny.privatize_reference(grads, cats), atol=1e-6, rtol=0)


def test_fast_path_noise_std_is_the_summed_variance_and_matches_reference(rng: np.random.Generator) -> None:
    grads, cats, z = _mixed_batch(rng, d=20_000)
    c, expected = 0.8, 7.5
    mech = CCDPMechanism(clipping_norm=c, noise_multipliers=z, expected_batch_size=expected, noise=SecureRandom())
    exact = clip_per_example(grads, c).astype(np.float64).sum(0) / expected
    fast = np.concatenate([mech.privatize(grads, cats) - exact for _ in range(20)])  # 400,000 draws
    ref = np.concatenate([mech.privatize_reference(grads, cats) - exact for _ in range(20)])
    target = np.sqrt(sum((zc * c) ** 2 for zc in z.values())) / expected
    assert mech.total_noise_std == pytest.approx(target * expected)
    # Sample std of n normals has relative sd 1/sqrt(2n) ~ 0.11% here: 2% is > 15 sd.
    assert abs(fast.std() / target - 1) < 0.02
    assert abs(ref.std() / target - 1) < 0.02
    assert abs(fast.std() / ref.std() - 1) < 0.02
    assert abs(fast.mean()) < 5 * target / np.sqrt(fast.size)
    assert abs(np.mean(fast**4) / fast.var() ** 2 - 3) < 0.05  # Gaussian (kurtosis 3), like the reference


def test_accounting_drops_only_rdp_non_convergence_warnings(caplog: pytest.LogCaptureFixture) -> None:
    import dp_accounting
    from dp_accounting import rdp

    event = DPSGDEvent(1.0, 0.2, 300)  # small z, large q: fractional orders whose series do not converge
    with caplog.at_level(logging.WARNING, logger="absl"):
        eps = epsilon_spent([event], target_delta=1e-5)
    assert not [r for r in caplog.records if "failed to converge" in r.getMessage()]
    caplog.clear()
    # Outside our calls the library still warns (global logging unchanged), and the epsilon is the same.
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    with caplog.at_level(logging.WARNING, logger="absl"):
        acc.compose(event.to_dp_event())
        assert acc.get_epsilon(1e-5) == eps
    assert [r for r in caplog.records if "failed to converge" in r.getMessage()]
