"""The three Camtrap DP 1.0 table schemas as data, so that a package validates without the network.

A Camtrap DP package names its table schemas by URL (``shared.camtrap_dp.schema_url``), and a validator fetches
them from there; a gateway has no internet. The schemas below are written in this project's own words from the
facts of the standard's table schemas, version 1.0.2 (TDWG, https://camtrap-dp.tdwg.org/data; fields, types and
constraints equal those of 1.0): the field names in schema order (those of ``shared.camtrap_dp``), each field's
type and datetime format, which fields are required or unique, the enums, the ranges and patterns, the missing
value ``""``, the primary keys and the foreign keys between the tables. The standard's long definitions are not
repeated: each field carries a one-line description and the page that defines it.

Packages written by WildFed on a gateway (``wildfed-edge package``, the demo's site packages) copy these schemas
into the package (``schemas/<table>-table-schema.json``, :func:`write_schema_files`) and point each resource at
its file (:func:`local_resource`), so ``frictionless validate datapackage.json`` checks every table, type, enum,
key and reference offline. The package's ``profile`` is :data:`LOCAL_PACKAGE_PROFILE`: the Camtrap DP profile
URL would be fetched by the validator too (see its docstring).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shared.camtrap_dp import CAMTRAP_DP_VERSION, DEPLOYMENTS_COLUMNS, MEDIA_COLUMNS, OBSERVATIONS_COLUMNS

__all__ = ["SCHEMA_VERSION", "TABLES", "DATETIME_FORMAT", "LOCAL_PACKAGE_PROFILE", "table_schema", "schema_file",
           "local_resource", "write_schema_files"]

SCHEMA_VERSION = CAMTRAP_DP_VERSION
"""The Camtrap DP version whose table schemas these are (1.0.2)."""
TABLES = ("deployments", "media", "observations")
DATETIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"
"""Every Camtrap DP datetime: ISO 8601 with seconds and a zone (``Z`` or ``+hh:mm``)."""
LOCAL_PACKAGE_PROFILE = "tabular-data-package"
"""``profile`` of a gateway's package: the Frictionless registry's Tabular Data Package (every resource a tabular
data resource), checked offline. The Camtrap DP profile URL (``shared.camtrap_dp.CAMTRAP_DP_PROFILE``) is a remote
JSON Schema that ``frictionless validate`` downloads, so a package naming it cannot validate on a gateway; and
that profile asks for the table schemas by URL, which local schemas are not. A package meant for publication
(the web view's export) names the profile and the schema URLs instead."""

_DOCS = "https://camtrap-dp.tdwg.org/data/#"


def _field(table: str, name: str, kind: str, description: str, *, required: bool = False, unique: bool = False,
           enum: Iterable[str] | None = None, minimum: float | None = None, maximum: float | None = None,
           pattern: str | None = None) -> dict[str, Any]:
    field: dict[str, Any] = {"name": name, "type": kind, "description": f"{description} ({_DOCS}{table}.{name})"}
    if kind == "datetime":
        field["format"] = DATETIME_FORMAT
    constraints: dict[str, Any] = {"required": required}
    if unique:
        constraints["unique"] = True
    if enum is not None:
        constraints["enum"] = list(enum)
    if minimum is not None:
        constraints["minimum"] = minimum
    if maximum is not None:
        constraints["maximum"] = maximum
    if pattern is not None:
        constraints["pattern"] = pattern
    field["constraints"] = constraints
    return field


def _deployments() -> list[dict[str, Any]]:
    t = "deployments"
    return [
        _field(t, "deploymentID", "string", "Identifier of the camera placement.", required=True, unique=True),
        _field(t, "locationID", "string", "Identifier of the place."),
        _field(t, "locationName", "string", "Name of the place."),
        _field(t, "latitude", "number", "WGS84 latitude, decimal degrees.", required=True, minimum=-90, maximum=90),
        _field(t, "longitude", "number", "WGS84 longitude, decimal degrees.", required=True, minimum=-180,
               maximum=180),
        _field(t, "coordinateUncertainty", "integer", "Radius around the coordinates holding the place, metres.",
               minimum=1),
        _field(t, "deploymentStart", "datetime", "When the placement began.", required=True),
        _field(t, "deploymentEnd", "datetime", "When the placement ended.", required=True),
        _field(t, "setupBy", "string", "Who placed the camera."),
        _field(t, "cameraID", "string", "Identifier of the camera (e.g. its serial number)."),
        _field(t, "cameraModel", "string", "Make and model, as make-model."),
        _field(t, "cameraDelay", "integer", "Seconds after a capture during which activity is ignored.", minimum=0),
        _field(t, "cameraHeight", "number", "Height of the camera above the ground, metres.", minimum=0),
        _field(t, "cameraDepth", "number", "Depth of the camera under water, metres.", minimum=0),
        _field(t, "cameraTilt", "integer", "Vertical angle, degrees: -90 down, 0 level, 90 up.", minimum=-90,
               maximum=90),
        _field(t, "cameraHeading", "integer", "Horizontal angle, degrees clockwise from north.", minimum=0,
               maximum=360),
        _field(t, "detectionDistance", "number", "Farthest distance at which activity is detected, metres.",
               minimum=0),
        _field(t, "timestampIssues", "boolean", "true when the placement's media timestamps are known to be wrong."),
        _field(t, "baitUse", "boolean", "true when bait was used."),
        _field(t, "featureType", "string", "Kind of feature the camera watches.",
               enum=("roadPaved", "roadDirt", "trailHiking", "trailGame", "roadUnderpass", "roadOverpass",
                     "roadBridge", "culvert", "burrow", "nestSite", "carcass", "waterSource", "fruitingTree")),
        _field(t, "habitat", "string", "Short description of the habitat."),
        _field(t, "deploymentGroups", "string", "Groups of the placement, pipe-separated key:value pairs."),
        _field(t, "deploymentTags", "string", "Tags of the placement, pipe-separated key:value pairs."),
        _field(t, "deploymentComments", "string", "Free comments."),
    ]


def _media() -> list[dict[str, Any]]:
    t = "media"
    return [
        _field(t, "mediaID", "string", "Identifier of the media file.", required=True, unique=True),
        _field(t, "deploymentID", "string", "The placement that recorded it.", required=True),
        _field(t, "captureMethod", "string", "What triggered the capture.", enum=("activityDetection", "timeLapse")),
        _field(t, "timestamp", "datetime", "When the media file was recorded.", required=True),
        # a relative path may not start with '.', '/' or '~' nor contain '..'; a URL passes
        _field(t, "filePath", "string", "Relative path in the package, or URL, of the file.", required=True,
               pattern=r"^[^./~]((?!\.\.).)*$"),
        _field(t, "filePublic", "boolean", "false when the file is not public.", required=True),
        _field(t, "fileName", "string", "Name of the file."),
        _field(t, "fileMediatype", "string", "IANA media type of the file.", required=True,
               pattern=r"^(image|video|audio)/.*$"),
        _field(t, "exifData", "object", "EXIF data, a JSON object."),
        _field(t, "favorite", "boolean", "true when the file is of particular interest."),
        _field(t, "mediaComments", "string", "Free comments."),
    ]


def _observations() -> list[dict[str, Any]]:
    t = "observations"
    unit = {"minimum": 0, "maximum": 1}
    size = {"minimum": 1e-15, "maximum": 1}
    return [
        _field(t, "observationID", "string", "Identifier of the observation.", required=True, unique=True),
        _field(t, "deploymentID", "string", "The placement it belongs to.", required=True),
        _field(t, "mediaID", "string", "The media file classified (media-level observations)."),
        _field(t, "eventID", "string", "The event it belongs to."),
        _field(t, "eventStart", "datetime", "When the event began.", required=True),
        _field(t, "eventEnd", "datetime", "When the event ended.", required=True),
        _field(t, "observationLevel", "string", "Whether one media file or a whole event was classified.",
               required=True, enum=("media", "event")),
        _field(t, "observationType", "string", "Kind of observation.", required=True,
               enum=("animal", "human", "vehicle", "blank", "unknown", "unclassified")),
        _field(t, "cameraSetupType", "string", "Camera set-up action shown, if any.", enum=("setup", "calibration")),
        _field(t, "scientificName", "string", "Scientific name of the individuals observed."),
        _field(t, "count", "integer", "Number of individuals.", minimum=1),
        _field(t, "lifeStage", "string", "Life stage of the individuals.", enum=("adult", "subadult", "juvenile")),
        _field(t, "sex", "string", "Sex of the individuals.", enum=("female", "male")),
        _field(t, "behavior", "string", "Dominant behaviour."),
        _field(t, "individualID", "string", "Identifier of the individual."),
        _field(t, "individualPositionRadius", "number", "Distance of the individual from the camera, metres.",
               minimum=0),
        _field(t, "individualPositionAngle", "number", "Angle of the individual from the view's centre line, degrees.",
               minimum=-90, maximum=90),
        _field(t, "individualSpeed", "number", "Mean speed of the individual, metres per second.", minimum=0),
        _field(t, "bboxX", "number", "Left edge of the box, fraction of the image width.", **unit),
        _field(t, "bboxY", "number", "Top edge of the box, fraction of the image height.", **unit),
        _field(t, "bboxWidth", "number", "Width of the box, fraction of the image width.", **size),
        _field(t, "bboxHeight", "number", "Height of the box, fraction of the image height.", **size),
        _field(t, "classificationMethod", "string", "Whether a person or a machine classified it.",
               enum=("human", "machine")),
        _field(t, "classifiedBy", "string", "The person or model that classified it."),
        _field(t, "classificationTimestamp", "datetime", "When it was classified."),
        _field(t, "classificationProbability", "number", "Certainty of the classification.", **unit),
        _field(t, "observationTags", "string", "Tags, pipe-separated key:value pairs."),
        _field(t, "observationComments", "string", "Free comments."),
    ]


def _reference(field: str, resource: str) -> dict[str, Any]:
    return {"fields": field, "reference": {"resource": resource, "fields": field}}


_SCHEMAS: dict[str, dict[str, Any]] = {
    "deployments": {"name": "deployments", "title": "Deployments", "fields": _deployments(),
                    "missingValues": [""], "primaryKey": "deploymentID"},
    "media": {"name": "media", "title": "Media", "fields": _media(), "missingValues": [""], "primaryKey": "mediaID",
              "foreignKeys": [_reference("deploymentID", "deployments")]},
    "observations": {"name": "observations", "title": "Observations", "fields": _observations(),
                     "missingValues": [""], "primaryKey": "observationID",
                     "foreignKeys": [_reference("deploymentID", "deployments"), _reference("mediaID", "media")]},
}
for _name, _columns in (("deployments", DEPLOYMENTS_COLUMNS), ("media", MEDIA_COLUMNS),
                        ("observations", OBSERVATIONS_COLUMNS)):
    assert tuple(f["name"] for f in _SCHEMAS[_name]["fields"]) == _columns, _name  # one list of columns


def table_schema(table: str, *, optional: Iterable[str] = ()) -> dict[str, Any]:
    """The Table Schema (a new dict) of ``deployments``, ``media`` or ``observations``.

    Args:
        table: the table.
        optional: fields the standard requires that this package leaves empty on purpose (a gateway's
            deployments without coordinates: ``("latitude", "longitude")``); their ``required`` becomes false and
            the schema's description says so, so the deviation is written in the package itself.

    Raises:
        ValueError: another table, or an ``optional`` name that is not a field of it.
    """
    if table not in _SCHEMAS:
        raise ValueError(f"Camtrap DP has no table {table!r} ({', '.join(TABLES)})")
    schema = copy.deepcopy(_SCHEMAS[table])
    relaxed = list(optional)
    fields = {f["name"]: f for f in schema["fields"]}
    unknown = [name for name in relaxed if name not in fields]
    if unknown:
        raise ValueError(f"{table} has no field(s) {unknown}")
    for name in relaxed:
        fields[name]["constraints"]["required"] = False
    schema["description"] = (f"Camtrap DP {SCHEMA_VERSION} {table} table schema, written offline by WildFed "
                             f"(shared/camtrap_dp_schema.py)")
    if relaxed:
        schema["description"] += (f"; left empty here although the standard requires them: {', '.join(relaxed)} "
                                  "(fill them in before publishing the package)")
    return schema


def schema_file(table: str) -> str:
    """Path of ``table``'s schema inside a package: ``schemas/<table>-table-schema.json``."""
    if table not in _SCHEMAS:
        raise ValueError(f"Camtrap DP has no table {table!r} ({', '.join(TABLES)})")
    return f"schemas/{table}-table-schema.json"


def local_resource(table: str) -> dict[str, Any]:
    """The ``datapackage.json`` resource of ``table`` (``<table>.csv``, UTF-8 CSV) pointing at its local schema
    file (:func:`schema_file`)."""
    return {"name": table, "path": f"{table}.csv", "profile": "tabular-data-resource", "format": "csv",
            "mediatype": "text/csv", "encoding": "utf-8", "schema": schema_file(table)}


def write_schema_files(package_dir: str | Path, *, optional: dict[str, Iterable[str]] | None = None) -> list[Path]:
    """Write the three schemas into ``package_dir`` at their :func:`schema_file` paths (JSON, indent 2).

    Args:
        package_dir: the package folder.
        optional: per table, the fields to write as not required (see :func:`table_schema`).

    Returns:
        The three files written.
    """
    written = []
    for table in TABLES:
        path = Path(package_dir) / schema_file(table)
        path.parent.mkdir(parents=True, exist_ok=True)
        schema = table_schema(table, optional=(optional or {}).get(table, ()))
        path.write_text(json.dumps(schema, indent=2) + "\n", encoding="utf-8")
        written.append(path)
    return written
