"""The checks every signed site message passes, whatever it carries: size, envelope, topic, federation and site,
header ranges, the site's keys and signature, and the replay window.

Written once here and used by every receiving handler: updates (:mod:`coordinator.inbound.ingest`), chunked uploads
and download receipts (:mod:`coordinator.inbound.transfers`), health records (:mod:`coordinator.inbound.health`),
detection records (:mod:`coordinator.detections`) and secure-aggregation stages (:mod:`coordinator.global_dp`).
Each check raises :class:`coordinator.inbound.reject.Reject` with its reason code; the order in which a handler
calls them decides which code a message with several faults gets (the table in :mod:`coordinator.inbound.ingest`).
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.envelope import Envelope, EnvelopeHeader, MessageKind, verify_payload, verify_signature
from shared.errors import ConfigError, MalformedEnvelopeError, SignatureError
from shared.topics import parse_topic

from coordinator.inbound.reject import Reject, RejectReason
from coordinator.registry import SiteRegistry, UnknownSiteError

__all__ = ["MAX_SITE_MESSAGE_BYTES", "MAX_HEADER_ROUND", "MAX_HEADER_INT", "ReplayWindow", "check_header_ranges",
           "parse_bytes", "parse_site_topic", "check_site_topic", "check_site_envelope", "parse_site_envelope",
           "check_timestamp", "verify_site_signature", "verify_site_envelope", "check_site_key"]

#: Largest message any site handler parses (bytes): a whole update, a detection record or a secure-aggregation stage.
#: Update topics have their own, smaller limit (coordinator.inbound.transfers.TransferLimits).
MAX_SITE_MESSAGE_BYTES = (256 << 20) + 65536

MAX_HEADER_ROUND = 2 ** 31 - 1
"""Largest round number a site envelope may carry (an SQL INTEGER column, 32-bit in PostgreSQL)."""
MAX_HEADER_INT = 2 ** 63 - 1
"""Largest sequence and timestamp a site envelope may carry (an SQL BIGINT column)."""


@dataclass(frozen=True)
class ReplayWindow:
    """How far a signed timestamp may stray from the coordinator's clock (``transfer:`` in the config).

    Attributes:
        max_clock_skew_s: seconds a message may be signed in the future (gateway clocks drift; GPS/NTP fix them).
        max_message_age_s: seconds after signing at which a message is refused as stale. An outbox keeps an update
            across outages of hours to days, so the default is 7 days; the round binding (round number and model
            hash) is what refuses an old update for a new round.
    """

    max_clock_skew_s: float = 300.0
    max_message_age_s: float = 7 * 24 * 3600.0


def check_header_ranges(env: Envelope) -> None:
    """Refuse header integers the database or a float cannot hold (the format allows any non-negative JSON
    integer; a round of 2**64 would otherwise crash the rejection's own INSERT).

    Raises:
        Reject: ``malformed_envelope``.
    """
    h = env.header
    if h.round > MAX_HEADER_ROUND or h.sequence > MAX_HEADER_INT or h.timestamp > MAX_HEADER_INT:
        raise Reject(RejectReason.MALFORMED_ENVELOPE, f"header round, sequence or timestamp out of range (round <= "
                     f"{MAX_HEADER_ROUND}, sequence and timestamp <= {MAX_HEADER_INT})")


def parse_bytes(raw: bytes, max_bytes: int) -> Envelope:
    """Check 1: the size limit, then the bytes parse (``oversized``, ``malformed_envelope``, e.g. a retired format).

    Raises:
        Reject: ``oversized`` (longer than ``max_bytes``) or ``malformed_envelope``.
    """
    if len(raw) > max_bytes:
        raise Reject(RejectReason.OVERSIZED, f"message of {len(raw)} bytes exceeds the limit of {max_bytes}")
    try:
        return Envelope.from_bytes(raw)
    except MalformedEnvelopeError as exc:
        raise Reject(RejectReason.MALFORMED_ENVELOPE, str(exc), exc) from exc


def parse_site_topic(topic: str) -> tuple[str, str, str]:
    """``(federation id, site id, channel)`` of a WildFed site topic (:func:`shared.topics.parse_topic`).

    Raises:
        Reject: ``bad_topic``.
    """
    try:
        return parse_topic(topic)
    except (MalformedEnvelopeError, ConfigError) as exc:
        raise Reject(RejectReason.BAD_TOPIC, str(exc), exc) from exc


def check_site_topic(topic: str, env: Envelope, *, federation_id: str, kind: MessageKind,
                     channel: str | None = None) -> None:
    """The topic checks of a site envelope: ``topic`` is a WildFed site topic of ``channel``, the header's kind is
    ``kind``, the header's and the topic's federation are ours, and the topic names the header's site.

    Args:
        topic: the MQTT topic it arrived on. env: the parsed envelope. federation_id: ours.
        kind: the header kind expected. channel: the topic channel expected (default ``kind``'s own; a MANIFEST or
            RECEIPT comes on the ``update`` channel).

    Raises:
        Reject: ``bad_topic``, ``wrong_kind``, ``wrong_federation`` or ``topic_mismatch``, checked in that order.
    """
    channel = kind.value if channel is None else channel
    t_fed, t_site, t_channel = parse_site_topic(topic)
    h = env.header
    if t_channel != channel or h.kind != kind:
        raise Reject(RejectReason.WRONG_KIND, f"expected a {kind.value.upper()} on a {channel} topic, got kind "
                     f"{h.kind.value!r} on channel {t_channel!r}")
    if h.federation_id != federation_id or t_fed != federation_id:
        raise Reject(RejectReason.WRONG_FEDERATION, f"federation {h.federation_id!r} (topic {t_fed!r}) is not "
                     f"{federation_id!r}")
    if t_site != h.site_id:
        raise Reject(RejectReason.TOPIC_MISMATCH, f"topic names site {t_site!r}, header names {h.site_id!r}")


def check_site_envelope(topic: str, env: Envelope, *, federation_id: str, kind: MessageKind) -> None:
    """The checks of :func:`parse_site_envelope` after parsing, for an envelope parsed already: header integers in
    range (:func:`check_header_ranges`), then :func:`check_site_topic`.

    Raises:
        Reject: with the reason code (malformed envelope, bad topic, wrong kind, wrong federation, topic mismatch).
    """
    check_header_ranges(env)
    check_site_topic(topic, env, federation_id=federation_id, kind=kind)


def parse_site_envelope(topic: str, raw: bytes, *, federation_id: str, kind: MessageKind,
                        max_bytes: int = MAX_SITE_MESSAGE_BYTES) -> Envelope:
    """Parse a message a site sent on its own topic and check everything that needs no key: the envelope parses,
    the topic is a WildFed topic of channel ``kind``, the header's kind, federation and site match the topic.

    Args:
        topic: the MQTT topic it arrived on. raw: the wire bytes. federation_id: ours. kind: UPDATE, DETECTION, ...
        max_bytes: longer messages are refused before any parsing (``oversized``).

    Raises:
        Reject: with the reason code (oversized, malformed envelope, bad topic, wrong kind, wrong federation, topic
            mismatch).
    """
    env = parse_bytes(raw, max_bytes)
    check_site_envelope(topic, env, federation_id=federation_id, kind=kind)
    return env


def check_timestamp(env: Envelope, window: ReplayWindow, now_ms: float) -> None:
    """The time window of replay protection for a verified site envelope: its timestamp (ms since the epoch) is at
    most ``window.max_clock_skew_s`` after ``now_ms`` and at most ``window.max_message_age_s`` before it.

    Raises:
        Reject: ``bad_timestamp``.
    """
    t, w = env.header.timestamp, window
    if t > now_ms + w.max_clock_skew_s * 1000.0:
        raise Reject(RejectReason.BAD_TIMESTAMP, f"signed {(t - now_ms) / 1000:.0f} s in the future (allowed clock "
                     f"skew {w.max_clock_skew_s:.0f} s); fix the gateway's clock (NTP/GPS)")
    if t < now_ms - w.max_message_age_s * 1000.0:
        raise Reject(RejectReason.BAD_TIMESTAMP, f"signed {(now_ms - t) / 3600e3:.1f} h ago, older than the "
                     f"allowed {w.max_message_age_s / 3600:.0f} h")


def _site_keys(site_id: str, registry: SiteRegistry) -> list:
    """The site's currently valid ``(fingerprint, public key)`` pairs (``SiteRegistry.verification_keys``).

    Raises:
        Reject: unknown site, or a site with no valid key (revoked).
    """
    try:
        keys = registry.verification_keys(site_id)
    except UnknownSiteError as exc:
        raise Reject(RejectReason.UNKNOWN_SITE, str(exc), exc) from exc
    if not keys:
        raise Reject(RejectReason.NO_VALID_KEY, f"site {site_id!r} has no valid key (revoked or expired); "
                     "an operator must rotate in a new one")
    return keys


def verify_site_signature(header: EnvelopeHeader, signature: bytes, registry: SiteRegistry) -> str:
    """Check the Ed25519 signature over ``header`` against the currently valid keys of the site it names (its
    current key, and during a rotation's grace period the previous one; revoked keys never); the payload is not
    looked at (a chunked upload's manifest names it by leaves, :mod:`shared.transfer`).

    Returns:
        the hex fingerprint of the key that verified.

    Raises:
        Reject: unknown site, a site with no valid key (revoked), or a signature that does not verify.
    """
    error: SignatureError | None = None
    for fingerprint, key in _site_keys(header.site_id, registry):
        try:
            verify_signature(header, signature, key)
            return fingerprint
        except SignatureError as exc:
            error = exc
    raise Reject(RejectReason.BAD_SIGNATURE, str(error), error)


def verify_site_envelope(env: Envelope, registry: SiteRegistry) -> str:
    """Check ``env`` against the currently valid keys of the site its header names (:func:`verify_site_signature`),
    then its payload against the signed length and payload digest, once (not once per key).

    Returns:
        the hex fingerprint of the key that verified.

    Raises:
        Reject: unknown site, a site with no valid key (revoked), or a signature / payload digest that does not
            verify.
    """
    fingerprint = verify_site_signature(env.header, env.signature, registry)
    try:
        verify_payload(env)
    except SignatureError as exc:
        raise Reject(RejectReason.BAD_SIGNATURE, str(exc), exc) from exc
    return fingerprint


def check_site_key(site_id: str, fingerprint: str, registry: SiteRegistry) -> None:
    """Check that the key ``fingerprint``, which verified a message of ``site_id`` earlier (a chunked upload's
    manifest), is still one of the site's valid keys: the key checks of :func:`verify_site_envelope` without the
    signature and the hashing, which were done when the key verified.

    Raises:
        Reject: unknown site, a site with no valid key, or a key revoked (or rotated out) since it verified
            (``no_valid_key``).
    """
    if fingerprint not in {fp for fp, _ in _site_keys(site_id, registry)}:
        raise Reject(RejectReason.NO_VALID_KEY, f"the key {fingerprint[:16]} that signed site {site_id!r}'s upload "
                     "is no longer valid (revoked or rotated out since its manifest verified); the site must sign "
                     "again with its current key")
