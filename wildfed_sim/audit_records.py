"""What a privacy audit (:mod:`wildfed_sim.audit`) runs and what it measured: :class:`AuditSettings` (checked on
construction), one :class:`CategoryAudit` per audited IUCN category, and the :class:`AuditResult` that
``audit.json`` holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shared.errors import ConfigError
from shared.iucn import CCDPBudget, IUCNCategory, parse_category
from shared.privacy.accounting import AccountantName
from shared.protocol import CCDP_VARIANTS

from wildfed_sim.audit_canaries import CanaryDesign
from wildfed_sim.audit_stats import guess_sizes

REFERENCE = ("Steinke, Nasr & Jagielski 2023, 'Privacy Auditing with One (1) Training Run' (NeurIPS 2023), "
             "Theorem 3.1; white-box Dirac gradient canaries")


# ------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class AuditSettings:
    """What the audit runs (one site, ``rounds`` rounds of ``local_steps`` CCDP steps).

    Attributes:
        canaries_per_category: m, canary records added per audited category (>= 2).
        categories: audited IUCN categories (default all six).
        budget: the CCDP budgets the task carries (per-category total epsilon at ``target_delta``).
        rounds: rounds run; also the task's ``planned_rounds`` (noise is calibrated for ``rounds * local_steps``).
        local_steps, expected_batch_size, learning_rate, clipping_norm, target_delta: the training task's values
            (``clipping_norm`` C is L2; q = expected_batch_size / N_active with N_active = real records + canaries).
        guess_fraction: share of each category's canaries that get a guess (half "in", half "out").
        beta: significance of the lower bound (0.05 = 95 % confidence).
        accountant: the ledger's accountant for the claimed epsilon (``"rdp"`` or ``"pld"``).
        ccdp_variant: the individualized DP-SGD variant (``"sample"`` or ``"scale"``), as the task carries it.
        break_noise: TEST/DIAGNOSTIC ONLY: the Gaussian draws of the mechanism return zeros (no privacy at all), to
            show the audit catches a broken mechanism.
        seed: None (default) draws canary design and inclusion from OS entropy and the mechanism's sampling and
            noise from the secure source; an integer seeds all of them for reproducible tests, with the
            :class:`~edge_sdk.privacy.randomness.InsecureRandomnessWarning` (no privacy guarantee holds then).
        probe_size: real records whose per-example gradients choose the canary coordinates.

    Raises:
        ConfigError: a value out of range (``field`` names the CLI option).
    """

    canaries_per_category: int = 100
    categories: tuple[IUCNCategory, ...] = tuple(IUCNCategory)
    budget: CCDPBudget = field(default_factory=lambda: CCDPBudget.from_anchor(IUCNCategory.VU, 1.0, 1.0))
    rounds: int = 5
    local_steps: int = 10
    expected_batch_size: int = 128
    learning_rate: float = 0.5
    clipping_norm: float = 1.0
    target_delta: float = 1e-5
    guess_fraction: float = 0.6
    beta: float = 0.05
    accountant: AccountantName = "rdp"
    ccdp_variant: str = "sample"
    break_noise: bool = False
    seed: int | None = None
    probe_size: int = 512

    def __post_init__(self) -> None:
        def positive_int(name: str, value: object, minimum: int = 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                option = name.replace("_", "-")
                raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}", field=option,
                                  fix=f"pass --{option} {minimum} or more")

        positive_int("canaries_per_category", self.canaries_per_category, 2)
        positive_int("rounds", self.rounds)
        positive_int("local_steps", self.local_steps)
        positive_int("expected_batch_size", self.expected_batch_size)
        positive_int("probe_size", self.probe_size)
        for name in ("learning_rate", "clipping_norm"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ConfigError(f"{name} must be positive and finite, got {value!r}",
                                  field=name.replace("_", "-"), fix="use e.g. 0.5 (learning rate) or 1.0 (C)")
        if not (isinstance(self.target_delta, float) and 0 < self.target_delta < 1):
            raise ConfigError(f"target_delta must be in (0, 1), got {self.target_delta!r}", field="target-delta",
                              fix="use e.g. 1e-5")
        if not (isinstance(self.guess_fraction, (int, float)) and 0 < self.guess_fraction <= 1):
            raise ConfigError(f"guess_fraction must be in (0, 1], got {self.guess_fraction!r}",
                              field="guess-fraction", fix="use e.g. 0.6")
        if guess_sizes(self.canaries_per_category, float(self.guess_fraction))[0] < 1:
            raise ConfigError(f"guess_fraction {self.guess_fraction} of {self.canaries_per_category} canaries "
                              "leaves no guess", field="guess-fraction",
                              fix="raise --guess-fraction or --canaries-per-category")
        if not (isinstance(self.beta, float) and 0 < self.beta < 1):
            raise ConfigError(f"beta must be in (0, 1), got {self.beta!r}", field="confidence",
                              fix="use a confidence such as 0.95")
        if self.accountant not in ("rdp", "pld"):
            raise ConfigError(f"unknown accountant {self.accountant!r}", field="accountant", fix="use rdp or pld")
        if self.ccdp_variant not in CCDP_VARIANTS:
            raise ConfigError(f"unknown CCDP variant {self.ccdp_variant!r}", field="ccdp-variant",
                              fix=f"use one of {', '.join(CCDP_VARIANTS)}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}", field="seed")
        cats = tuple(parse_category(c, field="categories") for c in self.categories)
        if not cats or len(set(cats)) != len(cats):
            raise ConfigError(f"categories must be non-empty and distinct, got {[c.value for c in cats]}",
                              field="categories", fix="e.g. --categories CR,EN,LC")
        object.__setattr__(self, "categories", tuple(sorted(cats, key=lambda c: c.rank)))

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict of every setting (budgets as the per-category table)."""
        return {"canaries_per_category": self.canaries_per_category,
                "categories": [c.value for c in self.categories],
                "budget": {"eps_max": self.budget.eps_max, "gamma": self.budget.gamma,
                           "per_category": {c.value: e for c, e in self.budget.table().items()}},
                "rounds": self.rounds, "local_steps": self.local_steps,
                "expected_batch_size": self.expected_batch_size, "learning_rate": self.learning_rate,
                "clipping_norm": self.clipping_norm, "target_delta": self.target_delta,
                "guess_fraction": self.guess_fraction, "beta": self.beta, "confidence": 1.0 - self.beta,
                "accountant": self.accountant, "ccdp_variant": self.ccdp_variant, "break_noise": self.break_noise,
                "seed": self.seed,
                "probe_size": self.probe_size}


# ------------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class CategoryAudit:
    """The audit of one IUCN category.

    Attributes:
        category: the IUCN category.
        canaries: m; included: how many were "in" (secret until the audit ends).
        guesses: r = k_plus + k_minus; correct: v.
        claimed_epsilon: the ledger's epsilon for the steps run (accountant of the settings, at ``delta``).
        lower_bound: empirical epsilon lower bound at confidence ``1 - beta``.
        ceiling: the bound had all ``guesses`` been correct: the largest epsilon this audit's size can certify
            (claims above it cannot be caught, whatever the mechanism does).
        noise_multiplier: sigma / C_c, the noise multiplier the category's records saw.
        delta: the claim's delta (the task's target_delta).
        sampling_rate: q_c, the category's Poisson rate (below the base rate under CCDP "sample").
    """

    category: IUCNCategory
    canaries: int
    included: int
    guesses: int
    correct: int
    claimed_epsilon: float
    lower_bound: float
    ceiling: float
    noise_multiplier: float
    delta: float
    sampling_rate: float = float("nan")

    @property
    def exceeds_claim(self) -> bool:
        """True when the lower bound is above the claim: evidence of a privacy bug (or a beta-probability fluke)."""
        return self.lower_bound > self.claimed_epsilon

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"category": self.category.value, "canaries": self.canaries, "included": self.included,
                "guesses": self.guesses, "correct": self.correct, "claimed_epsilon": self.claimed_epsilon,
                "lower_bound": self.lower_bound, "ceiling": self.ceiling,
                "noise_multiplier": self.noise_multiplier, "sampling_rate": self.sampling_rate,
                "delta": self.delta, "exceeds_claim": self.exceeds_claim}


@dataclass(frozen=True)
class AuditResult:
    """Everything one audit measured.

    Attributes:
        settings: what ran.
        rows: one :class:`CategoryAudit` per audited category, most threatened first.
        num_real_records: real records at the audited site; num_active: N_active (real + canary slots).
        sampling_rate: the base rate q = min(1, B / N_active) (the anchor category's; each row has its own q_c).
        scores: float64 (M,) canary scores, aligned with ``design``.
        design: the canaries (with the now-revealed inclusion bits).
        wall_seconds: training + audit time.
    """

    settings: AuditSettings
    rows: tuple[CategoryAudit, ...]
    num_real_records: int
    num_active: int
    sampling_rate: float
    scores: np.ndarray
    design: CanaryDesign
    wall_seconds: float

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the content of ``audit.json``)."""
        return {"method": REFERENCE, "confidence": 1.0 - self.settings.beta,
                "settings": self.settings.to_json(), "num_real_records": self.num_real_records,
                "num_active": self.num_active, "sampling_rate": self.sampling_rate,
                "noise_broken": self.settings.break_noise, "seeded": self.settings.seed is not None,
                "categories": [r.to_json() for r in self.rows],
                "any_bound_exceeds_claim": any(r.exceeds_claim for r in self.rows),
                "wall_seconds": self.wall_seconds}
