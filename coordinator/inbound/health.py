"""Fleet health, the receiving side: what the coordinator hears from its gateways (presence and health records),
stored per site (``site_health`` table) for the fleet table (:mod:`coordinator.fleet`).

Two inputs, both subscribed by :class:`coordinator.service.Coordinator` (so by ``run`` and by ``service``):

- **Health records** (``shared.health``, topic ``site/+/health``): signed by the site. :meth:`FleetIngestor.handle`
  checks, the first failure deciding the reason code (:class:`coordinator.inbound.reject.RejectReason`): size
  (``oversized``), envelope and topic (``malformed_envelope``, ``bad_topic``, ``wrong_kind``, ``wrong_federation``,
  ``topic_mismatch``), an enrolled site with a valid key whose signature verifies (``unknown_site``,
  ``no_valid_key``, ``bad_signature``), the signing time within the replay window (``bad_timestamp``), the payload
  (``malformed_payload``). A refusal is logged and stored in ``rejections`` (``status`` counts it). An accepted
  record replaces the site's stored one when it was signed later; an older one (a re-delivery) changes nothing.
- **Presence** (``shared.topics.status_topic``: ``online`` after each connect, the broker's last will ``offline``):
  unsigned, so advisory only. It is stored (state and arrival time) for enrolled sites whose topic and payload
  name the same site, and each change of state is kept as a ``presence_events`` row, from which
  :mod:`coordinator.link_stats` measures the sites' links; anything else is ignored (logged at debug level), never
  counted as a rejection.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import IntegrityError

from shared.envelope import Envelope, MessageKind
from shared.errors import ConfigError, MalformedEnvelopeError, PayloadError
from shared.health import MAX_HEALTH_BYTES, HealthRecord, decode_health
from shared.topics import parse_status_payload, parse_topic

from coordinator.inbound.reject import Reject, RejectReason, Rejected
from coordinator.inbound.site_checks import ReplayWindow, check_timestamp, parse_site_envelope, verify_site_envelope
from coordinator.registry import SiteRegistry, UnknownSiteError
from coordinator.storage import Store, utcnow
from coordinator.tables import PresenceEventRow, SiteHealthRow

__all__ = ["FleetIngestor"]

log = logging.getLogger(__name__)


class FleetIngestor:
    """Stores presence messages and verified health records (module docstring); thread-safe, never raises for bad
    input.

    Args:
        federation_id: our federation.
        store, registry: coordinator state (enrolled keys, the ``site_health`` table).
        replay_window: how far a health record's signing time may stray from ``clock`` (the config's ``transfer``).
        clock: naive-UTC now (tests inject one).

    Attributes:
        counts: ``Counter`` of outcomes (``stored``, ``stale``, ``presence``, ``presence_ignored``) and reasons.
    """

    def __init__(self, *, federation_id: str, store: Store, registry: SiteRegistry,
                 replay_window: ReplayWindow = ReplayWindow(), clock: Callable[[], _dt.datetime] = utcnow) -> None:
        self.federation_id = federation_id
        self._store = store
        self._registry = registry
        self._window = replay_window
        self._clock = clock
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def __call__(self, topic: str, raw: bytes) -> None:
        """Transport callback form of :meth:`handle`."""
        self.handle(topic, raw)

    def handle(self, topic: str, raw: bytes) -> str | Rejected:
        """One message from a ``status`` or ``health`` topic; returns the outcome (``stored``, ``stale``,
        ``presence``, ``presence_ignored``) or the :class:`~coordinator.inbound.reject.Rejected` of a health record."""
        with self._lock:
            try:
                channel = parse_topic(topic)[2]
            except (MalformedEnvelopeError, ConfigError):
                channel = ""
            outcome = self._presence(topic, raw) if channel == "status" else self._health(topic, raw)
            self.counts[outcome if isinstance(outcome, str) else outcome.reason.value] += 1
            return outcome

    # ---- presence ------------------------------------------------------------------------------------------
    def _presence(self, topic: str, raw: bytes) -> str:
        try:
            fed, site_id, _ = parse_topic(topic)
            named, state = parse_status_payload(raw)
            if fed != self.federation_id or named != site_id:
                raise MalformedEnvelopeError(f"presence for {named!r} on {topic!r}")
            self._registry.get(site_id)
        except (MalformedEnvelopeError, ConfigError, UnknownSiteError) as exc:
            log.debug("fleet: presence message on %s ignored: %s", topic, exc)
            return "presence_ignored"
        now = self._clock()

        def update(row: SiteHealthRow) -> list[Any]:
            changed = row.presence != state  # a retained message heard again at a (re)subscription is no change
            row.presence, row.presence_at = state, now
            return [PresenceEventRow(site_id=site_id, state=state, at=now)] if changed else []

        self._upsert(site_id, update)
        log.info("fleet: %s is %s", site_id, state)
        return "presence"

    # ---- health records ------------------------------------------------------------------------------------
    def _health(self, topic: str, raw: bytes) -> str | Rejected:
        env: Envelope | None = None
        try:
            env = parse_site_envelope(topic, raw, federation_id=self.federation_id, kind=MessageKind.HEALTH,
                                      max_bytes=MAX_HEALTH_BYTES)
            verify_site_envelope(env, self._registry)
            self._check_time(env)
            try:
                record = decode_health(env.payload)
            except (PayloadError, ValueError) as exc:  # ValueError: a JSON integer of > 4300 digits
                raise Reject(RejectReason.MALFORMED_PAYLOAD, str(exc), exc) from exc
        except Reject as rej:
            site = env.header.site_id if env is not None else None
            log.warning("fleet: health record on %s rejected: %s: %s", topic, rej.reason.value, rej.detail)
            self._store.add_rejection(round=None, site_id=site, topic=topic, reason=rej.reason.value,
                                      error_kind=rej.error_kind, detail=rej.detail)
            return Rejected(reason=rej.reason, detail=rej.detail, error_kind=rej.error_kind, site_id=site)
        return self._store_record(env.header.site_id, env.header.timestamp, record)

    def _check_time(self, env: Envelope) -> None:
        check_timestamp(env, self._window, self._clock().replace(tzinfo=_dt.timezone.utc).timestamp() * 1000.0)

    def _store_record(self, site_id: str, timestamp_ms: int, record: HealthRecord) -> str:
        sent_at = _dt.datetime.fromtimestamp(timestamp_ms / 1000, tz=_dt.timezone.utc).replace(tzinfo=None)
        now = self._clock()
        outcome = ["stale"]

        def update(row: SiteHealthRow) -> None:
            if row.sent_at is not None and sent_at <= row.sent_at:
                return  # a re-delivery, or older than the one stored
            row.record_json = json.dumps(record.to_json(), sort_keys=True)
            row.sent_at, row.received_at = sent_at, now
            outcome[0] = "stored"

        self._upsert(site_id, update)
        log.debug("fleet: health record of %s (%s)", site_id, outcome[0])
        return outcome[0]

    def _upsert(self, site_id: str, change: Callable[[SiteHealthRow], Any]) -> None:
        for attempt in range(3):
            try:
                with self._store.session() as s:
                    row = s.get(SiteHealthRow, site_id, with_for_update=True)
                    if row is None:
                        row = SiteHealthRow(site_id=site_id)
                        s.add(row)
                    for extra in change(row) or ():  # rows to add in the same transaction (presence events)
                        s.add(extra)
                return
            except IntegrityError:  # another process added the site's row first: update it instead
                if attempt == 2:
                    raise
