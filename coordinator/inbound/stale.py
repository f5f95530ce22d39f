"""Stale updates of buffered rounds (``buffered:`` in the coordinator config; docs/transport.md "Buffered rounds").

In a buffered federation an update for a round that has closed is not refused as ``late``: it was trained from a
model version the coordinator made, its site was sent that round's task, and its budget is spent either way. When
it arrives at most ``max_staleness`` rounds after its own round (``t = r_open - r``, where ``r_open`` is the open
round, or the next one when none is open), it runs the checks an update of the open round runs, against its own
round (:meth:`StaleUpdates.admit`):

==== ========================================================================== =====================
 #    check                                                                      reason on failure
==== ========================================================================== =====================
 8s   t <= max_staleness (an older update is charged, never aggregated)         ``late``
 10s  base_model_hash == the model its round was trained from                   ``stale_model``
 11s  no update of the site is stored for its round                             ``duplicate``
 12-17 as for the open round (payload, tensors, finite, report, budget),         as there
      against the round it was trained for; its events are charged first
==== ========================================================================== =====================

Then, in this order: its events are charged to the ledger durably (under its own round: ledger rows are unique per
site, round and category, so a re-delivery charges nothing more); it is stored with a waiting ``buffered_updates``
row (:func:`coordinator.buffered_store.store_waiting`); it is ACKed. The round that closes next folds it, weighted by
its staleness (:mod:`coordinator.buffered_rounds`). A crash between the charge and the store leaves the charge (the
gateway re-sends; the charge is then a no-op and the store happens); a crash after the store leaves it waiting for
the next close. Halted categories are not checked against the halts made after its round (the site trained before
them): the budget check (17) is what bounds its spend.

TEST-ONLY crash hook: with the environment variable ``WILDFED_TEST_CRASH_AT=after_buffered`` the process SIGKILLs
itself right after a stale update is stored and ACKed, while it waits in the buffer (tests/test_buffered_e2e.py).
Never set it in production.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable

from shared.envelope import Envelope
from shared.protocol import Ack

from coordinator.buffered_store import store_waiting
from coordinator.inbound.context import Accepted, RoundContext
from coordinator.inbound.reject import Reject, RejectReason
from coordinator.inbound.replies import SiteReplies
from coordinator.inbound.update_checks import (charge_late, charge_refused, check_report, check_tensors,
                                               decode_checked_update, stored_update)
from coordinator.ledger import PrivacyLedger
from coordinator.registry import SiteRegistry
from coordinator.storage import Store, UpdateOutcome, UpdateRow

__all__ = ["StaleUpdates"]

log = logging.getLogger(__name__)

_CRASH_ENV = "WILDFED_TEST_CRASH_AT"
CRASH_AFTER_BUFFERED = "after_buffered"
"""The value of ``$WILDFED_TEST_CRASH_AT`` that SIGKILLs the process once a stale update waits in the buffer."""


class StaleUpdates:
    """Admits the stale updates of a buffered federation (module docstring).

    Args:
        store, ledger, registry: coordinator state. replies: ACKs and refusals (the ingestor's).
        max_staleness: the oldest update admitted, in rounds (config ``buffered.max_staleness``).
        past_context: ``past_context(round)``: a :class:`RoundContext` of a past round (its model hash and
            template, the task's privacy parameters, no halts); raises ``LookupError`` when the round has no row.
        open_round: the round a stale update would join now: the open round, or the next one when none is open.
    """

    def __init__(self, *, store: Store, ledger: PrivacyLedger, registry: SiteRegistry, replies: SiteReplies,
                 max_staleness: int, past_context: Callable[[int], RoundContext],
                 open_round: Callable[[], int]) -> None:
        self._store, self._ledger, self._registry, self._replies = store, ledger, registry, replies
        self.max_staleness = int(max_staleness)
        self._past_context = past_context
        self._open_round = open_round

    def admit(self, env: Envelope) -> Accepted:
        """Check, charge, store and ACK one stale update (its signature, site and selection are checked already).

        Returns:
            the :class:`Accepted` update (``round``: the round it was trained for).

        Raises:
            Reject: a check of the module docstring failed (``late`` updates are charged first).
            OSError, sqlalchemy.exc.SQLAlchemyError: storing failed (nothing ACKed; the charge, if made, stays).
        """
        h = env.header
        joins = self._open_round()
        staleness = joins - h.round
        if staleness > self.max_staleness:
            charge_late(self._store, self._ledger, env)
            raise Reject(RejectReason.LATE, f"update for round {h.round} is {staleness} rounds old, more than "
                         f"buffered.max_staleness {self.max_staleness}; its events were charged to the ledger, it is "
                         "not aggregated")
        try:
            ctx = self._past_context(h.round)
        except LookupError as exc:
            raise Reject(RejectReason.WRONG_ROUND, f"update for round {h.round}, which has no round row") from exc
        if h.base_model_hash != ctx.model_hash:
            raise Reject(RejectReason.STALE_MODEL, f"update trained from model {h.base_model_hash[:12]}, round "
                         f"{h.round} trained from {ctx.model_hash[:12]}")
        if stored_update(self._store, h.round, h.site_id) is not None:
            raise Reject(RejectReason.DUPLICATE, f"site {h.site_id!r} already has an update stored for round "
                         f"{h.round}")
        report, delta = decode_checked_update(env.payload, check_weights=False)
        check_tensors(ctx, delta)
        events = check_report(ctx, h.site_id, report, registry=self._registry, ledger=self._ledger)
        charge_refused(self._ledger, h.site_id, h.round, events, report.count_events)  # durable before the store
        row = UpdateRow(round=h.round, site_id=h.site_id, sequence=h.sequence, num_examples=int(report.num_examples),
                        payload_sha256=h.payload_digest)
        if store_waiting(self._store, row, env.payload) is UpdateOutcome.DUPLICATE:
            raise Reject(RejectReason.DUPLICATE, f"site {h.site_id!r} already has an update stored for round "
                         f"{h.round}")
        self._replies.ack(env, Ack(round=h.round, accepted=True, reason="buffered"))
        log.info("ingest: buffered the round %d update from %s (its round had closed, or was closing) for the next "
                 "round to close", h.round, h.site_id)
        if os.environ.get(_CRASH_ENV) == CRASH_AFTER_BUFFERED:  # TEST ONLY: killed with the update in the buffer
            os.kill(os.getpid(), signal.SIGKILL)
        return Accepted(site_id=h.site_id, round=h.round, sequence=h.sequence, num_examples=int(report.num_examples),
                        weight=float(report.num_examples), payload_sha256=h.payload_digest, events=events,
                        count_events=dict(report.count_events), species_counts=dict(report.species_counts))
