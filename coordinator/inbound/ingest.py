"""Ingest: turn one raw MQTT message into an accepted update or a counted, stored rejection.

:class:`coordinator.inbound.transfers.TransferReceiver` comes first on the update topic: it refuses a payload over
the size limit before parsing (``oversized``), reassembles chunked uploads (``bad_transfer``, ``unknown_transfer``)
and hands whole envelopes here. :meth:`Ingestor.handle` then checks, in this order (the first failure decides the
reason code):

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
      reported events are charged to the ledger, it is never aggregated;     ``late``
      in a buffered federation it is a stale update instead, with checks of
      its own: coordinator.inbound.stale)
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

Where the checks live: 1-7b are the checks of every signed site message (:mod:`coordinator.inbound.site_checks`),
8-11 the round binding (:meth:`Ingestor._check_binding`, here: they read the open round and the commit group),
12-17 the update's content (:mod:`coordinator.inbound.update_checks`). The reason codes are
:class:`coordinator.inbound.reject.RejectReason`.

Parsed once, hashed once: :meth:`Ingestor.handle_envelope` takes an envelope its caller already parsed
(:class:`coordinator.inbound.transfers.TransferReceiver` parses every message once to route it). A chunked update
comes with ``verified_by``: the receiver verified its signature with the site key of that fingerprint when the
manifest came, and its payload piece by piece against the signed leaves (each byte hashed once,
:mod:`shared.transfer`); check 7 then only checks that this key is still one of the site's valid keys (not revoked
since), and hashes nothing. Every other check runs as for a whole update.

Charging refused updates: an update that verified, came from a site selected for its round, and decodes, shows
that the site *ran* those DP-SGD steps and that the coordinator has seen their output. Such updates refused as
``late``, ``halted_category`` or ``over_budget`` are therefore charged to the ledger immediately (durably), even
though nothing derived from them is ever released: the ledger reports what sites spent, never less.

Every rejection is logged with its reason, stored (``rejections`` table), counted per reason, and never reaches
the aggregate. Only the library's typed errors are caught (``EnvelopeError`` subclasses, ``ConfigError`` from
identifier checks); anything else is a bug and propagates to the transport, which logs it.

An accepted update is handled in this order: payload stored durably (blob fsync-ed + row committed), THEN a signed
ACK is published on the site's ack topic, THEN the delta is folded into the round's running sum. Durability is
shared by a group of updates (:mod:`coordinator.inbound.group_commit`): a checked update waits, for a few
milliseconds at most, until its group's blobs are fsync-ed together and their rows committed in one transaction; its
ACK and its accumulation follow that commit. Called directly, :meth:`Ingestor.handle` commits every update before
it returns (groups of one); the ingest thread (``coordinator.transport.handlers.QueuedCallback``) sets
:attr:`Ingestor.defer_commits` and seals the groups when they are due, which a committer thread then makes durable,
ACKs and accumulates (:meth:`Ingestor.commit_in_background`), and :meth:`Ingestor.handle` answers :class:`Pending`
for an update whose group is not yet durable. A site whose signature verified but whose update was refused gets a
signed negative ACK with the reason; a re-delivery of an already stored update (same payload hash; MQTT QoS 1 is
at-least-once) is counted as ``duplicate`` and re-ACKed positively so the gateway can drop it from its outbox. Every
ACK echoes the update's sequence (the idempotency key is site, round, sequence; docs/transport.md).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy.exc import SQLAlchemyError

from shared.envelope import Envelope, EnvelopeHeader, MessageKind
from shared.iucn import IUCNCategory
from shared.protocol import Ack, UpdateReport

from coordinator.inbound.context import Accepted, Pending, RoundContext
from coordinator.inbound.group_commit import CommitGroups, GroupCommitPolicy, StagedUpdate
from coordinator.inbound.reject import Reject, RejectReason, Rejected
from coordinator.inbound.replies import SiteReplies
from coordinator.inbound.site_checks import (MAX_SITE_MESSAGE_BYTES, ReplayWindow, check_site_envelope,
                                             check_site_key, check_timestamp, parse_bytes, verify_site_envelope)
from coordinator.inbound.stale import StaleUpdates
from coordinator.inbound.update_checks import (charge_late, charge_refused, check_report, check_round_binding,
                                               check_tensors, decode_checked_update, stored_update)
from coordinator.ledger import PrivacyLedger
from coordinator.registry import SiteRegistry
from coordinator.storage import Store, UpdateOutcome, UpdateRow
from coordinator.transport import Transport

__all__ = ["Ingestor"]

log = logging.getLogger(__name__)


class Ingestor:
    """Verifies, stores, acknowledges and aggregates incoming updates (see the module docstring).

    Args:
        federation_id: our federation.
        store, registry, ledger: coordinator state.
        transport: where ACKs are published.
        signing_key: the coordinator's Ed25519 key (signs ACKs).
        group_commit: bounds of a commit group (:class:`coordinator.inbound.group_commit.GroupCommitPolicy`;
            default one).

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
        #: partial sum there, ``coordinator.inbound.workers``); None: nothing.
        self.on_accepted: Callable[[RoundContext, Accepted], None] | None = None
        self._store = store
        self._registry = registry
        self._ledger = ledger
        self._ctx: RoundContext | None = None
        self._lock = threading.RLock()
        self.changed = threading.Condition(self._lock)
        self.counts: Counter[str] = Counter()
        self._replies = SiteReplies(federation_id=federation_id, store=store, transport=transport,
                                    signing_key=signing_key, counts=self.counts)
        self._commits = CommitGroups(store, group_commit, self.changed)
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
        #: buffered rounds: the stale updates' path (:meth:`admit_stale_updates`); None: a past round's update is late
        self.stale: StaleUpdates | None = None

    def admit_stale_updates(self, *, max_staleness: int, past_context: Callable[[int], RoundContext],
                            open_round: Callable[[], int]) -> None:
        """Buffered rounds: from now on an update of a past round that selected its site, at most ``max_staleness``
        rounds old, is admitted for the next close instead of refused as late (:class:`StaleUpdates`; the
        arguments are its own)."""
        self.stale = StaleUpdates(store=self._store, ledger=self._ledger, registry=self._registry,
                                  replies=self._replies, max_staleness=max_staleness, past_context=past_context,
                                  open_round=open_round)

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
                self._commits.flush()
            except (OSError, SQLAlchemyError):  # nothing of the group was ACKed: its gateways re-send (late then)
                log.exception("ingest: the updates waiting for a group commit could not be stored at round close")
            ctx, self._ctx = self._ctx, None
            self._prechecked.clear()
            self.changed.notify_all()
            return ctx

    # ---- group commit ------------------------------------------------------------------------------------------
    def commit_in_background(self) -> None:
        """From now on :meth:`flush_async` hands a due group to a committer thread
        (:class:`coordinator.inbound.group_commit.BackgroundCommits`), so its fsyncs and commit overlap the checks of
        the next messages; its ACKs and accumulation follow on that thread once it is durable. Idempotent."""
        with self._lock:
            self._commits.run_in_background()

    def flush(self) -> None:
        """Make every update waiting for a group commit durable now, then ACK and accumulate them, before returning
        (coordinator.inbound.group_commit).

        Raises:
            OSError, sqlalchemy.exc.SQLAlchemyError: storing failed; nothing of the group was ACKed.
        """
        with self._lock:
            self._commits.flush()

    def flush_async(self) -> None:
        """Start making the open group durable: on the committer thread after :meth:`commit_in_background` (waiting
        only for the group already in flight), else as :meth:`flush`."""
        with self._lock:
            self._commits.seal()

    @property
    def committing(self) -> bool:
        """Whether an update is waiting for, or in, a group commit (open group or one in flight)."""
        with self._lock:
            return self._commits.busy

    def flush_in(self) -> float | None:
        """Seconds until the open commit group must be flushed (<= 0: now), or None when none is open."""
        with self._lock:
            return self._commits.seconds_left()

    @property
    def group_stats(self) -> tuple[int, int]:
        """``(groups committed, updates in them)`` since start."""
        return self._commits.committer.groups, self._commits.committer.updates

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
                env = parse_bytes(raw, MAX_SITE_MESSAGE_BYTES)
            except Reject as rej:
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
                admitted = self._admit(topic, env)
                if isinstance(admitted, Accepted):  # a buffered round's stale update: stored and ACKed already
                    result = admitted
                    self.counts["buffered"] += 1
                else:
                    staged = admitted
            except Reject as rej:
                result: Accepted | Pending | Rejected = self._refuse(topic, rej, checked, verified)
            if not self.defer_commits:
                self._commits.flush()
            else:
                self._commits.seal_if_due()
            if staged is not None:
                h = staged.row
                result = staged.result if staged.done else Pending(site_id=h.site_id, round=h.round,
                                                                   sequence=h.sequence)
            self.changed.notify_all()
            return result

    def _refuse(self, topic: str, rej: Reject, env: Envelope | None, verified: bool) -> Rejected:
        return self._replies.refuse(topic, rej, env, verified)

    def refuse_verified(self, topic: str, rej: Reject, env: Envelope) -> Rejected:
        """Count, log, store and NACK a refusal of a message whose signature verified (e.g. a manifest refused by
        :class:`coordinator.inbound.transfers.TransferReceiver`)."""
        with self._lock:
            return self._refuse(topic, rej, env, True)

    def record_rejection(self, topic: str, rej: Reject) -> Rejected:
        """Count, log and store a rejection found before any envelope verified (e.g. by
        :class:`coordinator.inbound.transfers.TransferReceiver`); no NACK is sent (the sender is not authenticated)."""
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
            Reject: ``bad_timestamp``.
        """
        check_timestamp(env, self.replay_window, self._clock() * 1000.0)

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
                if self._check_binding(h) is None and stored_update(self._store, h.round, h.site_id) is not None:
                    raise Reject(RejectReason.DUPLICATE, f"site {h.site_id!r} already stored round {h.round}")
            except Reject as rej:
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
        """Checks 8-11 (:func:`coordinator.inbound.update_checks.check_round_binding`), after an update of the site
        waiting in the commit group is made durable, so that they see it.

        Args:
            h: the verified header. stored_read: read the database for a stored update of the site (False when
                this process read it for the update's manifest already; the group's transaction checks again).

        Returns:
            the open round's context, or None for an update of a past round that selected the site (late).

        Raises:
            Reject: ``wrong_round``, ``not_selected``, ``stale_model`` or ``duplicate``.
        """
        if self._commits.holds(h.round, h.site_id):
            self._commits.flush()
        return check_round_binding(h, self._ctx, self._store, read_stored=stored_read and not self.sole_ingest)

    def _admit(self, topic: str, env: Envelope) -> StagedUpdate | Accepted:
        """Check an update completely and hand it to the commit group; its finisher (:meth:`_finish`) ACKs and
        accumulates it once the group is durable. In a buffered federation an update of a past round is a stale
        update (:mod:`coordinator.inbound.stale`): charged, stored, ACKed here, and returned as :class:`Accepted`.

        Raises:
            Reject: any check failed (a late update is charged first).
        """
        h = env.header
        key = (h.round, h.site_id, h.sequence)
        ctx = self._check_binding(h, stored_read=key not in self._prechecked)
        self._prechecked.discard(key)
        if ctx is None and self.stale is not None:
            return self.stale.admit(env)
        if ctx is None:
            open_r = "none" if self._ctx is None else str(self._ctx.round)
            charge_late(self._store, self._ledger, env)
            raise Reject(RejectReason.LATE, f"update for closed round {h.round} (open round is {open_r}); "
                         "its events were charged to the ledger, it is not aggregated")
        # Decoded once, tensors unchecked: they are checked here against the model, with their own reason codes
        # (decode_update would fold wrong dtypes and non-finite values into one PayloadError).
        report, delta = decode_checked_update(env.payload, check_weights=False)
        check_tensors(ctx, delta)
        events = check_report(ctx, h.site_id, report, registry=self._registry, ledger=self._ledger)
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
        self._commits.submit(staged)
        return staged

    def _finish(self, topic: str, env: Envelope, ctx: RoundContext, report: UpdateReport,
                delta: Mapping[str, np.ndarray], accepted: Accepted, outcome: UpdateOutcome) -> Accepted | Rejected:
        """After the update's group committed: 2. the ACK, 3. the running sum (or the refusal the commit found)."""
        h = env.header
        try:
            if outcome is UpdateOutcome.DUPLICATE:  # another worker stored one first (unique round+site)
                raise Reject(RejectReason.DUPLICATE, f"site {h.site_id!r} already stored for round {ctx.round}")
            if outcome is UpdateOutcome.CLOSED:  # the finaliser closed the round meanwhile (scale-out): charged
                charge_refused(self._ledger, h.site_id, ctx.round, accepted.events,
                               {IUCNCategory(c): e for c, e in report.count_events.items()})
                raise Reject(RejectReason.LATE, f"round {ctx.round} closed while this update was checked; its "
                             "events were charged to the ledger, it is not aggregated")
        except Reject as rej:
            return self._refuse(topic, rej, env, True)
        ctx.accepted[h.site_id] = accepted
        # 2. then the ACK
        self._replies.ack(env, Ack(round=ctx.round, accepted=True, reason="stored"))
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
