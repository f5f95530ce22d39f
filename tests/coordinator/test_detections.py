"""Detection ingest: signed records from enrolled sites are stored; tampered, unsigned or misaddressed ones are
rejected and counted."""

from __future__ import annotations

import dataclasses

import pytest

from shared.envelope import Envelope, MessageKind, seal
from shared.keys import generate_signing_key, public_key_to_pem
from shared.protocol import Detection, DetectionRecord, encode_detection
from shared.topics import detection_topic, update_topic

from coordinator.detections import StoredDetection
from coordinator.inbound.reject import Rejected, RejectReason
from coordinator.storage import DetectionRow
from tests.coordinator.helpers import FED


def record(media: str = "a" * 32, species: str = "Vulpes vulpes", conf: float = 0.8) -> DetectionRecord:
    return DetectionRecord(media_id=media, file="StationA/PBE/x.JPG", deployment_id="StationA",
                           timestamp="2009-04-21T00:40:00+00:00", timestamp_source="exif", width=100, height=75,
                           detections=(Detection("animal", 0.9, (0.1, 0.2, 0.5, 0.6), species, 3, conf),),
                           detector="yolox_tiny", classifier_hash="c" * 64)


def envelope(key, rec: DetectionRecord, *, site: str = "site-1", sequence: int = 1, timestamp: int = 1_000,
             kind: MessageKind = MessageKind.DETECTION) -> bytes:
    return seal(private_key=key, federation_id=FED, site_id=site, round=0, base_model_hash="",
                kind=kind, sequence=sequence, payload=encode_detection(rec), timestamp=timestamp).to_bytes()


@pytest.fixture
def setup(federation):
    coord, transport, _ = federation()
    coord.start()
    key = generate_signing_key()
    coord.enrol("site-1", public_key_to_pem(key.public_key()))
    return coord, transport, key


def rows(coord) -> list[DetectionRow]:
    with coord.store.session() as s:
        return list(s.query(DetectionRow).order_by(DetectionRow.id))


def test_a_signed_record_published_on_the_detection_topic_is_stored(setup):
    # Prepare
    coord, transport, key = setup
    rec = record()
    # Execute: through the transport, as from the broker
    transport.publish(detection_topic(FED, "site-1"), envelope(key, rec))
    # Assert
    (row,) = rows(coord)
    assert (row.site_id, row.media_id, row.deployment_id, row.num_detections) == ("site-1", "a" * 32, "StationA", 1)
    assert row.top_species == "Vulpes vulpes" and row.top_species_confidence == pytest.approx(0.8)
    assert row.captured_at == "2009-04-21T00:40:00+00:00" and row.max_confidence == pytest.approx(0.9)
    assert coord.detections.records("site-1") == [rec]
    assert coord.detections.counts["stored"] == 1


def test_a_tampered_record_is_rejected_and_not_stored(setup):
    coord, _, key = setup
    raw = envelope(key, record())
    env = Envelope.from_bytes(raw)
    forged = encode_detection(record(species="Panthera tigris", conf=0.99))
    tampered = dataclasses.replace(env, payload=forged).to_bytes()
    result = coord.detections.handle(detection_topic(FED, "site-1"), tampered)
    assert isinstance(result, Rejected) and result.reason is RejectReason.BAD_SIGNATURE
    flipped = raw[:-5] + bytes([raw[-5] ^ 0x01]) + raw[-4:]
    assert coord.detections.handle(detection_topic(FED, "site-1"), flipped).reason is RejectReason.BAD_SIGNATURE
    assert rows(coord) == []
    assert coord.status().rejections == {"bad_signature": 2}


def test_records_signed_by_another_key_or_site_are_rejected(setup):
    coord, _, key = setup
    stranger = generate_signing_key()
    topic = detection_topic(FED, "site-1")
    assert coord.detections.handle(topic, envelope(stranger, record())).reason is RejectReason.BAD_SIGNATURE
    other = detection_topic(FED, "site-9")
    assert coord.detections.handle(other, envelope(stranger, record(), site="site-9")).reason \
        is RejectReason.UNKNOWN_SITE
    assert coord.detections.handle(other, envelope(key, record())).reason is RejectReason.TOPIC_MISMATCH
    assert coord.detections.handle(topic, envelope(key, record(), kind=MessageKind.UPDATE)).reason \
        is RejectReason.WRONG_KIND
    assert coord.detections.handle(update_topic(FED, "site-1"), envelope(key, record())).reason \
        is RejectReason.WRONG_KIND
    assert coord.detections.handle(topic, b"garbage").reason is RejectReason.MALFORMED_ENVELOPE
    bad_payload = seal(private_key=key, federation_id=FED, site_id="site-1", round=0, base_model_hash="",
                       kind=MessageKind.DETECTION, sequence=1, payload=b"not safetensors").to_bytes()
    assert coord.detections.handle(topic, bad_payload).reason is RejectReason.MALFORMED_PAYLOAD
    assert rows(coord) == []


def test_redelivery_is_a_no_op_and_a_newer_record_replaces_the_old(setup):
    coord, _, key = setup
    topic = detection_topic(FED, "site-1")
    first = envelope(key, record(), timestamp=1_000)
    assert coord.detections.handle(topic, first).status == "stored"
    assert coord.detections.handle(topic, first).status == "duplicate"  # QoS 1 re-delivery
    newer = record(species="Felis catus", conf=0.6)
    result = coord.detections.handle(topic, envelope(key, newer, sequence=2, timestamp=2_000))
    assert isinstance(result, StoredDetection) and result.status == "replaced"
    older = record(species="Canis lupus", conf=0.7)
    assert coord.detections.handle(topic, envelope(key, older, sequence=3, timestamp=500)).status == "stale"
    (row,) = rows(coord)
    assert row.top_species == "Felis catus" and row.sequence == 2
    assert coord.detections.handle(topic, envelope(key, record("b" * 32))).status == "stored"
    assert len(rows(coord)) == 2
    assert coord.status().rejections == {}


def test_every_outcome_is_counted_in_the_database(setup):
    """stored, duplicate (re-delivery), replaced (newer), stale (older) and refused are read back by a fresh store:
    the counts are the database's, not the ingestor's memory."""
    from coordinator.detections import detection_counts
    from coordinator.storage import Store

    coord, _, key = setup
    topic = detection_topic(FED, "site-1")
    first = envelope(key, record(), timestamp=2_000)
    statuses = [coord.detections.handle(topic, raw).status for raw in (
        first, first,  # the same message delivered twice
        envelope(key, record(conf=0.6), sequence=2, timestamp=3_000),  # the gateway re-ran the photo
        envelope(key, record(conf=0.4), sequence=3, timestamp=1_000),  # an older run, arriving late
        envelope(key, record(media="b" * 32), sequence=4, timestamp=1_000))]
    assert statuses == ["stored", "duplicate", "replaced", "stale", "stored"]
    forged = envelope(generate_signing_key(), record(media="c" * 32), sequence=5)
    assert coord.detections.handle(topic, forged).reason is RejectReason.BAD_SIGNATURE
    fresh = Store(coord.store.url, coord.store.data_dir)
    counts = detection_counts(fresh)
    assert (counts.rows, counts.from_gateways) == (2, 2)
    assert counts.outcomes == {"stored": 2, "duplicate": 1, "replaced": 1, "stale": 1}
    assert counts.refused == {"bad_signature": 1}
    assert coord.status().detections == counts
    fresh.dispose()
