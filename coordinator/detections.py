"""Detection ingest: verify signed DETECTION envelopes from gateways and store their records.

:meth:`DetectionIngestor.handle` checks, in this order (the first failure decides the reason code, the codes of
``coordinator.inbound.reject.RejectReason``):

==== ================================================================ =======================
 #    check                                                            reason on failure
==== ================================================================ =======================
 1    bytes parse as an envelope                                       ``malformed_envelope``
 2    topic is a WildFed detection topic                               ``bad_topic``
 3    header kind is DETECTION                                         ``wrong_kind``
 4    federation of header and topic is ours                           ``wrong_federation``
 5    site in the topic == site in the header                          ``topic_mismatch``
 6    site is enrolled                                                 ``unknown_site``
 7    Ed25519 signature, payload length and SHA-256 verify             ``bad_signature``
      (the site's enrolled key)
 8    payload decodes (shared.protocol.decode_detection)               ``malformed_payload``
==== ================================================================ =======================

Rejections are logged, stored in the ``rejections`` table and counted (``wildfed-coordinator status`` shows them).
An accepted record is committed to the ``detections`` table (one row per site and media id, the media id the
photo's own, ``shared.camtrap_dp.media_id``), and its outcome is counted in ``detection_tallies`` in the same
transaction, so ``status`` reads the counts from the database. Each record is therefore stored exactly once, or
refused visibly: MQTT QoS 1 delivers at least once (and the coordinator's persistent session re-delivers what it
did not acknowledge before a stop, coordinator.transport), so a re-delivery with the same payload digest is a no-op
counted as ``duplicate``; a record for a media id already stored with a different payload (the gateway re-ran the
image, e.g. with a newer classifier) replaces the row when its envelope is newer (``replaced``) and is ignored when
older (``stale``). The transport acknowledges a message only after this handler returned, i.e. after the commit.
No ACK is sent to the gateway (records are not charged to any privacy budget: they are outputs of the site's own
model on its own images, shown to its rangers; see docs/inference.md).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.envelope import Envelope, MessageKind
from shared.errors import PayloadError
from shared.protocol import DetectionRecord, decode_detection

from coordinator.inbound.reject import Reject, RejectReason, Rejected
from coordinator.inbound.site_checks import parse_site_envelope, verify_site_envelope
from coordinator.registry import SiteRegistry
from coordinator.storage import DetectionRow, DetectionTallyRow, RejectionRow, Store

__all__ = ["MAX_DETECTION_BYTES", "OUTCOMES", "StoredDetection", "DetectionIngestor", "DetectionCounts",
           "detection_counts"]

log = logging.getLogger(__name__)

#: A detection record carries boxes and species scores, never the image: anything over 1 MiB is refused unparsed.
MAX_DETECTION_BYTES = 1 << 20
#: What a verified record can lead to (:class:`StoredDetection` ``status``), as ``status`` lists them.
OUTCOMES = ("stored", "duplicate", "replaced", "stale")
_CHANNEL = MessageKind.DETECTION.value  # the last level of a detection topic (shared.topics)


@dataclass(frozen=True)
class StoredDetection:
    """A verified record: ``status`` is ``stored`` (new row), ``replaced`` (newer record for the same media),
    ``duplicate`` (same payload again) or ``stale`` (an older record than the one stored)."""

    site_id: str
    media_id: str
    status: str
    record: DetectionRecord


class DetectionIngestor:
    """Verifies and stores detection records (see the module docstring); thread-safe, never raises for bad input.

    Args:
        federation_id: our federation.
        store, registry: coordinator state (enrolled keys, the detections table).
    """

    def __init__(self, *, federation_id: str, store: Store, registry: SiteRegistry) -> None:
        self.federation_id = federation_id
        self._store = store
        self._registry = registry
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def __call__(self, topic: str, raw: bytes) -> None:
        """Transport callback form of :meth:`handle`."""
        self.handle(topic, raw)

    def handle(self, topic: str, raw: bytes) -> StoredDetection | Rejected:
        """Process one message; returns what happened."""
        with self._lock:
            env: Envelope | None = None
            try:
                env = self._parse(topic, raw)
                self._verify(env)
                try:
                    record = decode_detection(env.payload)
                except PayloadError as exc:
                    raise Reject(RejectReason.MALFORMED_PAYLOAD, str(exc), exc) from exc
                result: StoredDetection | Rejected = self._store_record(env, record)
                self.counts[result.status] += 1
            except Reject as rej:
                h = env.header if env is not None else None
                result = Rejected(reason=rej.reason, detail=rej.detail, error_kind=rej.error_kind,
                                  site_id=h.site_id if h is not None else None,
                                  round=h.round if h is not None else None)
                self.counts[rej.reason.value] += 1
                log.warning("detections: rejected message on %s: %s: %s", topic, rej.reason.value, rej.detail)
                self._store.add_rejection(round=result.round, site_id=result.site_id, topic=topic,
                                          reason=rej.reason.value, error_kind=rej.error_kind, detail=rej.detail)
            return result

    # ---- checks --------------------------------------------------------------------------------------------
    def _parse(self, topic: str, raw: bytes) -> Envelope:
        return parse_site_envelope(topic, raw, federation_id=self.federation_id, kind=MessageKind.DETECTION,
                                   max_bytes=MAX_DETECTION_BYTES)

    def _verify(self, env: Envelope) -> None:
        verify_site_envelope(env, self._registry)

    # ---- storage -------------------------------------------------------------------------------------------
    def _store_record(self, env: Envelope, record: DetectionRecord) -> StoredDetection:
        h = env.header
        sent_at = _dt.datetime.fromtimestamp(h.timestamp / 1000, tz=_dt.timezone.utc).replace(tzinfo=None)
        top = max(record.detections, key=lambda d: d.confidence, default=None)
        values = dict(deployment_id=record.deployment_id, file=record.file, captured_at=record.timestamp,
                      num_detections=len(record.detections),
                      max_confidence=top.confidence if top is not None else None,
                      top_species=top.species if top is not None else None,
                      top_species_confidence=top.species_confidence if top is not None else None,
                      failure=record.failure, record_json=json.dumps(record.to_json(), sort_keys=True),
                      species_json=json.dumps(sorted({d.species for d in record.detections if d.species})),
                      source="gateway",
                      sequence=h.sequence, payload_sha256=h.payload_digest, sent_at=sent_at)
        for attempt in range(3):
            try:
                with self._store.session() as s:
                    status = _write_record(s, h.site_id, record.media_id, h.payload_digest, sent_at, values)
                    _tally(s, h.site_id, status)
                break
            except IntegrityError:  # another process stored this media (or this site's first such outcome) first
                if attempt == 2:
                    raise
        log.info("detections: %s record %s from %s (%d detections)", status, record.media_id, h.site_id,
                 len(record.detections))
        return StoredDetection(site_id=h.site_id, media_id=record.media_id, status=status, record=record)

    # ---- reads (ranger view) -------------------------------------------------------------------------------
    def records(self, site_id: str | None = None) -> list[DetectionRecord]:
        """Stored records, oldest first, of one site or all."""
        with self._store.session() as s:
            q = select(DetectionRow).order_by(DetectionRow.id)
            if site_id is not None:
                q = q.where(DetectionRow.site_id == site_id)
            return [DetectionRecord.from_json(json.loads(r.record_json)) for r in s.scalars(q)]


def _write_record(s: Session, site_id: str, media_id: str, digest: str, sent_at: _dt.datetime,
                  values: dict[str, Any]) -> str:
    """Store one verified record in session ``s``; returns the outcome (:class:`StoredDetection` ``status``)."""
    row = s.scalars(select(DetectionRow).where(DetectionRow.site_id == site_id,
                                               DetectionRow.media_id == media_id)).first()
    if row is None:
        s.add(DetectionRow(site_id=site_id, media_id=media_id, **values))
        s.flush()  # a concurrent insert of the same (site, media) fails here, inside the retry
        return "stored"
    if row.payload_sha256 == digest:
        return "duplicate"
    if sent_at >= row.sent_at:
        for k, v in values.items():
            setattr(row, k, v)
        return "replaced"
    return "stale"


def _tally(s: Session, site_id: str, outcome: str) -> None:
    """Count ``outcome`` for ``site_id`` in the transaction that wrote the record (``detection_tallies``)."""
    row = s.get(DetectionTallyRow, (site_id, outcome), with_for_update=True)
    if row is None:
        s.add(DetectionTallyRow(site_id=site_id, outcome=outcome, count=1))
        s.flush()
    else:
        row.count += 1


@dataclass(frozen=True)
class DetectionCounts:
    """Detection records as the database holds them (``wildfed-coordinator status``).

    Attributes:
        rows: stored records (one per site and media id). from_gateways: of those, from verified gateway records
            (the rest were imported by an operator).
        outcomes: how often a gateway's verified record was ``stored``, a ``duplicate`` (e.g. a broker's
            re-delivery: nothing written), ``replaced`` (a newer record of the same media) or ``stale`` (older,
            ignored), summed over sites (``detection_tallies``).
        refused: records refused, counted per reason code (``rejections`` of the detection topics).
    """

    rows: int
    from_gateways: int
    outcomes: dict[str, int]
    refused: dict[str, int]


def detection_counts(store: Store) -> DetectionCounts:
    """Read :class:`DetectionCounts` from ``store`` (no in-memory state: a fresh process sees the same)."""
    with store.session() as s:
        by_source = dict(s.execute(select(DetectionRow.source == "gateway", func.count())
                                   .group_by(DetectionRow.source == "gateway")).all())
        outcomes = {o: int(n) for o, n in s.execute(select(DetectionTallyRow.outcome, func.sum(DetectionTallyRow.count))
                                                    .group_by(DetectionTallyRow.outcome)).all()}
        refused = {r: int(n) for r, n in s.execute(select(RejectionRow.reason, func.count())
                                                   .where(RejectionRow.topic.like(f"%/{_CHANNEL}"))
                                                   .group_by(RejectionRow.reason)).all()}
    gateway = int(by_source.get(True, 0))
    return DetectionCounts(rows=gateway + int(by_source.get(False, 0)), from_gateways=gateway,
                           outcomes={o: outcomes.get(o, 0) for o in OUTCOMES}, refused=refused)
