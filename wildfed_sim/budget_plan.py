"""Planning budgets for a network that runs for years: what each IUCN category's records go through under a
coordinator config, from public values only (``wildfed plan-budgets``).

Under record-level budgets (:mod:`coordinator.cohorts`) a record trains from the round after it is verified until
its category's budget is spent, then retires. The calibration (:func:`edge_sdk.privacy.ccdp.plan_ccdp`, the same
code a gateway runs) spends each category's budget over ``rounds`` rounds of ``local_steps`` steps, so every record
trains ``rounds`` rounds whatever its category: the categories differ in how often their records are sampled
(``q_c``), not in how long they train. At the config's round interval that is how long a new photo keeps teaching
the model. The best-case signal against the noise (:mod:`edge_sdk.field.learnability`) over that horizon says
whether a site holding ``n`` records of a category can teach the model anything about it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from shared.iucn import IUCNCategory
from shared.models.kinds import model_spec

from coordinator.config import CoordinatorConfig
from edge_sdk.field.learnability import CategorySignal, signal_to_noise
from edge_sdk.privacy.ccdp import plan_ccdp

__all__ = ["PlanRow", "budget_plan"]


@dataclass(frozen=True)
class PlanRow:
    """One IUCN category of :func:`budget_plan`.

    Attributes:
        category: the IUCN category. budget: its epsilon (per record, whole training life, at the config's delta).
        sampling_rate: q_c at the given capacity. noise_multiplier: the release's sigma / C_c.
        rounds: rounds each record trains before it retires. days: the same at the schedule's round interval.
        signal: the best-case signal against the noise of ``records`` records of the category over those rounds.
        federation_ratio: the same ratio for ``sites`` sites that each hold that many records, averaged by FedAvg
            (their signals add, their independent noises add in quadrature: ``sqrt(sites)`` times the site's).
    """

    category: IUCNCategory
    budget: float
    sampling_rate: float
    noise_multiplier: float
    rounds: int
    days: float
    signal: CategorySignal
    federation_ratio: float


def budget_plan(cfg: CoordinatorConfig, *, capacity: int, records: Mapping[IUCNCategory, int] | int,
                sites: int = 1, categories: tuple[IUCNCategory, ...] = tuple(IUCNCategory)) -> list[PlanRow]:
    """Per category, what a record of a site with declared ``capacity`` goes through under ``cfg`` (CCDP, the
    camera head model), and whether ``records`` records of it can teach the model.

    Args:
        cfg: the coordinator config (budgets, delta, B, C, rounds, local steps, CCDP variant, model, schedule).
        capacity: the site's declared capacity N_k (q = min(1, B / N_k)), >= 1.
        records: records per category at the site (or one number for every category).
        sites: sites that hold as many records of each category (the federation-level column), >= 1.
        categories: the site's species-table categories (the anchor, and so z, is chosen among them).

    Raises:
        ConfigError: the config is not a private camera federation, or capacity < 1.
        PrivacyBudgetError: as :func:`edge_sdk.privacy.ccdp.plan_ccdp`.
    """
    from shared.errors import ConfigError

    if cfg.privacy != "ccdp" or cfg.model != "head":
        raise ConfigError(f"plan is for camera federations with privacy ccdp, not {cfg.privacy}/{cfg.model}",
                          field="privacy", fix="plan a config with privacy: ccdp and model: head")
    if capacity < 1:
        raise ConfigError(f"capacity must be >= 1, got {capacity}", field="capacity",
                          fix="give the site's declared capacity (enrolment metadata)")
    budgets = {c: b for c, b in cfg.budgets().items() if c in categories}
    q = min(1.0, cfg.expected_batch_size / capacity)
    steps = cfg.planned_updates() * cfg.local_steps
    plan = plan_ccdp(variant=cfg.ccdp_variant, budgets=budgets, active=budgets, target_delta=cfg.target_delta,
                     sampling_rate=q, steps=steps, clipping_norm=float(cfg.clipping_norm),
                     accountant=cfg.accountant)
    counts = records if isinstance(records, Mapping) else {c: int(records) for c in budgets}
    parameters = sum(int(w.size) for w in model_spec("head", cfg.num_classes, adapter_width=cfg.adapter_width)
                     .initial_weights(0).values())
    signals = {s.category: s for s in signal_to_noise(counts, sampling_rates=plan.sampling_rates,
                                                      clipping_norms=plan.clipping_norms, noise_std=plan.noise_std,
                                                      steps=steps, parameters=parameters)}
    interval_days = cfg.schedule.round_interval_s / 86400.0
    return [PlanRow(category=c, budget=budgets[c], sampling_rate=plan.sampling_rates[c],
                    noise_multiplier=plan.noise_std / plan.clipping_norms[c], rounds=cfg.planned_updates(),
                    days=cfg.planned_updates() * interval_days, signal=signals[c],
                    federation_ratio=signals[c].ratio * math.sqrt(max(1, sites)))
            for c in sorted(budgets, key=lambda c: c.rank)]
