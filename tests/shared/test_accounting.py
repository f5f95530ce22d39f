"""Accounting: our wrapper against a direct dp-accounting composition; calibration stays inside the budget."""

import dp_accounting
import pytest
from dp_accounting import rdp

from shared.errors import ConfigError, PayloadError
from shared.privacy.accounting import calibrate_noise_multiplier, epsilon_spent
from shared.privacy.events import DPSGDEvent


def direct_rdp_epsilon(z, q, steps, delta):
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for _ in range(steps):
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
    return acc.get_epsilon(delta)


def direct_rdp_epsilon_composed(z, q, steps, delta):
    """dp-accounting directly, the event composed ``steps`` times in one call (RDP adds over steps: the same
    number as :func:`direct_rdp_epsilon`, which the test below checks, without recomputing the RDP per step)."""
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return acc.get_epsilon(delta)


def test_epsilon_equals_direct_step_by_step_composition():
    events = [DPSGDEvent(1.1, 0.05, 10), DPSGDEvent(1.1, 0.05, 15)]
    step_by_step = direct_rdp_epsilon(1.1, 0.05, 25, 1e-5)
    assert epsilon_spent(events, target_delta=1e-5) == pytest.approx(step_by_step, rel=1e-9)
    assert direct_rdp_epsilon_composed(1.1, 0.05, 25, 1e-5) == pytest.approx(step_by_step, rel=1e-12)


def test_full_batch_gaussian_matches_closed_form_rdp():
    # q = 1, one step: RDP of the Gaussian mechanism is alpha / (2 z^2) (Mironov 2017, Prop. 7); the conversion
    # used by dp-accounting is at least as tight as eps = min_alpha rdp + log(1/delta)/(alpha-1).
    z, delta = 2.0, 1e-5
    eps = epsilon_spent([DPSGDEvent(z, 1.0, 1)], target_delta=delta)
    import math
    classic = min(a / (2 * z * z) + math.log(1 / delta) / (a - 1) for a in [1 + i / 100 for i in range(1, 20000)])
    assert 0 < eps <= classic + 1e-9
    assert eps > 0.5 * classic


def test_no_events_is_zero():
    assert epsilon_spent([], target_delta=1e-5) == 0.0
    assert epsilon_spent([DPSGDEvent(1.0, 0.1, 0)], target_delta=1e-5) == 0.0


@pytest.mark.parametrize("eps,q,steps", [(0.33, 0.1, 50), (1.0, 0.02, 200), (4.0, 1.0, 10)])
def test_calibration_is_tight_and_inside_budget(eps, q, steps):
    z = calibrate_noise_multiplier(target_epsilon=eps, target_delta=1e-5, sampling_rate=q, steps=steps)
    spent = direct_rdp_epsilon_composed(z, q, steps, 1e-5)
    assert spent <= eps
    assert spent >= 0.99 * eps  # tight: not a wasteful over-estimate of the noise
    assert direct_rdp_epsilon_composed(z * 0.99, q, steps, 1e-5) > eps


def test_bad_inputs():
    with pytest.raises(ConfigError, match="target_epsilon"):
        calibrate_noise_multiplier(target_epsilon=0, target_delta=1e-5, sampling_rate=0.1, steps=1)
    with pytest.raises(ConfigError, match="target_delta"):
        epsilon_spent([], target_delta=1.5)
    with pytest.raises(PayloadError):
        DPSGDEvent(0.0, 0.1, 1)
    with pytest.raises(PayloadError):
        DPSGDEvent.from_json({"type": "laplace", "scale": 1})


def test_event_json_round_trip():
    e = DPSGDEvent(1.25, 0.125, 40)
    assert DPSGDEvent.from_json(e.to_json()) == e
