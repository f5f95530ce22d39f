"""The coordinator's front door: one object built from a :class:`coordinator.config.CoordinatorConfig`.

::

    coord = Coordinator(load_config("coordinator.yaml"))        # MQTT transport from broker_url
    coord.start()                                               # subscribe, store round-0 model, recover
    for result in coord.run():                                  # the configured rounds
        print(result.round, result.status, result.accepted)
    coord.close()

Wiring (nothing else builds these parts): :class:`~coordinator.storage.Store` ->
:class:`~coordinator.registry.SiteRegistry`, :class:`~coordinator.ledger.PrivacyLedger`,
:class:`~coordinator.inbound.transfers.TransferReceiver` (subscribed to ``shared.topics.updates_filter``: size limits,
chunked uploads) in front of :class:`~coordinator.inbound.ingest.Ingestor`,
:class:`~coordinator.detections.DetectionIngestor` (subscribed to ``shared.topics.detections_filter``),
:class:`~coordinator.secagg_collector.SecAggCollector` (subscribed to ``shared.topics.secagg_filter``; Global DP mode),
:class:`~coordinator.inbound.health.FleetIngestor` (subscribed to ``shared.topics.status_filter`` and ``health_filter``:
presence and health records, ``wildfed-coordinator fleet``), :class:`~coordinator.model_delivery.ModelPublisher`
(each new model released, retained, to the camera gateways; the round manager calls it),
:class:`~coordinator.software_delivery.SoftwarePublisher` (the SDK version ``publish-update`` recorded, retained),
:class:`~coordinator.rounds.RoundManager` with :class:`~coordinator.strategies.fedavg.FedAvg` and
:class:`~coordinator.optimizers.server_sgd.ServerSGD`. torch is never imported here; the round-0 model comes from
the head model's ``initial_weights`` (``shared.models.kinds.model_spec("head", num_classes, adapter_width=...)``,
numpy only) unless ``initial_weights`` is given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.codec import encode_tensors, model_hash
from shared.iucn import IUCNCategory
from shared.keys import load_private_key
from shared.topics import detections_filter, health_filter, secagg_filter, status_filter, updates_filter

from coordinator.config import CoordinatorConfig
from coordinator.detections import DetectionCounts, DetectionIngestor, detection_counts
from coordinator.inbound.group_commit import GroupCommitPolicy
from coordinator.inbound.health import FleetIngestor
from coordinator.inbound.ingest import Ingestor
from coordinator.inbound.site_checks import ReplayWindow
from coordinator.inbound.transfers import TransferLimits, TransferReceiver
from coordinator.instance_lock import InstanceLock
from coordinator.ledger import PrivacyLedger
from coordinator.model_delivery import ModelPublisher
from coordinator.software_delivery import SoftwarePublisher
from coordinator.optimizers.base import ServerOptimizer
from coordinator.optimizers.server_sgd import ServerSGD
from coordinator.registry import Site, SiteRegistry
from coordinator.rounds import RoundManager, RoundResult
from coordinator.secagg_collector import SecAggCollector
from coordinator.storage import Store
from coordinator.strategies.base import Strategy
from coordinator.strategies.fedavg import FedAvg
from coordinator.transport import Transport
from coordinator.transport.handlers import QueuedCallback
from coordinator.transport.mqtt import MqttTransport, transport_from_config

__all__ = ["Coordinator", "StatusReport", "BudgetRow", "build_strategy", "build_optimizer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StatusReport:
    """What ``wildfed-coordinator status`` prints.

    Attributes:
        rounds: ``[(round, status, num_accepted, model hash or None)]``, oldest first.
        accepted: accepted updates over all rounds.
        rejections: rejected messages counted per reason code.
        sites: number of enrolled sites. model_hash: newest global model.
        details: ``{round: (privacy mode or None, detail or None)}``; e.g. how a Global DP round's secure
            aggregation went, or why it failed.
        detections: detection records stored, by outcome, and refused by reason
            (:func:`coordinator.detections.detection_counts`, read from the database).
    """

    rounds: list[tuple[int, str, int, str | None]]
    accepted: int
    rejections: dict[str, int]
    sites: int
    model_hash: str | None
    details: dict[int, tuple[str | None, str | None]] = field(default_factory=dict)
    detections: DetectionCounts | None = None


@dataclass(frozen=True)
class BudgetRow:
    """One (site, IUCN category) line of the budget table: epsilon spent (at ``target_delta``) vs budget."""

    site_id: str
    category: IUCNCategory
    spent: float
    budget: float
    halted: bool


class Coordinator:
    """The cloud side of a WildFed federation.

    Args:
        config: a resolved config (:func:`coordinator.config.load_config` resolves paths).
        transport: message bus; defaults to :class:`~coordinator.transport.mqtt.MqttTransport` on ``config.broker_url``
            (connected in :meth:`start`).
        signing_key: the coordinator's Ed25519 key; defaults to the one at ``config.signing_key_path``.
        initial_weights: round-0 global model (float32 arrays); defaults to
            ``model_spec("head", config.num_classes, adapter_width=config.adapter_width).initial_weights(seed)``.
        strategy, optimizer: aggregation and server step; default: the strategy ``config.strategy`` names
            (:func:`build_strategy`: FedAvg or NIRA) and the optimizer ``config.server_optimizer`` names
            (:func:`build_optimizer`: server SGD or DP-FedSOFIM).
        schema: PostgreSQL schema for every table (see :class:`~coordinator.storage.Store`).

    Raises:
        ConfigError: unreachable database, missing/unsafe key file, invalid server learning rate.
    """

    def __init__(self, config: CoordinatorConfig, *, transport: Transport | None = None,
                 signing_key: Ed25519PrivateKey | None = None,
                 initial_weights: Mapping[str, np.ndarray] | None = None, strategy: Strategy | None = None,
                 optimizer: ServerOptimizer | None = None, schema: str | None = None) -> None:
        if config.database_url is None:
            config = config.resolved(".")
        self.config = config
        self.store = Store(config.database_url or "", config.data_dir, schema=schema)
        self.registry = SiteRegistry(self.store)
        self.ledger = PrivacyLedger(self.store, target_delta=config.target_delta, accountant=config.accountant,
                                    max_pending=config.pending_rounds_cap())
        self._owns_transport = transport is None
        self.transport: Transport = transport if transport is not None else transport_from_config(config)
        self._key = signing_key if signing_key is not None else load_private_key(config.signing_key_path)
        self.registry.reserve(self._key.public_key())  # no site may enrol with the coordinator's own key
        self._initial_weights = initial_weights
        t = config.transfer
        self.ingestor = Ingestor(federation_id=config.federation_id, store=self.store, registry=self.registry,
                                 ledger=self.ledger, transport=self.transport, signing_key=self._key,
                                 replay_window=ReplayWindow(t.max_clock_skew_s, t.max_message_age_s),
                                 group_commit=GroupCommitPolicy.from_config(config.group_commit))
        self.detections = DetectionIngestor(federation_id=config.federation_id, store=self.store,
                                            registry=self.registry)
        if strategy is None:
            strategy = build_strategy(config, self.store, self.registry)
        self.secagg = SecAggCollector(federation_id=config.federation_id, store=self.store, registry=self.registry)
        self.rounds = RoundManager(config=config, store=self.store, registry=self.registry, ledger=self.ledger,
                                   ingestor=self.ingestor, transport=self.transport,
                                   strategy=strategy,
                                   optimizer=optimizer or build_optimizer(config),
                                   signing_key=self._key, secagg_collector=self.secagg)
        self.releases = ModelPublisher(config=config, store=self.store, registry=self.registry,
                                       transport=self.transport, signing_key=self._key, strategy=strategy,
                                       offsets=self.rounds.prediction_offsets)
        self.rounds.on_new_model = self.releases.release
        if config.buffered is not None:  # stale updates join the next close (coordinator.inbound.stale)
            self.ingestor.admit_stale_updates(max_staleness=config.buffered.max_staleness,
                                              past_context=self.rounds.past_context,
                                              open_round=self.rounds.round_joined_now)
        self.software = SoftwarePublisher(config=config, store=self.store, registry=self.registry,
                                          transport=self.transport, signing_key=self._key)
        self.fleet = FleetIngestor(federation_id=config.federation_id, store=self.store, registry=self.registry,
                                   replay_window=ReplayWindow(t.max_clock_skew_s, t.max_message_age_s))
        self.transfers = TransferReceiver(
            federation_id=config.federation_id, store=self.store, registry=self.registry, ingestor=self.ingestor,
            transport=self.transport, signing_key=self._key,
            limits=TransferLimits(max_chunk_bytes=t.max_chunk_bytes, max_update_bytes=t.max_update_bytes,
                                  max_message_bytes=t.max_message_bytes, ttl_s=t.ttl_s,
                                  memory_limit_bytes=t.memory_limit_bytes, spill_above_bytes=t.spill_above_bytes),
            on_download_receipt=self.rounds.resend_task)
        self._started = False
        self._update_queue: QueuedCallback | None = None
        self._instance_lock = InstanceLock(config.data_dir)

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def ensure_initial_model(self) -> str:
        """Store the round-0 model if none is stored yet; return the current global model hash."""
        try:
            return self.rounds.current_model()[0]
        except LookupError:
            pass
        weights = self._initial_weights
        if weights is None and self.config.model == "radio_unet":
            from coordinator.radio import initial_weights as radio_initial_weights  # imports torch lazily

            weights = radio_initial_weights(self.config)
        elif weights is None:  # the head model: numpy only, no torch
            from shared.models.kinds import model_spec

            weights = model_spec("head", self.config.num_classes, adapter_width=self.config.adapter_width
                                 ).initial_weights(self.config.seed or 0)
        weights = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
        h = model_hash(weights)
        self.store.put_model(h, encode_tensors(weights), round=0)
        log.info("coordinator: stored round-0 model %s", h[:12])
        return h

    def start(self) -> list[RoundResult]:
        """Subscribe ingest to every site's update topic and detections and secure aggregation to theirs, connect
        (MQTT: after the handlers are in place, since a resumed persistent session delivers what the broker kept
        right after it connects), store the round-0 model, and close any round a previous run left open. Returns
        the recovered rounds. Idempotent.

        With an MQTT transport on a persistent session this process first takes the federation's lock
        (coordinator.instance_lock): one coordinator process per session at a time.

        Raises:
            CoordinatorRunning: another coordinator process holds the lock (nothing is started).
            TransportError: the broker cannot be reached (the lock is released again).
        """
        if self._started:
            return []
        if getattr(self.transport, "persistent_session", False):
            self._instance_lock.acquire()
        try:
            return self._start()
        except BaseException:
            self._instance_lock.release()
            raise

    def _start(self) -> list[RoundResult]:
        if self.config.ingest_workers == 0:  # else `ingest-worker` processes take them (coordinator.inbound.workers)
            self.ingestor.sole_ingest = True  # the open round's updates are all stored by this process
            handler: Any = self.transfers
            if isinstance(self.transport, MqttTransport):  # off paho's network thread (in-process buses stay sync)
                # ... and that thread drives group commit (coordinator.inbound.group_commit): updates in flight together
                # share one fsync pass and one commit, each ACKed after its group is durable.
                handler = self._update_queue = QueuedCallback(self.transfers, name="wildfed-ingest",
                                                              flush=self.ingestor.flush_async,
                                                              flush_in=self.ingestor.flush_in,
                                                              busy=lambda: self.ingestor.committing)
                self.ingestor.defer_commits = True
                self.ingestor.commit_in_background()  # a group's fsyncs overlap the checks of the next
            self.transport.subscribe(updates_filter(self.config.federation_id), handler)
        self.transport.subscribe(detections_filter(self.config.federation_id), self.detections)
        self.transport.subscribe(secagg_filter(self.config.federation_id), self.secagg)
        self.transport.subscribe(health_filter(self.config.federation_id), self.fleet)
        self.transport.subscribe(status_filter(self.config.federation_id), self.fleet)  # retained: each site's latest
        if isinstance(self.transport, MqttTransport):
            self.transport.connect()
            if self.config.ingest_workers > 0 and self.transport.persistent_session:
                # the workers take the updates: a subscription an earlier config left in the session would make
                # the broker send (and, while this process is down, queue) every update here too
                self.transport.unsubscribe([updates_filter(self.config.federation_id)])
        self.ensure_initial_model()
        self.rounds.restore_optimizer_state()
        self.transfers.sweep()  # expired uploads, and staging a killed process left for a stored update
        self._started = True
        recovered = self.rounds.recover()
        self.releases.catch_up()  # sites enrolled since, releases that failed, a database from before releases
        self.software.catch_up()  # an SDK version recorded by `publish-update` while no coordinator ran
        return recovered

    def close(self) -> None:
        """Stop ingesting (what was checked before the stop is made durable and ACKed), then disconnect the
        transport (if the coordinator built it; it lets its last ACKs go out first) and release database
        connections. The ACKs need the transport: it is closed last.

        A persistent session is first unsubscribed from the update, secure-aggregation, health and presence topics,
        so that while this process is stopped the broker queues detection records only: a gateway re-sends an update
        until it is ACKed (every ``resend_interval_s``: queued, the copies would fill the broker's queue for this
        client and push detection records out of it), a secure-aggregation message is of no use once its round has
        ended, health records come again every ``health_interval_s`` and presence is retained (the next subscription
        delivers each site's latest). The next start subscribes to them again. After a crash the subscriptions stay,
        and the broker queues those messages too until the coordinator is back (docs/service.md)."""
        if getattr(self.transport, "persistent_session", False) and self._started:
            fed = self.config.federation_id
            quiet = [updates_filter(fed), secagg_filter(fed), health_filter(fed), status_filter(fed)]
            self.transport.unsubscribe(quiet)  # type: ignore[attr-defined]
        if self._update_queue is not None:
            self._update_queue.close()
            self.ingestor.flush()
        if self._owns_transport and isinstance(self.transport, MqttTransport):
            self.transport.close()
        self.store.dispose()
        self._instance_lock.release()

    def __enter__(self) -> "Coordinator":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- operations --------------------------------------------------------------------------------------------
    def enrol(self, site_id: str, public_key_pem: str, metadata: Mapping[str, Any] | None = None) -> Site:
        """Enrol a site (see :meth:`coordinator.registry.SiteRegistry.enrol`; raises ``EnrolmentError``)."""
        return self.registry.enrol(site_id, public_key_pem, metadata)

    def release_models(self) -> dict[str, str]:
        """Release the current model to the camera sites that lack it (:meth:`ModelPublisher.catch_up`); returns
        ``{site: model hash released}``. ``service`` calls it at every look at the schedule."""
        return self.releases.catch_up()

    def publish_software(self) -> dict[str, str]:
        """Publish the SDK version recorded by ``publish-update`` to the sites that lack it
        (:meth:`SoftwarePublisher.catch_up`); returns ``{site: version}``. ``service`` calls it at every look at
        the schedule."""
        return self.software.catch_up()

    def run_round(self) -> RoundResult:
        """Run the next round (starts the coordinator first if needed)."""
        self.start()
        return self.rounds.run_round()

    def iter_rounds(self, rounds: int | None = None) -> Iterator[RoundResult]:
        """Run rounds until ``rounds`` (default ``config.rounds``) rounds exist, yielding each result; stops early
        when no site can train any more (every site halted). Buffered rounds end with one more round that sends no
        task and folds the updates still waiting or in flight (:meth:`RoundManager.drain_buffer`), when there are
        any."""
        self.start()
        target = self.config.rounds if rounds is None else rounds
        while self.rounds.next_round() <= target:
            result = self.rounds.run_round()
            yield result
            if result.status == "skipped":
                break
        drained = self.rounds.drain_buffer()
        if drained is not None:
            yield drained

    def run(self, rounds: int | None = None,
            on_round: Callable[[RoundResult], None] | None = None) -> list[RoundResult]:
        """Run the configured rounds; ``on_round`` is called after each (progress bars)."""
        out = []
        for result in self.iter_rounds(rounds):
            out.append(result)
            if on_round is not None:
                on_round(result)
        return out

    # ---- reports -----------------------------------------------------------------------------------------------
    def status(self) -> StatusReport:
        """Rounds, accepted updates and rejections counted by reason, read from the database."""
        return status_report(self.store, self.registry)

    def budget_rows(self) -> list[BudgetRow]:
        """Epsilon spent vs budget for every enrolled site and every IUCN category."""
        return budget_rows(self.config, self.registry, self.ledger)


def build_optimizer(config: CoordinatorConfig) -> ServerOptimizer:
    """The server optimizer ``config.server_optimizer`` names, with step size ``config.server_learning_rate``:
    server SGD (optionally with momentum), DP-FedSOFIM (on G or on M) or FedAdam."""
    cfg = config.server_optimizer
    if cfg.kind == "sgd":
        return ServerSGD(config.server_learning_rate, momentum=cfg.momentum)
    if cfg.kind == "fedadam":
        from coordinator.optimizers.fedadam import ServerAdam

        return ServerAdam(learning_rate=config.server_learning_rate, beta1=cfg.beta1, beta2=cfg.beta2, tau=cfg.tau)
    from coordinator.optimizers.fedsofim import DPFedSOFIM

    if cfg.precondition == "gradient" and config.privacy != "none":
        log.warning("server_optimizer: DP-FedSOFIM preconditioning the gradient (the seed's step) moved against the "
                    "aggregates' common direction under DP noise and ended at chance accuracy at eps <= 1 with the "
                    "head model (docs/fedsofim.md); precondition: momentum, or kind: sgd with momentum, did not")
    return DPFedSOFIM(learning_rate=config.server_learning_rate, beta=cfg.beta, rho=cfg.rho,
                      warmup_rounds=cfg.warmup_rounds, precondition=cfg.precondition)


def build_strategy(config: CoordinatorConfig, store: Store, registry: SiteRegistry) -> Strategy:
    """The aggregation strategy ``config.strategy`` names: FedAvg, or NIRA over the registry's public metadata
    with its state in ``store`` (coordinator/strategies/nira.py)."""
    cfg = config.strategy
    if cfg.kind == "fedavg":
        return FedAvg()
    from coordinator.strategies.nira import NIRA

    species = config.species or []
    return NIRA(store=store, site_metadata=lambda: {site.site_id: site.metadata for site in registry.list()},
                cut=cfg.cut, exclude_categories=tuple(c.value for c in cfg.exclude_categories),
                species_classes={e.scientific_name: e.class_index for e in species} or None,
                species_categories={e.scientific_name: e.iucn_category.value for e in species} or None,
                recluster_every=cfg.recluster_every, recluster_margin=cfg.recluster_margin,
                min_rounds_between_moves=cfg.min_rounds_between_moves, embedding_merging=cfg.embedding_merging,
                head_prefix=cfg.head_prefix,
                count_noise=cfg.count_noise_multiplier if cfg.embedding_weights == "noisy_counts" else None,
                phi_weighting=cfg.phi_weighting, min_cluster_records=cfg.min_cluster_records,
                recluster_min_snr=cfg.recluster_min_snr)


def status_report(store: Store, registry: SiteRegistry) -> StatusReport:
    """Build a :class:`StatusReport` from the database alone (used by the CLI without starting a coordinator)."""
    rows = store.rounds()
    return StatusReport(rounds=[(r.round, r.status, r.num_accepted, r.new_model_hash) for r in rows],
                        accepted=store.count_updates(), rejections=store.rejection_counts(),
                        sites=len(registry.list()), model_hash=store.latest_model_hash(),
                        details={r.round: (r.privacy, r.detail) for r in rows}, detections=detection_counts(store))


def budget_rows(config: CoordinatorConfig, registry: SiteRegistry, ledger: PrivacyLedger) -> list[BudgetRow]:
    """Per (site, category): spent epsilon (ledger, all recorded events), budget, halted flag."""
    budgets = config.budgets()
    out = []
    for site in registry.list():
        halted = ledger.halted(site.site_id)
        spent = ledger.spent_by_category(site.site_id, IUCNCategory)  # one read of the site's rows
        for cat in IUCNCategory:
            out.append(BudgetRow(site_id=site.site_id, category=cat, spent=spent[cat], budget=budgets[cat],
                                 halted=cat in halted))
    return out
