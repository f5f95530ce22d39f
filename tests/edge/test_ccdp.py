"""CCDP as individualized DP-SGD: clipping bounds, one noise draw, expected-batch normalisation, halted categories,
and the Sample / Scale calibrations checked against dp-accounting directly."""

from __future__ import annotations

import logging

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from shared.errors import ConfigError, PrivacyBudgetError
from shared.iucn import IUCNCategory as Cat
from shared.privacy.accounting import calibrate_sampling_rate, epsilon_spent
from shared.privacy.events import DPSGDEvent

from edge_sdk.privacy.ccdp import (
    CCDPMechanism,
    CCDPPlan,
    active_categories,
    clip_factors_from_norms,
    clip_per_example,
    plan_ccdp,
)
from edge_sdk.privacy.randomness import InsecureRandomnessWarning, SecureRandom, SeededRandom
from edge_sdk.privacy.sampling import eligible_mask, poisson_sample, poisson_sample_mask, sample_at_rates


class ZeroNoise:
    """A 'random source' with no randomness: uniforms 0 (every record of rate > 0 sampled), normals 0."""

    def random(self, size: int) -> np.ndarray:
        return np.zeros(size)

    def standard_normal(self, size) -> np.ndarray:
        return np.zeros(size)


def seeded(seed: int) -> SeededRandom:
    with pytest.warns(InsecureRandomnessWarning):
        return SeededRandom(seed)


def independent_epsilon(z: float, q: float, steps: int, delta: float = 1e-5, extra=()) -> float:
    """dp-accounting's RDP accountant, called directly (not through shared.privacy.accounting)."""
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    for event, count in extra:
        acc.compose(event, count)
    return acc.get_epsilon(delta)


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


def test_per_example_clipping_norms() -> None:
    # norms 5, 0.5, 2 against bounds 1, 1, 0.25: factors 0.2, 1, 0.125 (less the 1e-5 margin where clipped)
    factors = clip_factors_from_norms(np.array([5.0, 0.5, 2.0]), np.array([1.0, 1.0, 0.25]))
    np.testing.assert_allclose(factors, [0.2, 1.0, 0.125], rtol=2e-5)
    with pytest.raises(ValueError, match="clipping norms"):
        clip_factors_from_norms(np.array([1.0, 2.0]), np.array([1.0]))
    with pytest.raises(ValueError, match="> 0"):
        clip_factors_from_norms(np.array([1.0]), 0.0)


def test_one_draw_of_sigma_over_the_normaliser(rng: np.random.Generator) -> None:
    for noise in (seeded(2024), SecureRandom()):
        mech = CCDPMechanism(clipping_norms={Cat.CR: 0.25, Cat.LC: 1.0}, noise_std=1.5, expected_batch_size=10.0,
                             noise=noise)
        grads = np.zeros((2, 100_000), np.float32)
        grads[0, 0], grads[1, 1] = 3.0, 0.2  # CR clipped to 0.25, LC unchanged
        out = mech.privatize(grads, np.array([Cat.CR.rank, Cat.LC.rank])).astype(np.float64)
        out[0] -= 0.025
        out[1] -= 0.02
        # std of 1e5 normals: relative sd 1/sqrt(2e5) ~ 0.22 %; 1.5 % is > 6 sd
        assert abs(out.std() / 0.15 - 1) < 0.015
        assert abs(np.mean(out ** 4) / out.var() ** 2 - 3) < 0.1  # Gaussian (kurtosis 3)


def test_normalised_by_expected_not_realised_batch() -> None:
    # Hand-worked: C_CR = 1, C_LC = 0.25; g1 = (3, 4) (CR) has norm 5 -> (0.6, 0.8); g2 = (0.3, 0.4) (LC) has norm
    # 0.5 -> (0.15, 0.2). Expected batch size 4 (the realised batch has 2): (0.75, 1.0) / 4 = (0.1875, 0.25).
    mech = CCDPMechanism(clipping_norms={Cat.CR: 1.0, Cat.LC: 0.25}, noise_std=1.0, expected_batch_size=4.0,
                         noise=ZeroNoise())
    out = mech.privatize(np.array([[3.0, 4.0], [0.3, 0.4]], np.float32), np.array([1, 5]))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.1875, 0.25], rtol=2e-5)


def test_empty_batch_is_pure_noise_over_expected_size() -> None:
    mech = CCDPMechanism(clipping_norms={Cat.EN: 2.0}, noise_std=2.0, expected_batch_size=5.0, noise=seeded(1))
    out = mech.privatize(np.zeros((0, 20000), np.float32), np.zeros(0, np.int8))
    assert abs(out.std() - 2.0 / 5.0) < 0.02 * 0.4


def test_non_active_category_in_batch_is_refused() -> None:
    mech = CCDPMechanism(clipping_norms={Cat.LC: 1.0}, noise_std=1.0, expected_batch_size=1.0, noise=ZeroNoise())
    with pytest.raises(PrivacyBudgetError, match="not active"):
        mech.privatize(np.ones((2, 3), np.float32), np.array([Cat.LC.rank, Cat.CR.rank]))
    with pytest.raises(PrivacyBudgetError, match="not active"):
        mech.privatize(np.ones((1, 3), np.float32), np.array([99]))
    with pytest.raises(PrivacyBudgetError, match="halted"):
        CCDPMechanism(clipping_norms={}, noise_std=1.0, expected_batch_size=1.0, noise=ZeroNoise())


def test_implicit_and_materialised_gradients_give_the_same_step() -> None:
    from edge_sdk.privacy.per_example import MaterialisedGradients

    class Implicit(MaterialisedGradients):  # the interface a ghost-clipping backend implements
        def weighted_sum(self, weights):
            return np.stack([sum(w * g for w, g in zip(row, self.grads)) for row in weights]).astype(np.float32)

    grads = np.array([[3.0, 4.0], [0.3, 0.4], [0.0, 2.0]], np.float32)
    cats = np.array([1, 5, 1])
    mech = CCDPMechanism(clipping_norms={Cat.CR: 1.0, Cat.LC: 1.0}, noise_std=1.0, expected_batch_size=4.0,
                         noise=ZeroNoise())
    # (0.6, 0.8) + (0.3, 0.4) + (0, 1) = (0.9, 2.2); / 4 = (0.225, 0.55)
    np.testing.assert_allclose(mech.privatize(Implicit(grads), cats), [0.225, 0.55], rtol=2e-5)
    np.testing.assert_allclose(mech.privatize(grads, cats), [0.225, 0.55], rtol=2e-5)


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


def test_per_record_rates_are_the_realised_inclusion_rates() -> None:
    rates = np.repeat([0.0, 0.05, 0.3, 1.0], 500)
    source = seeded(3)
    counts = np.zeros(rates.size)
    for _ in range(400):
        counts[sample_at_rates(rates, source)] += 1
    for r in (0.0, 0.05, 0.3, 1.0):
        group = counts[rates == r] / 400
        # mean of 500 x 400 Bernoulli(r): sd sqrt(r (1 - r) / 200,000) <= 0.0012; 0.006 is > 5 sd
        assert abs(group.mean() - r) < 0.006, r
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        sample_at_rates(np.array([0.5, 1.5]), source)


def test_active_categories_come_from_config_not_batch() -> None:
    assert active_categories([Cat.LC, Cat.CR, Cat.NT, Cat.CR], [Cat.NT]) == (Cat.CR, Cat.LC)


def test_sampling_rate_calibration_against_dp_accounting() -> None:
    z, steps = 1.2, 200
    q = calibrate_sampling_rate(target_epsilon=0.5, target_delta=1e-5, noise_multiplier=z, steps=steps, max_rate=0.2)
    assert 0 < q < 0.2
    assert 0.5 * 0.99 <= independent_epsilon(z, q, steps) <= 0.5
    # a budget the largest rate already meets returns that rate
    assert calibrate_sampling_rate(target_epsilon=50.0, target_delta=1e-5, noise_multiplier=z, steps=steps,
                                   max_rate=0.2) == 0.2
    with pytest.raises(ConfigError, match="fixed releases alone"):
        calibrate_sampling_rate(target_epsilon=0.1, target_delta=1e-5, noise_multiplier=z, steps=steps, max_rate=0.2,
                                fixed_events=(DPSGDEvent(1.0, 1.0, 10),))


BUDGETS = {Cat.CR: 1 / 3, Cat.EN: 2 / 3, Cat.LC: 5 / 3, Cat.NE: 2.0}


def test_sample_plan_spends_each_budget_with_one_noise_multiplier() -> None:
    plan = plan_ccdp(variant="sample", budgets=BUDGETS, active=[Cat.CR, Cat.EN, Cat.LC], target_delta=1e-5,
                     sampling_rate=0.1, steps=100, clipping_norm=0.5)
    assert plan.anchor == Cat.LC  # NE is not active: the largest active budget
    assert plan.sampling_rates[Cat.LC] == 0.1
    assert plan.sampling_rates[Cat.CR] < plan.sampling_rates[Cat.EN] < 0.1
    assert set(plan.clipping_norms.values()) == {0.5}
    zs = plan.noise_multipliers()
    assert len(set(zs.values())) == 1  # one noise multiplier for every record
    events = plan.events(100)
    for c, ev in events.items():
        assert ev == DPSGDEvent(zs[c], plan.sampling_rates[c], 100)
        assert BUDGETS[c] * 0.99 <= independent_epsilon(ev.noise_multiplier, ev.sampling_rate, 100) <= BUDGETS[c], c


def test_scale_plan_spends_each_budget_with_one_sigma() -> None:
    plan = plan_ccdp(variant="scale", budgets=BUDGETS, active=[Cat.CR, Cat.EN, Cat.LC, Cat.NE], target_delta=1e-5,
                     sampling_rate=0.1, steps=100, clipping_norm=0.5)
    assert plan.anchor == Cat.NE and plan.clipping_norms[Cat.NE] == 0.5
    assert set(plan.sampling_rates.values()) == {0.1}
    assert plan.clipping_norms[Cat.CR] < plan.clipping_norms[Cat.EN] < plan.clipping_norms[Cat.LC] < 0.5
    for c, ev in plan.events(100).items():
        assert ev.noise_multiplier == pytest.approx(plan.noise_std / plan.clipping_norms[c], rel=1e-12)
        assert BUDGETS[c] * 0.99 <= independent_epsilon(ev.noise_multiplier, 0.1, 100) <= BUDGETS[c], c


@pytest.mark.parametrize("variant", ["sample", "scale"])
def test_plans_leave_room_for_the_fixed_count_releases(variant: str) -> None:
    fixed = (DPSGDEvent(40.0, 1.0, 10),)
    plan = plan_ccdp(variant=variant, budgets=BUDGETS, active=[Cat.CR, Cat.NE], target_delta=1e-5, sampling_rate=0.2,
                     steps=50, clipping_norm=1.0, fixed_events=fixed)
    for c, ev in plan.events(50).items():
        eps = independent_epsilon(ev.noise_multiplier, ev.sampling_rate, 50,
                                  extra=[(dp_accounting.GaussianDpEvent(40.0), 10)])
        assert BUDGETS[c] * 0.99 <= eps <= BUDGETS[c], c


def test_plan_errors_name_the_problem() -> None:
    with pytest.raises(PrivacyBudgetError, match="no epsilon budget for active category VU"):
        plan_ccdp(variant="sample", budgets=BUDGETS, active=[Cat.VU], target_delta=1e-5, sampling_rate=0.1, steps=10,
                  clipping_norm=1.0)
    with pytest.raises(ConfigError, match="unknown CCDP variant"):
        plan_ccdp(variant="split", budgets=BUDGETS, active=[Cat.CR], target_delta=1e-5, sampling_rate=0.1, steps=10,
                  clipping_norm=1.0)
    with pytest.raises(PrivacyBudgetError, match="halted"):
        plan_ccdp(variant="sample", budgets=BUDGETS, active=[], target_delta=1e-5, sampling_rate=0.1, steps=10,
                  clipping_norm=1.0)
    with pytest.raises(ValueError, match="same active categories"):
        CCDPPlan(variant="sample", noise_std=1.0, sampling_rates={Cat.CR: 0.1}, clipping_norms={Cat.EN: 1.0},
                 anchor=Cat.CR)


def test_the_anchor_comes_from_the_species_table_so_a_halt_keeps_z() -> None:
    kw = dict(variant="sample", budgets=BUDGETS, target_delta=1e-5, sampling_rate=0.1, steps=100, clipping_norm=0.5,
              site_categories=[Cat.CR, Cat.EN, Cat.LC])
    before = plan_ccdp(active=[Cat.CR, Cat.EN, Cat.LC], **kw)
    after = plan_ccdp(active=[Cat.CR, Cat.EN], **kw)  # LC, the anchor, halted
    assert before.anchor == after.anchor == Cat.LC and after.noise_std == before.noise_std
    assert after.sampling_rates == {c: before.sampling_rates[c] for c in (Cat.CR, Cat.EN)}


def test_accounting_drops_only_rdp_non_convergence_warnings(caplog: pytest.LogCaptureFixture) -> None:
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
