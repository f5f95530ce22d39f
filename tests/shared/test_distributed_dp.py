"""Distributed DP (Skellam shares under secure aggregation): the event's accounting against the paper's bound
computed by hand, the plan's calibration against dp-accounting directly, and the noise's distribution."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp
from scipy import stats

from shared.errors import PayloadError
from shared.iucn import CCDPBudget
from shared.iucn import IUCNCategory as Cat
from shared.privacy.accounting import epsilon_spent
from shared.privacy.distributed import distributed_plan, skellam_event, skellam_noise, skellam_share_variance
from shared.privacy.events import SkellamEvent, parse_event


def agarwal_bound(alpha: int, mu: float, d2: float, d1: float) -> float:
    """Agarwal, Kairouz & Liu 2021, Thm 3.5: the RDP of the Skellam mechanism at integer order alpha."""
    return alpha * d2 ** 2 / (2 * mu) + min(((2 * alpha - 1) * d2 ** 2 + 6 * d1) / (4 * mu ** 2), 3 * d1 / (2 * mu))


def test_the_zcdp_form_bounds_the_papers_rdp_at_every_order() -> None:
    ev = SkellamEvent(variance=4.0e6, l2_sensitivity=900.0, l1_sensitivity=900.0 * 113.0, steps=1)
    rho, xi = ev.zcdp()
    for alpha in range(2, 200):
        paper = agarwal_bound(alpha, 4.0e6, 900.0, 900.0 * 113.0)
        assert rho * alpha + xi >= paper  # a valid upper bound at every integer order ...
        assert rho * alpha + xi <= paper + rho * (1 + 1e-6)  # ... loose by the ceiling slack rho (and 1/mu)
    for alpha in (1.25, 2.5, 7.3):  # real orders: bounded by the next integer order's bound
        assert rho * alpha + xi >= agarwal_bound(math.ceil(alpha), 4.0e6, 900.0, 900.0 * 113.0)


def test_event_composes_through_dp_accounting_and_round_trips() -> None:
    ev = SkellamEvent(variance=4.0e6, l2_sensitivity=900.0, l1_sensitivity=1e5, steps=10)
    rho, xi = ev.zcdp()
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.ZCDpEvent(rho, xi), 10)
    assert epsilon_spent([ev], target_delta=1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
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
        rho, xi = ev.zcdp()
        acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        acc.compose(dp_accounting.ZCDpEvent(rho, xi), 10)
        assert eps * 0.99 <= acc.get_epsilon(1e-5) <= eps, c
    # the integer-unit sensitivity of a record clipped at C_c: C_c * scale + sqrt(d) (rounding)
    ev = skellam_event(noise_multiplier=z, anchor_clipping_norm=1.0, clipping_norm=norms[Cat.CR], vector_length=12810,
                       scale=2.0 ** 18)
    assert ev.l2_sensitivity == pytest.approx(norms[Cat.CR] * 2 ** 18 + math.sqrt(12810))
    assert ev.variance == pytest.approx((z * (2 ** 18 + math.sqrt(12810))) ** 2)


def test_shares_of_t_sites_sum_to_the_planned_variance() -> None:
    share = skellam_share_variance(noise_multiplier=2.0, clipping_norm=1.0, vector_length=100, scale=64.0,
                                   threshold=4)
    assert share == pytest.approx((2.0 * (64.0 + 10.0)) ** 2 / 4)
    rng = np.random.default_rng(5)
    total = sum(skellam_noise(share, 200_000, rng) for _ in range(4))
    assert total.dtype == np.int64
    # Skellam(mu) has mean 0, variance mu and excess kurtosis 1/mu (tiny here): check mean, variance, shape
    assert abs(total.mean()) < 5 * math.sqrt(4 * share / 200_000)
    assert abs(total.var() / (4 * share) - 1) < 0.02
    assert stats.kstest(total / math.sqrt(4 * share), "norm").pvalue > 1e-3
