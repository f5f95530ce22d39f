"""CCDP: conservation-calibrated DP-SGD as individualized DP-SGD (written once, backend-agnostic).

Each IUCN category c has its own budget eps_c (``shared.iucn``). CCDP meets every budget exactly with ONE Gaussian
draw per step, as individualized DP-SGD does (Boenisch, Mühl, Dziedzic, Rinberg and Papernot, "Have it your way:
individualized privacy assignment for DP-SGD", NeurIPS 2023, Sec. 4; docs/privacy.md). Two
variants, both behind :class:`CCDPMechanism`:

- **Sample** (the paper's Sec. 4.1): one noise multiplier z and one clipping norm C for every record; the records
  of category c are Poisson-sampled at their own rate q_c. Category c's records go through
  ``PoissonSampled(q_c, Gaussian(z))`` per step.
- **Scale** (Sec. 4.2): one sampling rate q and one noise standard deviation sigma for every record; the records of
  category c are clipped at their own norm ``C_c = sigma / z_c``. Category c's records go through
  ``PoissonSampled(q, Gaussian(z_c))`` per step (a record's sensitivity is C_c, the noise sigma = z_c C_c).

One step, for per-example gradients g_i (B, d) of the batch (Abadi et al. 2016, Alg. 1, with per-record rates
and clipping norms)::

    sample:  record i joins the batch with probability q_{cat(i)}         (independently, every step)
    clip:    g_i <- g_i * min(1, C_{cat(i)} / ||g_i||_2)
    noise:   g~  = (sum_{i in batch} g_i + N(0, sigma^2 I_d)) / (q N_site)

Formal guarantee (per record, add/remove-one): adding or removing one record x of category c changes the clipped
sum by at most C_c in L2 norm, and x is in the batch with probability q_c independently of every other record, so
each step is, for x, the Poisson-subsampled Gaussian mechanism with rate q_c and noise multiplier sigma / C_c; over
the steps run this is the :class:`shared.privacy.events.DPSGDEvent` ``(sigma / C_c, q_c, steps)`` that
:meth:`CCDPPlan.events` reports for category c (the individualized analysis of the paper's Thm 4.1 and 4.2:
the privacy loss of a record depends only on its own rate and sensitivity). The ledger records exactly that event,
so the epsilon it prints for category c is the epsilon of what category c's records went through.

Calibration (:func:`plan_ccdp`, with dp-accounting; the gateway uses only public values: the budgets, the site's
species table, the halted list, B and N_site):

- the *anchor* is the category of the site's species table with the largest budget (halted or not, so z does not
  change when a category halts); it is sampled at the base rate q = min(1, B/N_site) with clipping norm C (the
  task's), and z is calibrated so that it spends exactly its budget over the planned steps;
- Sample: for every other active category, q_c = the largest rate <= q at which ``PoissonSampled(q_c,
  Gaussian(z))`` over the planned steps spends eps_c (``shared.privacy.accounting.calibrate_sampling_rate``);
- Scale: for every other active category, z_c is calibrated at rate q for eps_c and ``C_c = z C / z_c``.

The searches take seconds and their answer is the same every round of a federation (and at every restart of the
gateway): it is memoised in the process and, given a
:class:`~shared.privacy.calibration_cache.CalibrationCache`, kept on disk as JSON keyed by
:func:`calibration_inputs` and the library versions and calibration code (:func:`calibration_environment`). A cached
z and q_c / z_c are used only after each active category's event has been re-checked within its budget by one
accountant evaluation; the plan is then the same arithmetic on them as on fresh ones, so it is bit-identical.

Normaliser. The step is divided by q N_site, the expected batch size of the anchor's rate over all the site's
records: a public number. The paper normalises by the expected batch size ``sum_c q_c N_c``, which is a function of
the site's per-category record counts; those are private (one record of category c changes N_c), so dividing by it
would release a function of the data that no noise covers. With Scale the two agree; with Sample the step is
smaller by the factor ``sum_c q_c N_c / (q N_site)``, which the learning rate absorbs (docs/privacy.md).

Active categories are the categories of the site's species table that the ledger has not halted: decided by
configuration, never by which records a batch holds. Noise is drawn and added in float64 and the result is cast to
float32 once (the backends' parameter dtype).

=====================================  ===================================================
batch empty                            output is pure noise / (q N_site); still a step
record of a non-active category        :class:`PrivacyBudgetError` (sampling must exclude it)
all categories halted                  :class:`PrivacyBudgetError` (the site stops training)
=====================================  ===================================================
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Literal

import numpy as np

from shared.errors import ConfigError, PrivacyBudgetError
from shared.iucn import IUCNCategory
from shared.privacy import accounting, events, individualized
from shared.privacy.accounting import AccountantName, calibrated_noise_multiplier, epsilon_spent
from shared.privacy.calibration_cache import CalibrationCache, environment
from shared.privacy.events import DPSGDEvent
from shared.privacy.individualized import anchor_category, anchor_noise_multiplier, individual_sampling_rates
from shared.protocol import CCDP_VARIANTS

from edge_sdk.privacy.per_example import MaterialisedGradients, PerExampleGradients
from edge_sdk.privacy.randomness import RandomSource

__all__ = [
    "CCDPVariant",
    "CCDP_VARIANTS",
    "clip_factors",
    "clip_factors_from_norms",
    "clip_per_example",
    "CCDPPlan",
    "CCDPMechanism",
    "active_categories",
    "plan_ccdp",
    "calibration_inputs",
    "calibration_environment",
    "CALIBRATION_KIND",
    "rank_table",
]

CCDPVariant = Literal["sample", "scale"]

# Clipping scales by C/||g|| times this, so float32 rounding (of the gradient or of a norm computed without
# materialising it) cannot push a clipped norm above C.
_CLIP_SAFETY = 1.0 - 1e-5
_NUM_RANKS = max(c.rank for c in IUCNCategory) + 1


def clip_factors_from_norms(norms: np.ndarray, clipping_norm: float | np.ndarray) -> np.ndarray:
    """Per-example scale factors ``min(1, C_i / ||g_i||_2)`` (Abadi et al. 2016, Alg. 1, "clip gradient").

    Args:
        norms: float (B,), L2 norms of the per-example gradients.
        clipping_norm: C > 0 (L2), one for every example, or float (B,) one per example (individualized clipping,
            the "Scale" variant).

    Returns:
        float32 (B,), in (0, 1]. When clipping is active the factor is shrunk by a relative 1e-5 so that float32
        rounding cannot push a clipped norm above C_i.

    Raises:
        ValueError: a clipping norm not positive, or a per-example array of the wrong shape.
    """
    norms = np.asarray(norms, dtype=np.float64)
    bound = np.asarray(clipping_norm, dtype=np.float64)
    if bound.ndim == 0:
        if not bound > 0:
            raise ValueError(f"clipping_norm must be > 0, got {clipping_norm}")
        bound = np.full(norms.shape, float(bound))
    elif bound.shape != norms.shape:
        raise ValueError(f"expected clipping norms {norms.shape}, got {bound.shape}")
    elif not np.all(bound > 0):
        raise ValueError("every clipping norm must be > 0")
    factors = np.ones_like(norms)
    over = norms > bound
    factors[over] = (bound[over] / norms[over]) * _CLIP_SAFETY
    return factors.astype(np.float32)


def clip_factors(per_example_grads: np.ndarray, clipping_norm: float) -> np.ndarray:
    """:func:`clip_factors_from_norms` of the rows of a float (B, d) array (norms computed in float64)."""
    return clip_factors_from_norms(MaterialisedGradients(per_example_grads).norms, clipping_norm)


def clip_per_example(per_example_grads: np.ndarray, clipping_norm: float) -> np.ndarray:
    """Clipped per-example gradients, float32 (B, d), each with L2 norm <= C (see :func:`clip_factors`)."""
    grads = np.asarray(per_example_grads, dtype=np.float32)
    return grads * clip_factors(grads, clipping_norm)[:, None]


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


@dataclass(frozen=True)
class CCDPMechanism:
    """The CCDP step for one site: per-category clipping, one Gaussian draw, the public normaliser (module
    docstring).

    Attributes:
        clipping_norms: ``{category: C_c}`` for exactly the active categories (L2, > 0).
        noise_std: sigma (> 0), the standard deviation per coordinate of the one draw.
        expected_batch_size: q N_site (> 0), the public normaliser.
        noise: the random source of the Gaussian noise (a :class:`~edge_sdk.privacy.randomness.SecureRandom` in
            production).

    Raises:
        PrivacyBudgetError: no active category.
        ValueError: a C_c, sigma or the expected batch size not positive.
    """

    clipping_norms: Mapping[IUCNCategory, float]
    noise_std: float
    expected_batch_size: float
    noise: RandomSource = field(repr=False)
    _table: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.clipping_norms:
            raise PrivacyBudgetError("no active IUCN category: every category is halted, the site stops training")
        if not self.noise_std > 0:
            raise ValueError(f"noise_std must be > 0, got {self.noise_std}")
        if not self.expected_batch_size > 0:
            raise ValueError(f"expected_batch_size must be > 0, got {self.expected_batch_size}")
        for category, c in self.clipping_norms.items():
            if not c > 0:
                raise ValueError(f"clipping norm of {category.value} must be > 0, got {c}")
        object.__setattr__(self, "_table", rank_table(self.clipping_norms))

    @classmethod
    def from_plan(cls, plan: CCDPPlan, *, expected_batch_size: float, noise: RandomSource) -> "CCDPMechanism":
        """The mechanism that runs ``plan`` (its clipping norms and sigma; the sampling is the caller's, with
        :meth:`CCDPPlan.inclusion_rates`)."""
        return cls(clipping_norms=dict(plan.clipping_norms), noise_std=plan.noise_std,
                   expected_batch_size=float(expected_batch_size), noise=noise)

    @property
    def categories(self) -> tuple[IUCNCategory, ...]:
        """Active categories in IUCN rank order."""
        return tuple(sorted(self.clipping_norms, key=lambda c: c.rank))

    def clipped_sum(self, per_example_grads: np.ndarray | PerExampleGradients, categories: np.ndarray) -> np.ndarray:
        """``sum_i g_i min(1, C_{cat(i)} / ||g_i||)`` as float64 (d,), one weighted sum (no noise).

        Args:
            per_example_grads: float32 (B, d) array, B >= 0, or a
                :class:`~edge_sdk.privacy.per_example.PerExampleGradients` (norms + weighted sums).
            categories: int (B,), IUCN rank of each example.

        Raises:
            PrivacyBudgetError: an example belongs to a category that is not active.
            ValueError: shapes disagree.
        """
        grads = (per_example_grads if isinstance(per_example_grads, PerExampleGradients)
                 else MaterialisedGradients(per_example_grads))
        ranks = np.asarray(categories).astype(np.int64)
        if ranks.shape != (grads.batch_size,):
            raise ValueError(f"expected categories ({grads.batch_size},), got {ranks.shape}")
        bound = np.zeros(ranks.shape, dtype=np.float64)  # the lookup table doubles as the category check
        in_range = (ranks >= 0) & (ranks < _NUM_RANKS)
        bound[in_range] = self._table[ranks[in_range]]
        stray = ~(bound > 0)
        if np.any(stray):
            raise PrivacyBudgetError(
                f"{int(stray.sum())} example(s) of IUCN rank(s) {sorted(set(ranks[stray].tolist()))} are in the batch "
                "but their category is not active (halted or not in the species table); sampling must exclude them"
            )
        factors = clip_factors_from_norms(grads.norms, bound)
        return np.asarray(grads.weighted_sum(factors[None, :]), dtype=np.float64).reshape(-1)

    def privatize(self, per_example_grads: np.ndarray | PerExampleGradients, categories: np.ndarray) -> np.ndarray:
        """The whole step, as training runs it: per-example gradients ((B, d) array or implicit) -> float32 (d,)
        private mean gradient ``(sum_i clip_{C_cat(i)}(g_i) + N(0, sigma^2 I)) / (q N_site)``.

        Raises:
            PrivacyBudgetError: an example belongs to a category that is not active.
            ValueError: shapes disagree.
        """
        total = self.clipped_sum(per_example_grads, categories)
        total += self.noise_std * self.noise.standard_normal(total.shape[0])
        total *= 1.0 / self.expected_batch_size
        return total.astype(np.float32)


def active_categories(
    site_categories: Iterable[IUCNCategory], halted: Iterable[IUCNCategory]
) -> tuple[IUCNCategory, ...]:
    """The site's categories (from its species table) that are not halted, in IUCN rank order."""
    halted_set = set(halted)
    return tuple(sorted({c for c in site_categories if c not in halted_set}, key=lambda c: c.rank))
