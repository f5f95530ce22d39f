"""What a viewer asks the web view for and how records' times are flagged: the detection filters of the pages, API
and exports (:class:`DetectionFilter`, parsed from query parameters with clear errors), the page size cap, the
separator of a record reference, the note shown beside a time that is not the camera's (:func:`time_note`), and the
location policy of a coordinator config's ``web`` block (:func:`policy_from_config`). What each role then sees is
:class:`coordinator.web.views.Viewer`'s.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

from shared.errors import ConfigError
from shared.iucn import IUCNCategory

from coordinator.config import CoordinatorConfig
from coordinator.web.location_privacy import LocationPolicy

__all__ = ["DetectionFilter", "MAX_PAGE_SIZE", "REF_SEPARATOR", "TIME_NOTES", "policy_from_config", "time_note"]

MAX_PAGE_SIZE = 500
REF_SEPARATOR = "~"
"""Between the site id and the media id of a record reference (:meth:`Viewer.record_ref`): an unreserved URL
character (RFC 3986) that site ids (``coordinator.registry.SITE_ID_PATTERN``) never contain."""


#: What a record's ``timestamp_source`` (shared.protocol.DetectionRecord) says of its time, when it is not the
#: camera's own EXIF capture time.
TIME_NOTES = {"mtime": "time from the file, not the camera",
              "run": "time of the detection run, not of the capture",
              "json": "time from the detector's output file, not read from the camera here",
              "unknown": "capture time unknown", "": "capture time unknown"}


def time_note(timestamp_source: str | None) -> str | None:
    """The flag shown beside a record's time: None when it is the camera's (``exif``), else what it is
    (:data:`TIME_NOTES`; another source is named as it is)."""
    source = (timestamp_source or "").strip()
    if source == "exif":
        return None
    return TIME_NOTES.get(source, f"time from {source}, not the camera")


def policy_from_config(cfg: CoordinatorConfig) -> LocationPolicy:
    """The :class:`LocationPolicy` of a coordinator config's ``web`` block (method, radius, cell, sensitive
    categories, ``unknown_species``)."""
    return LocationPolicy(method=cfg.web.location_method, radius_m=cfg.web.location_radius_m,
                          cell_m=cfg.web.location_cell_m, categories=frozenset(cfg.web.sensitive_categories),
                          protect_unknown=cfg.web.unknown_species == "protect")


def _parse_date(value: str | None, name: str) -> _dt.date | None:
    if value in (None, ""):
        return None
    try:
        return _dt.date.fromisoformat(str(value))
    except ValueError:
        raise ConfigError(f"{value!r} is not a date", field=name, fix="use YYYY-MM-DD") from None


@dataclass(frozen=True)
class DetectionFilter:
    """Filters of the detection list; every field optional.

    Attributes:
        site: site id. species: exact species name (case-insensitive). category: IUCN category of the record's
            top species. date_from, date_to: capture date range, inclusive (the record's local date as sent).
        min_confidence: lowest top detector confidence in [0, 1]. limit: rows per page (1..500). offset: >= 0.
    """

    site: str | None = None
    species: str | None = None
    category: IUCNCategory | None = None
    date_from: _dt.date | None = None
    date_to: _dt.date | None = None
    min_confidence: float | None = None
    limit: int = 50
    offset: int = 0

    @classmethod
    def parse(cls, *, site: str | None = None, species: str | None = None, category: str | None = None,
              date_from: str | None = None, date_to: str | None = None, min_confidence: str | float | None = None,
              limit: str | int | None = None, offset: str | int | None = None) -> "DetectionFilter":
        """Build from query-string values ("" means unset).

        Raises:
            ConfigError: a bad category, date, confidence, limit or offset (names the field and the fix).
        """
        cat = None
        if category not in (None, ""):
            try:
                cat = IUCNCategory(str(category).upper())
            except ValueError:
                raise ConfigError(f"{category!r} is not an IUCN category", field="category",
                                  fix=f"use one of {[c.value for c in IUCNCategory]}") from None
        conf = None
        if min_confidence not in (None, ""):
            try:
                conf = float(min_confidence)  # type: ignore[arg-type]
            except ValueError:
                raise ConfigError(f"{min_confidence!r} is not a number", field="min_confidence",
                                  fix="give a number between 0 and 1") from None
            if not 0.0 <= conf <= 1.0:
                raise ConfigError(f"{min_confidence!r} is not in [0, 1]", field="min_confidence",
                                  fix="give a number between 0 and 1")

        def integer(value: Any, name: str, default: int, lo: int, hi: int) -> int:
            if value in (None, ""):
                return default
            try:
                n = int(value)
            except (TypeError, ValueError):
                raise ConfigError(f"{value!r} is not a whole number", field=name,
                                  fix=f"give {lo}..{hi}") from None
            if not lo <= n <= hi:
                raise ConfigError(f"{value!r} is not in [{lo}, {hi}]", field=name, fix=f"give {lo}..{hi}")
            return n

        d_from, d_to = _parse_date(date_from, "date_from"), _parse_date(date_to, "date_to")
        if d_from and d_to and d_from > d_to:
            raise ConfigError("it is after date_to", field="date_from", fix="swap the dates")
        return cls(site=site or None, species=(species or "").strip() or None, category=cat, date_from=d_from,
                   date_to=d_to, min_confidence=conf, limit=integer(limit, "limit", 50, 1, MAX_PAGE_SIZE),
                   offset=integer(offset, "offset", 0, 0, 10**9))
