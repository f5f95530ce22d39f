"""The comparison-only formulas (shared.privacy.comparison): their values, their validity labels, how they sit
against dp-accounting, and that nothing but the budget report uses them."""

from __future__ import annotations

import math
import pathlib
import re

import dp_accounting
import pytest
from dp_accounting import rdp

from shared.privacy.accounting import calibrate_noise_multiplier
from shared.privacy.comparison import (
    seed_advanced_composition_epsilon,
    textbook_formula_valid,
    textbook_gaussian_noise_multiplier,
)
from shared.privacy.events import DPSGDEvent

DELTA = 1e-5
ROOT = pathlib.Path(__file__).resolve().parents[2]


def rdp_epsilon(z: float, q: float, steps: int) -> float:
    acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps))
    return acc.get_epsilon(DELTA)


@pytest.mark.parametrize("eps", [0.1, 0.5, 0.99, 1.0, 2.0])
def test_textbook_value_and_validity(eps):
    assert textbook_gaussian_noise_multiplier(eps, DELTA) == pytest.approx(
        math.sqrt(2 * math.log(1.25 / DELTA)) / eps, rel=1e-12)
    assert textbook_formula_valid(eps) is (eps < 1)


@pytest.mark.parametrize("eps", [0.3, 0.5, 0.9])
def test_textbook_is_conservative_for_one_release_below_one(eps):
    # Where the textbook formula holds (one release, eps < 1), the accountant's calibration needs no more noise.
    z_acc = calibrate_noise_multiplier(target_epsilon=eps, target_delta=DELTA, sampling_rate=1.0, steps=1)
    assert z_acc <= textbook_gaussian_noise_multiplier(eps, DELTA)


def test_seed_bound_matches_its_formula_and_generalises_to_mixed_events():
    z, q, t = 1.3, 0.05, 160
    assert seed_advanced_composition_epsilon([DPSGDEvent(z, q, t)], DELTA) == pytest.approx(
        q * math.sqrt(2 * t * math.log(1 / DELTA)) / z, rel=1e-12)
    # splitting the same steps over several events changes nothing
    assert seed_advanced_composition_epsilon([DPSGDEvent(z, q, 60), DPSGDEvent(z, q, 100)], DELTA) == pytest.approx(
        seed_advanced_composition_epsilon([DPSGDEvent(z, q, t)], DELTA), rel=1e-12)
    mixed = [DPSGDEvent(1.1, 0.02, 10), DPSGDEvent(2.0, 0.05, 30)]
    want = math.sqrt(2 * math.log(1 / DELTA) * (10 * (0.02 / 1.1) ** 2 + 30 * (0.05 / 2.0) ** 2))
    assert seed_advanced_composition_epsilon(mixed, DELTA) == pytest.approx(want, rel=1e-12)
    assert seed_advanced_composition_epsilon([], DELTA) == 0.0
    assert seed_advanced_composition_epsilon([DPSGDEvent(1.0, 0.1, 0)], DELTA) == 0.0


def test_seed_bound_is_not_a_guarantee():
    # Measured, not assumed: the seed's formula (Abadi et al. Thm 1 without its constant) falls BELOW the RDP
    # epsilon for some realistic settings, so it can never be used to claim a guarantee; elsewhere it is above.
    below = (1.3, 0.05, 160)
    above = (7.2, 0.05, 80)
    for (z, q, t), sign in ((below, -1), (above, +1)):
        seed = seed_advanced_composition_epsilon([DPSGDEvent(z, q, t)], DELTA)
        assert sign * (seed - rdp_epsilon(z, q, t)) > 0


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_bad_inputs_raise(bad):
    with pytest.raises(ValueError):
        textbook_gaussian_noise_multiplier(bad, DELTA)
    with pytest.raises(ValueError):
        textbook_gaussian_noise_multiplier(1.0, 1.5)
    with pytest.raises(ValueError):
        seed_advanced_composition_epsilon([], 0.0)


def test_only_the_budget_report_uses_the_comparison_formulas():
    users = []
    for path in list((ROOT / "coordinator").rglob("*.py")) + list((ROOT / "edge_sdk").rglob("*.py")) + \
            list((ROOT / "shared").rglob("*.py")):
        if re.search(r"privacy\.comparison|privacy import comparison", path.read_text(encoding="utf-8")):
            users.append(path.relative_to(ROOT).as_posix())
    assert users == ["coordinator/reports.py"]
