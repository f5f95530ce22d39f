"""One Global DP round (``privacy: global``; :mod:`coordinator.global_dp`) for the round manager: select, send each
site its task with the secure-aggregation settings, run secure aggregation, charge the survivors durably before
the sum is unmasked, add the noise once, take the server step and store the new model.

The plan (noise multiplier, secagg settings, budgets) is :class:`coordinator.round_plan.GlobalRoundPlan`; the
protocol driver is :class:`coordinator.secagg_round.SecureAggregationRound`. A Global DP round left open by a crash
is marked ``failed`` by :meth:`coordinator.rounds.RoundManager.recover` (its secure-aggregation state was in memory
only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.iucn import IUCNCategory
from shared.models.feature_centre import uncentred_gradient

from coordinator.ledger import PrivacyLedger
from coordinator.optimizers.base import ServerOptimizer
from coordinator.registry import SiteRegistry
from coordinator.round_plan import GlobalRoundPlan
from coordinator.round_record import RoundRecord
from coordinator.round_result import RoundResult
from coordinator.round_tasks import TaskPublisher
from coordinator.secagg_collector import SecAggCollector
from coordinator.secagg_round import GlobalRoundOutcome, SecureAggregationRound
from coordinator.selection import known_categories
from coordinator.storage import Store
from coordinator.transport import Transport, pipelined_publish

__all__ = ["GlobalRound", "RoundsView"]

log = logging.getLogger(__name__)


class RoundsView(Protocol):
    """What a Global DP round reads of the round manager (:class:`coordinator.rounds.RoundManager`)."""

    config: Any
    on_new_model: Callable[[int, str, Mapping[str, np.ndarray]], object] | None

    def next_round(self) -> int: ...

    def current_model(self) -> tuple[str, dict[str, np.ndarray]]: ...

    def select(self, round: int) -> tuple[list[str], dict[str, frozenset[IUCNCategory]]]: ...

    def task_artifacts(self, model_hash_: str, weights: Mapping[str, np.ndarray]) -> dict[str, bytes]: ...

    def prediction_offsets(self, round: int | None = None) -> tuple[float, ...] | None: ...

    def task_cohorts(self, site_id: str) -> dict[int, tuple[IUCNCategory, ...]] | None: ...


class GlobalRound:
    """The next Global DP round of ``rounds`` (see the module docstring); :meth:`run` once.

    Args:
        rounds: the round manager: its config, round numbering, model versions, selection, task artifacts,
            prediction offsets, cohorts and ``on_new_model``.
        registry, ledger, store, transport, signing_key, secagg, tasks, optimizer: the manager's parts.
        centre: the public feature centre (float32 (E,)) the sites centred their inputs by, or None;
            centre_digest: its digest, named in the tasks.
        clock: monotonic seconds. after_charge: called once every survivor is charged, before unmasking (the
            manager's test-only crash point).
    """

    def __init__(self, rounds: RoundsView, *, registry: SiteRegistry, ledger: PrivacyLedger, store: Store,
                 transport: Transport, signing_key: Ed25519PrivateKey, secagg: SecAggCollector, tasks: TaskPublisher,
                 optimizer: ServerOptimizer, centre: np.ndarray | None, centre_digest: str | None,
                 clock: Callable[[], float], after_charge: Callable[[], None]) -> None:
        self._rounds = rounds
        self._registry, self._ledger, self._store = registry, ledger, store
        self._transport, self._key, self._secagg, self._tasks = transport, signing_key, secagg, tasks
        self._optimizer, self._centre, self._centre_digest = optimizer, centre, centre_digest
        self._clock, self._after_charge = clock, after_charge

    def run(self) -> RoundResult:
        """Run the round to its close; ``skipped`` when fewer than 2 sites can train (secure aggregation needs
        2), ``failed`` when secure aggregation fails or a charge would pass a budget (model unchanged)."""
        rounds, t0 = self._rounds, self._clock()
        cfg = rounds.config
        r = rounds.next_round()
        base_hash, weights = rounds.current_model()
        selected, halted = rounds.select(r)
        if len(selected) < 2:
            log.error("rounds: round %d: Global DP needs at least 2 sites for secure aggregation, %d can train",
                      r, len(selected))
            return RoundResult(round=r, status="skipped", selected=tuple(selected), accepted=(), model_hash=base_hash,
                               duration_s=self._clock() - t0)
        enrolled = {site.site_id: site for site in self._registry.list() if site.site_id in selected}
        declared = {s: frozenset(known_categories(site, self._ledger)) for s, site in enrolled.items()}
        plan = GlobalRoundPlan.for_round(cfg, round=r, model_hash=base_hash, weights=weights, selected=selected,
                                         halted=halted, enrolled=enrolled, declared=declared)
        record = RoundRecord.open(self._store, round=r, base_model_hash=base_hash, selected=selected,
                                  privacy="global")
        self._secagg.open_round(r, base_hash, selected)
        log.info("rounds: round %d open (Global DP, secure aggregation t=%d of %d), model %s", r,
                 plan.settings.threshold, len(selected), base_hash[:12])
        self._publish_tasks(plan, selected, weights)
        open_s = self._clock() - t0
        outcome = self._secure_aggregation(plan)
        new_weights: dict[str, np.ndarray] | None = None
        if outcome.status == "closed":
            assert outcome.noisy_gradient is not None
            gradient = outcome.noisy_gradient
            if self._centre is not None:  # the sites summed centred gradients: fold with the public c
                gradient = uncentred_gradient(gradient, self._centre)
            step = {k: (-float(cfg.learning_rate) * v).astype(np.float32) for k, v in gradient.items()}
            new_weights = self._optimizer.step(weights, step)
            record.commit_model(new_weights, optimizer=self._optimizer)
        record.close(outcome.status, num_accepted=len(outcome.survivors) if outcome.status == "closed" else 0,
                     detail=outcome.reason)
        new_hash = record.model_hash_after
        log.info("rounds: round %d %s (Global DP), model %s", r, outcome.status, new_hash[:12])
        if new_weights is not None and rounds.on_new_model is not None:
            rounds.on_new_model(r, new_hash, new_weights)
        return RoundResult(round=r, status=outcome.status, selected=tuple(sorted(selected)),
                           accepted=outcome.survivors if outcome.status == "closed" else (), model_hash=new_hash,
                           duration_s=self._clock() - t0,
                           halted={s: tuple(sorted(c, key=lambda c: c.rank)) for s, c in halted.items() if c},
                           open_s=open_s)

    def _publish_tasks(self, plan: GlobalRoundPlan, selected: list[str], weights: Mapping[str, np.ndarray]) -> None:
        """Send each selected site its Global DP task: the plan's secagg settings and z, the feature centre's
        digest; sites differ only in their halted categories (and cohorts)."""
        rounds = self._rounds
        artifacts = rounds.task_artifacts(plan.model_hash, weights)
        offsets = rounds.prediction_offsets(plan.round)
        self._tasks.begin_round()  # one sealed task per distinct content
        with pipelined_publish(self._transport):  # the round's tasks: PUBACKs awaited once
            for site_id in selected:
                self._tasks.publish(plan.round, site_id, plan.model_hash, weights,
                                    plan.halted.get(site_id, frozenset()), artifacts, secagg=plan.settings,
                                    noise_multiplier=plan.noise_multiplier, distributed_noise=plan.distributed,
                                    feature_centre=self._centre_digest, prediction_offsets=offsets,
                                    cohorts=rounds.task_cohorts(site_id))

    def _secure_aggregation(self, plan: GlobalRoundPlan) -> GlobalRoundOutcome:
        """Run the round's secure aggregation (:class:`coordinator.secagg_round.SecureAggregationRound`): each
        survivor is charged to the ledger durably before the sum is unmasked; a charge that would pass a budget
        abandons the round first. The collector stops collecting whatever happens."""
        r, budgets = plan.round, plan.budgets

        def over_budget(site: str, events: Mapping[IUCNCategory, object]) -> str | None:
            for cat, ev in events.items():
                if cat in budgets and self._ledger.would_exceed(site, cat, ev, budgets[cat],  # type: ignore[arg-type]
                                                                round=r):
                    return f"site {site} category {cat.value} would pass its budget eps={budgets[cat]:.4f}"
            return None

        try:
            return SecureAggregationRound(
                plan, collector=self._secagg, transport=self._transport, signing_key=self._key,
                charge=lambda site, ev: self._ledger.record_round(site, r, ev), over_budget=over_budget,
                after_charge=self._after_charge, clock=self._clock).run()
        finally:
            self._secagg.close_round()
