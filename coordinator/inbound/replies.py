"""What the receiving path says back to a site, and how it records a refusal.

A refusal is counted per reason, logged, and stored (``rejections`` table); when the message's signature verified,
the site also gets a signed negative ACK with the reason (an unauthenticated sender gets nothing). An accepted
update gets a signed positive ACK; a re-delivery of the update already stored (same payload digest, or for a
manifest the same sequence) is ACKed positively again, so the gateway can drop it from its outbox. Every reply
echoes the header's round, model hash and sequence, and is published with QoS 1 on the site's ack topic
(:func:`shared.topics.ack_topic`); receipts of chunked uploads (:mod:`coordinator.inbound.transfers`) go the same
way (:func:`send_to_site`).
"""

from __future__ import annotations

import logging
from collections import Counter

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.envelope import Envelope, EnvelopeHeader, MessageKind, seal
from shared.errors import EnvelopeError
from shared.protocol import Ack, encode_ack
from shared.topics import ack_topic

from coordinator.inbound.reject import Reject, RejectReason, Rejected
from coordinator.inbound.update_checks import stored_update
from coordinator.storage import Store
from coordinator.transport import Transport, TransportError

__all__ = ["SiteReplies", "send_to_site"]

log = logging.getLogger(__name__)


def send_to_site(transport: Transport, signing_key: Ed25519PrivateKey, federation_id: str, header: EnvelopeHeader,
                 kind: MessageKind, payload: bytes) -> None:
    """Sign ``payload`` as a ``kind`` envelope answering ``header`` (its site, round, model hash and sequence) and
    publish it with QoS 1 on the site's ack topic.

    Raises:
        TransportError: the publish failed. EnvelopeError: the envelope could not be sealed.
    """
    out = seal(private_key=signing_key, federation_id=federation_id, site_id=header.site_id, round=header.round,
               base_model_hash=header.base_model_hash, kind=kind, sequence=header.sequence, payload=payload)
    transport.publish(ack_topic(federation_id, header.site_id), out.to_bytes(), qos=1)


class SiteReplies:
    """Records refusals and sends the signed ACKs of the update path (module docstring).

    Args:
        federation_id: ours. store: where rejections are stored. transport: where ACKs go.
        signing_key: the coordinator's Ed25519 key. counts: the ``Counter`` each refusal's reason is added to
            (the ingestor's ``counts``, shown by ``status``).

    Not thread-safe by itself: :class:`coordinator.inbound.ingest.Ingestor` calls it under its lock.
    """

    def __init__(self, *, federation_id: str, store: Store, transport: Transport, signing_key: Ed25519PrivateKey,
                 counts: Counter[str]) -> None:
        self.federation_id = federation_id
        self._store = store
        self._transport = transport
        self._key = signing_key
        self._counts = counts

    def refuse(self, topic: str, rej: Reject, env: Envelope | None, verified: bool) -> Rejected:
        """Count, log and store ``rej`` of a message on ``topic``; NACK it when ``verified`` (its signature verified).

        Returns:
            the :class:`Rejected`, with the site and round of ``env``'s header when there is one.
        """
        h = env.header if env is not None else None
        result = Rejected(reason=rej.reason, detail=rej.detail, error_kind=rej.error_kind,
                          site_id=h.site_id if h is not None else None, round=h.round if h is not None else None)
        self._record(topic, result)
        if verified and env is not None:
            self._nack(env, result)
        return result

    def ack(self, env: Envelope, ack: Ack) -> None:
        """Send ``ack`` for ``env``; a failure is logged (the gateway re-sends and gets a duplicate re-ACK)."""
        h = env.header
        try:
            send_to_site(self._transport, self._key, self.federation_id, h, MessageKind.ACK, encode_ack(ack))
        except (TransportError, EnvelopeError) as exc:
            # The update (if accepted) is already stored; the gateway re-sends and gets a duplicate re-ACK.
            log.error("ingest: could not send ACK to %s for round %d: %s", h.site_id, h.round, exc)

    def _record(self, topic: str, rej: Rejected) -> None:
        self._counts[rej.reason.value] += 1
        log.warning("ingest: rejected message on %s: %s: %s", topic, rej.reason.value, rej.detail)
        self._store.add_rejection(round=rej.round, site_id=rej.site_id, topic=topic, reason=rej.reason.value,
                                  error_kind=rej.error_kind, detail=rej.detail)

    def _nack(self, env: Envelope, rej: Rejected) -> None:
        if rej.reason is RejectReason.DUPLICATE:
            row = stored_update(self._store, env.header.round, env.header.site_id)
            same = row is not None and (row.payload_sha256 == env.header.payload_digest
                                        or (env.header.kind == MessageKind.MANIFEST
                                            and row.sequence == env.header.sequence))
            if same:
                self.ack(env, Ack(round=env.header.round, accepted=True, reason="duplicate: already stored"))
                return
        self.ack(env, Ack(round=env.header.round, accepted=False, reason=f"{rej.reason.value}: {rej.detail}"))
