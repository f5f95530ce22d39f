"""Camtrap DP 1.0 out: the package of what one role sees (``GET /export/camtrap-dp.zip``,
``wildfed-coordinator export-camtrap-dp``).

Export: :func:`export_camtrap_dp` writes a Camtrap DP 1.0 package (TDWG 2023, https://camtrap-dp.tdwg.org; profile
:data:`CAMTRAP_DP_PROFILE`) from what one :class:`~coordinator.web.views.Viewer` sees, and from nothing else, so each
role's protections apply by construction:

* ``deployments.csv``: one row per deployment of each site, ``deploymentID`` the key ``"<site>/<deployment>"``
  (:func:`coordinator.storage.deployment_key`: deployment ids are unique within one site's package only, and the
  package holds every site's), coordinates as the viewer sees them; for a protected deployment ``coordinateUncertainty`` is
  the most the shown point can be from the truth, rounded up to whole metres (the displacement radius, or half the
  cell diagonal, plus the join distance of a place, plus the radius for a neighbour:
  ``LocationPolicy.shown_within_m``), the
  ``locationName`` is the one shown (its id), and ``timestampIssues`` is true when record times were cut to dates;
  ``deploymentStart``/``deploymentEnd`` are the first and last capture times exported for it;
* ``media.csv``: one row per record; ``filePath`` is the path at the site for roles that see it, else
  ``media/<mediaID>`` (paths name places; the file itself is not in the package, ``filePublic`` false);
* ``observations.csv``: one row per box (``observationType`` animal / human / vehicle, ``unknown`` for another
  detector category), one ``blank`` row for an image without boxes and one ``unclassified`` row for a failed one;
  ``observationLevel`` media, ``classificationMethod`` machine, ``classificationProbability`` the classifier's,
  else the detector's confidence; ``eventID`` the gateway's event when the record names one and the viewer sees its
  time. A box whose species the gateway read as ``unknown`` (below its threshold) has no ``scientificName``.

Times: Camtrap DP needs a time with an offset. A record whose time the viewer withholds (partner/public, sensitive
deployment) is written as its date at ``T00:00:00Z`` and says so in ``mediaComments``; a record with no known
time is written with an empty timestamp (which a strict validator flags: the time is truly unknown). Records of a
deployment without coordinates (not imported into the deployments table) are left out, since Camtrap DP requires
coordinates; ``datapackage.json`` lists them under ``wildfed.unplacedDeployments``.
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
import json
import math
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shared.camtrap_dp import (CAMTRAP_DP_PROFILE, DEPLOYMENTS_COLUMNS, MEDIA_COLUMNS, MEDIA_TYPES, OBSERVATIONS_COLUMNS,
                               schema_url)
from shared.errors import ConfigError

from coordinator.storage import deployment_key
from coordinator.web.views import MAX_PAGE_SIZE, DetectionFilter, Viewer

__all__ = ["CAMTRAP_DP_PROFILE", "CAMTRAP_DP_SCHEMAS", "DEPLOYMENT_COLUMNS", "MEDIA_COLUMNS", "OBSERVATION_COLUMNS",
           "camtrap_dp_files", "export_camtrap_dp", "export_camtrap_dp_zip"]

CAMTRAP_DP_SCHEMAS = {name: schema_url(name) for name in ("deployments", "media", "observations")}
# Camtrap DP columns, in schema order: shared.camtrap_dp (the gateway and the demo write the same)
DEPLOYMENT_COLUMNS, OBSERVATION_COLUMNS = DEPLOYMENTS_COLUMNS, OBSERVATIONS_COLUMNS

_MEDIATYPES = MEDIA_TYPES


# ---- Camtrap DP export -------------------------------------------------------------------------------------------

def _timestamp(captured_at: str | None) -> tuple[str, bool]:
    """``(Camtrap DP timestamp, withheld)``: a date-only value becomes the date at 00:00:00Z."""
    text = (captured_at or "").strip()
    if len(text) == 10:
        return f"{text}T00:00:00Z", True
    return text, False


def _uncertainty(dep: Mapping[str, Any], policy: Any) -> str:
    """``coordinateUncertainty`` of a shown deployment, whole metres: "" when exact, else the most its shown point
    can be from the truth (``LocationPolicy.shown_within_m``: radius or half a cell's diagonal, plus the distance
    within which one place's deployments share its point, plus the radius within which neighbours join), rounded
    up."""
    if not dep.get("fuzzed"):
        return ""
    return str(max(1, math.ceil(float(policy.shown_within_m))))


def _num(value: float, digits: int = 6) -> str:
    return repr(round(float(value), digits))


def _observation_type(category: str | None) -> str:
    c = (category or "").lower()
    if c == "animal":
        return "animal"
    if c in ("person", "human"):
        return "human"
    if c == "vehicle":
        return "vehicle"
    return "unknown"


def _all_records(viewer: Viewer) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    offset = 0
    while True:
        page, total = viewer.detections(DetectionFilter(limit=MAX_PAGE_SIZE, offset=offset))
        out.extend(page)
        offset += len(page)
        if not page or offset >= total:
            return out


def _csv(columns: Sequence[str], rows: Sequence[Mapping[str, str]]) -> bytes:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: row.get(c, "") for c in columns})
    return buf.getvalue().encode("utf-8")


def _export_id(key: str) -> str:
    """The exported ``deploymentID`` of a ``"<site>/<deployment>"`` key: the deployment's own id when it already
    names its site (a gateway's ``SITE/DEPLOYMENT``), the key otherwise (ids unique across the sites exported)."""
    site, _, dep = key.partition("/")
    return dep if dep.startswith(f"{site}/") else key

def camtrap_dp_files(viewer: Viewer, *, created: _dt.datetime | None = None) -> dict[str, bytes]:
    """The files of a Camtrap DP 1.0 package of what ``viewer`` sees: ``{"datapackage.json": ..., "deployments.csv":
    ..., "media.csv": ..., "observations.csv": ...}`` (UTF-8). Rules in the module docstring.

    Args:
        viewer: a :class:`coordinator.web.views.Viewer`; only its ``deployments()``, ``detections(...)`` and
            ``policy`` are read. created: the package's ``created`` time (default: now, UTC).
    """
    deployments = {deployment_key(d["site_id"], d["deployment_id"]): d for d in viewer.deployments()}
    records = _all_records(viewer)
    for r in records:
        r["key"] = deployment_key(r["site_id"], r["deployment_id"])
    placed = [r for r in records if r["key"] in deployments]
    unplaced = sorted({r["key"] for r in records if r["key"] not in deployments})
    placed.sort(key=lambda r: (r["key"], r["captured_at"] or "", r["media_id"]))

    media_rows: list[dict[str, str]] = []
    obs_rows: list[dict[str, str]] = []
    times: dict[str, list[str]] = {}
    withheld_deps: set[str] = set()
    species: set[str] = set()
    days: list[str] = []
    for r in placed:
        ts, withheld = _timestamp(r.get("captured_at"))
        dep_id = r["key"]
        if ts:
            times.setdefault(dep_id, []).append(ts)
            days.append(ts[:10])
        if withheld or (r.get("timestamp_source") or "exif") != "exif":  # withheld, or only a file's time
            withheld_deps.add(dep_id)
        file = r.get("file")
        file_path = file if file else f"media/{r['media_id']}"
        media_rows.append({
            "mediaID": r["media_id"], "deploymentID": _export_id(dep_id), "timestamp": ts, "filePath": file_path,
            "filePublic": "false", "fileName": Path(file).name if file else "",
            "fileMediatype": _MEDIATYPES.get(Path(file).suffix.lower(), "image/jpeg") if file else "image/jpeg",
            "mediaComments": "capture time withheld (sensitive species): date only" if withheld else ""})
        base = {"deploymentID": _export_id(dep_id), "mediaID": r["media_id"], "eventID": r.get("event_id") or "",
                "eventStart": ts, "eventEnd": ts,
                "observationLevel": "media", "classificationMethod": "machine",
                "classifiedBy": r.get("detector") or ""}
        if r.get("failure") is not None:
            obs_rows.append({**base, "observationID": f"{r['media_id']}_0", "observationType": "unclassified",
                             "observationComments": str(r["failure"])})
            continue
        boxes = r.get("detections") or []
        if not boxes:
            obs_rows.append({**base, "observationID": f"{r['media_id']}_0", "observationType": "blank"})
            continue
        for i, d in enumerate(boxes, start=1):
            x, y, w, h = d["bbox"]
            prob = d.get("species_confidence")
            prob = d.get("confidence") if prob is None else prob
            name = d.get("species") or ""
            if name:
                species.add(name)
            obs_rows.append({**base, "observationID": f"{r['media_id']}_{i}",
                             "observationType": _observation_type(d.get("category")), "scientificName": name,
                             "count": "1", "bboxX": _num(x), "bboxY": _num(y), "bboxWidth": _num(w),
                             "bboxHeight": _num(h), "classificationProbability": "" if prob is None else _num(prob),
                             "observationComments": f"detector confidence {float(d['confidence']):.3f}"})

    dep_rows = []
    for dep_id, d in sorted(deployments.items()):
        ts = sorted(times.get(dep_id, []))
        # the deployment's own period when its import gave one (dates only for a fuzzed place), else the first
        # and last record times exported for it
        start = _timestamp(d["start"])[0] if d.get("start") else (ts[0] if ts else "")
        end = _timestamp(d["end"])[0] if d.get("end") else (ts[-1] if ts else "")
        days += [x[:10] for x in (start, end) if x]
        dep_rows.append({"deploymentID": _export_id(dep_id), "locationName": d.get("name") or d["deployment_id"],
                         "latitude": repr(float(d["latitude"])), "longitude": repr(float(d["longitude"])),
                         "coordinateUncertainty": _uncertainty(d, viewer.policy),
                         "deploymentStart": start, "deploymentEnd": end,
                         "timestampIssues": "true" if dep_id in withheld_deps else "false"})

    lats = [float(d["latitude"]) for d in deployments.values()]
    lons = [float(d["longitude"]) for d in deployments.values()]
    if not lats:
        spatial: dict[str, Any] | None = None
    elif min(lats) == max(lats) and min(lons) == max(lons):
        spatial = {"type": "Point", "coordinates": [lons[0], lats[0]]}
    else:
        w, e, so, no = min(lons), max(lons), min(lats), max(lats)
        spatial = {"type": "Polygon", "bbox": [w, so, e, no],
                   "coordinates": [[[w, so], [e, so], [e, no], [w, no], [w, so]]]}
    when = (created or _dt.datetime.now(_dt.timezone.utc)).astimezone(_dt.timezone.utc)
    package: dict[str, Any] = {
        "profile": CAMTRAP_DP_PROFILE,
        "name": "wildfed-export",
        "title": "WildFed detections",
        "created": when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "contributors": [{"title": "WildFed coordinator", "role": "publisher"}],
        "project": {"title": "WildFed federation", "samplingDesign": "opportunistic",
                    "captureMethod": ["activityDetection"], "individualAnimals": False,
                    "observationLevel": ["media"]},
        "spatial": spatial,
        "temporal": {"start": min(days), "end": max(days)} if days else None,
        "taxonomic": [{"scientificName": n} for n in sorted(species)],
        "resources": [{"name": name, "path": f"{name}.csv", "profile": "tabular-data-resource", "format": "csv",
                       "mediatype": "text/csv", "encoding": "utf-8", "schema": CAMTRAP_DP_SCHEMAS[name]}
                      for name in ("deployments", "media", "observations")],
        "wildfed": {"role": viewer.role.value,
                    "unplacedDeployments": unplaced,
                    "recordsLeftOut": len(records) - len(placed)},
    }
    return {"datapackage.json": (json.dumps(package, indent=2) + "\n").encode("utf-8"),
            "deployments.csv": _csv(DEPLOYMENT_COLUMNS, dep_rows),
            "media.csv": _csv(MEDIA_COLUMNS, media_rows),
            "observations.csv": _csv(OBSERVATION_COLUMNS, obs_rows)}


def export_camtrap_dp(viewer: Viewer, out_dir: str | Path) -> Path:
    """Write a Camtrap DP 1.0 package of what ``viewer`` sees into ``out_dir`` (created if absent; the four files
    are replaced atomically one by one) and return the path of its ``datapackage.json``.

    Args:
        viewer: a :class:`coordinator.web.views.Viewer` (its role decides which locations and times are protected).
        out_dir: the package folder.

    Raises:
        ConfigError: ``out_dir`` (or a folder above it) is a file, or it cannot be created (nothing is written).
    """
    out = Path(out_dir)
    fix = "give a folder for the package (a new one, or one of an earlier export), not a file"
    if out.exists() and not out.is_dir():
        raise ConfigError("exists and is not a folder", source=out, field="OUT_DIR", fix=fix)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError("a folder on this path is a file", source=out, field="OUT_DIR", fix=fix) from None
    except OSError as exc:
        raise ConfigError(f"cannot create the folder: {exc.strerror or exc}", source=out, field="OUT_DIR",
                          fix="give a folder you can write to") from None
    for name, data in camtrap_dp_files(viewer).items():
        with tempfile.NamedTemporaryFile(dir=out, prefix=f".{name}-", delete=False) as fh:
            fh.write(data)
            tmp = Path(fh.name)
        tmp.replace(out / name)
    return out / "datapackage.json"


def export_camtrap_dp_zip(viewer: Viewer) -> bytes:
    """The same package as :func:`export_camtrap_dp`, as the bytes of a ZIP archive (deflate) with the four files
    at its root (for a download route)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in camtrap_dp_files(viewer).items():
            zf.writestr(name, data)
    return buf.getvalue()
