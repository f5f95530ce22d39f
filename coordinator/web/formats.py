"""Exchange formats of the coordinator: MegaDetector batch output in (operator imports), Camtrap DP 1.0 out.

Import: MegaDetector batch output, format 1.x (1.4 is what the gateways write, edge_sdk.inference.formats;
https://lila.science/megadetector-output-format). :func:`import_megadetector` reads the whole file, validates every
field and builds every record *before* it writes anything; one bad field rejects the file with a
:class:`~shared.errors.DatasetError` that names the field (``images[3].detections[0].bbox``) and the fix.

================================ =======================================================================================
 decision                         what and why
================================ =======================================================================================
 site                             ``--site``, an enrolled site (``detections.site_id`` is a foreign key to ``sites``)
 deployment                       ``--deployment``, required, the same for every image of the file (one MegaDetector run
                                  is one folder of one camera placement, as on the gateways; guessing it from the first
                                  path component would silently split or merge deployments)
 media id                         ``shared.camtrap_dp.media_id`` of the image bytes when ``images_dir`` has the file
                                  (the first 32 hex of their SHA-256: the id the gateways give the photo, so a photo a
                                  gateway also sent is the same row, stored once); otherwise the first 32 hex of the
                                  SHA-256 of the string ``"<deployment>/<file>"`` (the deployment is included so that
                                  two cameras' ``IMG_0001.JPG`` do not collide), which no gateway record shares: import
                                  with ``--images`` to merge with the gateways' records. Importing again *with* the
                                  images therefore gives the rows new ids (the old path-keyed rows stay; delete them
                                  by hand if unwanted)
 image size                       from the image when present, else the optional per-image ``width``/``height`` that
                                  ``run_detector_batch --include_image_size`` writes, else 1 x 1 (unknown: the record
                                  format needs a positive size; boxes are normalised, so nothing depends on it)
 capture time                     per-image ``datetime`` (``--include_image_timestamp``; ISO 8601 or EXIF
                                  ``YYYY:MM:DD HH:MM:SS``), else the image's EXIF (gateway rule), else empty
                                  (``timestamp_source`` ``"unknown"``); times without an offset get ``utc_offset``
 boxes                            ``category`` is the ``detection_categories`` name; species is the
                                  ``classification_categories`` name of the box's most probable classification;
                                  boxes are stored most confident first (the record's convention)
 humans                           a record with a ``person``/``human`` or ``vehicle`` box keeps its row but the
                                  coordinator never stores its image (``image_sha256`` None): people and number plates
                                  are personal data and the view has no need of them
 images                           stored byte for byte as blobs (``Store.put_blob``); a role without exact locations is
                                  served a copy re-encoded from the pixels alone, with no metadata
                                  (:func:`coordinator.web.media.strip_metadata`).
                                  A file outside ``images_dir`` (``..``, absolute, symlink out) counts as missing;
                                  unreadable files are counted and not stored
 re-import                        idempotent: the same record again is ``unchanged``; a different record for the same
                                  (site, media id) replaces an *imported* row and never a gateway row (``kept_gateway``)
 row fields                       ``source`` ``import:<file name>``, ``sequence`` 0, ``payload_sha256`` the SHA-256 of
                                  the canonical record JSON (sorted keys, no spaces), ``sent_at`` the import time (UTC)
================================ =======================================================================================

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
import hashlib
import io
import json
import math
import tempfile
import zipfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select

from shared.camtrap_dp import (CAMTRAP_DP_PROFILE, DEPLOYMENTS_COLUMNS, MEDIA_COLUMNS, MEDIA_ID_HEX_DIGITS,
                               MEDIA_TYPES, OBSERVATIONS_COLUMNS, schema_url)
from shared.camtrap_dp import media_id as camtrap_media_id
from shared.errors import ConfigError, DatasetError, PayloadError
from shared.iucn import IUCNCategory
from shared.protocol import Detection, DetectionRecord

from coordinator.storage import DetectionRow, SiteRow, Store, deployment_key, utcnow
from coordinator.web.deployments import CategoryOf
from coordinator.web.location_privacy import LocationPolicy
from coordinator.web.media import exif_capture_time, image_info
from coordinator.web.places import evaluate
from coordinator.web.views import MAX_PAGE_SIZE, DetectionFilter, Viewer

__all__ = ["ImportSummary", "HUMAN_CATEGORIES", "import_megadetector", "CAMTRAP_DP_PROFILE", "CAMTRAP_DP_SCHEMAS",
           "DEPLOYMENT_COLUMNS", "MEDIA_COLUMNS", "OBSERVATION_COLUMNS", "camtrap_dp_files", "export_camtrap_dp",
           "export_camtrap_dp_zip"]

HUMAN_CATEGORIES = frozenset({"person", "human", "vehicle"})
"""Detector categories whose images the coordinator never stores (see the module docstring)."""

CAMTRAP_DP_SCHEMAS = {name: schema_url(name) for name in ("deployments", "media", "observations")}
# Camtrap DP columns, in schema order: shared.camtrap_dp (the gateway and the demo write the same)
DEPLOYMENT_COLUMNS, OBSERVATION_COLUMNS = DEPLOYMENTS_COLUMNS, OBSERVATIONS_COLUMNS

_BBOX_SLACK = 1e-4  # MegaDetector rounds boxes to 4 decimals: x + w may pass 1 by that much
_MEDIATYPES = MEDIA_TYPES
_MD_FIX = "see https://lila.science/megadetector-output-format (MegaDetector batch output 1.x)"


# ---- MegaDetector import -----------------------------------------------------------------------------------------

@dataclass
class ImportSummary:
    """What :func:`import_megadetector` did; every count is of images (records) unless named otherwise.

    Attributes:
        source: the rows' ``source`` (``import:<file name>``). images: images in the file.
        stored: new rows. replaced: imported rows replaced by a different record. unchanged: the same record was
            already stored. kept_gateway: rows of a gateway left as they were. duplicates: images of the file with the
            same media id as an earlier one of the file (same bytes twice), skipped.
        failures: images the detector could not process (rows kept, with ``failure``). boxes: detections imported.
        images_stored: image blobs the rows name (held now: written by this import or already there).
        images_new: of those, blobs this import wrote (0 on a re-import).
        images_missing: ``images_dir`` given but the file absent (or outside it).
        images_unreadable: present but not a readable image. images_withheld: not stored because of a
            person/vehicle box. categories: IUCN category -> boxes whose species has it (via ``category_of``).
    """

    source: str
    images: int = 0
    stored: int = 0
    replaced: int = 0
    unchanged: int = 0
    kept_gateway: int = 0
    duplicates: int = 0
    failures: int = 0
    boxes: int = 0
    images_stored: int = 0
    images_new: int = 0
    images_missing: int = 0
    images_unreadable: int = 0
    images_withheld: int = 0
    categories: dict[str, int] = field(default_factory=dict)


def _bad(path: Path, where: str, message: str, fix: str = _MD_FIX) -> DatasetError:
    return DatasetError(message, source=path, field=where, fix=fix)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _category_map(path: Path, results: Mapping[str, Any], key: str, required: bool) -> dict[str, str]:
    if key not in results:
        if required:
            raise _bad(path, key, f"missing required field {key!r}", 'add e.g. {"1": "animal", "2": "person", '
                       '"3": "vehicle"}')
        return {}
    cats = results[key]
    if not isinstance(cats, Mapping):
        raise _bad(path, key, f"{key} must be an object of id -> name")
    for k, v in cats.items():
        if not (isinstance(k, str) and k.isdigit()) or not isinstance(v, str) or not v.strip():
            raise _bad(path, f"{key}[{k!r}]", f"id {k!r} -> {v!r}: ids must be non-negative string-formatted "
                       "integers naming a non-empty string")
    return {k: v.strip() for k, v in cats.items()}


def _parse_time(value: Any, zone: _dt.timezone) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    for fmt in ("%Y:%m:%d %H:%M:%S", None):
        try:
            moment = _dt.datetime.strptime(text, fmt) if fmt else _dt.datetime.fromisoformat(text)
        except ValueError:
            continue
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=zone)
        return moment.isoformat()
    return None


@dataclass(frozen=True)
class _Parsed:
    """One validated image entry: the record minus what the image file decides (media id, size, time)."""

    file: str
    detections: tuple[Detection, ...]
    failure: str | None
    datetime: str | None
    width: int | None
    height: int | None


def _parse_detection(path: Path, where: str, det: Any, det_cats: Mapping[str, str],
                     cls_cats: Mapping[str, str]) -> Detection:
    if not isinstance(det, Mapping):
        raise _bad(path, where, "a detection must be an object with category, conf and bbox")
    cat = det.get("category")
    if cat not in det_cats:
        raise _bad(path, f"{where}.category", f"category {cat!r} is not an id of detection_categories "
                   f"{sorted(det_cats)}", "use a string id listed in detection_categories")
    conf = det.get("conf")
    if not _is_number(conf) or not 0.0 <= conf <= 1.0:
        raise _bad(path, f"{where}.conf", f"conf {conf!r} is not a number in [0, 1]")
    box = det.get("bbox")
    if not (isinstance(box, list) and len(box) == 4 and all(_is_number(v) for v in box)):
        raise _bad(path, f"{where}.bbox", f"bbox {box!r} is not four numbers",
                   "give [x_min, y_min, width, height] normalised to the image size")
    if not (all(0.0 <= v <= 1.0 for v in box) and box[0] + box[2] <= 1 + _BBOX_SLACK
            and box[1] + box[3] <= 1 + _BBOX_SLACK):
        raise _bad(path, f"{where}.bbox", f"bbox {box!r} is not a normalised box inside the image",
                   "give [x_min, y_min, width, height] as fractions of the image width and height")
    x, y, w, h = (float(v) for v in box)
    w, h = min(w, 1.0 - x), min(h, 1.0 - y)  # clip the rounding slack
    species = species_index = species_conf = None
    classes = det.get("classifications")
    if classes is not None:
        if not isinstance(classes, list):
            raise _bad(path, f"{where}.classifications", "classifications must be a list of [id, probability]")
        best: tuple[str, float] | None = None
        for j, c in enumerate(classes):
            cw = f"{where}.classifications[{j}]"
            if not (isinstance(c, list) and len(c) == 2):
                raise _bad(path, cw, f"{c!r} is not [class id, probability]")
            cid, p = c
            if cid not in cls_cats:
                raise _bad(path, cw, f"class id {cid!r} is not an id of classification_categories",
                           "use a string id listed in classification_categories")
            if not _is_number(p) or not 0.0 <= p <= 1.0:
                raise _bad(path, cw, f"probability {p!r} is not a number in [0, 1]")
            if best is None or p > best[1]:
                best = (cid, float(p))
        if best is not None:
            species, species_index, species_conf = cls_cats[best[0]], int(best[0]), best[1]
    try:
        return Detection(category=det_cats[cat], confidence=float(conf), bbox=(x, y, w, h), species=species,
                         species_index=species_index, species_confidence=species_conf)
    except PayloadError as exc:  # defensive: the checks above mirror Detection's
        raise _bad(path, where, str(exc)) from None


def _parse_results(path: Path, results: Any) -> tuple[list[_Parsed], str]:
    """Validate a whole results object; returns the image entries and the detector name."""
    if not isinstance(results, Mapping):
        raise _bad(path, "(top level)", "the file is not a JSON object with info, detection_categories, images")
    info = results.get("info")
    if not isinstance(info, Mapping) or "format_version" not in info:
        raise _bad(path, "info.format_version", "missing required info.format_version",
                   'add "info": {"format_version": "1.4"}')
    try:
        version = float(str(info["format_version"]))
    except ValueError:
        version = float("nan")
    if not (1.0 <= version < 2.0):
        raise _bad(path, "info.format_version", f"format_version {info['format_version']!r} is not a 1.x version",
                   "export the results in MegaDetector batch output format 1.x")
    det_cats = _category_map(path, results, "detection_categories", required=True)
    cls_cats = _category_map(path, results, "classification_categories", required=False)
    images = results.get("images")
    if not isinstance(images, list):
        raise _bad(path, "images", "missing or not a list", 'add "images": [{"file": ..., "detections": [...]}]')
    parsed: list[_Parsed] = []
    for i, im in enumerate(images):
        where = f"images[{i}]"
        if not isinstance(im, Mapping):
            raise _bad(path, where, "an image entry must be an object")
        name = im.get("file")
        if not isinstance(name, str) or not name.strip():
            raise _bad(path, f"{where}.file", f"file {name!r} is not a non-empty string",
                       "give the image path relative to the folder the detector ran on")
        name = name.replace("\\", "/")
        failure = im.get("failure")
        dets = im.get("detections")
        if failure is not None:
            if not isinstance(failure, str) or not failure:
                raise _bad(path, f"{where}.failure", f"failure {failure!r} is not a non-empty string")
            if dets:
                raise _bad(path, f"{where}.detections", "a failed image must have null (or no) detections")
            detections: tuple[Detection, ...] = ()
        else:
            if not isinstance(dets, list):
                raise _bad(path, f"{where}.detections", f"detections {dets!r} is not a list",
                           "give a list (empty when nothing was detected) or a failure string")
            parsed_dets = [_parse_detection(path, f"{where}.detections[{j}]", d, det_cats, cls_cats)
                           for j, d in enumerate(dets)]
            detections = tuple(sorted(parsed_dets, key=lambda d: -d.confidence))
        size: list[int | None] = []
        for key in ("width", "height"):
            v = im.get(key)
            if v is not None and (type(v) is not int or v <= 0):
                raise _bad(path, f"{where}.{key}", f"{key} {v!r} is not a positive integer (pixels)")
            size.append(v)
        dt = im.get("datetime")
        if dt is not None and (not isinstance(dt, str) or _parse_time(dt, _dt.timezone.utc) is None):
            raise _bad(path, f"{where}.datetime", f"datetime {dt!r} is neither ISO 8601 nor YYYY:MM:DD HH:MM:SS")
        parsed.append(_Parsed(file=name, detections=detections, failure=failure, datetime=dt, width=size[0],
                              height=size[1]))
    detector = info.get("detector")
    return parsed, detector if isinstance(detector, str) else ""


def _image_file(images_dir: Path, name: str) -> Path | None:
    """The file for ``name`` inside ``images_dir``, or None when absent or outside it."""
    root = images_dir.resolve()
    try:
        candidate = (root / name).resolve()
    except (OSError, RuntimeError):
        return None
    if not candidate.is_relative_to(root) or not candidate.is_file():
        return None
    return candidate


def _canonical(record: DetectionRecord) -> str:
    return json.dumps(record.to_json(), sort_keys=True, separators=(",", ":"))


def import_megadetector(store: Store, path_to_json: str | Path, *, site_id: str, deployment_id: str | None = None,
                        images_dir: str | Path | None = None, category_of: CategoryOf | None = None,
                        utc_offset: _dt.timezone = _dt.timezone.utc,
                        progress: Callable[[int, int], None] | None = None,
                        policy: LocationPolicy | None = None) -> ImportSummary:
    """Import a MegaDetector batch output file (format 1.x, https://lila.science/megadetector-output-format) as
    detection rows of one enrolled site and deployment (rules in the module docstring).

    Args:
        store: coordinator state. path_to_json: the results file (UTF-8 JSON).
        site_id: an enrolled site. deployment_id: the Camtrap DP deployment of every image (required).
        images_dir: the folder the detector ran on; images found there are hashed, measured and stored.
        category_of: species -> IUCN category, only for the summary's ``categories`` counts.
        utc_offset: zone of capture times written without an offset (the camera clock's).
        progress: called as ``progress(done, total)`` after each image (the CLI draws a bar with it).
        policy: the web view's location policy (with ``category_of``): protection the stored records earned is
            recorded before any of them is replaced (coordinator.web.places), in the same transaction.

    Returns:
        :class:`ImportSummary`.

    Raises:
        ConfigError: no deployment given, or the site is not enrolled (nothing is written).
        DatasetError: the file is missing, not JSON, or any field is invalid, or ``images_dir`` is not a folder
            (nothing is written).
    """
    path = Path(path_to_json)
    if not deployment_id or not isinstance(deployment_id, str):
        raise ConfigError("no deployment given", field="deployment", fix="pass --deployment <deploymentID>, the "
                          "camera placement the images come from")
    if images_dir is not None and not Path(images_dir).is_dir():
        raise DatasetError("the images folder does not exist", source=images_dir, field="images",
                           fix="give the folder the detector ran on, or leave --images out")
    with store.session() as s:
        if s.get(SiteRow, site_id) is None:
            raise ConfigError(f"site {site_id!r} is not enrolled", field="site",
                              fix=f"enrol it first: wildfed-coordinator enrol {site_id} --public-key FILE")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError("file not found", source=path, fix="give the path of a MegaDetector results .json") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read the file: {exc}", source=path, fix="give a UTF-8 JSON file") from None
    try:
        results = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"not JSON: {exc}", source=path, fix=_MD_FIX) from None
    parsed, detector = _parse_results(path, results)

    summary = ImportSummary(source=f"import:{path.name}", images=len(parsed))
    root = Path(images_dir) if images_dir is not None else None
    now = utcnow()
    rows: dict[str, dict[str, Any]] = {}
    categories: Counter[str] = Counter()
    for n, p in enumerate(parsed, start=1):
        data: bytes | None = None
        if root is not None:
            file = _image_file(root, p.file)
            if file is None:
                summary.images_missing += 1
            else:
                data = file.read_bytes()
        # the photo's one media id (shared.camtrap_dp.media_id); without the image, a stand-in of the path
        media_id = (camtrap_media_id(data) if data is not None
                    else hashlib.sha256(f"{deployment_id}/{p.file}".encode()).hexdigest()[:MEDIA_ID_HEX_DIGITS])
        if media_id in rows:
            summary.duplicates += 1
            if progress is not None:
                progress(n, len(parsed))
            continue
        width, height = p.width or 1, p.height or 1
        timestamp, ts_source = _parse_time(p.datetime, utc_offset), "json"
        readable = False
        if data is not None:
            try:
                width, height, _ = image_info(data)
                readable = True
            except DatasetError:
                summary.images_unreadable += 1
            if readable and timestamp is None:
                timestamp, ts_source = exif_capture_time(data, utc_offset=utc_offset), "exif"
        if timestamp is None:
            timestamp, ts_source = "", "unknown"
        if p.failure is not None and not readable:  # a failed record may have size 0 (unknown)
            width, height = p.width or 0, p.height or 0
        record = DetectionRecord(media_id=media_id, file=p.file, deployment_id=deployment_id, timestamp=timestamp,
                                 timestamp_source=ts_source, width=width, height=height, detections=p.detections,
                                 detector=detector, failure=p.failure)
        human = any(d.category.lower() in HUMAN_CATEGORIES for d in p.detections)
        image_sha = None
        if data is not None and readable:
            if human:
                summary.images_withheld += 1
            else:
                image_sha = hashlib.sha256(data).hexdigest()
        canonical = _canonical(record)
        top = max(record.detections, key=lambda d: d.confidence, default=None)
        rows[media_id] = dict(
            deployment_id=deployment_id, file=p.file, captured_at=timestamp, num_detections=len(record.detections),
            max_confidence=top.confidence if top is not None else None,
            top_species=top.species if top is not None else None,
            top_species_confidence=top.species_confidence if top is not None else None,
            failure=record.failure, record_json=json.dumps(record.to_json(), sort_keys=True),
            species_json=json.dumps(sorted({d.species for d in record.detections if d.species})),
            source=summary.source, image_sha256=image_sha, sequence=0,
            payload_sha256=hashlib.sha256(canonical.encode()).hexdigest(), sent_at=now,
            _data=data if image_sha is not None else None)
        summary.failures += int(record.failure is not None)
        summary.boxes += len(record.detections)
        if category_of is not None:
            for d in record.detections:
                if d.species:
                    categories[IUCNCategory(category_of(d.species)).value] += 1
        if progress is not None:
            progress(n, len(parsed))
    summary.categories = dict(sorted(categories.items()))

    for values in rows.values():  # blobs first: a row never names an image that is not on disk
        data = values.pop("_data")
        if data is not None:
            summary.images_new += int(not store.blob_path(values["image_sha256"]).exists())
            store.put_blob(data, sha256_hex=values["image_sha256"])
            summary.images_stored += 1
    with store.session() as s:
        if policy is not None and category_of is not None:
            evaluate(s, policy, category_of)  # what the stored records earned, before any is replaced
        existing = {r.media_id: r for r in s.scalars(select(DetectionRow).where(
            DetectionRow.site_id == site_id, DetectionRow.media_id.in_(list(rows))))} if rows else {}
        for media_id, values in rows.items():
            row = existing.get(media_id)
            if row is None:
                s.add(DetectionRow(site_id=site_id, media_id=media_id, **values))
                summary.stored += 1
            elif row.source == "gateway":
                summary.kept_gateway += 1
            elif row.payload_sha256 == values["payload_sha256"] and row.image_sha256 == values["image_sha256"]:
                summary.unchanged += 1
            else:
                for k, v in values.items():
                    setattr(row, k, v)
                summary.replaced += 1
        if policy is not None and category_of is not None:
            s.flush()
            evaluate(s, policy, category_of)
    return summary


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
