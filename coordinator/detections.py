"""Detection ingest: verify signed DETECTION envelopes from gateways and store their records.

:meth:`DetectionIngestor.handle` checks, in this order (the first failure decides the reason code, the codes of
``coordinator.ingest.RejectReason``):

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
An accepted record is committed to the ``detections`` table (one row per site and media id). MQTT QoS 1 delivers at
least once: a re-delivery with the same payload hash is a no-op; a record for a media id already stored with a
different payload (the gateway re-ran the image, e.g. with a newer classifier) replaces the row when its envelope
is newer and is ignored when older. No ACK is sent (records are not charged to any privacy budget: they are
outputs of the site's own model on its own images, shown to its rangers; see docs/inference.md).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import threading
from collections import Counter
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from shared.envelope import Envelope, MessageKind
from shared.errors import PayloadError
from shared.protocol import DetectionRecord, decode_detection

from coordinator.ingest import RejectReason, Rejected, _Reject, parse_site_envelope, verify_site_envelope

#: A detection record carries boxes and species scores, never the image: anything over 1 MiB is refused unparsed.
MAX_DETECTION_BYTES = 1 << 20
from coordinator.registry import SiteRegistry
from coordinator.storage import DetectionRow, Store

__all__ = ["StoredDetection", "DetectionIngestor"]

log = logging.getLogger(__name__)


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
                    raise _Reject(RejectReason.MALFORMED_PAYLOAD, str(exc), exc) from exc
                result: StoredDetection | Rejected = self._store_record(env, record)
                self.counts[result.status] += 1
            except _Reject as rej:
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
        status = "stored"
        try:
            with self._store.session() as s:
                row = s.scalars(select(DetectionRow).where(DetectionRow.site_id == h.site_id,
                                                           DetectionRow.media_id == record.media_id)).first()
                if row is None:
                    s.add(DetectionRow(site_id=h.site_id, media_id=record.media_id, **values))
                elif row.payload_sha256 == h.payload_digest:
                    status = "duplicate"
                elif sent_at >= row.sent_at:
                    for k, v in values.items():
                        setattr(row, k, v)
                    status = "replaced"
                else:
                    status = "stale"
        except IntegrityError:  # another worker stored the same media first
            status = "duplicate"
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
