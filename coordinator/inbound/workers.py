"""Scale-out ingest: several worker processes on one MQTT shared subscription, partial sums merged at close.

docs/transport.md, "Scale-out": past a few hundred gateways, updates are ingested by N workers. Each worker

* subscribes to ``$share/<group>/wildfed/v1/<federation>/site/+/update`` (MQTT 5.0, sec. 4.8.2; Mosquitto >= 1.6
  and EMQX also serve shared subscriptions to MQTT 3.1.1 clients), so the broker hands each message to one worker;
* runs the same :class:`~coordinator.inbound.transfers.TransferReceiver` and
  :class:`~coordinator.inbound.ingest.Ingestor` as a single coordinator, with the round it ingests for read from the
  database (the round row the finaliser opened);
* keeps a FedAvg running sum of what it accepted and, after every commit group that accepted updates
  (coordinator.inbound.group_commit), writes it durably as its *partial sum* (``partial_sums`` table + a blob), with the
  sites it covers and what they reported.

The finaliser (the coordinator process that opens and closes rounds, ``ingest_workers > 0`` in its config) does not
subscribe to updates. It waits until the round's ``updates`` rows reach the quorum, then closes the round in the
database (under a lock on the round row, so a worker either stored its update before the close or sees the round
closed and charges the update as late: :meth:`coordinator.storage.Store.add_update_if_open`) and merges: the sum of
the workers' partial sums (``coordinator.strategies.fedavg.merge``; addition is associative) plus, for any stored
update that no partial covers (a worker died between storing it and writing its partial), the update itself, read
from its blob. Each stored update is therefore aggregated exactly once, and its events are charged once (ledger
rows are unique per site, round and category). The partial sums' encoding and the merge are
:mod:`coordinator.inbound.partial_sums`; the task resends a worker answers are :mod:`coordinator.outgoing`.

State shared by the workers and the finaliser: the database (PostgreSQL; SQLite only on one machine) and the blob
directory ``data_dir`` (accepted payloads, partial sums, chunk staging), which must be one shared folder. The
broker hands each *message* to one worker, so the chunks of one upload are spread over the workers: a worker stages
every chunk on disk in the shared folder and records every manifest in the database (``shared_staging``,
coordinator.inbound.staging; a single coordinator keeps chunks in memory instead), and whichever worker receives a
transfer's last chunk assembles it. The path
to an MQTT cluster: point every worker and gateway at the cluster's listener (EMQX cluster, or Mosquitto bridges);
shared subscriptions are then balanced cluster-wide (EMQX) or per node (bridged Mosquitto: give each node's
workers the same group name). Only FedAvg is merged this way; NIRA's per-cluster heads are sums too, but are not
wired for workers (the config refuses ``strategy: nira`` with workers).
"""

from __future__ import annotations

import json
import logging
import threading
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select

from shared.codec import decode_tensors
from shared.iucn import IUCNCategory
from shared.keys import load_private_key
from shared.topics import updates_filter

from coordinator.config import CoordinatorConfig
from coordinator.inbound.context import Accepted, RoundContext
from coordinator.inbound.group_commit import GroupCommitPolicy
from coordinator.inbound.ingest import Ingestor
from coordinator.inbound.partial_sums import accepted_to_json, encode_partial
from coordinator.inbound.site_checks import ReplayWindow
from coordinator.inbound.transfers import TransferLimits, TransferReceiver
from coordinator.ledger import PrivacyLedger
from coordinator.radio import expected_events
from coordinator.outgoing import answer_download_receipt
from coordinator.registry import SiteRegistry
from coordinator.storage import HaltRow, PartialSumRow, RoundRow, Store
from coordinator.strategies.fedavg import FedAvg
from coordinator.transport import Transport
from coordinator.transport.handlers import QueuedCallback
from coordinator.transport.mqtt import MqttTransport, transport_from_config

__all__ = ["SHARE_GROUP", "shared_updates_filter", "IngestWorker"]

log = logging.getLogger(__name__)

SHARE_GROUP = "wildfed-ingest"


def shared_updates_filter(federation_id: str, group: str = SHARE_GROUP) -> str:
    """``$share/<group>/<updates filter>``: the broker gives each update message to one member of ``group``."""
    return f"$share/{group}/{updates_filter(federation_id)}"


class IngestWorker:
    """One ingest worker (see the module docstring). ``wildfed-coordinator ingest-worker`` runs it.

    Args:
        config: the federation's coordinator config (same database, data_dir, keys, transfer limits).
        worker_id: unique name of this worker (its partial-sum rows are keyed by it).
        transport: default: an MQTT client on ``config.broker_url`` subscribed to :func:`shared_updates_filter`.
        signing_key: the coordinator's key (signs ACKs and receipts); default: ``config.signing_key_path``.
        schema: PostgreSQL schema (tests).

    Raises:
        ConfigError: unreachable database, unsafe key file, or a strategy other than FedAvg.
    """

    def __init__(self, config: CoordinatorConfig, worker_id: str, *, transport: Transport | None = None,
                 signing_key: Ed25519PrivateKey | None = None, schema: str | None = None) -> None:
        from shared.errors import ConfigError

        if config.strategy.kind != "fedavg":
            raise ConfigError(f"ingest workers merge FedAvg sums only, the config asks for {config.strategy.kind}",
                              field="strategy", fix="use strategy: {kind: fedavg} with ingest_workers")
        self.config = config
        self.worker_id = worker_id
        self.store = Store(config.database_url or "", config.data_dir, schema=schema)
        self.registry = SiteRegistry(self.store)
        self.ledger = PrivacyLedger(self.store, target_delta=config.target_delta, accountant=config.accountant,
                                    max_pending=config.pending_rounds_cap())
        self._owns_transport = transport is None
        self.transport: Transport = transport if transport is not None else transport_from_config(
            config, client_id=f"wildfed-ingest-{config.federation_id}-{worker_id}", role=worker_id)  # own account
        key = signing_key if signing_key is not None else load_private_key(config.signing_key_path)
        t = config.transfer
        self.ingestor = Ingestor(federation_id=config.federation_id, store=self.store, registry=self.registry,
                                 ledger=self.ledger, transport=self.transport, signing_key=key,
                                 replay_window=ReplayWindow(t.max_clock_skew_s, t.max_message_age_s),
                                 group_commit=GroupCommitPolicy.from_config(config.group_commit))
        self.ingestor.on_accepted = self._note_accepted
        self._dirty: RoundContext | None = None  # the round whose running sum changed since its partial was written
        self.receiver = TransferReceiver(
            federation_id=config.federation_id, store=self.store, registry=self.registry, ingestor=self.ingestor,
            transport=self.transport, signing_key=key,
            limits=TransferLimits(max_chunk_bytes=t.max_chunk_bytes, max_update_bytes=t.max_update_bytes,
                                  max_message_bytes=t.max_message_bytes, ttl_s=t.ttl_s,
                                  memory_limit_bytes=t.memory_limit_bytes, spill_above_bytes=t.spill_above_bytes),
            on_download_receipt=lambda site, r, receipt: answer_download_receipt(
                config, self.transport, key, self.ingestor.context, site, r, receipt),
            shared_staging=True)  # the broker spreads one transfer's chunks over the workers (inbound.staging)
        self._lock = threading.Lock()
        self._queue: QueuedCallback | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect (MQTT) and join the shared subscription."""
        if isinstance(self.transport, MqttTransport):
            self.transport.connect()
        handler = self.on_message
        if isinstance(self.transport, MqttTransport):  # off paho's network thread (coordinator.transport)
            handler = self._queue = QueuedCallback(self.on_message, name=f"wildfed-ingest-{self.worker_id}",
                                                   flush=self._flush, flush_in=self.ingestor.flush_in)
            self.ingestor.defer_commits = True
        self.transport.subscribe(shared_updates_filter(self.config.federation_id), handler)
        log.info("ingest worker %s: listening on %s", self.worker_id,
                 shared_updates_filter(self.config.federation_id))

    def close(self) -> None:
        """Disconnect (if this worker built the transport) and release the database."""
        if self._owns_transport and isinstance(self.transport, MqttTransport):
            self.transport.close()
        if self._queue is not None:
            self._queue.close()
        self.store.dispose()

    # ---- messages ----------------------------------------------------------------------------------------------
    def on_message(self, topic: str, raw: bytes) -> object:
        """Transport callback: bring the round context up to date with the database, then receive the message."""
        with self._lock:
            self.refresh_round()
            try:
                return self.receiver.handle(topic, raw)
            finally:
                self._write_dirty_partial()

    def _flush(self) -> None:
        """Group commit, driven by the ingest thread (coordinator.inbound.group_commit), under the worker's lock; then
        the partial sum, once for the whole group."""
        with self._lock:
            try:
                self.ingestor.flush()
            finally:
                self._write_dirty_partial()

    def _note_accepted(self, ctx: RoundContext, accepted: Accepted) -> None:
        self._dirty = ctx

    def _write_dirty_partial(self) -> None:
        ctx, self._dirty = self._dirty, None
        if ctx is not None:
            self._write_partial(ctx)

    def refresh_round(self) -> RoundContext | None:
        """Open ingest for the round the finaliser has open in the database (a new FedAvg sum per round), or close
        it when none is open. Returns the current context."""
        with self.store.session() as s:
            row = s.scalars(select(RoundRow).where(RoundRow.status == "open").order_by(RoundRow.round.desc())).first()
            halts = list(s.scalars(select(HaltRow))) if row is not None else []
        ctx = self.ingestor.context
        if row is None:
            if ctx is not None:
                self.ingestor.close_round()
            return None
        if ctx is not None and ctx.round == row.round:
            return ctx
        weights, _ = decode_tensors(self.store.get_model(row.base_model_hash))
        halted: dict[str, set[IUCNCategory]] = {}
        for h in halts:
            halted.setdefault(h.site_id, set()).add(IUCNCategory(h.category))
        for site_id in json.loads(row.selected_json):  # record-level budgets: halted in every cohort of the round
            if self.ledger.cohort_targets(site_id, row.round) != [(site_id, frozenset())]:
                halted[site_id] = set(self.ledger.halted_in_round(site_id, row.round))
        strategy = FedAvg()
        strategy.begin_round(weights)
        cfg = self.config
        ctx = RoundContext(round=row.round, model_hash=row.base_model_hash, template=weights,
                           selected=frozenset(json.loads(row.selected_json)),
                           halted={k: frozenset(v) for k, v in halted.items()}, budgets=cfg.budgets(),
                           privacy=cfg.privacy, local_steps=_local_steps(cfg), strategy=strategy, bundle=weights,
                           expected_events=expected_events(cfg))
        self.ingestor.open_round(ctx)
        log.info("ingest worker %s: ingesting round %d", self.worker_id, row.round)
        return ctx

    def _write_partial(self, ctx: RoundContext) -> None:
        """After each commit group that accepted updates: this worker's partial sum and covered sites, durably
        (blob, then row). A worker killed before it is written leaves stored updates no partial covers: the
        finaliser reads those from their blobs (module docstring)."""
        acc = ctx.strategy.running_sum  # type: ignore[attr-defined] - FedAvg
        digest = self.store.put_blob(encode_partial(acc))
        sites = [accepted_to_json(a) for a in ctx.accepted.values()]
        with self.store.session() as s:
            row = s.scalars(select(PartialSumRow).where(PartialSumRow.round == ctx.round,
                                                        PartialSumRow.worker_id == self.worker_id)).first()
            if row is None:
                s.add(PartialSumRow(round=ctx.round, worker_id=self.worker_id, blob_sha256=digest,
                                    sites_json=json.dumps(sites), total_weight=acc.total_weight))
            else:
                row.blob_sha256, row.sites_json, row.total_weight = digest, json.dumps(sites), acc.total_weight


def _local_steps(config: CoordinatorConfig) -> int:
    radio = config.radio if config.model == "radio_unet" else None
    return radio.local_epochs if radio is not None else config.local_steps
