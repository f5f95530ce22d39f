"""The plan of one Global DP round: everything its secure-aggregation driver needs, fixed before the tasks go out.

:meth:`GlobalRoundPlan.for_round` derives it from the coordinator config and the round's selection (public values
only: the selected sites' declared capacities and categories, the budgets, the model's size), through
:func:`coordinator.global_dp.plan_global_round`; the tasks carry its ``settings`` and ``noise_multiplier``, and
:class:`coordinator.secagg_round.SecureAggregationRound` runs the round from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from shared.iucn import IUCNCategory
from shared.privacy.accounting import AccountantName
from shared.privacy.distributed import site_sampling_rate
from shared.protocol import SecAggSettings

from coordinator.config import CoordinatorConfig
from coordinator.global_dp import plan_global_round
from coordinator.registry import Site

__all__ = ["GlobalRoundPlan"]


@dataclass(frozen=True)
class GlobalRoundPlan:
    """One Global DP round's fixed parameters (module docstring of :mod:`coordinator.global_dp`).

    Attributes:
        federation_id, round, model_hash: the round. template: the global weights (names and shapes of g~).
        settings: the round's secagg settings (as sent in the tasks).
        budgets: epsilon per category. halted: per site, the categories halted for this round (a masked sum
            reporting one is refused). declared: per site, its declared categories (registry metadata); the charged
            and noised categories are the reported ones plus the declared, non-halted ones, so a site cannot lower
            its charge by under-reporting.
        target_delta, planned_rounds, accountant: calibration.
        clipping_norm, expected_batch_size: C (L2, per record) and B (records per step in expectation).
        noise_multiplier: z, as the tasks carry it (:func:`coordinator.global_dp.global_noise_multiplier`, or
            ``shared.privacy.distributed.distributed_plan``).
        distributed: the sites add the noise (Skellam shares under the masks, calibrated for t survivors): the
            coordinator adds none and charges each survivor the Skellam event of its categories' clipping norms.
        shares_timeout_s: seconds to wait for the shares (the sites train first). stage_timeout_s: seconds to wait
            for each other stage.
        capacities: per site, its declared capacity N_k (registry metadata; the tasks carry it): the sampling
            rate's denominator and the normaliser's weight. A masked sum reporting another N_k is refused (treated
            as dropped). A site missing here is taken at the N_k it reports.
    """

    federation_id: str
    round: int
    model_hash: str
    template: Mapping[str, np.ndarray]
    settings: SecAggSettings
    budgets: Mapping[IUCNCategory, float]
    halted: Mapping[str, frozenset[IUCNCategory]]
    declared: Mapping[str, frozenset[IUCNCategory]]
    target_delta: float
    planned_rounds: int
    accountant: AccountantName
    clipping_norm: float
    expected_batch_size: int
    noise_multiplier: float
    shares_timeout_s: float
    stage_timeout_s: float
    distributed: bool = False
    capacities: Mapping[str, int] | None = None

    @classmethod
    def for_round(cls, config: CoordinatorConfig, *, round: int, model_hash: str,
                  weights: Mapping[str, np.ndarray], selected: Sequence[str],
                  halted: Mapping[str, frozenset[IUCNCategory]], enrolled: Mapping[str, Site],
                  declared: Mapping[str, frozenset[IUCNCategory]]) -> GlobalRoundPlan:
        """The plan of round ``round`` over ``selected`` (at least 2 sites), trained from ``weights`` (hash
        ``model_hash``). ``enrolled``: the selected sites' registry records (a site missing there is taken at
        q_k = 1.0, which only raises z); ``halted`` and ``declared`` as the attributes.

        Each site's q_k comes from its declared capacity (public;
        :func:`shared.privacy.distributed.site_sampling_rate`: 1.0 where unknown, and under distributed noise, which
        credits no subsampling); settings and z from :func:`coordinator.global_dp.plan_global_round`.

        Raises:
            ConfigError / PayloadError: as :func:`coordinator.global_dp.plan_global_round`.
        """
        cfg = config
        d = sum(int(np.asarray(w).size) for w in weights.values())
        distributed = cfg.global_noise == "distributed"
        budgets = cfg.budgets()
        rates = {s: site_sampling_rate(cfg.expected_batch_size,
                                       enrolled[s].capacity if s in enrolled else None, distributed=distributed)
                 for s in selected}
        settings, z = plan_global_round(budgets=budgets, sampling_rates=rates, vector_length=d,
                                        clipping_norm=float(cfg.clipping_norm),
                                        expected_batch_size=cfg.expected_batch_size,
                                        target_delta=float(cfg.target_delta), planned_rounds=cfg.rounds,
                                        distributed=distributed, threshold=cfg.secagg.threshold,
                                        modulus_bits=cfg.secagg.modulus_bits,
                                        max_abs_value=cfg.secagg.max_abs_value, accountant=cfg.accountant,
                                        colluding_sites=cfg.secagg.colluding_sites)
        return cls(federation_id=cfg.federation_id, round=round, model_hash=model_hash, template=weights,
                   settings=settings, budgets=budgets, halted=halted, declared=declared,
                   target_delta=float(cfg.target_delta), planned_rounds=cfg.rounds, accountant=cfg.accountant,
                   clipping_norm=float(cfg.clipping_norm), expected_batch_size=cfg.expected_batch_size,
                   noise_multiplier=z, distributed=distributed, shares_timeout_s=cfg.round_deadline_s,
                   stage_timeout_s=cfg.secagg.stage_timeout_s,
                   capacities={s: enrolled[s].capacity for s in selected if s in enrolled and enrolled[s].capacity})
