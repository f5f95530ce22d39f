"""Fleet health: what the coordinator hears from its gateways (presence and health records), stored per site, and
the table ``wildfed-coordinator fleet`` and the operator page ``/operator/fleet`` show.

Two inputs, both subscribed by :class:`coordinator.service.Coordinator` (so by ``run`` and by ``service``):

- **Health records** (``shared.health``, topic ``site/+/health``): signed by the site. :meth:`FleetIngestor.handle`
  checks, the first failure deciding the reason code (``coordinator.ingest.RejectReason``): size
  (``oversized``), envelope and topic (``malformed_envelope``, ``bad_topic``, ``wrong_kind``, ``wrong_federation``,
  ``topic_mismatch``), an enrolled site with a valid key whose signature verifies (``unknown_site``,
  ``no_valid_key``, ``bad_signature``), the signing time within the replay window (``bad_timestamp``), the payload
  (``malformed_payload``). A refusal is logged and stored in ``rejections`` (``status`` counts it). An accepted
  record replaces the site's stored one when it was signed later; an older one (a re-delivery) changes nothing.
- **Presence** (``shared.topics.status_topic``: ``online`` after each connect, the broker's last will ``offline``):
  unsigned, so advisory only. It is stored (state and arrival time) for enrolled sites whose topic and payload
  name the same site; anything else is ignored (logged at debug level), never counted as a rejection.

Reading (:func:`fleet_rows`) needs the database only: ``fleet`` runs beside a running ``service``. A site is
**silent** when nothing was heard from it (health record or presence message) for longer than the threshold, or
never. The model a gateway holds is compared with the one the coordinator released to it
(``coordinator.model_delivery``).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError

from shared.envelope import Envelope, MessageKind
from shared.errors import ConfigError, MalformedEnvelopeError, PayloadError
from shared.health import MAX_HEALTH_BYTES, HealthRecord, decode_health
from shared.topics import parse_status_payload, parse_topic

from coordinator.ingest import (RejectReason, Rejected, ReplayWindow, _Reject, parse_site_envelope,
                                verify_site_envelope)
from coordinator.model_delivery import release_state_key
from coordinator.registry import SiteRegistry, UnknownSiteError
from coordinator.storage import SiteHealthRow, Store, utcnow

__all__ = ["FleetIngestor", "FleetRow", "fleet_rows", "DEFAULT_SILENT_AFTER_S", "format_age", "format_gib"]

log = logging.getLogger(__name__)

DEFAULT_SILENT_AFTER_S = 3600.0
"""A site is flagged silent after this long without a message (4 of the gateways' default 15-minute health
intervals)."""


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
        ``presence``, ``presence_ignored``) or the :class:`~coordinator.ingest.Rejected` of a health record."""
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
        self._upsert(site_id, lambda row: (setattr(row, "presence", state), setattr(row, "presence_at", now)))
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
                raise _Reject(RejectReason.MALFORMED_PAYLOAD, str(exc), exc) from exc
        except _Reject as rej:
            site = env.header.site_id if env is not None else None
            log.warning("fleet: health record on %s rejected: %s: %s", topic, rej.reason.value, rej.detail)
            self._store.add_rejection(round=None, site_id=site, topic=topic, reason=rej.reason.value,
                                      error_kind=rej.error_kind, detail=rej.detail)
            return Rejected(reason=rej.reason, detail=rej.detail, error_kind=rej.error_kind, site_id=site)
        return self._store_record(env.header.site_id, env.header.timestamp, record)

    def _check_time(self, env: Envelope) -> None:
        now_ms = self._clock().replace(tzinfo=_dt.timezone.utc).timestamp() * 1000.0
        t, w = env.header.timestamp, self._window
        if t > now_ms + w.max_clock_skew_s * 1000.0:
            raise _Reject(RejectReason.BAD_TIMESTAMP, f"signed {(t - now_ms) / 1000:.0f} s in the future (allowed "
                          f"clock skew {w.max_clock_skew_s:.0f} s); fix the gateway's clock (NTP/GPS)")
        if t < now_ms - w.max_message_age_s * 1000.0:
            raise _Reject(RejectReason.BAD_TIMESTAMP, f"signed {(now_ms - t) / 3600e3:.1f} h ago, older than the "
                          f"allowed {w.max_message_age_s / 3600:.0f} h")

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
                    change(row)
                return
            except IntegrityError:  # another process added the site's row first: update it instead
                if attempt == 2:
                    raise


@dataclass(frozen=True)
class FleetRow:
    """One line of the fleet table.

    Attributes:
        site_id: the site. presence: ``online``/``offline`` (advisory) or None when never heard.
        last_seen: arrival of the newest health record or presence message (naive UTC), None when never.
        silent_s: seconds since ``last_seen`` (None: never heard). silent: no message for longer than the
            threshold, or never.
        record: the newest health record, or None. sent_at: when the gateway signed it (naive UTC).
        released_hash, released_round: the model the coordinator released to the site (None: none yet).
    """

    site_id: str
    presence: str | None
    last_seen: _dt.datetime | None
    silent_s: float | None
    silent: bool
    record: HealthRecord | None
    sent_at: _dt.datetime | None
    released_hash: str | None
    released_round: int | None

    @property
    def model_current(self) -> bool | None:
        """Whether the gateway holds the model released to it (None when either is unknown)."""
        if self.record is None or not self.record.model_hash or self.released_hash is None:
            return None
        return self.record.model_hash == self.released_hash

    def to_json(self) -> dict[str, Any]:
        """The row as JSON (times ISO 8601 UTC with ``Z``; ``record`` as the health record's fields)."""
        def iso(t: _dt.datetime | None) -> str | None:
            return None if t is None else t.isoformat(timespec="seconds") + "Z"

        return {"site_id": self.site_id, "presence": self.presence, "last_seen": iso(self.last_seen),
                "silent_s": self.silent_s, "silent": self.silent, "sent_at": iso(self.sent_at),
                "record": None if self.record is None else self.record.to_json(),
                "released_hash": self.released_hash, "released_round": self.released_round,
                "model_current": self.model_current}


def fleet_rows(store: Store, registry: SiteRegistry, *, now: _dt.datetime | None = None,
               silent_after_s: float = DEFAULT_SILENT_AFTER_S) -> list[FleetRow]:
    """The fleet table from the database alone: one row per enrolled site, by site id.

    Args:
        now: naive-UTC now (default :func:`coordinator.storage.utcnow`; tests inject one).
        silent_after_s: seconds without a message after which a site is flagged silent (> 0).

    Raises:
        ConfigError: ``silent_after_s`` is not positive.
    """
    if not silent_after_s > 0:
        raise ConfigError(f"the silence threshold must be positive, got {silent_after_s!r} s", field="silent-hours",
                          fix="give a positive number of hours, e.g. --silent-hours 1")
    now = now or utcnow()
    with store.session() as s:
        health = {row.site_id: row for row in s.query(SiteHealthRow).all()}
    out = []
    for site in sorted(registry.list(), key=lambda x: x.site_id):
        row = health.get(site.site_id)
        record = None
        if row is not None and row.record_json:
            try:
                record = HealthRecord(**json.loads(row.record_json))
            except (PayloadError, TypeError, ValueError) as exc:  # written by another release: shown as absent
                log.warning("fleet: stored health record of %s unreadable: %s", site.site_id, exc)
        seen = [t for t in ((row.received_at, row.presence_at) if row is not None else ()) if t is not None]
        last_seen = max(seen, default=None)
        silent_s = None if last_seen is None else max(0.0, (now - last_seen).total_seconds())
        released = store.get_state(release_state_key(site.site_id)) or {}
        out.append(FleetRow(site_id=site.site_id, presence=row.presence if row is not None else None,
                            last_seen=last_seen, silent_s=silent_s,
                            silent=silent_s is None or silent_s > silent_after_s, record=record,
                            sent_at=row.sent_at if row is not None else None,
                            released_hash=released.get("model"), released_round=released.get("round")))
    return out


def format_age(seconds: float | None) -> str:
    """``seconds`` as a short age: ``45 s``, ``12 min``, ``3.5 h``, ``2.0 d``; ``never`` for None."""
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86_400:.1f} d"


def format_gib(value: int | None) -> str:
    """Bytes as whole GiB (health records round disk free down to whole GiB); ``-`` for None."""
    return "-" if value is None else f"{value / (1 << 30):.0f} GiB"
