"""Distributed DP (Skellam shares under secure aggregation): the event's accounting against the paper's bound
computed by hand, the plan's calibration against it, and the shares' distribution with f colluding sites."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import rdp
from scipy import stats

from shared.errors import ConfigError, PayloadError
from shared.iucn import CCDPBudget
from shared.iucn import IUCNCategory as Cat
from shared.privacy.accounting import epsilon_spent
from shared.privacy.distributed import distributed_plan, skellam_event, skellam_noise, skellam_share_variance
from shared.privacy.events import SkellamEvent, parse_event


def agarwal_bound(alpha, mu: float, d2: float, d1: float):
    """Agarwal, Kairouz & Liu 2021, Thm 3.5: the RDP of the Skellam mechanism at integer order(s) alpha."""
    alpha = np.asarray(alpha, dtype=np.float64)
    return alpha * d2 ** 2 / (2 * mu) + np.minimum(((2 * alpha - 1) * d2 ** 2 + 6 * d1) / (4 * mu ** 2),
                                                   3 * d1 / (2 * mu))


def direct_epsilon(ev: SkellamEvent, delta: float = 1e-5) -> float:
    """``ev``'s steps of Thm 3.5 at every integer order 2..2000, converted by dp-accounting's ``compute_epsilon``."""
    orders = np.arange(2, 2001, dtype=np.float64)
    return float(rdp.rdp_privacy_accountant.compute_epsilon(
        orders, ev.steps * agarwal_bound(orders, ev.variance, ev.l2_sensitivity, ev.l1_sensitivity), delta)[0])


def test_event_composes_by_the_papers_rdp_and_round_trips() -> None:
    ev = SkellamEvent(variance=4.0e6, l2_sensitivity=900.0, l1_sensitivity=1e5, steps=10)
    np.testing.assert_allclose(ev.rdp(np.arange(2, 50)), agarwal_bound(np.arange(2, 50), 4.0e6, 900.0, 1e5),
                               rtol=1e-15)
    assert epsilon_spent([ev], target_delta=1e-5) == pytest.approx(direct_epsilon(ev), rel=1e-4)
    assert parse_event(ev.to_json()) == ev
    assert ev.noise_multiplier == pytest.approx(2000.0 / 900.0) and ev.sampling_rate == 1.0
    with pytest.raises(PayloadError):
        SkellamEvent(variance=-1.0, l2_sensitivity=1.0, l1_sensitivity=1.0, steps=1)
    with pytest.raises(PayloadError):
        parse_event({"type": "laplace", "b": 1.0})


def test_plan_spends_each_budget_with_one_noise_level() -> None:
    budgets = CCDPBudget.from_anchor("VU", 1.0, 1.0).table()
    kw = dict(target_delta=1e-5, planned_rounds=10, clipping_norm=1.0, vector_length=12810, scale=2.0 ** 18)
    z, norms = distributed_plan(budgets=budgets, **kw)
    assert norms[Cat.NE] == 1.0 and norms[Cat.CR] < norms[Cat.EN] < norms[Cat.VU] < norms[Cat.LC] < 1.0
    for c, eps in budgets.items():
        ev = skellam_event(noise_multiplier=z, anchor_clipping_norm=1.0, clipping_norm=norms[c],
                           vector_length=12810, scale=2.0 ** 18, steps=10)
        # the ledger's charge stays within the budget and spends it (within 1 %), by the paper's bound computed here
        assert eps * 0.99 <= epsilon_spent([ev], target_delta=1e-5) <= eps, c
        assert eps * 0.99 <= direct_epsilon(ev) <= eps * (1 + 1e-4), c
    # the integer-unit sensitivity of a record clipped at C_c: C_c * scale + sqrt(d) (rounding)
    ev = skellam_event(noise_multiplier=z, anchor_clipping_norm=1.0, clipping_norm=norms[Cat.CR], vector_length=12810,
                       scale=2.0 ** 18)
    assert ev.l2_sensitivity == pytest.approx(norms[Cat.CR] * 2 ** 18 + math.sqrt(12810))
    assert ev.variance == pytest.approx((z * (2 ** 18 + math.sqrt(12810))) ** 2)


def test_shares_of_t_minus_f_sites_sum_to_the_planned_variance() -> None:
    # mu = (z (C scale + sqrt d))^2 = (2 (64 + 10))^2; t = 4 sites of which f = 1 may collude: each adds mu / 3
    mu = (2.0 * (64.0 + 10.0)) ** 2
    kw = dict(noise_multiplier=2.0, clipping_norm=1.0, vector_length=100, scale=64.0, threshold=4)
    assert skellam_share_variance(**kw) == pytest.approx(mu / 4)  # f = 0: t shares carry mu
    share = skellam_share_variance(**kw, colluding_sites=1)
    assert share == pytest.approx(mu / 3)
    rng = np.random.default_rng(5)
    total = sum(skellam_noise(share, 200_000, rng) for _ in range(3))  # the shares the colluder does not know
    assert total.dtype == np.int64
    # Skellam(mu) has mean 0, variance mu and excess kurtosis 1/mu (tiny here): check mean, variance, shape
    assert abs(total.mean()) < 5 * math.sqrt(mu / 200_000)
    assert abs(total.var() / mu - 1) < 0.02
    assert stats.kstest(total / math.sqrt(mu), "norm").pvalue > 1e-3
    for bad in (4, 5, -1):
        with pytest.raises(ConfigError, match="colluding_sites"):
            skellam_share_variance(**kw, colluding_sites=bad)


def test_site_sampling_rate_is_min_one_b_over_n_and_one_under_distributed_noise():
    from shared.privacy.distributed import site_sampling_rate

    # by hand: B = 1024 at N = 2305, 470 and unknown; distributed credits no subsampling, so every record goes in
    assert site_sampling_rate(1024, 2305) == pytest.approx(1024 / 2305, rel=1e-15)
    assert site_sampling_rate(1024, 470) == 1.0 and site_sampling_rate(1024, None) == 1.0
    assert site_sampling_rate(1024, 0) == 1.0
    assert site_sampling_rate(1024, 2305, distributed=True) == 1.0
    with pytest.raises(ConfigError, match="expected_batch_size"):
        site_sampling_rate(0, 10)


def test_a_distributed_site_sums_every_record_when_b_is_below_n(tmp_path):
    # Prepare: 40 NE and 10 LC records, B = 5 (q would be 0.1); a source whose uniforms are all 0.5, so any rate
    # below 0.5 would leave every record out and a rate of 1 takes every one
    from edge_sdk.training import clipped_sum_locally
    from shared.protocol import SecAggSettings, TrainingTask
    from tests.gateway_backend import model_weights, training_backend

    class Half:
        def random(self, size):
            return np.full(size, 0.5)

        def standard_normal(self, size):
            return np.zeros(size)

    class Records:
        def __init__(self, n_ne, n_lc, e):
            rng = np.random.default_rng(3)
            self.features = rng.standard_normal((n_ne + n_lc, e)).astype(np.float32)
            self.labels = np.arange(n_ne + n_lc) % 3
            self.categories = np.array([Cat.NE.rank] * n_ne + [Cat.LC.rank] * n_lc, np.int8)

        def __len__(self):
            return len(self.labels)

    e = 8
    weights = model_weights("tiny-8")  # the head alone on e = 8 inputs, K = 3
    d = sum(w.size for w in weights.values())
    for distributed, want in ((True, 50), (False, 0)):
        task = TrainingTask(federation_id="f", round=0, model_hash="0" * 64, local_steps=1, expected_batch_size=5,
                            learning_rate=1.0, clipping_norm=1.0, target_delta=1e-5, planned_rounds=2,
                            privacy="global", budgets={Cat.NE: 2.0, Cat.LC: 1.0}, noise_multiplier=3.0,
                            distributed_noise=distributed,
                            secagg=SecAggSettings(site_ids=("a", "b"), threshold=2, vector_length=d,
                                                  max_abs_value=100.0, scale=2.0 ** 16))
        # Execute
        part = clipped_sum_locally(backend=training_backend("tiny-8", tmp_path / str(distributed)),
                                   dataset=Records(40, 10, e), task=task,
                                   global_weights=weights, site_categories=[Cat.NE, Cat.LC], randomness=Half())
        # Assert: distributed takes all 50 records at q = 1; trusted samples at q <= 0.1 < 0.5, so none
        assert part.batch_size == want
        assert part.sampling_rate == (1.0 if distributed else pytest.approx(0.1))


@pytest.mark.parametrize("variance", [4.0, 200.0])  # Poisson(2): numpy's inversion branch; Poisson(100): its PTRS
def test_skellam_noise_follows_the_exact_pmf(variance) -> None:
    n = 400_000
    x = skellam_noise(variance, n)  # the production default: a fresh secure generator keyed from os.urandom
    assert x.shape == (n,) and x.dtype == np.int64
    # chi-square against scipy's exact Skellam(mu/2, mu/2) pmf over every k expecting >= 20 draws, the two tails
    # pooled; significance 1e-6 (a correct sampler fails once in 10^6 runs). At this n a variance off by 3 %
    # gives p below 1e-15 (measured at both variances), and the mean of the pair shifted by 0.1 below 1e-100 at mu = 4.
    dist = stats.skellam(variance / 2, variance / 2)
    ks = np.arange(*dist.ppf([1e-6, 1 - 1e-6]).astype(int))
    ks = ks[n * dist.pmf(ks) >= 20]
    expected = np.r_[dist.cdf(ks[0] - 1), dist.pmf(ks), dist.sf(ks[-1])] * n
    observed = np.r_[np.sum(x < ks[0]), np.bincount(x[(x >= ks[0]) & (x <= ks[-1])] - ks[0], minlength=ks.size),
                     np.sum(x > ks[-1])]
    assert observed.sum() == n
    assert stats.chisquare(observed, expected * n / expected.sum()).pvalue > 1e-6


def test_skellam_noise_draws_from_a_cipher_stream_keyed_by_os_urandom(monkeypatch) -> None:
    import os

    from shared.privacy.randomness import CIPHERS, default_cipher, secure_generator

    key = bytes(range(CIPHERS[default_cipher()]))
    monkeypatch.setattr(os, "urandom", lambda k: key[:k])
    drawn = skellam_noise(50.0, 1000)
    monkeypatch.undo()
    np.testing.assert_array_equal(drawn, skellam_noise(50.0, 1000, secure_generator(key)))
    assert not np.array_equal(skellam_noise(50.0, 64), skellam_noise(50.0, 64))  # a fresh key per share
