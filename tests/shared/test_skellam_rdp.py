"""The Skellam mechanism's RDP (Agarwal, Kairouz and Liu, NeurIPS 2021, Thm 3.5) and its composition through
dp-accounting: the bound against the Rényi divergence of shifted Skellam distributions summed over their support,
against the theorem written in the units of the authors' reference implementation, the accountant against
dp-accounting's own for every other event, and the printed epsilon against the bound's minimum over every integer
order (within 1 %), below the zCDP relaxation."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp
from scipy import special

from shared.privacy.accounting import epsilon_spent, make_accountant
from shared.privacy.events import DPSGDEvent, SkellamEvent, parse_event
from shared.privacy.running import RunningComposition
from shared.privacy.skellam import SkellamDpEvent, SkellamRdpAccountant, skellam_rdp

DELTA = 1e-5
ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def skellam_log_pmf(k: np.ndarray, mu: float) -> np.ndarray:
    """log P[Poisson(mu/2) - Poisson(mu/2) = k] = log(e^-mu I_|k|(mu)) (the Skellam law; scipy's scaled Bessel)."""
    with np.errstate(divide="ignore"):
        return np.log(special.ive(np.abs(k), mu))


def renyi_of_shift(shift: int, mu: float, alpha: int) -> float:
    """D_alpha(Sk + shift || Sk) by summation over the support (the tails where the pmf underflows carry nothing)."""
    reach = int(mu + 40 * math.sqrt(mu) + 60 + abs(shift))
    k = np.arange(-reach, reach + 1)
    lp, lq = skellam_log_pmf(k - shift, mu), skellam_log_pmf(k, mu)
    ok = np.isfinite(lp) & np.isfinite(lq)
    return float(special.logsumexp(alpha * lp[ok] + (1 - alpha) * lq[ok]) / (alpha - 1))


def reference_form(order: int, l1: float, l2: float, variance: float, scale: float) -> float:
    """Thm 3.5 in the units of the authors' reference implementation (google-research/federated,
    distributed_dp/accounting_utils.py): sensitivities and variance before scaling by ``scale`` to the integer grid."""
    a = order
    return (a * l2 ** 2 / (2 * variance)
            + min(((2 * a - 1) * scale * l2 ** 2 + 6 * l1) / (4 * scale ** 3 * variance ** 2),
                  3 * l1 / (2 * scale * variance)))


@pytest.mark.parametrize("mu", [1.0, 3.0, 10.0, 50.0])
def test_the_bound_is_above_the_renyi_divergence_of_shifted_skellams(mu):
    for alpha in (2, 3, 5, 8, 16):
        for shift in (1, 2, 3):  # one coordinate: D2 = D1 = |shift|
            assert renyi_of_shift(shift, mu, alpha) <= float(skellam_rdp(alpha, mu, shift, shift)) + 1e-12
        # two coordinates shifted by (1, 2): independent coordinates, so the divergences add; D2 = sqrt 5, D1 = 3
        exact = renyi_of_shift(1, mu, alpha) + renyi_of_shift(2, mu, alpha)
        assert exact <= float(skellam_rdp(alpha, mu, math.sqrt(5.0), 3.0)) + 1e-12


def test_the_bound_is_sharp_at_moderate_noise():
    # at mu = 50 the bound is within 10 % of the exact divergence for orders up to 8 (and tends to the Gaussian's)
    for alpha in (2, 3, 5, 8):
        for shift in (1, 2, 3):
            exact = renyi_of_shift(shift, 50.0, alpha)
            assert float(skellam_rdp(alpha, 50.0, shift, shift)) <= 1.1 * exact


def test_the_closed_form_is_the_theorem_in_the_reference_implementation_s_units():
    for scale in (1.0, 64.0, 2.0 ** 17):
        l2, l1, var = 0.7, 0.7 * 40.0, 3.5e-3  # clipped sum units; var = (z C)^2 with z about 0.085
        for alpha in (2, 7, 40, 300):
            ours = float(skellam_rdp(alpha, var * scale ** 2, l2 * scale, l1 * scale))
            assert ours == pytest.approx(reference_form(alpha, l1, l2, var, scale), rel=1e-12)


def test_fractional_orders_take_the_next_integer_order_and_orders_must_exceed_one():
    orders = np.array([1.1, 2.0, 2.5, 10.9, 64.0])
    np.testing.assert_allclose(skellam_rdp(orders, 400.0, 20.0, 80.0),
                               [float(skellam_rdp(a, 400.0, 20.0, 80.0)) for a in (2, 2, 3, 11, 64)], rtol=0)
    with pytest.raises(ValueError, match="orders > 1"):
        skellam_rdp(np.array([1.0, 2.0]), 400.0, 20.0, 80.0)
    acc = SkellamRdpAccountant(orders=[1.5, 4.0], neighboring_relation=ADD_REMOVE)
    acc.compose(SkellamDpEvent(400.0, 20.0, 80.0), 3)
    np.testing.assert_allclose(acc.rdp, 3 * skellam_rdp(np.array([2.0, 4.0]), 400.0, 20.0, 80.0), rtol=1e-15)


def test_every_other_event_is_dp_accounting_s_own_composition():
    events = [DPSGDEvent(1.1, 0.02, 50), DPSGDEvent(8.0, 1.0, 1), DPSGDEvent(0.7, 0.3, 4)]
    ours = make_accountant("rdp")
    theirs = rdp.RdpAccountant(neighboring_relation=ADD_REMOVE)
    for acc in (ours, theirs):  # twice: the second time our subsampled-Gaussian curves come from the memo
        acc.compose(dp_accounting.ComposedDpEvent([e.to_dp_event() for e in events]))
        acc.compose(dp_accounting.ComposedDpEvent([e.to_dp_event() for e in events]))
    assert isinstance(ours, SkellamRdpAccountant)
    np.testing.assert_array_equal(ours.orders, theirs.orders)  # the extra Skellam orders are for Skellam releases
    np.testing.assert_array_equal(ours.rdp, theirs.rdp)
    assert ours.get_epsilon(DELTA) == theirs.get_epsilon(DELTA)
    assert ours.get_delta(1.0) == theirs.get_delta(1.0)


def test_the_extra_orders_count_for_skellam_releases_only():
    ev = SkellamEvent(variance=(60.0 * 131185.0) ** 2, l2_sensitivity=131185.0, l1_sensitivity=1.5e7, steps=10)
    acc = make_accountant("rdp")
    acc.compose(ev.to_dp_event())
    eps, order = acc.get_epsilon_and_optimal_order(DELTA)
    assert order not in rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS and float(order).is_integer()  # e.g. 94
    acc.compose(DPSGDEvent(50.0, 1e-3, 1).to_dp_event())  # a negligible other release: back to the default orders
    eps_mixed, order_mixed = acc.get_epsilon_and_optimal_order(DELTA)
    assert order_mixed in rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS and eps_mixed > eps


def bound_epsilon(ev: SkellamEvent, delta: float) -> float:
    """The mechanism's bound as (eps, delta): the minimum over EVERY integer order 2..20000 of the steps' RDP
    converted by Canonne, Kamath and Steinke 2020, Prop. 12 (written out here)."""
    a = np.arange(2, 20001, dtype=np.float64)
    r = ev.steps * (a * ev.l2_sensitivity ** 2 / (2 * ev.variance)
                    + np.minimum(((2 * a - 1) * ev.l2_sensitivity ** 2 + 6 * ev.l1_sensitivity)
                                 / (4 * ev.variance ** 2), 3 * ev.l1_sensitivity / (2 * ev.variance)))
    return float(np.min(r + np.log1p(-1 / a) - np.log(delta * a) / (a - 1)))


def zcdp_relaxation_epsilon(ev: SkellamEvent, delta: float) -> float:
    """The linear relaxation rho alpha + xi of the bound over real orders (what a zCDP charge would print)."""
    mu, d2, d1 = ev.variance, ev.l2_sensitivity, ev.l1_sensitivity
    rho = d2 * d2 / (2 * mu) * (1 + 1 / mu)
    acc = rdp.RdpAccountant(neighboring_relation=ADD_REMOVE)
    acc.compose(dp_accounting.ZCDpEvent(rho, rho + max(0.0, (6 * d1 - d2 * d2) / (4 * mu * mu))), ev.steps)
    return float(acc.get_epsilon(delta))


@pytest.mark.parametrize("sigma_over_d2", [3.0, 6.8, 12.0, 25.0, 60.0, 120.0])
def test_printed_epsilon_is_the_bound_within_one_percent_and_below_the_relaxation(sigma_over_d2):
    # ten releases at the demo's sensitivities (C_c scale + sqrt d with scale 2^17, d = 12,810): eps 0.05 to 4
    d2 = 131072.0 + math.sqrt(12810)
    ev = SkellamEvent(variance=(sigma_over_d2 * d2) ** 2, l2_sensitivity=d2, l1_sensitivity=math.sqrt(12810) * d2,
                      steps=10)
    printed = epsilon_spent([ev], target_delta=DELTA)
    bound = bound_epsilon(ev, DELTA)
    assert bound * (1 - 1e-12) <= printed <= 1.01 * bound
    assert printed < zcdp_relaxation_epsilon(ev, DELTA)


def test_the_pld_accountant_refuses_skellam_events_rather_than_skip_them():
    ev = SkellamEvent(variance=4.0e6, l2_sensitivity=900.0, l1_sensitivity=1e5, steps=2)
    with pytest.raises(dp_accounting.UnsupportedEventError):
        epsilon_spent([ev], target_delta=DELTA, accountant="pld")
    assert not make_accountant("pld").supports(ev.to_dp_event())


def test_a_stored_skellam_row_still_composes_with_dp_sgd_rows():
    # the JSON a ledger row holds for a distributed round (its format is what was released, not how it is charged)
    row = '{"type": "skellam", "variance": 4.0e6, "l2_sensitivity": 900.0, "l1_sensitivity": 101700.0, "steps": 1}'
    stored = parse_event(json.loads(row))
    history = [stored, stored, DPSGDEvent(1.1, 0.02, 10), stored]
    running = RunningComposition(target_delta=DELTA)
    for ev in history:
        running.compose([ev])
    # reference: dp-accounting's RDP accountant for the DP-SGD steps, Thm 3.5 by hand for the three releases
    acc = rdp.RdpAccountant(neighboring_relation=ADD_REMOVE)
    acc.compose(DPSGDEvent(1.1, 0.02, 10).to_dp_event())
    a = np.ceil(acc.orders)
    thm = a * 900.0 ** 2 / 8.0e6 + np.minimum(((2 * a - 1) * 900.0 ** 2 + 6 * 101700.0) / (4 * 4.0e6 ** 2),
                                               3 * 101700.0 / 8.0e6)
    want = rdp.rdp_privacy_accountant.compute_epsilon(acc.orders, acc.rdp + 3 * thm, DELTA)[0]
    assert running.epsilon() == pytest.approx(want, rel=1e-12)
    assert epsilon_spent(history, target_delta=DELTA) == pytest.approx(want, rel=1e-12)
