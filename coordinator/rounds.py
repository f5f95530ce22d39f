"""The round manager: open a round, publish signed tasks, wait for a quorum or the deadline, close it.

One round ``r`` (docs/architecture.md, "A round"):

1. **Halt check.** For every enrolled site the ledger dry-runs the next round's events of each category
   (:meth:`coordinator.ledger.PrivacyLedger.halt_if_needed`) and halts categories that would pass their budget.
2. **Select** the sites that still have a non-halted category (optionally a seeded random subset of
   ``sites_per_round``); write the round row (status ``open``).
3. **Publish** to each selected site a TASK envelope signed by the coordinator on
   ``shared.topics.task_topic``: the global weights plus :class:`shared.protocol.TrainingTask` with that site's
   halted categories.
4. **Collect** (ingest runs on the transport's thread) until ``ceil(quorum_fraction * selected)`` updates are
   accepted or ``round_deadline_s`` passes.
5. **Close**: stop ingest; write every accepted update's events to the ledger DURABLY; THEN, if the quorum was
   met, take the aggregate, apply the server optimizer, store the new model version, and mark the round
   ``closed``; otherwise mark it ``failed`` (model unchanged; the spend is still charged, conservatively, because
   the coordinator has seen the updates).

Crash recovery (:meth:`RoundManager.recover`): a round left ``open`` is closed from its durably stored updates
(the running sum is rebuilt from the blobs); ledger writes are idempotent, so a replay never double-charges. A
Global DP round left open is marked ``failed``: its secure-aggregation state was in memory only; the spend it
recorded before unmasking (if any) stays charged once.

Budgets whatever crashes: the updates of a round that closed without them (its deadline passed, or ``recover``
closed it after a crash) can still arrive and are then charged as ``late``. So the halt check of step 1 counts every
such round as spent (:meth:`coordinator.ledger.PrivacyLedger.pending_rounds`), and step 5 checks each accepted
update again against what is recorded by then (:meth:`coordinator.ledger.PrivacyLedger.round_would_exceed`): an
update whose events would take its site past a budget is charged (the coordinator has seen it) but not aggregated,
and is recorded as an ``over_budget`` rejection.

Global DP mode (``privacy: global``) replaces steps 3-5 by secure aggregation and one coordinator-side noise draw:
:mod:`coordinator.global_dp`.

The parts, each in a module of its own: selection and halting (:mod:`coordinator.selection`); the tasks
(:mod:`coordinator.round_tasks`); the round row from open to close and the model version it commits, for both
lifecycles (:mod:`coordinator.round_record`); the close-time steps that settle which updates count
(:mod:`coordinator.round_close`, folding stored blobs with :mod:`coordinator.stored_updates`); a Global DP round
(:mod:`coordinator.global_round`), with its plan (:mod:`coordinator.round_plan`) and secure-aggregation driver
(:mod:`coordinator.secagg_round`); what a round came to (:mod:`coordinator.round_result`); crash recovery
(:mod:`coordinator.round_recovery`) and the buffered rounds' past contexts and final drain
(:mod:`coordinator.buffered_drain`), both bases of :class:`RoundManager`.

TEST-ONLY crash hook: with the environment variable ``WILDFED_TEST_CRASH_AT`` set to ``after_ingest`` (updates
stored, ledger not yet written) or ``after_ledger`` (ledger written, model not yet stored), the process SIGKILLs
itself at that point of :meth:`RoundManager._close` (tests/coordinator/test_crash.py); set to ``after_publish``, it
SIGKILLs itself once :meth:`RoundManager.open_round` has sent every task (tests/coordinator/test_recover_budget.py).
Never set it in production.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.codec import model_hash
from shared.iucn import IUCNCategory
from shared.models.backbone import EMBEDDING_DIM
from shared.models.feature_centre import centre_digest, load_feature_centre
from shared.transfer import Receipt

from coordinator.artifacts import ArtifactStore
from coordinator.buffered_drain import BufferedDrain
from coordinator.buffered_rounds import BufferedRounds
from coordinator.config import CoordinatorConfig
from coordinator.global_round import GlobalRound
from coordinator.inbound.context import RoundContext
from coordinator.inbound.ingest import Ingestor
from coordinator.ledger import PrivacyLedger
from coordinator.model_versions import GlobalModel
from coordinator.optimizers.base import ServerOptimizer
from coordinator.radio import expected_events
from coordinator.registry import SiteRegistry
from coordinator.round_close import absorb_stored, drop_refused, finalise_from_workers, over_budget_at_close
from coordinator.round_record import RoundRecord, store_model
from coordinator.round_recovery import RoundRecovery
from coordinator.round_result import RoundResult
from coordinator.round_tasks import TaskPublisher
from coordinator.secagg_collector import SecAggCollector
from coordinator.selection import select_sites, uses_cohorts
from coordinator.storage import Store
from coordinator.strategies.base import Strategy
from coordinator.transport import Transport, pipelined_publish

__all__ = ["RoundResult", "RoundManager"]  # RoundResult: coordinator.round_result

log = logging.getLogger(__name__)


_CRASH_ENV = "WILDFED_TEST_CRASH_AT"


def _test_crash_point(name: str) -> None:
    """TEST ONLY: SIGKILL this process here when ``$WILDFED_TEST_CRASH_AT == name`` (see the module docstring)."""
    if os.environ.get(_CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


class RoundManager(BufferedDrain, RoundRecovery):
    """Runs rounds (see the module docstring). Built by :class:`coordinator.service.Coordinator`.

    Args:
        config: the coordinator config (rounds, quorum, deadline, hyper-parameters, privacy, budgets, seed).
        store, registry, ledger, ingestor, transport: coordinator parts.
        strategy: aggregation (FedAvg). optimizer: server step (ServerSGD).
        signing_key: the coordinator's Ed25519 key (signs TASKs).
        clock: monotonic clock in seconds (tests inject one).
        secagg_collector: files the sites' secure-aggregation messages (Global DP mode); the service subscribes it
            to ``shared.topics.secagg_filter``.
    """

    def __init__(self, *, config: CoordinatorConfig, store: Store, registry: SiteRegistry, ledger: PrivacyLedger,
                 ingestor: Ingestor, transport: Transport, strategy: Strategy, optimizer: ServerOptimizer,
                 signing_key: Ed25519PrivateKey, clock: Callable[[], float] = time.monotonic,
                 secagg_collector: SecAggCollector | None = None) -> None:
        self.config = config
        self._store = store
        self._registry = registry
        self._ledger = ledger
        self._ingestor = ingestor
        self._transport = transport
        self._strategy = strategy
        self._optimizer = optimizer
        self._key = signing_key
        self._clock = clock
        self._secagg = secagg_collector or SecAggCollector(federation_id=config.federation_id, store=store,
                                                           registry=registry)
        self._tasks = TaskPublisher(config=config, registry=registry, transport=transport, signing_key=signing_key,
                                    artifacts=ArtifactStore(config.data_dir / "ort-artifacts"), store=store)
        self.buffered = BufferedRounds(config.buffered, store, registry) if config.buffered is not None else None
        self._templates: dict[str, dict[str, np.ndarray]] = {}  # past rounds' models, by hash (stale updates)
        self._centre = (load_feature_centre(config.feature_centre, dim=EMBEDDING_DIM)
                        if config.feature_centre is not None else None)
        self._centre_digest = None if self._centre is None else centre_digest(self._centre)  # named in global tasks
        self.models = GlobalModel(config, store, registry, optimizer)  # current and served model, optimizer state
        self.round_cohorts: dict[str, dict[int, frozenset[IUCNCategory]]] = {}  # planned in select()
        self.on_new_model: Callable[[int, str, Mapping[str, np.ndarray]], object] | None = None
        """``on_new_model(round, model hash, weights)`` once a round's new model is stored and its row closed (before
        the strategy's ``end_round``, so NIRA's sites are still in the clusters that trained it): the coordinator
        releases it to the gateways (coordinator.model_delivery). It must not raise."""

    # ---- ORT training artifacts --------------------------------------------------------------------------------
    def ships_artifacts(self) -> bool:
        """Whether tasks carry ONNX Runtime training artifacts (:meth:`coordinator.round_tasks.TaskPublisher.ships_artifacts`)."""
        return self._tasks.ships_artifacts()

    def task_artifacts(self, model_hash_: str, weights: Mapping[str, np.ndarray]) -> dict[str, bytes]:
        """The files a task of this model version carries, ``{}`` when none
        (:meth:`coordinator.round_tasks.TaskPublisher.task_artifacts`)."""
        return self._tasks.task_artifacts(model_hash_, weights)

    # ---- model versions (coordinator.model_versions) ---------------------------------------------------------------
    def current_model(self) -> tuple[str, dict[str, np.ndarray]]:
        """:meth:`coordinator.model_versions.GlobalModel.current_model`."""
        return self.models.current_model()

    def prediction_offsets(self, round: int | None = None) -> tuple[float, ...] | None:
        """:meth:`coordinator.model_versions.GlobalModel.prediction_offsets`."""
        return self.models.prediction_offsets(round)

    def inference_model(self) -> tuple[str, dict[str, np.ndarray]]:
        """:meth:`coordinator.model_versions.GlobalModel.inference_model`."""
        return self.models.inference_model()

    def served_model(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """:meth:`coordinator.model_versions.GlobalModel.served_model`."""
        return self.models.served_model(weights)

    def restore_optimizer_state(self) -> bool:
        """:meth:`coordinator.model_versions.GlobalModel.restore_optimizer_state`."""
        return self.models.restore_optimizer_state()

    def next_round(self) -> int:
        """Number of the next round to open (1 + the highest round recorded, so a restart continues)."""
        rows = self._store.rounds()
        return (rows[-1].round + 1) if rows else 1

    # ---- selection ---------------------------------------------------------------------------------------------
    def select(self, round: int) -> tuple[list[str], dict[str, frozenset[IUCNCategory]]]:
        """Halt what must be halted, then choose this round's sites (:func:`coordinator.selection.select_sites`);
        under record-level budgets each chosen site's cohorts are kept in ``self.round_cohorts`` for its task.

        Returns:
            ``(selected site ids, {site: halted categories})`` for every enrolled site.
        """
        chosen = select_sites(self.config, self._store, self._registry, self._ledger, round)
        self.round_cohorts = chosen.cohorts
        return chosen.selected, chosen.halted

    def uses_cohorts(self) -> bool:
        """Whether rounds train records in cohorts with record-level budgets (:func:`coordinator.selection.uses_cohorts`)."""
        return uses_cohorts(self.config)

    # ---- one round ---------------------------------------------------------------------------------------------
    def quorum(self, num_selected: int) -> int:
        """Accepted updates that close a round early: ``max(1, ceil(quorum_fraction * num_selected))``; buffered
        rounds: K, stale updates included."""
        if self.buffered is not None:
            return self.buffered.buffer_size
        return max(1, math.ceil(self.config.quorum_fraction * num_selected - 1e-9))

    def _in_buffer(self, ctx: RoundContext) -> int:
        """Updates that count towards ``ctx``'s quorum: its own, and the stale ones waiting (buffered rounds)."""
        return len(ctx.accepted) + (self.buffered.waiting() if self.buffered is not None else 0)

    def run_round(self) -> RoundResult:
        """Run the next round to completion (open, publish, collect, close) and return its outcome."""
        t0 = self._clock()
        if self.config.privacy == "global":
            return self.run_global_round()
        ctx = self.open_round()
        if ctx is None:
            return RoundResult(round=self.next_round(), status="skipped", selected=(), accepted=(),
                               model_hash=self.current_model()[0], duration_s=self._clock() - t0)
        open_s = self._clock() - t0
        self.wait_for_quorum(ctx)
        result = self.close_round(ctx)
        return RoundResult(round=result.round, status=result.status, selected=result.selected,
                           accepted=result.accepted, model_hash=result.model_hash, duration_s=self._clock() - t0,
                           halted=result.halted, open_s=open_s, stale=result.stale)

    def open_round(self) -> RoundContext | None:
        """Halt, select, let the strategy prepare its bundle, record the round as ``open``, start ingest, publish
        the signed tasks (each site gets ``strategy.site_weights(bundle, site)``).

        Returns:
            The open round's context, or None when no site can train (nothing is recorded then).
        """
        r = self.next_round()
        base_hash, stored = self.current_model()
        selected, halted = self.select(r)
        if not selected:
            log.warning("rounds: no site can train in round %d (all halted or none enrolled)", r)
            return None
        bundle = self._strategy.prepare(stored, round=r)
        if set(bundle) != set(stored) or any(not np.array_equal(bundle[k], stored[k]) for k in bundle):
            base_hash = store_model(self._store, bundle, round=r - 1)
        site_models = {site: self._strategy.site_weights(bundle, site) for site in selected}
        by_arrays: dict[tuple[int, ...], str] = {}  # FedAvg gives every site the same arrays: hash them once
        site_hashes = {}
        for site, w in site_models.items():
            key = tuple(id(v) for v in w.values())
            if key not in by_arrays:
                by_arrays[key] = model_hash(w)
            site_hashes[site] = by_arrays[key]
        self._tasks.begin_round()  # one sealed task per distinct content
        RoundRecord.open(self._store, round=r, base_model_hash=base_hash, selected=selected,
                         privacy=self.config.privacy)
        self._strategy.begin_round(bundle)
        ctx = RoundContext(round=r, model_hash=base_hash, template=site_models[selected[0]],
                           selected=frozenset(selected), halted=halted, budgets=self.config.budgets(),
                           privacy=self.config.privacy, local_steps=self._local_steps(), strategy=self._strategy,
                           site_hashes=site_hashes, bundle=bundle,
                           count_noise_multiplier=self._count_noise(),
                           num_classes=self.config.num_classes, expected_events=expected_events(self.config),
                           **self._task_noise_parameters())
        self._ingestor.open_round(ctx)
        log.info("rounds: round %d open, %d site(s) selected, model %s", r, len(selected), base_hash[:12])
        offsets = self.prediction_offsets(r)
        with pipelined_publish(self._transport):  # the round's tasks: PUBACKs awaited once
            for site_id in selected:
                artifacts = self.task_artifacts(site_hashes[site_id], site_models[site_id])
                self._tasks.publish(r, site_id, site_hashes[site_id], site_models[site_id],
                                    halted.get(site_id, frozenset()), artifacts,
                                    count_noise_multiplier=self._count_noise(), prediction_offsets=offsets,
                                    cohorts=self.task_cohorts(site_id))
        _test_crash_point("after_publish")
        return ctx

    def wait_for_quorum(self, ctx: RoundContext, timeout_s: float | None = None) -> bool:
        """Block until the quorum of ``ctx`` is accepted or ``timeout_s`` (default ``round_deadline_s``) passes.

        Returns:
            True if the quorum was reached.
        """
        need = self.quorum(len(ctx.selected))
        deadline = self._clock() + (self.config.round_deadline_s if timeout_s is None else timeout_s)
        if self.config.ingest_workers > 0:  # the workers store; this process watches the updates table
            while True:
                have = len(self._store.updates_for_round(ctx.round))
                left = deadline - self._clock()
                if have >= need or left <= 0:
                    return have >= need
                time.sleep(min(left, 0.2))
        with self._ingestor.changed:
            while self._in_buffer(ctx) < need:
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._ingestor.changed.wait(timeout=min(left, 0.5))
            return self._in_buffer(ctx) >= need

    def close_round(self, ctx: RoundContext) -> RoundResult:
        """Stop ingest, charge the ledger durably, then aggregate, step and store the model (see module doc)."""
        t0 = self._clock()
        self._ingestor.close_round()
        weights = ctx.bundle if ctx.bundle is not None else ctx.template
        if self.config.ingest_workers > 0:
            finalise_from_workers(self._store, ctx, weights)
        else:
            absorb_stored(self._store, ctx)
        status, new_hash, stale = self._close(ctx, weights, self._needed(ctx))
        return RoundResult(round=ctx.round, status=status, selected=tuple(sorted(ctx.selected)),
                           accepted=tuple(sorted(ctx.accepted)), model_hash=new_hash,
                           duration_s=self._clock() - t0,
                           halted={s: tuple(sorted(c, key=lambda c: c.rank)) for s, c in ctx.halted.items() if c},
                           stale=stale)

    def _needed(self, ctx: RoundContext) -> int:
        """Updates a closing round needs for a new model: the quorum; a buffered round closes with any (>= 1)."""
        return 1 if self.buffered is not None else self.quorum(len(ctx.selected))

    def run_global_round(self) -> RoundResult:
        """One Global DP round (:class:`coordinator.global_round.GlobalRound`)."""
        return GlobalRound(self, registry=self._registry, ledger=self._ledger, store=self._store,
                           transport=self._transport, signing_key=self._key, secagg=self._secagg, tasks=self._tasks,
                           optimizer=self._optimizer, centre=self._centre, centre_digest=self._centre_digest,
                           clock=self._clock, after_charge=lambda: _test_crash_point("after_ledger")).run()

    def _count_noise(self) -> float | None:
        """The count release tasks ask for: the strategy's (NIRA with noisy counts); exact counts (0) when the
        federation is not private; None when the strategy asks for none."""
        z = self._strategy.count_noise_multiplier()
        if z is None:
            return None
        return 0.0 if self.config.privacy == "none" else float(z)

    def _task_noise_parameters(self) -> dict[str, float | int]:
        """The camera tasks' learning rate, clipping norm and expected batch size (for the DP noise variance of an
        update, :meth:`coordinator.inbound.context.RoundContext.noise_variance`); zeros for radio rounds (FedAvg only)."""
        if self.config.model == "radio_unet":
            return {}
        cfg = self.config
        return {"learning_rate": float(cfg.learning_rate), "clipping_norm": float(cfg.clipping_norm),
                "expected_batch_size": int(cfg.expected_batch_size)}

    def _local_steps(self) -> int:
        """Local steps a task asks for: the config's, or a radio task's local epochs."""
        radio = self.config.radio if self.config.model == "radio_unet" else None
        return radio.local_epochs if radio is not None else self.config.local_steps

    def task_cohorts(self, site_id: str) -> dict[int, tuple[IUCNCategory, ...]] | None:
        """The site's cohorts for its task (planned in :meth:`select`), None outside record-level budgets."""
        plan = self.round_cohorts.get(site_id)
        return None if plan is None else {c: tuple(h) for c, h in plan.items()}

    def resend_task(self, site_id: str, round: int, receipt: Receipt) -> None:
        """Answer a site's download receipt (see :func:`coordinator.outgoing.answer_download_receipt`) for this
        process's open round."""
        self._tasks.resend(self._ingestor.context, site_id, round, receipt)

    def _close(self, ctx: RoundContext, weights: Mapping[str, np.ndarray],
               need: int) -> tuple[str, str, tuple[str, ...]]:
        """Check the budgets again, ledger first (durable), then aggregate (with the stale updates a buffered round
        claims: :mod:`coordinator.buffered_rounds`) + step + store. Returns ``(status, model hash after, the stale
        updates folded as "<site>@r<round>")``."""
        _test_crash_point("after_ingest")
        refused = over_budget_at_close(self._ledger, ctx)
        for acc in ctx.accepted.values():  # every update the coordinator has seen is charged, refused ones too
            if acc.events:
                self._ledger.record_round(acc.site_id, ctx.round, acc.events)
            if acc.count_events:
                self._ledger.record_round(acc.site_id, ctx.round, acc.count_events, mechanism="counts")
        _test_crash_point("after_ledger")
        if refused:
            drop_refused(self._store, ctx, weights, refused)
        stale = self.buffered.fold(ctx) if self.buffered is not None else []
        record = RoundRecord(self._store, ctx.round, ctx.model_hash)
        new_weights: dict[str, np.ndarray] | None = None
        if len(ctx.accepted) + len(stale) >= need and ctx.strategy.count > 0:
            avg_delta = (ctx.strategy.aggregate() if self.buffered is None
                         else self.buffered.aggregate(ctx, stale))
            new_weights = ctx.strategy.after_step(self._optimizer.step(weights, avg_delta))
            record.commit_model(new_weights, optimizer=self._optimizer)
            status = "closed"
        else:
            status = "failed"
            log.warning("rounds: round %d failed: %d of %d needed updates", ctx.round, len(ctx.accepted), need)
        record.close(status, num_accepted=len(ctx.accepted) + len(stale),
                     detail=f"{len(stale)} stale update(s) folded" if stale else None)
        new_hash = record.model_hash_after
        log.info("rounds: round %d %s with %d update(s)%s, model %s", ctx.round, status, len(ctx.accepted),
                 f" and {len(stale)} stale" if stale else "", new_hash[:12])
        shutil.rmtree(self.config.data_dir / "outgoing" / str(ctx.round), ignore_errors=True)
        if new_weights is not None:
            if self.on_new_model is not None:
                self.on_new_model(ctx.round, new_hash, new_weights)
            for line in ctx.strategy.end_round(ctx.round):
                log.info("rounds: round %d: %s", ctx.round, line)
        return status, new_hash, tuple(f"{f.site_id}@r{f.round}" for f in stale)
