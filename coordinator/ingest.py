"""Ingest: turn one raw MQTT message into an accepted update or a counted, stored rejection.

:class:`coordinator.transfers.TransferReceiver` comes first on the update topic: it refuses a payload over the size
limit before parsing (``oversized``), reassembles chunked uploads (``bad_transfer``, ``unknown_transfer``) and hands
whole envelopes here. :meth:`Ingestor.handle` then checks, in this order (the first failure decides the reason code):

==== ======================================================================== =====================
 #    check                                                                    reason on failure
==== ======================================================================== =====================
 1    bytes parse as an envelope (shared.envelope.Envelope.from_bytes)          ``malformed_envelope``
 2    topic is a WildFed update topic                                           ``bad_topic``
 3    header kind is UPDATE                                                     ``wrong_kind``
 4    federation id of header and topic is ours                                 ``wrong_federation``
 5    site in the topic == site in the header                                   ``topic_mismatch``
 6    site is enrolled                                                          ``unknown_site``
      and has a valid key (not revoked; a rotated-out key only in its grace)   ``no_valid_key``
 7    Ed25519 signature, payload length and payload digest verify (site's      ``bad_signature``
      key; the digest is the BLAKE3 hash list of shared.envelope, one pass)
 7b   timestamp within the replay window (ReplayWindow)                         ``bad_timestamp``
 8    a round is open and the header's round is it                              ``wrong_round``
      (an update for a *past* round that selected the site is ``late``: its
      reported events are charged to the ledger, it is never aggregated)      ``late``
 9    the site was selected for this round                                      ``not_selected``
 10   base_model_hash == the round's global model hash                          ``stale_model``
 11   no update from this site was accepted for this round                      ``duplicate``
 12   payload decodes (shared.protocol.decode_update)                           ``malformed_payload``
 13   tensors have the model's names, shapes and dtypes                         ``wrong_tensors``
 14   every value is finite                                                     ``non_finite``
 15   report is sane: num_examples >= 1 and (camera) the site's declared         ``bad_report``
      capacity, 1 <= local_steps <= task's, each event's steps <= local_steps,
      events present when privacy is on
 16   no halted category was trained                                            ``halted_category``
 17   no event takes its (site, category) spend past the budget                 ``over_budget``
==== ======================================================================== =====================

Parsed once, hashed once: :meth:`Ingestor.handle_envelope` takes an envelope its caller already parsed
(:class:`coordinator.transfers.TransferReceiver` parses every message once to route it). A chunked update comes with
``verified_by``: the receiver verified its signature with the site key of that fingerprint when the manifest came, and
its payload piece by piece against the signed leaves (each byte hashed once, :mod:`shared.transfer`); check 7 then
only checks that this key is still one of the site's valid keys (not revoked since), and hashes nothing. Every other
check runs as for a whole update.

Charging refused updates: an update that verified, came from a site selected for its round, and decodes, shows
that the site *ran* those DP-SGD steps and that the coordinator has seen their output. Such updates refused as
``late``, ``halted_category`` or ``over_budget`` are therefore charged to the ledger immediately (durably), even
though nothing derived from them is ever released: the ledger reports what sites spent, never less.

Every rejection is logged with its reason, stored (``rejections`` table), counted per reason, and never reaches
the aggregate. Only the library's typed errors are caught (``EnvelopeError`` subclasses, ``ConfigError`` from
identifier checks); anything else is a bug and propagates to the transport, which logs it.

An accepted update is handled in this order: payload stored durably (blob fsync-ed + row committed), THEN a signed
ACK is published on the site's ack topic, THEN the delta is folded into the round's running sum. Durability is
shared by a group of updates (:mod:`coordinator.group_commit`): a checked update waits, for a few milliseconds at
most, until its group's blobs are fsync-ed together and their rows committed in one transaction; its ACK and its
accumulation follow that commit. Called directly, :meth:`Ingestor.handle` commits every update before it returns
(groups of one); the ingest thread (``coordinator.transport.QueuedCallback``) sets :attr:`Ingestor.defer_commits`
and seals the groups when they are due, which a committer thread then makes durable, ACKs and accumulates
(:meth:`Ingestor.commit_in_background`), and :meth:`Ingestor.handle` answers :class:`Pending` for an update whose
group is not yet durable. A site whose
signature verified but whose update was refused gets a signed negative ACK with the reason; a re-delivery of an
already stored update (same payload hash; MQTT QoS 1 is at-least-once) is counted as ``duplicate`` and re-ACKed
positively so the gateway can drop it from its outbox. Every ACK echoes the update's sequence (the idempotency key
is site, round, sequence; docs/transport.md).
"""

from __future__ import annotations

import enum
import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from shared.envelope import Envelope, EnvelopeHeader, MessageKind, seal, verify_payload, verify_signature
from shared.errors import ConfigError, EnvelopeError, MalformedEnvelopeError, PayloadError, SignatureError
from shared.iucn import IUCNCategory
from shared.privacy.events import DPSGDEvent
from shared.protocol import Ack, UpdateReport, decode_update, encode_ack
from shared.topics import ack_topic, parse_topic

from coordinator.group_commit import BackgroundCommits, GroupCommitPolicy, GroupCommitter, StagedUpdate
from coordinator.ledger import LedgerError, PrivacyLedger
from coordinator.registry import SiteRegistry, UnknownSiteError
from coordinator.storage import RoundRow, Store, UpdateOutcome, UpdateRow
from coordinator.strategies.base import Strategy, update_noise_variance
from coordinator.transport import Transport, TransportError

__all__ = ["RejectReason", "ReplayWindow", "Accepted", "Pending", "Rejected", "RoundContext", "Ingestor"]

log = logging.getLogger(__name__)


class RejectReason(str, enum.Enum):
    """Stable reason codes of rejected messages (stored and counted in ``status``)."""

    MALFORMED_ENVELOPE = "malformed_envelope"
    BAD_TOPIC = "bad_topic"
    WRONG_KIND = "wrong_kind"
    WRONG_FEDERATION = "wrong_federation"
    TOPIC_MISMATCH = "topic_mismatch"
    UNKNOWN_SITE = "unknown_site"
    BAD_SIGNATURE = "bad_signature"
    WRONG_ROUND = "wrong_round"
    LATE = "late"
    NOT_SELECTED = "not_selected"
    STALE_MODEL = "stale_model"
    DUPLICATE = "duplicate"
    MALFORMED_PAYLOAD = "malformed_payload"
    WRONG_TENSORS = "wrong_tensors"
    NON_FINITE = "non_finite"
    BAD_REPORT = "bad_report"
    HALTED_CATEGORY = "halted_category"
    OVER_BUDGET = "over_budget"
    SECAGG_PROTOCOL = "secagg_protocol"
    OVERSIZED = "oversized"
    BAD_TRANSFER = "bad_transfer"
    UNKNOWN_TRANSFER = "unknown_transfer"
    NO_VALID_KEY = "no_valid_key"
    REPLAYED = "replayed"
    BAD_TIMESTAMP = "bad_timestamp"


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


@dataclass(frozen=True)
class Accepted:
    """An update that passed every check and is stored durably.

    Attributes:
        site_id, round, sequence: from the verified header.
        num_examples: N_k reported by the site (its public record count, every category; unchanged by halts).
        weight: the FedAvg weight used (= ``num_examples``).
        payload_sha256: name of the stored blob: the update's payload digest (``shared.envelope``, a BLAKE3 hash
            list, verified against the signature; the name is kept from format 1, when it was the SHA-256).
        events: ``{category: DPSGDEvent}`` the site ran (charged to the ledger when the round closes).
        count_events: ``{category: DPSGDEvent}`` of its noisy count release (NIRA), charged with ``events``.
        species_counts: ``{class index: noisy count}`` it released (empty when the task asked for none).
    """

    site_id: str
    round: int
    sequence: int
    num_examples: int
    weight: float
    payload_sha256: str
    events: Mapping[IUCNCategory, DPSGDEvent]
    count_events: Mapping[IUCNCategory, DPSGDEvent] = field(default_factory=dict)
    species_counts: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Pending:
    """An update that passed every check and waits for its group to become durable (coordinator.group_commit): its
    ACK and its accumulation follow the group's commit, within ``group_commit.max_delay_s``; it may still be refused
    then as a duplicate or as late (another process stored one first, or the round closed meanwhile).

    Attributes:
        site_id, round, sequence: from the verified header.
    """

    site_id: str
    round: int
    sequence: int


@dataclass(frozen=True)
class Rejected:
    """A refused message: ``reason`` (code), ``detail`` (human-readable), the typed error's class name, and the
    site / round when they were known."""

    reason: RejectReason
    detail: str
    error_kind: str
    site_id: str | None = None
    round: int | None = None


@dataclass
class RoundContext:
    """What ingest must know about the open round (built by :class:`coordinator.rounds.RoundManager`).

    Attributes:
        round: round number.
        model_hash: hash of the global model the round trains from (shared.codec.model_hash).
        template: the global weights (names, shapes, dtypes are what updates must match).
        selected: sites offered the round.
        halted: per site, the categories it must not have trained.
        budgets: total epsilon per IUCN category.
        privacy: ``"ccdp"`` or ``"none"``.
        local_steps: steps the task asked for.
        strategy: running aggregate (``begin_round`` already called).
        accepted: filled by ingest, site id -> :class:`Accepted`.
        site_hashes: per site, the hash of the model it was sent (NIRA sends each cluster its own head); a site
            not listed trains from ``model_hash``.
        bundle: the strategy's stored model that the round steps (FedAvg: the model itself; None = ``template``).
        count_noise_multiplier: the count release the tasks asked for (None: none; NIRA with noisy counts).
        num_classes: length of a count vector.
        expected_events: radio rounds: the exact events every upload must report (``coordinator.radio``); None for
            camera rounds.
        learning_rate, clipping_norm, expected_batch_size: the task's (for :meth:`noise_variance`; 0: unknown).
    """

    round: int
    model_hash: str
    template: Mapping[str, np.ndarray]
    selected: frozenset[str]
    halted: Mapping[str, frozenset[IUCNCategory]]
    budgets: Mapping[IUCNCategory, float]
    privacy: str
    local_steps: int
    strategy: Strategy
    accepted: dict[str, Accepted] = field(default_factory=dict)
    site_hashes: Mapping[str, str] = field(default_factory=dict)
    bundle: Mapping[str, np.ndarray] | None = None
    count_noise_multiplier: float | None = None
    num_classes: int | None = None
    expected_events: Mapping[IUCNCategory, DPSGDEvent] | None = None
    learning_rate: float = 0.0
    clipping_norm: float = 0.0
    expected_batch_size: int = 0

    def noise_variance(self, report: UpdateReport) -> float | None:
        """The variance per coordinate of the DP noise in ``report``'s delta
        (:func:`coordinator.strategies.base.update_noise_variance`), or None when the task's parameters are unknown."""
        if self.learning_rate <= 0 or self.clipping_norm <= 0:
            return None if report.events else 0.0
        return update_noise_variance(report.events, clipping_norm=self.clipping_norm,
                                     learning_rate=self.learning_rate, expected_batch_size=self.expected_batch_size,
                                     num_examples=int(report.num_examples), local_steps=int(report.local_steps))

    def expected_hash(self, site_id: str) -> str:
        """The model hash ``site_id``'s update must have been trained from."""
        return self.site_hashes.get(site_id, self.model_hash)


class _Reject(Exception):
    """Internal control flow: carries a rejection out of the check chain."""

    def __init__(self, reason: RejectReason, detail: str, error: BaseException | None = None) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.error_kind = type(error).__name__ if error is not None else "check"


#: Largest message any site handler parses (bytes): a whole update, a detection record or a secure-aggregation stage.
#: Update topics have their own, smaller limit (coordinator.transfers.TransferLimits).
MAX_SITE_MESSAGE_BYTES = (256 << 20) + 65536


MAX_HEADER_ROUND = 2 ** 31 - 1
"""Largest round number a site envelope may carry (an SQL INTEGER column, 32-bit in PostgreSQL)."""
MAX_HEADER_INT = 2 ** 63 - 1
"""Largest sequence and timestamp a site envelope may carry (an SQL BIGINT column)."""


def check_header_ranges(env: Envelope) -> None:
    """Refuse header integers the database or a float cannot hold (the format allows any non-negative JSON
    integer; a round of 2**64 would otherwise crash the rejection's own INSERT).

    Raises:
        _Reject: ``malformed_envelope``.
    """
    h = env.header
    if h.round > MAX_HEADER_ROUND or h.sequence > MAX_HEADER_INT or h.timestamp > MAX_HEADER_INT:
        raise _Reject(RejectReason.MALFORMED_ENVELOPE, f"header round, sequence or timestamp out of range (round <= "
                      f"{MAX_HEADER_ROUND}, sequence and timestamp <= {MAX_HEADER_INT})")


def parse_site_envelope(topic: str, raw: bytes, *, federation_id: str, kind: MessageKind,
                        max_bytes: int = MAX_SITE_MESSAGE_BYTES) -> Envelope:
    """Parse a message a site sent on its own topic and check everything that needs no key: the envelope parses,
    the topic is a WildFed topic of channel ``kind``, the header's kind, federation and site match the topic.

    Args:
        topic: the MQTT topic it arrived on. raw: the wire bytes. federation_id: ours. kind: UPDATE or DETECTION.
        max_bytes: longer messages are refused before any parsing (``oversized``).

    Raises:
        _Reject: with the reason code (malformed envelope, bad topic, wrong kind, wrong federation, topic mismatch).
    """
    env = _parse_bytes(raw, max_bytes)
    check_site_envelope(topic, env, federation_id=federation_id, kind=kind)
    return env


def _parse_bytes(raw: bytes, max_bytes: int) -> Envelope:
    """Check 1: the size limit, then the bytes parse (``oversized``, ``malformed_envelope``, e.g. a retired format)."""
    if len(raw) > max_bytes:
        raise _Reject(RejectReason.OVERSIZED, f"message of {len(raw)} bytes exceeds the limit of {max_bytes}")
    try:
        return Envelope.from_bytes(raw)
    except MalformedEnvelopeError as exc:
        raise _Reject(RejectReason.MALFORMED_ENVELOPE, str(exc), exc) from exc


def check_site_envelope(topic: str, env: Envelope, *, federation_id: str, kind: MessageKind) -> None:
    """The checks of :func:`parse_site_envelope` after parsing, for an envelope parsed already: header integers in
    range, the topic is a WildFed topic of channel ``kind``, the header's kind, federation and site match the topic.

    Raises:
        _Reject: with the reason code (malformed envelope, bad topic, wrong kind, wrong federation, topic mismatch).
    """
    check_header_ranges(env)
    try:
        t_fed, t_site, channel = parse_topic(topic)
    except (MalformedEnvelopeError, ConfigError) as exc:
        raise _Reject(RejectReason.BAD_TOPIC, str(exc), exc) from exc
    h = env.header
    if channel != kind.value or h.kind != kind:
        raise _Reject(RejectReason.WRONG_KIND, f"expected a {kind.value.upper()} on a {kind.value} topic, got kind "
                      f"{h.kind.value!r} on channel {channel!r}")
    if h.federation_id != federation_id or t_fed != federation_id:
        raise _Reject(RejectReason.WRONG_FEDERATION, f"federation {h.federation_id!r} (topic {t_fed!r}) is not "
                      f"{federation_id!r}")
    if t_site != h.site_id:
        raise _Reject(RejectReason.TOPIC_MISMATCH, f"topic names site {t_site!r}, header names {h.site_id!r}")


def _decode_update(payload: bytes, *, check_weights: bool = True) -> tuple[UpdateReport, dict[str, np.ndarray]]:
    """:func:`decode_update`, refusing report numbers no float holds (a JSON integer such as 10**400 passes
    shared.protocol's checks but raises OverflowError where it is used: the weight, the ledger's accountant) and
    JSON integers too long for Python to parse (ValueError).

    Raises:
        _Reject: ``malformed_payload``.
    """
    try:
        report, delta = decode_update(payload, check_weights=check_weights)
        for ev in (*report.events.values(), *report.count_events.values()):
            float(ev.noise_multiplier), float(ev.sampling_rate)
    except (PayloadError, ValueError, OverflowError) as exc:  # ValueError: a JSON integer of > 4300 digits
        raise _Reject(RejectReason.MALFORMED_PAYLOAD, str(exc), exc) from exc
    return report, delta


def _site_keys(site_id: str, registry: SiteRegistry) -> list:
    """The site's currently valid ``(fingerprint, public key)`` pairs (``SiteRegistry.verification_keys``).

    Raises:
        _Reject: unknown site, or a site with no valid key (revoked).
    """
    try:
        keys = registry.verification_keys(site_id)
    except UnknownSiteError as exc:
        raise _Reject(RejectReason.UNKNOWN_SITE, str(exc), exc) from exc
    if not keys:
        raise _Reject(RejectReason.NO_VALID_KEY, f"site {site_id!r} has no valid key (revoked or expired); "
                      "an operator must rotate in a new one")
    return keys


def verify_site_signature(header: EnvelopeHeader, signature: bytes, registry: SiteRegistry) -> str:
    """Check the Ed25519 signature over ``header`` against the currently valid keys of the site it names (its
    current key, and during a rotation's grace period the previous one; revoked keys never); the payload is not
    looked at (a chunked upload's manifest names it by leaves, :mod:`shared.transfer`).

    Returns:
        the hex fingerprint of the key that verified.

    Raises:
        _Reject: unknown site, a site with no valid key (revoked), or a signature that does not verify.
    """
    error: SignatureError | None = None
    for fingerprint, key in _site_keys(header.site_id, registry):
        try:
            verify_signature(header, signature, key)
            return fingerprint
        except SignatureError as exc:
            error = exc
    raise _Reject(RejectReason.BAD_SIGNATURE, str(error), error)


def verify_site_envelope(env: Envelope, registry: SiteRegistry) -> str:
    """Check ``env`` against the currently valid keys of the site its header names (:func:`verify_site_signature`),
    then its payload against the signed length and payload digest, once (not once per key).

    Returns:
        the hex fingerprint of the key that verified.

    Raises:
        _Reject: unknown site, a site with no valid key (revoked), or a signature / payload digest that does not
            verify.
    """
    fingerprint = verify_site_signature(env.header, env.signature, registry)
    try:
        verify_payload(env)
    except SignatureError as exc:
        raise _Reject(RejectReason.BAD_SIGNATURE, str(exc), exc) from exc
    return fingerprint


def check_site_key(site_id: str, fingerprint: str, registry: SiteRegistry) -> None:
    """Check that the key ``fingerprint``, which verified a message of ``site_id`` earlier (a chunked upload's
    manifest), is still one of the site's valid keys: the key checks of :func:`verify_site_envelope` without the
    signature and the hashing, which were done when the key verified.

    Raises:
        _Reject: unknown site, a site with no valid key, or a key revoked (or rotated out) since it verified
            (``no_valid_key``).
    """
    if fingerprint not in {fp for fp, _ in _site_keys(site_id, registry)}:
        raise _Reject(RejectReason.NO_VALID_KEY, f"the key {fingerprint[:16]} that signed site {site_id!r}'s upload "
                      "is no longer valid (revoked or rotated out since its manifest verified); the site must sign "
                      "again with its current key")


class Ingestor:
    """Verifies, stores, acknowledges and aggregates incoming updates (see the module docstring).

    Args:
        federation_id: our federation.
        store, registry, ledger: coordinator state.
        transport: where ACKs are published.
        signing_key: the coordinator's Ed25519 key (signs ACKs).
        group_commit: bounds of a commit group (:class:`coordinator.group_commit.GroupCommitPolicy`; default one).

    Thread-safe: :meth:`handle` serialises on an internal lock (paho calls it from its network thread). After each
    message, and after each group commit, ``changed`` (a ``threading.Condition``) is notified so a waiting round
    manager can check its quorum.
    """

    def __init__(self, *, federation_id: str, store: Store, registry: SiteRegistry, ledger: PrivacyLedger,
                 transport: Transport, signing_key: Ed25519PrivateKey,
                 replay_window: ReplayWindow | None = None, clock: Callable[[], float] = time.time,
                 group_commit: GroupCommitPolicy | None = None) -> None:
        self.federation_id = federation_id
        self.replay_window = replay_window or ReplayWindow()
        self._clock = clock
        #: ``callback(ctx, accepted)`` after an update is stored, ACKed and accumulated (an ingest worker writes its
        #: partial sum there, ``coordinator.workers``); None: nothing.
        self.on_accepted: Callable[[RoundContext, Accepted], None] | None = None
        self._store = store
        self._registry = registry
        self._ledger = ledger
        self._transport = transport
        self._key = signing_key
        self._ctx: RoundContext | None = None
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)
        self.counts: Counter[str] = Counter()
        self._group = GroupCommitter(store, group_commit)
        self._background: BackgroundCommits | None = None  # commit_in_background(): groups made durable on a thread
        #: True while a driver (the ingest thread's loop) calls :meth:`flush` when :meth:`flush_in` says so; False:
        #: every :meth:`handle` commits its update before returning.
        self.defer_commits = False
        #: True when no other process stores updates for the rounds this one opens (a single coordinator,
        #: ``ingest_workers: 0``; set by coordinator.service): then the open round's accepted and waiting updates,
        #: kept here, say whether a site's update is in, with no query; the commit group's transaction still checks
        #: the table (an update stored by a stray second process is then refused as a duplicate there, and counted
        #: at the close: ``RoundManager._absorb_stored``). False: the table is read for each new update.
        self.sole_ingest = False
        # (round, site, sequence) of updates whose "stored already?" read was made by precheck() for their manifest
        # in this process: the reassembled update is not read again (the group's transaction checks once more).
        self._prechecked: set[tuple[int, str, int]] = set()

    # ---- round lifecycle ---------------------------------------------------------------------------------------
    def open_round(self, ctx: RoundContext) -> None:
        """Start accepting updates for ``ctx.round``."""
        with self._lock:
            self._ctx = ctx

    def close_round(self) -> RoundContext | None:
        """Make the updates waiting for a group commit durable (ACKed and accumulated), then stop accepting; return
        the closed round's context (with its accepted updates)."""
        with self._lock:
            try:
                self._flush()
            except (OSError, SQLAlchemyError):  # nothing of the group was ACKed: its gateways re-send (late then)
                log.exception("ingest: the updates waiting for a group commit could not be stored at round close")
            ctx, self._ctx = self._ctx, None
            self._prechecked.clear()
            self.changed.notify_all()
            return ctx

    # ---- group commit ------------------------------------------------------------------------------------------
    def commit_in_background(self) -> None:
        """From now on :meth:`flush_async` hands a due group to a committer thread
        (:class:`coordinator.group_commit.BackgroundCommits`), so its fsyncs and commit overlap the checks of the
        next messages; its ACKs and accumulation follow on that thread once it is durable. Idempotent."""
        with self._lock:
            if self._background is None:
                self._background = BackgroundCommits(self._group, self.changed)

    def flush(self) -> None:
        """Make every update waiting for a group commit durable now, then ACK and accumulate them, before returning
        (coordinator.group_commit).

        Raises:
            OSError, sqlalchemy.exc.SQLAlchemyError: storing failed; nothing of the group was ACKed.
        """
        with self._lock:
            self._flush()

    def flush_async(self) -> None:
        """Start making the open group durable: on the committer thread after :meth:`commit_in_background` (waiting
        only for the group already in flight), else as :meth:`flush`."""
        with self._lock:
            self._seal()

    @property
    def committing(self) -> bool:
        """Whether an update is waiting for, or in, a group commit (open group or one in flight)."""
        with self._lock:
            return bool(len(self._group)) or (self._background is not None and self._background.in_flight)

    def flush_in(self) -> float | None:
        """Seconds until the open commit group must be flushed (<= 0: now), or None when none is open."""
        with self._lock:
            return self._group.seconds_left()

    @property
    def group_stats(self) -> tuple[int, int]:
        """``(groups committed, updates in them)`` since start."""
        return self._group.groups, self._group.updates

    def _flush(self) -> None:
        """Under the lock: the group in flight finished (waiting releases the lock), then the open group committed
        in this thread."""
        if self._background is not None:
            self._background.wait()
        if len(self._group):
            try:
                self._group.flush()
            finally:
                self.changed.notify_all()

    def _seal(self) -> None:
        if self._background is not None:
            self._background.seal()
        else:
            self._flush()

    def _holds(self, round: int, site_id: str) -> bool:
        return self._group.holds(round, site_id) or (self._background is not None
                                                     and self._background.holds(round, site_id))

    @property
    def context(self) -> RoundContext | None:
        """The open round's context, or None."""
        return self._ctx

    # ---- the entry point ---------------------------------------------------------------------------------------
    def handle(self, topic: str, raw: bytes) -> Accepted | Pending | Rejected:
        """Process one message (wire bytes) from ``topic``: parse it, then :meth:`handle_envelope`. Never raises for
        bad input: returns :class:`Rejected` instead.

        Returns:
            :class:`Accepted` (stored, ACKed, accumulated), :class:`Rejected`, or, while :attr:`defer_commits` is
            set, :class:`Pending` for an update whose commit group is not yet durable (its outcome follows at the
            group's flush: ACKed and accumulated, or refused as a duplicate or late).

        Raises:
            OSError, sqlalchemy.exc.SQLAlchemyError: a group could not be stored (nothing of it was ACKed).
        """
        with self._lock:
            try:
                env = _parse_bytes(raw, MAX_SITE_MESSAGE_BYTES)
            except _Reject as rej:
                result = self._refuse(topic, rej, None, False)
                self.changed.notify_all()
                return result
            return self.handle_envelope(topic, env)

    def handle_envelope(self, topic: str, env: Envelope, *, verified_by: str | None = None
                        ) -> Accepted | Pending | Rejected:
        """Process one envelope already parsed (checks 2-17 of the module docstring). Never raises for bad input.

        Args:
            topic: the MQTT topic it arrived on.
            env: the parsed envelope (a whole update, or one reassembled by :func:`shared.transfer.assemble`).
            verified_by: None: verify the signature and the payload digest here (check 7, one pass). A key
                fingerprint: the caller verified ``env``'s signature with the site key of this fingerprint and its
                payload against the signed payload digest (a chunked upload: its manifest, and each chunk against
                its leaf); check 7 then only checks that the key is still valid, and nothing is hashed again.

        Returns:
            as :meth:`handle`: :class:`Accepted`, :class:`Rejected`, or :class:`Pending` while its commit group is
            not yet durable.

        Raises:
            OSError, sqlalchemy.exc.SQLAlchemyError: a group could not be stored (nothing of it was ACKed).
        """
        with self._lock:
            checked: Envelope | None = None
            verified = False
            staged: StagedUpdate | None = None
            try:
                self._check(topic, env)
                checked = env
                self._verify(env, verified_by)
                verified = True
                self.check_replay(env)
                staged = self._admit(topic, env)
            except _Reject as rej:
                result: Accepted | Pending | Rejected = self._refuse(topic, rej, checked, verified)
            if not self.defer_commits:
                self._flush()
            elif self._group.full() or (self._group.seconds_left() or 0.0) < 0:
                self._seal()
            if staged is not None:
                h = staged.row
                result = staged.result if staged.done else Pending(site_id=h.site_id, round=h.round,
                                                                   sequence=h.sequence)
            self.changed.notify_all()
            return result

    def _refuse(self, topic: str, rej: _Reject, env: Envelope | None, verified: bool) -> Rejected:
        h = env.header if env is not None else None
        result = Rejected(reason=rej.reason, detail=rej.detail, error_kind=rej.error_kind,
                          site_id=h.site_id if h is not None else None, round=h.round if h is not None else None)
        self._record_rejection(topic, result)
        if verified and env is not None:
            self._nack(env, result)
        return result

    def refuse_verified(self, topic: str, rej: _Reject, env: Envelope) -> Rejected:
        """Count, log, store and NACK a refusal of a message whose signature verified (e.g. a manifest refused by
        :class:`coordinator.transfers.TransferReceiver`)."""
        with self._lock:
            return self._refuse(topic, rej, env, True)

    def record_rejection(self, topic: str, rej: _Reject) -> Rejected:
        """Count, log and store a rejection found before any envelope verified (e.g. by
        :class:`coordinator.transfers.TransferReceiver`); no NACK is sent (the sender is not authenticated)."""
        with self._lock:
            return self._refuse(topic, rej, None, False)

    def check_replay(self, env: Envelope) -> None:
        """The time window of replay protection for a verified site envelope: its timestamp is at most
        ``max_clock_skew_s`` in the future and at most ``max_message_age_s`` old.

        The rest of replay protection is the binding of every update to (federation, site, round, base model hash)
        under the site's signature, and its idempotency key (site, round, sequence): a replayed update is either a
        duplicate of the stored one (re-ACKed, never aggregated or charged again), or an update for a closed round
        (charged once: ledger rows are unique per site, round and category), or for a round that did not select the
        site (refused). A strict per-site sequence floor is *not* applied to updates: it would refuse a genuine
        late update whose events must still be charged.

        Raises:
            _Reject: ``bad_timestamp``.
        """
        h = env.header
        now_ms = self._clock() * 1000.0
        w = self.replay_window
        if h.timestamp > now_ms + w.max_clock_skew_s * 1000.0:
            raise _Reject(RejectReason.BAD_TIMESTAMP, f"signed {(h.timestamp - now_ms) / 1000:.0f} s in the future "
                          f"(allowed clock skew {w.max_clock_skew_s:.0f} s); fix the gateway's clock (NTP/GPS)")
        if h.timestamp < now_ms - w.max_message_age_s * 1000.0:
            raise _Reject(RejectReason.BAD_TIMESTAMP, f"signed {(now_ms - h.timestamp) / 3600e3:.1f} h ago, older "
                          f"than the allowed {w.max_message_age_s / 3600:.0f} h")

    def precheck(self, env: Envelope) -> Rejected | None:
        """The checks of an update that need only its (verified) header, for a MANIFEST announcing it: the round is
        open (or is a past round that selected the site: a late update is still received, to be charged), the
        site was selected, the model version matches, and no update of the site is stored for the round (an
        announcement of the stored update itself is ACKed again). Refusals are recorded and NACKed.

        Returns:
            None when the chunks may come, else the :class:`Rejected`.
        """
        with self._lock:
            h = env.header
            try:
                if self._check_binding(h) is None and self._stored(h.round, h.site_id) is not None:
                    raise _Reject(RejectReason.DUPLICATE, f"site {h.site_id!r} already stored round {h.round}")
            except _Reject as rej:
                return self._refuse(f"manifest of {h.site_id}", rej, env, True)
            if self._ctx is not None and h.round == self._ctx.round:
                self._prechecked.add((h.round, h.site_id, h.sequence))
            return None

    def __call__(self, topic: str, raw: bytes) -> None:
        """Transport callback form of :meth:`handle`."""
        self.handle(topic, raw)

    # ---- checks ------------------------------------------------------------------------------------------------
    def _check(self, topic: str, env: Envelope) -> None:
        check_site_envelope(topic, env, federation_id=self.federation_id, kind=MessageKind.UPDATE)

    def _verify(self, env: Envelope, verified_by: str | None = None) -> None:
        if verified_by is None:
            verify_site_envelope(env, self._registry)
        else:
            check_site_key(env.header.site_id, verified_by, self._registry)

    def _check_binding(self, h: EnvelopeHeader, *, stored_read: bool = True) -> RoundContext | None:
        """The checks that need only the (verified) header: the round is open, the site was selected, the update
        was trained from the model the site was sent, and no update of the site is in for the round. An update of
        the site waiting in the commit group is made durable first, so that this check sees it.

        Args:
            h: the verified header. stored_read: read the database for a stored update of the site (False when
                this process read it for the update's manifest already; the group's transaction checks again).

        Returns:
            the open round's context, or None for an update of a past round that selected the site (a late update:
            the caller charges it, or lets its chunks come so that it can be charged).

        Raises:
            _Reject: ``wrong_round``, ``not_selected``, ``stale_model`` or ``duplicate``.
        """
        if self._holds(h.round, h.site_id):
            self._flush()
        ctx = self._ctx
        if ctx is None or h.round != ctx.round:
            if self._selected_in_past_round(h.round, h.site_id):
                return None
            open_r = "none" if ctx is None else str(ctx.round)
            raise _Reject(RejectReason.WRONG_ROUND, f"update for round {h.round}, open round is {open_r}")
        if h.site_id not in ctx.selected:
            raise _Reject(RejectReason.NOT_SELECTED, f"site {h.site_id!r} was not selected for round {ctx.round}")
        if h.base_model_hash != ctx.expected_hash(h.site_id):
            raise _Reject(RejectReason.STALE_MODEL, f"update trained from model {h.base_model_hash[:12]}, round "
                          f"{ctx.round} trains site {h.site_id} from {ctx.expected_hash(h.site_id)[:12]}")
        if h.site_id in ctx.accepted or (stored_read and not self.sole_ingest
                                         and self._stored(ctx.round, h.site_id) is not None):
            raise _Reject(RejectReason.DUPLICATE, f"site {h.site_id!r} already has an accepted update for round "
                          f"{ctx.round}")
        return ctx

    def _admit(self, topic: str, env: Envelope) -> StagedUpdate:
        """Check an update completely and hand it to the commit group; its finisher (:meth:`_finish`) ACKs and
        accumulates it once the group is durable.

        Raises:
            _Reject: any check failed (a late update is charged first).
        """
        h = env.header
        key = (h.round, h.site_id, h.sequence)
        ctx = self._check_binding(h, stored_read=key not in self._prechecked)
        self._prechecked.discard(key)
        if ctx is None:
            open_r = "none" if self._ctx is None else str(self._ctx.round)
            self._charge_late(env)
            raise _Reject(RejectReason.LATE, f"update for closed round {h.round} (open round is {open_r}); "
                          "its events were charged to the ledger, it is not aggregated")
        # Decoded once, tensors unchecked: they are checked here against the model, with their own reason codes
        # (decode_update would fold wrong dtypes and non-finite values into one PayloadError).
        report, delta = _decode_update(env.payload, check_weights=False)
        self._check_tensors(ctx, delta)
        events = self._check_report(ctx, h.site_id, report)
        weight = float(report.num_examples)  # N_k: declared public (shared.protocol.UpdateReport, docs/privacy.md)
        accepted = Accepted(site_id=h.site_id, round=ctx.round, sequence=h.sequence,
                            num_examples=int(report.num_examples), weight=weight, payload_sha256=h.payload_digest,
                            events=events, count_events=dict(report.count_events),
                            species_counts=dict(report.species_counts))
        # 1. durable storage first: blob + row, with the rest of the group (payload hash verified by the signature)
        staged = StagedUpdate(row=UpdateRow(round=ctx.round, site_id=h.site_id, sequence=h.sequence,
                                            num_examples=int(report.num_examples), payload_sha256=h.payload_digest),
                              payload=env.payload, digest=h.payload_digest,
                              finish=lambda outcome: self._finish(topic, env, ctx, report, delta, accepted, outcome))
        self._group.submit(staged)
        return staged

    def _finish(self, topic: str, env: Envelope, ctx: RoundContext, report: UpdateReport,
                delta: Mapping[str, np.ndarray], accepted: Accepted, outcome: UpdateOutcome) -> Accepted | Rejected:
        """After the update's group committed: 2. the ACK, 3. the running sum (or the refusal the commit found)."""
        h = env.header
        try:
            if outcome is UpdateOutcome.DUPLICATE:  # another worker stored one first (unique round+site)
                raise _Reject(RejectReason.DUPLICATE, f"site {h.site_id!r} already stored for round {ctx.round}")
            if outcome is UpdateOutcome.CLOSED:  # the finaliser closed the round meanwhile (scale-out): charged
                self._charge(h.site_id, ctx.round, accepted.events,
                             {IUCNCategory(c): e for c, e in report.count_events.items()})
                raise _Reject(RejectReason.LATE, f"round {ctx.round} closed while this update was checked; its "
                              "events were charged to the ledger, it is not aggregated")
        except _Reject as rej:
            return self._refuse(topic, rej, env, True)
        ctx.accepted[h.site_id] = accepted
        # 2. then the ACK
        self._send_ack(env, Ack(round=ctx.round, accepted=True, reason="stored"))
        # 3. then the running sum
        ctx.strategy.accumulate(h.site_id, delta, num_examples=accepted.num_examples,
                                species_counts=report.species_counts or None,
                                noise_variance=ctx.noise_variance(report))
        if self.on_accepted is not None:
            self.on_accepted(ctx, accepted)
        self.counts["accepted"] += 1
        log.info("ingest: accepted round %d update from %s (N=%d, %d bytes)", ctx.round, h.site_id,
                 report.num_examples, len(env.payload))
        return accepted

    def _stored(self, round: int, site_id: str) -> UpdateRow | None:
        with self._store.session() as s:
            return s.scalars(select(UpdateRow).where(UpdateRow.round == round, UpdateRow.site_id == site_id)).first()

    @staticmethod
    def _check_tensors(ctx: RoundContext, delta: Mapping[str, np.ndarray]) -> None:
        names, want = set(delta), set(ctx.template)
        if names != want:
            raise _Reject(RejectReason.WRONG_TENSORS, f"tensor names differ from the model: missing "
                          f"{sorted(want - names)[:5]}, unexpected {sorted(names - want)[:5]}")
        for name, ref in ctx.template.items():
            d = delta[name]
            if d.shape != ref.shape or d.dtype != ref.dtype:
                raise _Reject(RejectReason.WRONG_TENSORS, f"tensor {name!r} is {d.dtype}{list(d.shape)}, the model "
                              f"has {ref.dtype}{list(ref.shape)}")
        for name, d in delta.items():
            if not np.all(np.isfinite(d)):
                raise _Reject(RejectReason.NON_FINITE, f"tensor {name!r} has NaN or infinite values")

    def _declared_capacity(self, site_id: str) -> int | None:
        try:
            return self._registry.get(site_id).capacity
        except UnknownSiteError:
            return None

    def _check_report(self, ctx: RoundContext, site_id: str, report: UpdateReport
                      ) -> dict[IUCNCategory, DPSGDEvent]:
        n, steps = report.num_examples, report.local_steps
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_HEADER_ROUND:
            raise _Reject(RejectReason.BAD_REPORT, f"num_examples is {n!r}, must be a positive integer")
        declared = self._declared_capacity(site_id) if ctx.expected_events is None else None
        if declared is not None and n != declared:  # camera rounds: N_k is the public capacity, never a count
            raise _Reject(RejectReason.BAD_REPORT, f"num_examples is {n}, the site's declared capacity is {declared} "
                          "(a gateway reports its capacity, never its record count: upgrade it)")
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= ctx.local_steps:
            raise _Reject(RejectReason.BAD_REPORT, f"local_steps is {steps!r}, task asked for {ctx.local_steps}")
        events = {IUCNCategory(c): e for c, e in report.events.items()}
        if ctx.privacy != "none" and not events:
            raise _Reject(RejectReason.BAD_REPORT, "privacy is on but the update reports no DP events")
        if ctx.expected_events is not None and events != dict(ctx.expected_events):
            raise _Reject(RejectReason.BAD_REPORT, f"a radio upload of this round must report exactly "
                          f"{ {c.value: e for c, e in ctx.expected_events.items()} }, got "
                          f"{ {c.value: e for c, e in events.items()} }")
        for cat, ev in events.items():
            if not isinstance(ev, DPSGDEvent) or ev.steps > steps:
                raise _Reject(RejectReason.BAD_REPORT, f"event for {cat.value} ({ev!r}) is not a DP-SGD event of at "
                              f"most {steps} steps")
        counts = {IUCNCategory(c): e for c, e in report.count_events.items()}
        self._check_counts(ctx, report, counts)
        halted = ctx.halted.get(site_id, frozenset())
        trained_halted = sorted(c.value for c in {*events, *counts} if c in halted
                                and (c in counts or events[c].steps > 0))
        if trained_halted:
            self._charge(site_id, ctx.round, events, counts)
            raise _Reject(RejectReason.HALTED_CATEGORY, f"site trained halted categories {trained_halted}; "
                          "its events were charged to the ledger")
        if ctx.privacy != "none":
            for cat in {*events, *counts}:
                budget = ctx.budgets.get(cat)
                round_events = tuple(e for e in (events.get(cat), counts.get(cat)) if e is not None)
                if budget is not None and self._ledger.would_exceed(site_id, cat, round_events, budget,
                                                                    round=ctx.round):
                    self._charge(site_id, ctx.round, events, counts)
                    raise _Reject(RejectReason.OVER_BUDGET, f"events for {cat.value} take site {site_id!r} past its "
                                  f"budget eps={budget:.4f}; charged to the ledger, not aggregated")
        return events

    @staticmethod
    def _check_counts(ctx: RoundContext, report: UpdateReport, counts: Mapping[IUCNCategory, DPSGDEvent]) -> None:
        """The count release is exactly what the task asked for: every class, the asked noise, one release."""
        z = ctx.count_noise_multiplier
        if z is None:
            if report.species_counts or counts:
                raise _Reject(RejectReason.BAD_REPORT, "the update carries species counts the task did not ask for")
            return
        if ctx.num_classes is not None and set(report.species_counts) != set(range(ctx.num_classes)):
            raise _Reject(RejectReason.BAD_REPORT, f"species_counts must cover classes 0..{ctx.num_classes - 1}")
        if ctx.privacy != "none":
            if set(counts) != set(report.events):
                raise _Reject(RejectReason.BAD_REPORT, "the count release must be charged to every trained category")
            for cat, ev in counts.items():
                if ev != DPSGDEvent(float(z), 1.0, 1):
                    raise _Reject(RejectReason.BAD_REPORT, f"count event for {cat.value} is {ev!r}, the task asked "
                                  f"for one Gaussian release with noise multiplier {z}")

    def _selected_in_past_round(self, round: int, site_id: str) -> bool:
        """True if ``round`` was opened before (and is not the open round) and selected ``site_id``; a round that
        is being closed right now counts as past."""
        if self._ctx is not None and self._ctx.round == round:
            return False
        with self._store.session() as s:
            row = s.get(RoundRow, round)
            return row is not None and site_id in json.loads(row.selected_json)

    def _charge_late(self, env: Envelope) -> None:
        h = env.header
        if self._stored(h.round, h.site_id) is not None:
            raise _Reject(RejectReason.DUPLICATE, f"site {h.site_id!r} already has an accepted update for round "
                          f"{h.round}")
        report, _ = _decode_update(env.payload)
        self._charge(h.site_id, h.round, report.events, report.count_events)

    def _charge(self, site_id: str, round: int, events: Mapping[IUCNCategory, DPSGDEvent],
                count_events: Mapping[IUCNCategory, DPSGDEvent] | None = None) -> None:
        """Charge a refused update's events (durably); a second, different report for the same round is a
        duplicate (ledger rows are immutable)."""
        try:
            self._ledger.record_round(site_id, round, events)
            if count_events:
                self._ledger.record_round(site_id, round, count_events, mechanism="counts")
        except LedgerError as exc:
            raise _Reject(RejectReason.DUPLICATE, f"site {site_id!r} already reported other events for round "
                          f"{round}", exc) from exc

    # ---- side effects ------------------------------------------------------------------------------------------
    def _record_rejection(self, topic: str, rej: Rejected) -> None:
        self.counts[rej.reason.value] += 1
        log.warning("ingest: rejected message on %s: %s: %s", topic, rej.reason.value, rej.detail)
        self._store.add_rejection(round=rej.round, site_id=rej.site_id, topic=topic, reason=rej.reason.value,
                                  error_kind=rej.error_kind, detail=rej.detail)

    def _nack(self, env: Envelope, rej: Rejected) -> None:
        if rej.reason is RejectReason.DUPLICATE:
            row = self._stored(env.header.round, env.header.site_id)
            same = row is not None and (row.payload_sha256 == env.header.payload_digest
                                        or (env.header.kind == MessageKind.MANIFEST
                                            and row.sequence == env.header.sequence))
            if same:
                self._send_ack(env, Ack(round=env.header.round, accepted=True, reason="duplicate: already stored"))
                return
        self._send_ack(env, Ack(round=env.header.round, accepted=False, reason=f"{rej.reason.value}: {rej.detail}"))

    def _send_ack(self, env: Envelope, ack: Ack) -> None:
        h = env.header
        try:
            out = seal(private_key=self._key, federation_id=self.federation_id, site_id=h.site_id, round=h.round,
                       base_model_hash=h.base_model_hash, kind=MessageKind.ACK, sequence=h.sequence,
                       payload=encode_ack(ack))
            self._transport.publish(ack_topic(self.federation_id, h.site_id), out.to_bytes(), qos=1)
        except (TransportError, EnvelopeError) as exc:
            # The update (if accepted) is already stored; the gateway re-sends and gets a duplicate re-ACK.
            log.error("ingest: could not send ACK to %s for round %d: %s", h.site_id, h.round, exc)
