"""A ranger's verdict on an event, written as human observations into the site's Camtrap DP package.

Camtrap DP keeps machine and human classifications side by side (``classificationMethod`` ``machine`` or
``human``, ``classifiedBy``, ``classificationTimestamp``). A verdict never edits the machine rows: it appends, for
every photo of the event, media-level rows with ``classificationMethod: human``:

=============  =====================================================================================
verdict        rows per photo
=============  =====================================================================================
``species``    ``observationType: animal`` with the chosen ``scientificName``, one row per detection box
               (the box's ``bbox*``), or one row without a box when the detector found none
``blank``      one ``blank`` row
``unknown``    one ``unknown`` row (an animal nobody could name: not a training record)
``person``     one ``human`` row
``vehicle``    one ``vehicle`` row
=============  =====================================================================================

The rows of one verdict share its ``classificationTimestamp`` and ``classifiedBy``; a later verdict on the same
photo supersedes an earlier one (the loader reads each photo's last human rows, those sharing the last row's
timestamp and reviewer: :mod:`edge_sdk.data.camtrap_dp`). Camtrap DP times have whole seconds, so a verdict given
within the second of the event's previous one is stamped one second after it: two verdicts never share a stamp.
Photos and verdicts stay in the package on the gateway; nothing here is published.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping

from shared.camtrap_dp import parse_datetime

from edge_sdk.field.site_package import SitePackage
from edge_sdk.field.store import FieldStore

__all__ = ["VERDICTS", "OBSERVATION_TYPES", "apply_verdict"]

#: Verdict kind -> Camtrap DP ``observationType``.
OBSERVATION_TYPES = {"species": "animal", "blank": "blank", "unknown": "unknown", "person": "human",
                     "vehicle": "vehicle"}
VERDICTS = tuple(OBSERVATION_TYPES)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _after(when: str, previous: str | None) -> str:
    """``when``, or one second after ``previous`` when ``when`` is not later than it (ISO 8601 with offset)."""
    if previous is None:
        return when
    moment, before = parse_datetime(when), parse_datetime(previous)
    return when if moment > before else (before + _dt.timedelta(seconds=1)).isoformat()


def _bbox_columns(bbox: object) -> dict[str, str]:
    x, y, w, h = (float(v) for v in bbox)  # type: ignore[union-attr]
    return {"bboxX": f"{x:.6f}", "bboxY": f"{y:.6f}", "bboxWidth": f"{w:.6f}", "bboxHeight": f"{h:.6f}"}


def apply_verdict(store: FieldStore, package: SitePackage, event_id: str, *, verdict: str,
                  reviewer: str, species: str | None = None, species_table: Mapping[str, object] | None = None,
                  at: str | None = None) -> int:
    """Write a ranger's verdict on an event (module docstring); returns the number of observation rows written.

    Args:
        store: the gateway's index.
        package: the site's package.
        event_id: the event.
        verdict: one of :data:`VERDICTS`.
        reviewer: the ranger's user name (``classifiedBy``).
        species: the scientific name, for ``species`` verdicts.
        species_table: the site's species table (scientific name -> entry); a ``species`` verdict must name one
            of its species.
        at: the verdict's time (ISO 8601 with offset; default now, UTC, and at least one second after the
            event's previous verdict).

    Raises:
        KeyError: no such event.
        ValueError: an unknown verdict, a ``species`` verdict without a species or with one outside the table, or a
            species given with another verdict.
    """
    if verdict not in OBSERVATION_TYPES:
        raise ValueError(f"verdict must be one of {', '.join(VERDICTS)}, got {verdict!r}")
    if verdict == "species":
        if not species:
            raise ValueError("a species verdict names a species")
        if species_table is not None and species not in species_table:
            raise ValueError(f"{species!r} is not in the site's species table")
    elif species:
        raise ValueError(f"a {verdict} verdict names no species")
    if not reviewer:
        raise ValueError("the reviewer's name is required (classifiedBy)")
    event = store.event(event_id)
    if event is None:
        raise KeyError(event_id)
    when = at or _after(_now(), event.verdict_at)
    rows = []
    for photo in store.event_photos(event_id):
        common = {"deploymentID": photo.deployment_id, "mediaID": photo.media_id, "eventID": event_id,
                  "eventStart": photo.timestamp, "eventEnd": photo.timestamp, "observationLevel": "media",
                  "observationType": OBSERVATION_TYPES[verdict], "classificationMethod": "human",
                  "classifiedBy": reviewer, "classificationTimestamp": when}
        boxes = [b for b in photo.boxes if b.get("bbox")] if verdict == "species" else []
        for i, box in enumerate(boxes or [None]):
            row = dict(common, observationID=f"{photo.media_id}-h{when.replace(':', '')}-{i}")
            if verdict == "species":
                row.update(scientificName=species, count=1)
            if box is not None:
                row.update(_bbox_columns(box["bbox"]))
            rows.append(row)
    with package.locked():
        package.append("observations", rows)
    store.set_verdict(event_id, verdict=verdict, species=species, by=reviewer, at=when)
    return len(rows)
