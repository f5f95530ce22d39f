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

TEST-ONLY crash hook: with the environment variable ``WILDFED_TEST_CRASH_AT`` set to ``after_ingest`` (updates
stored, ledger not yet written) or ``after_ledger`` (ledger written, model not yet stored), the process SIGKILLs
itself at that point of :meth:`RoundManager._close` (tests/coordinator/test_crash.py); set to ``after_publish``, it
SIGKILLs itself once :meth:`RoundManager.open_round` has sent every task (tests/coordinator/test_recover_budget.py).
Never set it in production.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select

from shared.codec import decode_tensors, encode_tensors, model_hash
from shared.envelope import Envelope, MessageKind, readdress, seal
from shared.iucn import IUCNCategory, parse_category
from shared.models.backbone import EMBEDDING_DIM
from shared.models.feature_centre import centre_digest, load_feature_centre, uncentred_gradient
from shared.models.logit_adjustment import adjusted_for_prediction, metadata_offsets
from shared.protocol import SecAggSettings, TrainingTask, decode_update, encode_task
from shared.privacy.distributed import site_sampling_rate
from shared.transfer import Receipt, piece_size_for

from coordinator.artifacts import ArtifactStore, artifact_digests, ort_training_available
from coordinator.config import CoordinatorConfig
from coordinator.global_dp import SecAggCollector, SecureAggregationRound, plan_global_round
from coordinator.inbound.context import Accepted, RoundContext
from coordinator.inbound.ingest import Ingestor
from coordinator.radio import city_artifact, expected_events, radio_task
from coordinator.cohorts import plan_round
from coordinator.ledger import PrivacyLedger
from coordinator.optimizers.base import ServerOptimizer
from coordinator.outgoing import answer_download_receipt, outgoing_task_path, send_task_bytes, store_outgoing_task
from coordinator.inbound.partial_sums import collect_round
from coordinator.registry import UnknownSiteError, Site, SiteRegistry
from coordinator.storage import ModelVersionRow, RoundRow, Store, dumps, utcnow
from coordinator.strategies.base import Strategy
from coordinator.transport import Transport, pipelined_publish

__all__ = ["RoundResult", "RoundManager", "derive_seed", "known_categories"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundResult:
    """Outcome of one round.

    Attributes:
        round: number. status: ``closed`` (new model) / ``failed`` (no quorum) / ``skipped`` (no site selectable).
        selected: sites offered the round. accepted: sites whose update was aggregated (or charged, if failed).
        model_hash: the global model after the round. duration_s: wall time, seconds, from the round's start (the
        halt check) to its close. open_s: seconds from the round's start until its last task was published (0.0
        where no task went out): the part of the gap between rounds that the round's opening takes.
        halted: per site, halted categories at the start of the round.
    """

    round: int
    status: str
    selected: tuple[str, ...]
    accepted: tuple[str, ...]
    model_hash: str
    duration_s: float
    halted: Mapping[str, tuple[IUCNCategory, ...]] = field(default_factory=dict)
    open_s: float = 0.0


def derive_seed(seed: int | None, round: int, label: str) -> int | None:
    """A seed for (round, label) derived from the federation seed (None stays None): first 4 bytes of
    SHA-256("seed:round:label"). Used for site sampling; never sent to gateways."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.sha256(f"{seed}:{round}:{label}".encode()).digest()[:4], "big")


def known_categories(site: Site, ledger: PrivacyLedger) -> set[IUCNCategory]:
    """The categories a site holds: its declared ``metadata.categories``, else those it has spent on."""
    declared = site.metadata.get("categories")
    if declared:
        return {parse_category(c, field="metadata.categories") for c in declared}
    return ledger.categories(site.site_id)


_CRASH_ENV = "WILDFED_TEST_CRASH_AT"


def _test_crash_point(name: str) -> None:
    """TEST ONLY: SIGKILL this process here when ``$WILDFED_TEST_CRASH_AT == name`` (see the module docstring)."""
    if os.environ.get(_CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


class RoundManager:
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
        self._artifacts = ArtifactStore(config.data_dir / "ort-artifacts")
        self._artifacts_failed = False
        self._centre = (load_feature_centre(config.feature_centre, dim=EMBEDDING_DIM)
                        if config.feature_centre is not None else None)
        self._centre_digest = None if self._centre is None else centre_digest(self._centre)  # named in global tasks
        # the open round's sealed tasks, one per distinct content (payload encoded and hashed once for its sites)
        self._payloads: dict[tuple[str, str, tuple[str, ...]], Envelope] = {}
        self._offsets: tuple[int, tuple[float, ...] | None] | None = None  # (round, offsets) of prediction_offsets
        self.on_new_model: Callable[[int, str, Mapping[str, np.ndarray]], object] | None = None
        """``on_new_model(round, model hash, weights)`` once a round's new model is stored and its row closed (before
        the strategy's ``end_round``, so NIRA's sites are still in the clusters that trained it): the coordinator
        releases it to the gateways (coordinator.model_delivery). It must not raise."""

    # ---- ORT training artifacts --------------------------------------------------------------------------------
    def ships_artifacts(self) -> bool:
        """Whether tasks carry ONNX Runtime training artifacts: ``config.ship_ort_artifacts``, or (None) whether
        ``onnxruntime.training`` imports here."""
        ship = self.config.ship_ort_artifacts
        return ort_training_available() if ship is None else bool(ship)

    def task_artifacts(self, model_hash_: str, weights: Mapping[str, np.ndarray]) -> dict[str, bytes]:
        """The artifact files of the model version (``coordinator.artifacts``), or ``{}`` when not shipped or when
        making them fails (logged; gateways on ``auto`` then train with torch). Radio tasks carry the public city
        raster instead (``coordinator.radio.city_artifact``)."""
        if self.config.model == "radio_unet" and self.config.radio is not None:
            return city_artifact(self.config.radio)
        if not self.ships_artifacts() or self._artifacts_failed:
            return {}
        try:
            return self._artifacts.get(model_hash_, weights, self.config.num_classes)
        except Exception as exc:  # noqa: BLE001 - artifacts are an optimisation; the torch path must go on
            self._artifacts_failed = True  # same architecture every round: do not retry (and log) each round
            log.error("rounds: ORT training artifacts for model %s could not be made (%s: %s); tasks go without "
                      "them from now on", model_hash_[:12], type(exc).__name__, exc)
            return {}

    # ---- model versions ----------------------------------------------------------------------------------------
    def current_model(self) -> tuple[str, dict[str, np.ndarray]]:
        """``(hash, weights)`` of the current global model: the new model of the last closed round, else the
        round-0 model.

        Raises:
            LookupError: no model stored yet (the service stores the initial one at start).
        """
        with self._store.session() as s:
            h = s.scalars(select(RoundRow.new_model_hash).where(RoundRow.status == "closed")
                          .order_by(RoundRow.round.desc())).first()
            if h is None:
                h = s.scalars(select(ModelVersionRow.model_hash).where(ModelVersionRow.round == 0)
                              .order_by(ModelVersionRow.created_at)).first()
        if h is None:
            raise LookupError("no global model stored yet: start the Coordinator (it stores the initial model)")
        weights, _ = decode_tensors(self._store.get_model(h))
        return h, weights

    def prediction_offsets(self, round: int | None = None) -> tuple[float, ...] | None:
        """The post-hoc logit adjustment of the federation's head (``config.posthoc_logit_adjustment`` = tau > 0): float
        offsets (K,) ``tau (log pi - mean log pi)``, pi estimated from the enrolled sites' public metadata
        (:func:`shared.models.logit_adjustment.registry_log_prior`); None when tau is 0, the model is not a head or
        no site lists a species of the table (logged). Computed once per ``round`` (None: recomputed) from the
        registry as it is then; public values only, nothing is charged.
        """
        cfg = self.config
        if not cfg.posthoc_logit_adjustment > 0 or cfg.model != "head" or not cfg.species:
            return None
        if round is not None and self._offsets is not None and self._offsets[0] == round:
            return self._offsets[1]
        metadata = {site.site_id: site.metadata for site in self._registry.list()}
        index = {e.scientific_name: int(e.class_index) for e in cfg.species}
        try:
            offsets: tuple[float, ...] | None = tuple(
                float(v) for v in metadata_offsets(metadata, index, int(cfg.num_classes),
                                                   float(cfg.posthoc_logit_adjustment)))
        except ValueError as exc:
            log.warning("rounds: no logit adjustment: %s", exc)
            offsets = None
        if round is not None:
            self._offsets = (round, offsets)
        return offsets

    def inference_model(self) -> tuple[str, dict[str, np.ndarray]]:
        """``(hash, weights)`` of the model to predict with: :meth:`current_model` (its hash: the stored version's)
        with the logit adjustment of :meth:`prediction_offsets` taken off ``psi.bias`` when there is one, the same
        model the sites keep for ``detect``.

        Raises:
            LookupError: no model stored yet.
        """
        h, weights = self.current_model()
        return h, self.served_model(weights)

    def served_model(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``weights`` (a global model, e.g. from :meth:`current_model`) as predicted with: ``psi.bias`` less the
        offsets of :meth:`prediction_offsets` when there are some, else the same tensors (a new dict)."""
        offsets = self.prediction_offsets()
        return dict(weights) if offsets is None else adjusted_for_prediction(weights, offsets)

    def save_optimizer_state(self, model_hash_: str) -> None:
        """Store the server optimizer's state (if any) for the model version ``model_hash_`` (a blob, named in the
        strategy-state table), so that a restart from that version continues with the same state."""
        state = self._optimizer.state_tensors()
        if state:
            digest = self._store.put_blob(encode_tensors(state))
            self._store.set_state(f"optimizer/{model_hash_}", digest)

    def restore_optimizer_state(self) -> bool:
        """Load the optimizer state stored with the current model version; returns whether there was one."""
        try:
            h, _ = self.current_model()
        except LookupError:
            return False
        digest = self._store.get_state(f"optimizer/{h}")
        if digest is None:
            return False
        state, _ = decode_tensors(self._store.get_blob(digest))
        self._optimizer.load_state_tensors(state)
        log.info("rounds: server optimizer state restored for model %s", h[:12])
        return True

    def next_round(self) -> int:
        """Number of the next round to open (1 + the highest round recorded, so a restart continues)."""
        rows = self._store.rounds()
        return (rows[-1].round + 1) if rows else 1

    # ---- selection ---------------------------------------------------------------------------------------------
    def select(self, round: int) -> tuple[list[str], dict[str, frozenset[IUCNCategory]]]:
        """Halt what must be halted, then choose this round's sites: those with a valid key (not revoked) and a
        category that is not halted. Under record-level budgets (:meth:`uses_cohorts`) the seeded subset is drawn
        first and each chosen site's cohorts are then planned (:func:`coordinator.cohorts.plan_round`, kept in
        ``self.round_cohorts`` for its task); a category is halted at a site when it is halted in every cohort.

        Returns:
            ``(selected site ids, {site: halted categories})`` for every enrolled site.
        """
        budgets = self.config.budgets()
        halted: dict[str, frozenset[IUCNCategory]] = {}
        eligible: list[str] = []
        # rounds whose tasks went out and whose charges can still arrive: counted as spent in the dry run. Read
        # BEFORE the ledger's history: a late charge landing in between is then counted twice (safe), never missed.
        pending = self._ledger.pending_rounds(before_round=round) if self.config.privacy != "none" else {}
        cohorts = self.uses_cohorts()
        sites = {site.site_id: site for site in self._registry.list()}
        for site in sites.values():
            if not self._registry.verification_keys(site.site_id):
                log.warning("rounds: site %s has no valid key (revoked); it is not selected", site.site_id)
                continue
            if self.config.privacy != "none" and not cohorts:
                halted[site.site_id] = self._ledger.halt_if_needed(site.site_id, budgets, round=round,
                                                                   pending=len(pending.get(site.site_id, ())))
            else:
                halted[site.site_id] = frozenset()
            known = known_categories(site, self._ledger)
            if known and known <= halted[site.site_id]:
                log.warning("rounds: site %s has every category halted; it is no longer selected", site.site_id)
                continue
            eligible.append(site.site_id)
        k = self.config.sites_per_round
        if k is not None and k < len(eligible):
            rng = random.Random(derive_seed(self.config.seed, round, "selection"))
            eligible = sorted(rng.sample(eligible, k))
        self.round_cohorts = {}
        if cohorts:
            for site_id in list(eligible):
                plan = plan_round(self._store, self._ledger, site_id, round, budgets,
                                  categories=known_categories(sites[site_id], self._ledger),
                                  pending_rounds=pending.get(site_id, ()))
                if not plan:
                    eligible.remove(site_id)
                    continue
                self.round_cohorts[site_id] = plan
                halted[site_id] = frozenset.intersection(*plan.values())
        return eligible, halted

    def uses_cohorts(self) -> bool:
        """Whether rounds train records in cohorts with record-level budgets (:mod:`coordinator.cohorts`): every
        private camera federation; radio maps (a site's survey is one record) and ``privacy: none`` do not."""
        return self.config.privacy != "none" and self.config.model != "radio_unet"

    # ---- one round ---------------------------------------------------------------------------------------------
    def quorum(self, num_selected: int) -> int:
        """Accepted updates that close a round early: ``max(1, ceil(quorum_fraction * num_selected))``."""
        return max(1, math.ceil(self.config.quorum_fraction * num_selected - 1e-9))

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
                           halted=result.halted, open_s=open_s)

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
            base_hash = model_hash(bundle)
            self._store.put_model(base_hash, encode_tensors(bundle), round=r - 1)
        site_models = {site: self._strategy.site_weights(bundle, site) for site in selected}
        by_arrays: dict[tuple[int, ...], str] = {}  # FedAvg gives every site the same arrays: hash them once
        site_hashes = {}
        for site, w in site_models.items():
            key = tuple(id(v) for v in w.values())
            if key not in by_arrays:
                by_arrays[key] = model_hash(w)
            site_hashes[site] = by_arrays[key]
        self._payloads = {}  # one sealed task per distinct content
        with self._store.session() as s:
            s.add(RoundRow(round=r, status="open", base_model_hash=base_hash, selected_json=dumps(selected),
                           privacy=self.config.privacy))
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
        with pipelined_publish(self._transport):  # the round's tasks: PUBACKs awaited once
            for site_id in selected:
                artifacts = self.task_artifacts(site_hashes[site_id], site_models[site_id])
                self._publish_task(r, site_id, site_hashes[site_id], site_models[site_id],
                                   halted.get(site_id, frozenset()), artifacts)
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
            while len(ctx.accepted) < need:
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._ingestor.changed.wait(timeout=min(left, 0.5))
            return len(ctx.accepted) >= need

    def close_round(self, ctx: RoundContext) -> RoundResult:
        """Stop ingest, charge the ledger durably, then aggregate, step and store the model (see module doc)."""
        t0 = self._clock()
        self._ingestor.close_round()
        weights = ctx.bundle if ctx.bundle is not None else ctx.template
        if self.config.ingest_workers > 0:
            self._finalise_from_workers(ctx, weights)
        else:
            self._absorb_stored(ctx)
        status, new_hash = self._close(ctx, weights, self.quorum(len(ctx.selected)))
        return RoundResult(round=ctx.round, status=status, selected=tuple(sorted(ctx.selected)),
                           accepted=tuple(sorted(ctx.accepted)), model_hash=new_hash,
                           duration_s=self._clock() - t0,
                           halted={s: tuple(sorted(c, key=lambda c: c.rank)) for s, c in ctx.halted.items() if c})

    def _absorb_stored(self, ctx: RoundContext) -> None:
        """Make every stored update of the round count once: one stored by another process (e.g. a misconfigured
        ingest worker beside this coordinator) is aggregated and charged like the ones this process accepted, never
        lost from the ledger. Normally there is none."""
        for upd in self._store.updates_for_round(ctx.round):
            if upd.site_id in ctx.accepted:
                continue
            report, delta = decode_update(self._store.get_blob(upd.payload_sha256))
            ctx.strategy.accumulate(upd.site_id, delta, num_examples=int(report.num_examples),
                                    species_counts=report.species_counts or None,
                                    noise_variance=ctx.noise_variance(report))
            ctx.accepted[upd.site_id] = Accepted(site_id=upd.site_id, round=ctx.round, sequence=upd.sequence,
                                                 num_examples=upd.num_examples, weight=float(report.num_examples),
                                                 payload_sha256=upd.payload_sha256, events=report.events,
                                                 count_events=dict(report.count_events),
                                                 species_counts=dict(report.species_counts))
            log.warning("rounds: round %d: %s's update was stored by another process; counted here once", ctx.round,
                        upd.site_id)

    def _finalise_from_workers(self, ctx: RoundContext, weights: Mapping[str, np.ndarray]) -> None:
        """Scale-out close (``coordinator.workers``): mark the round ``closing`` under the round row's lock (from then
        on a worker charges an update as late instead of storing it), then take the merged partial sums and the
        stored updates' reports as this round's aggregate and accepted set."""
        with self._store.session() as s:
            row = s.scalars(select(RoundRow).where(RoundRow.round == ctx.round).with_for_update()).first()
            assert row is not None
            row.status = "closing"
        merged, accepted = collect_round(self._store, ctx.round, weights)
        ctx.strategy.begin_round(weights)
        ctx.strategy.absorb(merged)  # type: ignore[attr-defined] - FedAvg (the config refuses other strategies)
        ctx.accepted.clear()
        ctx.accepted.update(accepted)

    def run_global_round(self) -> RoundResult:
        """One Global DP round (:mod:`coordinator.global_dp`): select, send tasks with secagg settings, run secure
        aggregation, charge the survivors before unmasking, add the noise once, step, store."""
        t0 = self._clock()
        cfg = self.config
        r = self.next_round()
        base_hash, weights = self.current_model()
        selected, halted = self.select(r)
        if len(selected) < 2:
            log.error("rounds: round %d: Global DP needs at least 2 sites for secure aggregation, %d can train",
                      r, len(selected))
            return RoundResult(round=r, status="skipped", selected=tuple(selected), accepted=(), model_hash=base_hash,
                               duration_s=self._clock() - t0)
        d = sum(int(np.asarray(w).size) for w in weights.values())
        distributed = cfg.global_noise == "distributed"
        budgets = cfg.budgets()
        enrolled = {site.site_id: site for site in self._registry.list() if site.site_id in selected}
        # each site's q_k from its declared capacity (public); 1.0 where unknown, which only raises z, and
        # 1.0 under distributed noise (no subsampling credited: shared.privacy.distributed.site_sampling_rate)
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
        with self._store.session() as s:
            s.add(RoundRow(round=r, status="open", base_model_hash=base_hash, selected_json=dumps(selected),
                           privacy="global"))
        self._secagg.open_round(r, base_hash, selected)
        log.info("rounds: round %d open (Global DP, secure aggregation t=%d of %d), model %s", r, settings.threshold,
                 len(selected), base_hash[:12])
        artifacts = self.task_artifacts(base_hash, weights)
        declared = {s: frozenset(known_categories(site, self._ledger)) for s, site in enrolled.items()}
        self._payloads = {}  # one sealed task per distinct content (sites differ only in their halted categories)
        with pipelined_publish(self._transport):  # the round's tasks: PUBACKs awaited once
            for site_id in selected:
                self._publish_task(r, site_id, base_hash, weights, halted.get(site_id, frozenset()), artifacts,
                                   secagg=settings, noise_multiplier=z, distributed_noise=distributed,
                                   feature_centre=self._centre_digest)
        open_s = self._clock() - t0

        def over_budget(site: str, events: Mapping[IUCNCategory, object]) -> str | None:
            for cat, ev in events.items():
                if cat in budgets and self._ledger.would_exceed(site, cat, ev, budgets[cat],  # type: ignore[arg-type]
                                                                round=r):
                    return f"site {site} category {cat.value} would pass its budget eps={budgets[cat]:.4f}"
            return None

        try:
            outcome = SecureAggregationRound(
                federation_id=cfg.federation_id, round=r, model_hash=base_hash, template=weights, settings=settings,
                collector=self._secagg, transport=self._transport, signing_key=self._key,
                charge=lambda site, ev: self._ledger.record_round(site, r, ev), over_budget=over_budget,
                budgets=budgets, halted=halted, declared=declared, target_delta=float(cfg.target_delta),
                planned_rounds=cfg.rounds, accountant=cfg.accountant, clipping_norm=float(cfg.clipping_norm),
                expected_batch_size=cfg.expected_batch_size, noise_multiplier=z, distributed=distributed,
                shares_timeout_s=cfg.round_deadline_s,
                stage_timeout_s=cfg.secagg.stage_timeout_s, after_charge=lambda: _test_crash_point("after_ledger"),
                clock=self._clock,
                capacities={s: enrolled[s].capacity for s in selected if s in enrolled and enrolled[s].capacity}
                ).run()
        finally:
            self._secagg.close_round()
        new_hash = base_hash
        if outcome.status == "closed":
            assert outcome.noisy_gradient is not None
            gradient = outcome.noisy_gradient
            if self._centre is not None:  # the sites summed centred gradients: fold with the public c
                gradient = uncentred_gradient(gradient, self._centre)
            step = {k: (-float(cfg.learning_rate) * v).astype(np.float32) for k, v in gradient.items()}
            new_weights = self._optimizer.step(weights, step)
            new_hash = model_hash(new_weights)
            self.save_optimizer_state(new_hash)
            self._store.put_model(new_hash, encode_tensors(new_weights), round=r)
        with self._store.session() as s:
            row = s.get(RoundRow, r)
            assert row is not None
            row.status = outcome.status
            row.new_model_hash = new_hash if outcome.status == "closed" else None
            row.num_accepted = len(outcome.survivors) if outcome.status == "closed" else 0
            row.closed_at = utcnow()
            row.detail = outcome.reason[:2000]
        log.info("rounds: round %d %s (Global DP), model %s", r, outcome.status, new_hash[:12])
        if outcome.status == "closed" and self.on_new_model is not None:
            self.on_new_model(r, new_hash, new_weights)
        return RoundResult(round=r, status=outcome.status, selected=tuple(sorted(selected)),
                           accepted=outcome.survivors if outcome.status == "closed" else (), model_hash=new_hash,
                           duration_s=self._clock() - t0,
                           halted={s: tuple(sorted(c, key=lambda c: c.rank)) for s, c in halted.items() if c},
                           open_s=open_s)

    def _count_noise(self) -> float | None:
        """The count release tasks ask for: the strategy's (NIRA with noisy counts); exact counts (0) when the
        federation is not private; None when the strategy asks for none."""
        z = self._strategy.count_noise_multiplier()
        if z is None:
            return None
        return 0.0 if self.config.privacy == "none" else float(z)

    def _task_noise_parameters(self) -> dict[str, float | int]:
        """The camera tasks' learning rate, clipping norm and expected batch size (for the DP noise variance of an
        update, :meth:`coordinator.ingest.RoundContext.noise_variance`); zeros for radio rounds (FedAvg only)."""
        if self.config.model == "radio_unet":
            return {}
        cfg = self.config
        return {"learning_rate": float(cfg.learning_rate), "clipping_norm": float(cfg.clipping_norm),
                "expected_batch_size": int(cfg.expected_batch_size)}

    def _local_steps(self) -> int:
        """Local steps a task asks for: the config's, or a radio task's local epochs."""
        radio = self.config.radio if self.config.model == "radio_unet" else None
        return radio.local_epochs if radio is not None else self.config.local_steps

    def _publish_task(self, r: int, site_id: str, model_hash_: str, weights: Mapping[str, np.ndarray],
                      halted: frozenset[IUCNCategory], artifacts: Mapping[str, bytes] | None = None,
                      secagg: SecAggSettings | None = None, noise_multiplier: float | None = None,
                      distributed_noise: bool = False, feature_centre: str | None = None) -> None:
        cfg = self.config
        radio = cfg.radio if cfg.model == "radio_unet" else None
        if radio is not None:
            # The generic fields mean: epochs, maps per Adam step, Adam step size, C of the whole update.
            task = TrainingTask(federation_id=cfg.federation_id, round=r, model_hash=model_hash_,
                                local_steps=radio.local_epochs, expected_batch_size=radio.batch_size,
                                learning_rate=float(radio.learning_rate), clipping_norm=float(radio.clipping_norm),
                                target_delta=float(cfg.target_delta), planned_rounds=cfg.rounds,
                                privacy=cfg.privacy, budgets=cfg.budgets() if cfg.privacy != "none" else {},
                                halted=tuple(halted), seed=cfg.task_seed, artifacts=artifact_digests(artifacts or {}),
                                radio=radio_task(radio), round_duration_s=float(cfg.round_duration_s))
            self._send_task(r, site_id, model_hash_, task, weights, artifacts)
            return
        task = TrainingTask(federation_id=cfg.federation_id, round=r, model_hash=model_hash_,
                            local_steps=cfg.local_steps, expected_batch_size=cfg.expected_batch_size,
                            learning_rate=float(cfg.learning_rate), clipping_norm=float(cfg.clipping_norm),
                            target_delta=float(cfg.target_delta), planned_rounds=cfg.rounds, privacy=cfg.privacy,
                            budgets=cfg.budgets(), halted=tuple(halted), seed=cfg.task_seed,
                            artifacts=artifact_digests(artifacts or {}), secagg=secagg,
                            count_noise_multiplier=None if secagg is not None else self._count_noise(),
                            ccdp_variant=cfg.ccdp_variant, noise_multiplier=noise_multiplier,
                            distributed_noise=distributed_noise, feature_centre=feature_centre,
                            class_reweighting=float(cfg.class_reweighting) if cfg.privacy == "ccdp" else 0.0,
                            prediction_offsets=self.prediction_offsets(r), capacity=self._capacity(site_id),
                            round_duration_s=float(cfg.round_duration_s), cohorts=self._task_cohorts(site_id))
        self._send_task(r, site_id, model_hash_, task, weights, artifacts)

    def _task_cohorts(self, site_id: str) -> dict[int, tuple[IUCNCategory, ...]] | None:
        """The site's cohorts for its task (planned in :meth:`select`), None outside record-level budgets."""
        plan = getattr(self, "round_cohorts", {}).get(site_id)
        return None if plan is None else {c: tuple(h) for c, h in plan.items()}

    def _capacity(self, site_id: str) -> int | None:
        """The site's declared capacity (enrolment metadata), sent in its camera tasks; None when it declared none
        (its gateway then refuses the task, naming the fix)."""
        try:
            return self._registry.get(site_id).capacity
        except UnknownSiteError:
            return None

    def _send_task(self, r: int, site_id: str, model_hash_: str, task: TrainingTask,
                   weights: Mapping[str, np.ndarray], artifacts: Mapping[str, bytes] | None) -> None:
        cfg = self.config
        memo = self._payloads
        key = (model_hash_, json.dumps(task.to_json(), sort_keys=True),
               tuple(sorted(artifact_digests(artifacts or {}).values())))
        sealed = memo.get(key)
        if sealed is None:  # encoded and hashed once per distinct task content; each further site is a new header
            env = memo[key] = seal(private_key=self._key, federation_id=cfg.federation_id, site_id=site_id, round=r,
                                   base_model_hash=model_hash_, kind=MessageKind.TASK, sequence=r,
                                   payload=encode_task(task, weights, artifacts),
                                   piece_size=piece_size_for(cfg.transfer.chunk_size_bytes))  # chunks = pieces
        else:
            env = readdress(sealed, private_key=self._key, site_id=site_id)
        store_outgoing_task(cfg, r, site_id, env)  # for resends while the round is open
        self._send_envelope(site_id, env)

    def _send_envelope(self, site_id: str, env: Envelope) -> int:
        return send_task_bytes(self.config, self._transport, self._key, site_id, env)

    def _outgoing_path(self, r: int, site_id: str) -> Path:
        return outgoing_task_path(self.config, r, site_id)

    def resend_task(self, site_id: str, round: int, receipt: Receipt) -> None:
        """Answer a site's download receipt (see :func:`answer_download_receipt`) for this process's open round."""
        answer_download_receipt(self.config, self._transport, self._key, self._ingestor.context, site_id, round,
                                receipt)

    def _over_budget_at_close(self, ctx: RoundContext) -> dict[str, str]:
        """The over-budget check repeated at close, against what the ledger holds NOW (late updates of earlier
        rounds may have been charged since an update was admitted): per accepted update and category, its round's
        events (every mechanism) after every other round's recorded events and the site's other pending rounds
        (:meth:`coordinator.ledger.PrivacyLedger.round_would_exceed`).

        Returns:
            ``{site: reason}`` of the updates that must not be aggregated (empty when every one fits).
        """
        if ctx.privacy == "none":
            return {}
        budgets = ctx.budgets
        pending = self._ledger.pending_rounds(before_round=ctx.round)
        refused: dict[str, str] = {}
        for site_id, acc in sorted(ctx.accepted.items()):
            others = len(pending.get(site_id, ()))  # per cohort: those from its first round on (the ledger counts)
            for cat in sorted({*acc.events, *acc.count_events}, key=lambda c: c.rank):
                budget = budgets.get(cat)
                events = tuple(e for e in (acc.events.get(cat), acc.count_events.get(cat)) if e is not None)
                if budget is None or not events:
                    continue
                if self._ledger.cohort_round_would_exceed(site_id, cat, ctx.round, events, budget,
                                                          pending_rounds=pending.get(site_id, ())):
                    refused[site_id] = (f"at close, round {ctx.round}'s events for {cat.value} would take site "
                                        f"{site_id!r} past its budget eps={budget:.4f} (after {others} other "
                                        "round(s) whose charges can still arrive); charged, not aggregated")
                    break
        return refused

    def _rebuild_without(self, ctx: RoundContext, weights: Mapping[str, np.ndarray], refused: Mapping[str, str]
                         ) -> None:
        """Drop ``refused`` from the round: rebuild the running sum from the stored blobs of the others."""
        for site_id, reason in refused.items():
            ctx.accepted.pop(site_id)
            log.error("rounds: round %d: %s", ctx.round, reason)
            self._store.add_rejection(round=ctx.round, site_id=site_id, topic="", reason="over_budget",
                                      error_kind="close_check", detail=reason)
        ctx.strategy.begin_round(weights)
        for acc in ctx.accepted.values():
            report, delta = decode_update(self._store.get_blob(acc.payload_sha256))
            ctx.strategy.accumulate(acc.site_id, delta, num_examples=int(report.num_examples),
                                    species_counts=report.species_counts or None,
                                    noise_variance=ctx.noise_variance(report))

    def _close(self, ctx: RoundContext, weights: Mapping[str, np.ndarray], need: int) -> tuple[str, str]:
        """Check the budgets again, ledger first (durable), then aggregate + step + store. Returns ``(status,
        model hash after)``."""
        _test_crash_point("after_ingest")
        refused = self._over_budget_at_close(ctx)
        for acc in ctx.accepted.values():  # every update the coordinator has seen is charged, refused ones too
            if acc.events:
                self._ledger.record_round(acc.site_id, ctx.round, acc.events)
            if acc.count_events:
                self._ledger.record_round(acc.site_id, ctx.round, acc.count_events, mechanism="counts")
        _test_crash_point("after_ledger")
        if refused:
            self._rebuild_without(ctx, weights, refused)
        if len(ctx.accepted) >= need and ctx.strategy.count > 0:
            avg_delta = ctx.strategy.aggregate()
            new_weights = ctx.strategy.after_step(self._optimizer.step(weights, avg_delta))
            new_hash = model_hash(new_weights)
            self.save_optimizer_state(new_hash)
            self._store.put_model(new_hash, encode_tensors(new_weights), round=ctx.round)
            status = "closed"
        else:
            new_hash = ctx.model_hash
            status = "failed"
            log.warning("rounds: round %d failed: %d of %d needed updates", ctx.round, len(ctx.accepted), need)
        with self._store.session() as s:
            row = s.get(RoundRow, ctx.round)
            assert row is not None
            row.status = status
            row.new_model_hash = new_hash if status == "closed" else None
            row.num_accepted = len(ctx.accepted)
            row.closed_at = utcnow()
        log.info("rounds: round %d %s with %d update(s), model %s", ctx.round, status, len(ctx.accepted),
                 new_hash[:12])
        shutil.rmtree(self.config.data_dir / "outgoing" / str(ctx.round), ignore_errors=True)
        if status == "closed" and self.on_new_model is not None:
            self.on_new_model(ctx.round, new_hash, new_weights)
        if status == "closed":
            for line in ctx.strategy.end_round(ctx.round):
                log.info("rounds: round %d: %s", ctx.round, line)
        return status, new_hash

    # ---- recovery ----------------------------------------------------------------------------------------------
    def recover(self) -> list[RoundResult]:
        """Close every round a previous process left ``open``, from its durably stored updates."""
        results = []
        with self._store.session() as s:
            open_rows = list(s.scalars(select(RoundRow).where(RoundRow.status.in_(("open", "closing")))
                                       .order_by(RoundRow.round)))
        for row in open_rows:
            t0 = self._clock()
            if row.privacy == "global":
                with self._store.session() as s:
                    live = s.get(RoundRow, row.round)
                    assert live is not None
                    live.status, live.closed_at = "failed", utcnow()
                    live.detail = ("the coordinator stopped during secure aggregation (its state is in memory "
                                   "only); spend recorded before unmasking stays charged once; re-run as a new round")
                log.warning("rounds: Global DP round %d left open by a previous run: marked failed", row.round)
                results.append(RoundResult(round=row.round, status="failed",
                                           selected=tuple(sorted(json.loads(row.selected_json))), accepted=(),
                                           model_hash=row.base_model_hash, duration_s=self._clock() - t0))
                continue
            weights, _ = decode_tensors(self._store.get_model(row.base_model_hash))
            selected = frozenset(json.loads(row.selected_json))
            self._strategy.begin_round(weights)
            ctx = RoundContext(round=row.round, model_hash=row.base_model_hash, template=weights, selected=selected,
                               halted={}, budgets=self.config.budgets(), privacy=self.config.privacy,
                               local_steps=self._local_steps(), strategy=self._strategy, bundle=weights,
                               expected_events=expected_events(self.config), **self._task_noise_parameters())
            for upd in self._store.updates_for_round(row.round):
                report, delta = decode_update(self._store.get_blob(upd.payload_sha256))
                weight = float(report.num_examples)
                self._strategy.accumulate(upd.site_id, delta, num_examples=int(weight),
                                          species_counts=report.species_counts or None,
                                          noise_variance=ctx.noise_variance(report))
                ctx.accepted[upd.site_id] = Accepted(site_id=upd.site_id, round=row.round, sequence=upd.sequence,
                                                     num_examples=upd.num_examples, weight=weight,
                                                     payload_sha256=upd.payload_sha256, events=report.events,
                                                     count_events=dict(report.count_events),
                                                     species_counts=dict(report.species_counts))
            status, h = self._close(ctx, weights, self.quorum(len(selected)))
            log.warning("rounds: recovered round %d left open by a previous run: %s", row.round, status)
            results.append(RoundResult(round=row.round, status=status, selected=tuple(sorted(selected)),
                                       accepted=tuple(sorted(ctx.accepted)), model_hash=h,
                                       duration_s=self._clock() - t0))
        return results
