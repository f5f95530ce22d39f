"""COMPARISON-ONLY formulas shown beside the real accountant in ``wildfed-coordinator budget``.

Nothing in this module is used to calibrate noise, to decide a halt, to record spend, or to claim a privacy
guarantee. WildFed's guarantees come only from dp-accounting (``shared.privacy.accounting``: RDP or PLD composition
of the DP events the ledger holds). These two closed forms are printed next to those numbers so an operator can see
how far the textbook and the seed's formulas are from the accountant:

- :func:`textbook_gaussian_noise_multiplier`: the classical Gaussian-mechanism calibration
  ``sigma / C = sqrt(2 ln(1.25/delta)) / eps`` (Dwork & Roth 2014, Thm A.1). It is a statement about ONE release of
  ONE Gaussian mechanism, and its proof holds only for ``eps < 1``; for ``eps >= 1`` the number it gives is not a
  valid calibration at all (:func:`textbook_formula_valid` says so and the report labels it ``invalid (eps >= 1)``).
  It knows nothing of subsampling or of composition over rounds and steps.
- :func:`seed_advanced_composition_epsilon`: the DP budget seed's bound ``eps <= q sqrt(2 T ln(1/delta)) / z``
  for ``T`` steps of the Poisson-subsampled Gaussian mechanism with rate ``q`` and noise multiplier ``z = sigma/C``.
  It is the asymptotic shape of Abadi et al. (2016) Thm 1 with the unspecified constant set to 1, i.e. a loose,
  heuristic form: it is NOT a guarantee and can come out below the true (RDP/PLD) epsilon as well as above it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from shared.privacy.events import DPSGDEvent

__all__ = ["textbook_gaussian_noise_multiplier", "textbook_formula_valid", "seed_advanced_composition_epsilon"]


def _check(epsilon: float | None, delta: float) -> None:
    if epsilon is not None and not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be positive and finite, got {epsilon!r}")
    if not (0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")


def textbook_formula_valid(epsilon: float) -> bool:
    """Whether the textbook Gaussian calibration's proof covers ``epsilon`` (it requires ``epsilon < 1``)."""
    return epsilon < 1


def textbook_gaussian_noise_multiplier(epsilon: float, delta: float) -> float:
    """COMPARISON ONLY, never used to calibrate noise or to claim a guarantee:
    the textbook ``sigma / C = sqrt(2 ln(1.25 / delta)) / epsilon`` for a single Gaussian release.

    Valid only for ``epsilon < 1`` and one release (see :func:`textbook_formula_valid`); the value is returned for
    any positive epsilon so that the report can print it labelled as invalid. WildFed calibrates every noise
    multiplier with dp-accounting (``shared.privacy.accounting.calibrate_noise_multiplier``).

    Raises:
        ValueError: epsilon not positive and finite, or delta not in (0, 1).
    """
    _check(epsilon, delta)
    return math.sqrt(2.0 * math.log(1.25 / delta)) / epsilon


def seed_advanced_composition_epsilon(events: Iterable[DPSGDEvent], delta: float) -> float:
    """COMPARISON ONLY, never used to record spend, halt, or claim a guarantee: the DP budget seed's loose bound
    ``eps = q sqrt(2 T ln(1/delta)) / z`` for the composed events.

    For events with different ``(q, z)`` the natural generalisation ``sqrt(2 ln(1/delta) * sum_i T_i (q_i/z_i)^2)``
    is used (it equals the seed's formula when every event has the same ``q`` and ``z``). Returns 0.0 for no steps.

    Raises:
        ValueError: delta not in (0, 1).
    """
    _check(None, delta)
    s = sum(e.steps * (e.sampling_rate / e.noise_multiplier) ** 2 for e in events)
    return math.sqrt(2.0 * math.log(1.0 / delta) * s) if s > 0 else 0.0
