"""Detection records wait in a durable queue until the broker has taken them.

A photo's detection record is sealed (a DETECTION envelope signed with the site key) and written to its own
SQLite outbox (``<state>/detections.sqlite``, :class:`edge_sdk.uplink.outbox.Outbox`) in the same step that stores
the photo; :meth:`DetectionQueue.flush` publishes what is waiting (QoS 1) and removes a record only once the broker
acknowledged it (PUBACK). A gateway that is offline for a week keeps its records and sends them when the link is
back; the coordinator's persistent MQTT session (docs/transport.md) holds them while it is itself down, and its
ingest stores each media id once (coordinator/detections.py). Message ids are ``detection/<mediaID>``, so storing
a photo's record again replaces, never duplicates, the waiting one.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.envelope import MessageKind, seal
from shared.protocol import DetectionRecord, encode_detection
from shared.topics import detection_topic

from edge_sdk.uplink.outbox import Outbox
from edge_sdk.uplink.transport import Transport, TransportError

__all__ = ["DetectionQueue"]

log = logging.getLogger(__name__)

_SEQUENCE = "detection_sequence"


class DetectionQueue:
    """Durable queue of signed detection records (module docstring).

    Args:
        path: the SQLite file.
        private_key: the site's Ed25519 key.
        federation_id, site_id: identities (topic ``detection_topic(federation_id, site_id)``).
    """

    def __init__(self, path: str | Path, *, private_key: Ed25519PrivateKey, federation_id: str,
                 site_id: str) -> None:
        self.outbox = Outbox(path)
        self._key = private_key
        self.federation_id = federation_id
        self.site_id = site_id
        self.topic = detection_topic(federation_id, site_id)

    def close(self) -> None:
        """Close the database."""
        self.outbox.close()

    def add(self, record: DetectionRecord, *, model_round: int = 0, model_hash: str = "") -> str:
        """Seal ``record`` and store it durably; returns its message id. ``model_round``/``model_hash``: the
        global model that classified it (envelope header), 0 and ``""`` when none did."""
        sequence = int(self.outbox.get_state(_SEQUENCE, "0")) + 1
        self.outbox.set_state(_SEQUENCE, str(sequence))
        envelope = seal(private_key=self._key, federation_id=self.federation_id, site_id=self.site_id,
                        round=model_round, base_model_hash=model_hash, kind=MessageKind.DETECTION,
                        sequence=sequence, payload=encode_detection(record))
        message_id = f"detection/{record.media_id}"
        self.outbox.put(message_id, self.topic, envelope.to_bytes())
        return message_id

    def pending(self) -> int:
        """Records waiting."""
        return self.outbox.count()

    def flush(self, transport: Transport, *, limit: int | None = None) -> int:
        """Publish waiting records (oldest first) until one fails; returns how many the broker acknowledged.

        A failure (no link, no PUBACK) stops the flush: the rest wait for the next one.
        """
        sent = 0
        for entry in self.outbox.pending()[:limit]:
            message = self.outbox.get(entry.message_id)
            if message is None:
                continue
            try:
                transport.publish(message.topic, message.payload, qos=1)
            except TransportError as exc:
                log.info("detections: %d record(s) wait for the broker (%s)", self.pending(), exc)
                break
            self.outbox.remove(entry.message_id)
            sent += 1
        return sent
