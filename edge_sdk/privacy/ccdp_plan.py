"""A site's CCDP plan and its calibration: per IUCN category a Poisson sampling rate q_c and a clipping norm C_c
with one noise standard deviation sigma (:class:`CCDPPlan`), calibrated from public values by the accountant
(:func:`plan_ccdp`), memoised in the process and kept in a
:class:`~shared.privacy.calibration_cache.CalibrationCache` on disk.

The mechanism that runs a plan, and why the plan's events are the privacy of what each category's records go
through, are in :mod:`edge_sdk.privacy.ccdp` (its docstring's "Calibration" describes the searches done here:
Boenisch et al. 2023, Sec. 4.1-4.2).
"""
from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from shared.errors import ConfigError, PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.privacy import accounting, events, individualized
from shared.privacy.accounting import AccountantName, calibrated_noise_multiplier, epsilon_spent
from shared.privacy.calibration_cache import CalibrationCache, environment
from shared.privacy.events import DPSGDEvent
from shared.privacy.individualized import anchor_category, anchor_noise_multiplier, individual_sampling_rates
from shared.protocol import CCDP_VARIANTS

__all__ = ["CCDPPlan", "plan_ccdp", "calibration_inputs", "calibration_environment", "CALIBRATION_KIND", "rank_table"]

#: one slot per IUCN rank in the lookup tables (:func:`rank_table`)
_NUM_RANKS = max(c.rank for c in IUCNCategory) + 1

def rank_table(values: Mapping[IUCNCategory, float], default: float = 0.0) -> np.ndarray:
    """float64 (ranks,) lookup table indexed by IUCN rank: ``values[c]`` at ``c.rank``, ``default`` elsewhere."""
    table = np.full(_NUM_RANKS, float(default), dtype=np.float64)
    for c, v in values.items():
        table[c.rank] = float(v)
    return table


@dataclass(frozen=True)
class CCDPPlan:
    """What one site runs for its active categories (see the module docstring): per category c a Poisson sampling
    rate q_c and a clipping norm C_c, and one Gaussian noise draw of standard deviation sigma per step.

    Attributes:
        variant: ``"sample"`` (per-category q_c, one C) or ``"scale"`` (one q, per-category C_c).
        noise_std: sigma, the standard deviation per coordinate of the one draw (units of the clipped sum).
        sampling_rates: ``{category: q_c}`` in (0, 1] for exactly the active categories.
        clipping_norms: ``{category: C_c}`` > 0 (L2) for the same categories.
        anchor: the species table's category with the largest budget (sampled at the base rate with the task's C
            while it is active; it may be halted).

    Raises:
        PrivacyBudgetError: no active category.
        ValueError: mismatched categories, a rate outside (0, 1], a norm or sigma not positive, unknown variant.
    """

    variant: str
    noise_std: float
    sampling_rates: Mapping[IUCNCategory, float]
    clipping_norms: Mapping[IUCNCategory, float]
    anchor: IUCNCategory

    def __post_init__(self) -> None:
        if not self.sampling_rates:
            raise PrivacyBudgetError("no active IUCN category: every category is halted, the site stops training")
        if self.variant not in CCDP_VARIANTS:
            raise ValueError(f"variant must be one of {CCDP_VARIANTS}, got {self.variant!r}")
        if set(self.sampling_rates) != set(self.clipping_norms):
            raise ValueError("sampling_rates and clipping_norms must name the same active categories")
        if not self.noise_std > 0:
            raise ValueError(f"noise_std must be > 0, got {self.noise_std}")
        for c in self.sampling_rates:
            if not 0 < self.sampling_rates[c] <= 1:
                raise ValueError(f"sampling rate of {c.value} must be in (0, 1], got {self.sampling_rates[c]}")
            if not self.clipping_norms[c] > 0:
                raise ValueError(f"clipping norm of {c.value} must be > 0, got {self.clipping_norms[c]}")

    @property
    def categories(self) -> tuple[IUCNCategory, ...]:
        """Active categories in IUCN rank order."""
        return tuple(sorted(self.sampling_rates, key=lambda c: c.rank))

    def noise_multiplier(self, category: IUCNCategory) -> float:
        """``sigma / C_c``: the noise multiplier category c's records see (the same for every category under
        Sample)."""
        return float(self.noise_std / self.clipping_norms[category])

    def noise_multipliers(self) -> dict[IUCNCategory, float]:
        """``{category: sigma / C_c}`` in rank order."""
        return {c: self.noise_multiplier(c) for c in self.categories}

    def events(self, steps: int) -> dict[IUCNCategory, DPSGDEvent]:
        """The DP events of ``steps`` steps: ``DPSGDEvent(sigma / C_c, q_c, steps)`` per active category, the
        mechanism its records went through (module docstring, "Formal guarantee")."""
        return {c: DPSGDEvent(self.noise_multiplier(c), float(self.sampling_rates[c]), int(steps))
                for c in self.categories}

    def relative_weights(self) -> dict[IUCNCategory, float]:
        """``{c: (q_c / q_max) (C_c / C_max)}``: the expected weight of a (clipped) record of category c in a step,
        relative to the anchor's (1.0 for the anchor; under "sample" the rate ratio, under "scale" the norm
        ratio). Public: a function of the plan alone."""
        q_max, c_max = max(self.sampling_rates.values()), max(self.clipping_norms.values())
        return {c: float(self.sampling_rates[c] / q_max * self.clipping_norms[c] / c_max) for c in self.categories}

    def inclusion_rates(self, categories: np.ndarray) -> np.ndarray:
        """float64 (N,) Poisson inclusion probability of each record (q_c of its category, 0 for a record of a
        category that is not active), from int (N,) IUCN ranks."""
        ranks = np.asarray(categories).astype(np.int64)
        ok = (ranks >= 0) & (ranks < _NUM_RANKS)
        out = np.zeros(ranks.shape, dtype=np.float64)
        out[ok] = rank_table(self.sampling_rates)[ranks[ok]]
        return out


def plan_ccdp(
    *,
    variant: str,
    budgets: Mapping[IUCNCategory, float],
    active: Iterable[IUCNCategory],
    target_delta: float,
    sampling_rate: float,
    steps: int,
    clipping_norm: float,
    fixed_events: tuple[DPSGDEvent, ...] = (),
    accountant: AccountantName = "rdp",
    site_categories: Iterable[IUCNCategory] | None = None,
    cache: CalibrationCache | None = None,
) -> CCDPPlan:
    """Calibrate a site's :class:`CCDPPlan` from public values, with the real accountant (module docstring,
    "Calibration"; Boenisch et al. 2023, Sec. 4.1-4.2).

    Args:
        variant: ``"sample"`` or ``"scale"``.
        budgets: total epsilon per category (whole federation, per record).
        active: the site's active categories (species table minus halted).
        target_delta: delta of every guarantee.
        sampling_rate: the base rate q = min(1, B / N_site).
        steps: DP-SGD steps planned for the whole federation (``planned_rounds * local_steps``): running them all
            spends at most each category's budget.
        clipping_norm: C, the anchor's clipping norm (the task's).
        fixed_events: other releases about every record whose noise is already set (NIRA's noisy counts over the
            planned rounds): each category's steps are calibrated so that they and those releases stay within its
            budget.
        site_categories: the site's species table (halted categories included), from which the anchor is chosen
            (default: ``active``). Choosing it from the table keeps z the same when a category halts, so every
            round of the federation runs at one z and each category's rate stays what its budget was planned for.
        cache: a persistent :class:`~shared.privacy.calibration_cache.CalibrationCache` (None: memoised in this
            process only). The accountant's outputs (z, and per category q_c or z_c) are stored under
            :func:`calibration_inputs`; a cached entry is used only after every active category's event has been
            re-checked within its budget by one accountant evaluation, and the plan is derived from it by the same
            arithmetic as from a fresh calibration, so it is bit-identical.

    Raises:
        PrivacyBudgetError: no active category, or an active category without a budget.
        ConfigError: unknown variant; a budget, delta, q or steps out of range, or the fixed releases alone
            exceed a budget (field ``count_noise_multiplier``; from ``shared.privacy.accounting``).
    """
    if variant not in CCDP_VARIANTS:
        raise ConfigError(f"unknown CCDP variant {variant!r}", field="ccdp_variant",
                          fix=f"use one of {', '.join(CCDP_VARIANTS)}")
    # every round of a federation asks for the same plan (the values are public and fixed for the run): calibrate
    # once per process (and, with a cache, once per machine); the arguments are normalised to hashable values and
    # the plan is immutable
    plan = _plan_ccdp_cached(
        variant, _budget_items(budgets), _ranked(active), float(target_delta), float(sampling_rate), int(steps),
        float(clipping_norm), tuple(fixed_events), accountant,
        None if site_categories is None else _ranked(site_categories), cache)
    # the cached plan is shared: hand out copies of its tables so no caller can change another's plan
    return replace(plan, sampling_rates=dict(plan.sampling_rates), clipping_norms=dict(plan.clipping_norms))


#: The ``kind`` of CCDP calibrations in a :class:`~shared.privacy.calibration_cache.CalibrationCache`.
CALIBRATION_KIND = "ccdp-plan"


def _ranked(categories: Iterable[IUCNCategory]) -> tuple[IUCNCategory, ...]:
    return tuple(sorted(set(categories), key=lambda c: c.rank))


def _budget_items(budgets: Mapping[IUCNCategory, float]) -> tuple[tuple[IUCNCategory, float], ...]:
    return tuple(sorted(((c, float(e)) for c, e in budgets.items()), key=lambda t: t[0].rank))


def _anchor_of(budgets: Mapping[IUCNCategory, float], cats: tuple[IUCNCategory, ...],
               site_categories: tuple[IUCNCategory, ...] | None) -> IUCNCategory:
    anchor_category(budgets, cats)  # raises for no active category or an active category without a budget
    table = {c for c in (site_categories if site_categories is not None else cats) if c in budgets} | set(cats)
    return anchor_category(budgets, table)  # the largest budget of the species table


def _inputs(variant: str, budget_items: tuple[tuple[IUCNCategory, float], ...], cats: tuple[IUCNCategory, ...],
            anchor: IUCNCategory, target_delta: float, sampling_rate: float, steps: int,
            fixed_events: tuple[DPSGDEvent, ...], accountant: str) -> dict[str, Any]:
    return {"variant": variant, "budgets": [[c.value, e] for c, e in budget_items],
            "active": [c.value for c in cats], "anchor": anchor.value, "target_delta": target_delta,
            "sampling_rate": sampling_rate, "steps": steps,
            "fixed_events": [[float(e.noise_multiplier), float(e.sampling_rate), int(e.steps)] for e in fixed_events],
            "accountant": accountant}


def calibration_inputs(
    *,
    variant: str,
    budgets: Mapping[IUCNCategory, float],
    active: Iterable[IUCNCategory],
    target_delta: float,
    sampling_rate: float,
    steps: int,
    fixed_events: tuple[DPSGDEvent, ...] = (),
    accountant: AccountantName = "rdp",
    site_categories: Iterable[IUCNCategory] | None = None,
) -> dict[str, Any]:
    """The JSON-ready public inputs of :func:`plan_ccdp`'s calibration, as its cache keys them (with
    :data:`CALIBRATION_KIND` and :func:`calibration_environment`).

    Every value the accountant's search reads is here: the variant, all budgets, the active categories, the anchor,
    delta, q, the planned steps, the fixed releases and the accountant. ``site_categories`` enters through the
    anchor it picks (the only thing the calibration takes from it); the clipping norm C does not enter at all (the
    accountant works with noise multipliers; C only scales the plan afterwards: ``sigma = z C``, ``C_c = sigma /
    z_c``), so one entry serves every C.

    Raises:
        PrivacyBudgetError: no active category, or an active category without a budget.
    """
    items, cats = _budget_items(budgets), _ranked(active)
    sites = None if site_categories is None else _ranked(site_categories)
    return _inputs(variant, items, cats, _anchor_of(dict(items), cats, sites), float(target_delta),
                   float(sampling_rate), int(steps), tuple(fixed_events), accountant)


def calibration_environment() -> dict[str, str]:
    """Library versions and the source digest of the modules that calibrate a plan
    (:func:`shared.privacy.calibration_cache.environment`)."""
    return environment(accounting, individualized, events, sys.modules[__name__])


@dataclass(frozen=True)
class _Calibration:
    """What the accountant decides for a plan: the anchor's noise multiplier z, and per active category (rank
    order) its sampling rate q_c ("sample") or its own noise multiplier z_c ("scale")."""

    noise_multiplier: float
    per_category: tuple[tuple[IUCNCategory, float], ...]

    def to_json(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier,
                "per_category": {c.value: v for c, v in self.per_category}}


def _calibrate(variant: str, budgets: Mapping[IUCNCategory, float], cats: tuple[IUCNCategory, ...],
               anchor: IUCNCategory, delta: float, q: float, steps: int, fixed: tuple[DPSGDEvent, ...],
               accountant: AccountantName) -> _Calibration:
    """The accountant's searches (seconds): z for the anchor, then q_c or z_c per active category."""
    z = anchor_noise_multiplier(budgets=budgets, categories=(anchor,), target_delta=delta, max_rate=q,
                                steps=steps, fixed_events=fixed, accountant=accountant)
    if variant == "sample":
        per = individual_sampling_rates(noise_multiplier=z, budgets=budgets, categories=cats, target_delta=delta,
                                        max_rate=q, steps=steps, fixed_events=fixed, accountant=accountant)
        if anchor in per:
            per[anchor] = q
    else:
        per = {c: z if c == anchor else calibrated_noise_multiplier(float(budgets[c]), delta, q, steps, accountant,
                                                                     fixed)
               for c in cats}
    return _Calibration(noise_multiplier=z, per_category=tuple((c, per[c]) for c in cats))


def _decoder(variant: str, cats: tuple[IUCNCategory, ...], q: float) -> Callable[[Any], _Calibration]:
    def decode(data: Any) -> _Calibration:
        z, per = data["noise_multiplier"], data["per_category"]
        if type(z) is not float or not 0 < z < math.inf:
            raise ValueError(f"noise multiplier {z!r} is not a positive finite float")
        if not isinstance(per, dict) or set(per) != {c.value for c in cats}:
            raise ValueError("its categories are not the active ones")
        for c in cats:
            v = per[c.value]
            if type(v) is not float or not 0 < v < math.inf or (variant == "sample" and v > q):
                raise ValueError(f"{c.value}: {v!r} is out of range")
        return _Calibration(noise_multiplier=z, per_category=tuple((c, per[c.value]) for c in cats))
    return decode


def _verifier(variant: str, budgets: Mapping[IUCNCategory, float], delta: float, q: float, steps: int,
              fixed: tuple[DPSGDEvent, ...], accountant: AccountantName) -> Callable[[_Calibration], bool]:
    def verify(cal: _Calibration) -> bool:  # one accountant evaluation per category: each stays within its budget
        for c, v in cal.per_category:
            z_c, q_c = (cal.noise_multiplier, v) if variant == "sample" else (max(v, cal.noise_multiplier), q)
            if epsilon_spent([DPSGDEvent(z_c, q_c, steps), *fixed], target_delta=delta,
                             accountant=accountant) > float(budgets[c]):
                return False
        return True
    return verify


@lru_cache(maxsize=256)
def _plan_ccdp_cached(variant: str, budget_items: tuple[tuple[IUCNCategory, float], ...],
                      cats: tuple[IUCNCategory, ...], target_delta: float, sampling_rate: float, steps: int,
                      clipping_norm: float, fixed_events: tuple[DPSGDEvent, ...], accountant: AccountantName,
                      site_categories: tuple[IUCNCategory, ...] | None,
                      cache: CalibrationCache | None) -> CCDPPlan:
    """:func:`plan_ccdp` on normalised arguments (memoised: calibration costs seconds, a lookup nothing)."""
    budgets = dict(budget_items)
    anchor = _anchor_of(budgets, cats, site_categories)
    q, delta, fixed, steps = float(sampling_rate), float(target_delta), tuple(fixed_events), int(steps)

    def compute() -> _Calibration:
        return _calibrate(variant, budgets, cats, anchor, delta, q, steps, fixed, accountant)

    if cache is None:
        cal = compute()
    else:
        cal = cache.get_or_compute(
            CALIBRATION_KIND, _inputs(variant, budget_items, cats, anchor, delta, q, steps, fixed, accountant),
            calibration_environment(), compute=compute, encode=_Calibration.to_json,
            decode=_decoder(variant, cats, q), verify=_verifier(variant, budgets, delta, q, steps, fixed, accountant))
    # the plan is arithmetic on the calibration (the same for a fresh and a cached one: bit-identical plans)
    z = cal.noise_multiplier
    sigma = z * float(clipping_norm)
    if variant == "sample":
        rates = dict(cal.per_category)
        norms = {c: float(clipping_norm) for c in cats}
    else:
        rates = {c: q for c in cats}
        # never above C: a smaller budget never earns a larger norm
        norms = {c: sigma / max(z_c, z) for c, z_c in cal.per_category}
    return CCDPPlan(variant=variant, noise_std=sigma, sampling_rates=rates, clipping_norms=norms, anchor=anchor)
