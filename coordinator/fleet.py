"""Fleet health, the reading side: the table ``wildfed-coordinator fleet`` and the operator page ``/operator/fleet``
show, from what :class:`coordinator.inbound.health.FleetIngestor` stored of the gateways' presence and health
records (``site_health`` table).

Reading (:func:`fleet_rows`) needs the database only: ``fleet`` runs beside a running ``service``. A site is
**silent** when nothing was heard from it (health record or presence message) for longer than the threshold, or
never. The model a gateway holds is compared with the one the coordinator released to it
(``coordinator.model_delivery``).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
from dataclasses import dataclass
from typing import Any

from shared.errors import ConfigError, PayloadError
from shared.health import HealthRecord

from coordinator.model_delivery import release_state_key
from coordinator.registry import SiteRegistry
from coordinator.storage import SiteHealthRow, Store, utcnow

__all__ = ["FleetRow", "fleet_rows", "DEFAULT_SILENT_AFTER_S", "format_age", "format_gib"]

log = logging.getLogger(__name__)


DEFAULT_SILENT_AFTER_S = 3600.0
"""A site is flagged silent after this long without a message (4 of the gateways' default 15-minute health
intervals)."""


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
