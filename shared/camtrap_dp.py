"""Camtrap DP 1.0 (TDWG 2023, https://camtrap-dp.tdwg.org): the table columns and schema addresses, written once
for every writer of the project (the gateway's detection output, edge_sdk.inference.formats; the demo's site
packages, wildfed_sim.camtrap_writer; the web view's export, coordinator.web.formats).

Column names are the field names of the standard's table schemas, in schema order (version 1.0.2, whose fields
equal those of 1.0).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import re

__all__ = ["media_id", "MEDIA_ID_HEX_DIGITS", "CAMTRAP_DP_VERSION", "CAMTRAP_DP_PROFILE", "schema_url",
           "DEPLOYMENTS_COLUMNS", "MEDIA_COLUMNS", "OBSERVATIONS_COLUMNS", "MEDIA_TYPES", "TIMESTAMP_SOURCES",
           "TIMESTAMP_SOURCE_KEY", "mark_timestamp_source", "timestamp_source", "parse_datetime"]

#: Hex digits of a media id (128 bits of SHA-256: collisions need about 2**64 photos).
MEDIA_ID_HEX_DIGITS = 32


def media_id(data: bytes | memoryview) -> str:
    """The one media id of a photo everywhere in WildFed: the first :data:`MEDIA_ID_HEX_DIGITS` hex digits of the
    SHA-256 of the file's bytes.

    It depends on the bytes only, not on the file's name or folder, so the same photo gets the same id on the
    gateway (its site package, its detection records), in a package built by ``wildfed-edge package`` and in the
    coordinator's ``import-detections``: a photo copied twice (an SD card read twice, a file renamed) is one media
    row, stored once.

    Args:
        data: the file's bytes.

    Returns:
        32 lower-case hex characters.
    """
    return hashlib.sha256(data).hexdigest()[:MEDIA_ID_HEX_DIGITS]


CAMTRAP_DP_VERSION = "1.0.2"
CAMTRAP_DP_PROFILE = f"https://raw.githubusercontent.com/tdwg/camtrap-dp/{CAMTRAP_DP_VERSION}/camtrap-dp-profile.json"
"""The ``profile`` of a package's ``datapackage.json``."""


def schema_url(table: str) -> str:
    """The table schema address of ``deployments``, ``media`` or ``observations`` (a resource's ``schema``).

    Raises:
        ValueError: another table name.
    """
    if table not in ("deployments", "media", "observations"):
        raise ValueError(f"Camtrap DP has no table {table!r} (deployments, media, observations)")
    return f"https://raw.githubusercontent.com/tdwg/camtrap-dp/{CAMTRAP_DP_VERSION}/{table}-table-schema.json"


DEPLOYMENTS_COLUMNS: tuple[str, ...] = (
    "deploymentID", "locationID", "locationName", "latitude", "longitude", "coordinateUncertainty",
    "deploymentStart", "deploymentEnd", "setupBy", "cameraID", "cameraModel", "cameraDelay", "cameraHeight",
    "cameraDepth", "cameraTilt", "cameraHeading", "detectionDistance", "timestampIssues", "baitUse", "featureType",
    "habitat", "deploymentGroups", "deploymentTags", "deploymentComments")
"""``deployments`` columns."""
MEDIA_COLUMNS: tuple[str, ...] = (
    "mediaID", "deploymentID", "captureMethod", "timestamp", "filePath", "filePublic", "fileName",
    "fileMediatype", "exifData", "favorite", "mediaComments")
"""``media`` columns."""
OBSERVATIONS_COLUMNS: tuple[str, ...] = (
    "observationID", "deploymentID", "mediaID", "eventID", "eventStart", "eventEnd", "observationLevel",
    "observationType", "cameraSetupType", "scientificName", "count", "lifeStage", "sex", "behavior",
    "individualID", "individualPositionRadius", "individualPositionAngle", "individualSpeed", "bboxX", "bboxY",
    "bboxWidth", "bboxHeight", "classificationMethod", "classifiedBy", "classificationTimestamp",
    "classificationProbability", "observationTags", "observationComments")
"""``observations`` columns."""
MEDIA_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".tif": "image/tiff",
               ".tiff": "image/tiff", ".bmp": "image/bmp", ".webp": "image/webp", ".gif": "image/gif"}
"""``fileMediatype`` (IANA media type) by lower-case file suffix."""


# ---- where a media timestamp came from ---------------------------------------------------------------------------
# Camtrap DP 1.0 has no column for it, and its tables take no columns beyond the standard's (the FAQ's ways to add
# information are the pipe-separated ``key:value`` tags and extra resources; ``media`` has no tags column). So the
# mark is one ``key:value`` item of ``media.mediaComments``, written in the tags' form, and the deployment's
# ``timestampIssues`` is true when any of its timestamps is only a file time.

TIMESTAMP_SOURCES = ("exif", "table", "mtime", "run")
"""Where a media timestamp came from, best first: the photo's EXIF ``DateTimeOriginal`` (else ``DateTime``), the
input table's time column (a labels CSV's ``timestamp``, Timelapse's ``DateTime``), the file's modification time
(a guess: copying a card can change it), the time a detection run read it (the file could not be read at all)."""
TIMESTAMP_SOURCE_KEY = "timestampSource"


def mark_timestamp_source(source: str, comments: str = "") -> str:
    """``media.mediaComments`` carrying the timestamp's source: ``timestampSource:<source>``, then `` | `` and the
    other comments (if any, with any older mark removed).

    Raises:
        ValueError: ``source`` is not one of :data:`TIMESTAMP_SOURCES`.
    """
    if source not in TIMESTAMP_SOURCES:
        raise ValueError(f"timestamp source {source!r} is not one of {TIMESTAMP_SOURCES}")
    rest = [item for item in _comment_items(comments) if not item.startswith(f"{TIMESTAMP_SOURCE_KEY}:")]
    return " | ".join([f"{TIMESTAMP_SOURCE_KEY}:{source}", *rest])


def timestamp_source(media_comments: str | None) -> str | None:
    """The source :func:`mark_timestamp_source` wrote into ``media_comments``, or None when there is no mark (or an
    unknown one): a reader then knows nothing about the timestamp's origin."""
    for item in _comment_items(media_comments or ""):
        key, _, value = item.partition(":")
        if key.strip() == TIMESTAMP_SOURCE_KEY and value.strip() in TIMESTAMP_SOURCES:
            return value.strip()
    return None


def _comment_items(comments: str) -> list[str]:
    return [item.strip() for item in comments.split("|") if item.strip()]


# ---- reading a date and time -------------------------------------------------------------------------------------
_ZULU = re.compile(r"[Zz]$")
_FRACTION = re.compile(r"(\d{2}:\d{2}:\d{2})[.,](\d+)")


def parse_datetime(text: str) -> _dt.datetime:
    """A Camtrap DP date and time (ISO 8601 extended form, e.g. ``2024-01-02T10:00:00Z``,
    ``2024-01-02T10:00:00.5+01:00``) as a datetime, aware where the text has a zone (``Z`` is UTC).

    ``datetime.fromisoformat`` reads a ``Z`` zone and a fraction of a second of other than 3 or 6 digits only from
    Python 3.11 on; both are rewritten first (``+00:00``; the fraction cut or padded to 6 digits, as 3.11 does), so
    that a gateway on Python 3.10 reads the same timestamps.

    Raises:
        ValueError: not an ISO 8601 date (and time).
    """
    value = _ZULU.sub("+00:00", text.strip())
    value = _FRACTION.sub(lambda m: f"{m[1]}.{(m[2] + '000000')[:6]}", value, count=1)
    try:
        return _dt.datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"{text!r} is not an ISO 8601 date and time (YYYY-MM-DDThh:mm:ss with Z or +hh:mm)") \
            from None
