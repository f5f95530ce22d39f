"""MegaDetector batch output in: the operator's import of detections (``wildfed-coordinator import-detections``).

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
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select

from shared.camtrap_dp import MEDIA_ID_HEX_DIGITS
from shared.camtrap_dp import media_id as camtrap_media_id
from shared.errors import ConfigError, DatasetError
from shared.iucn import IUCNCategory
from shared.protocol import DetectionRecord

from coordinator.storage import DetectionRow, SiteRow, Store, utcnow
from coordinator.web.deployments import CategoryOf
from coordinator.web.location_privacy import LocationPolicy
from coordinator.web.media import exif_capture_time, image_info
from coordinator.web.megadetector_parse import MD_FIX, parse_results, parse_time
from coordinator.web.places import evaluate

__all__ = ["ImportSummary", "HUMAN_CATEGORIES", "import_megadetector"]

HUMAN_CATEGORIES = frozenset({"person", "human", "vehicle"})
"""Detector categories whose images the coordinator never stores (see the module docstring)."""


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


def _read_json(path: Path) -> Any:
    """The results file's JSON value.

    Raises:
        DatasetError: the file is missing, unreadable, not UTF-8 or not JSON.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError("file not found", source=path, fix="give the path of a MegaDetector results .json") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read the file: {exc}", source=path, fix="give a UTF-8 JSON file") from None
    try:
        results = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"not JSON: {exc}", source=path, fix=MD_FIX) from None
    return results


def _store_rows(store: Store, rows: dict[str, dict[str, Any]], *, site_id: str, summary: ImportSummary,
                policy: LocationPolicy | None, category_of: CategoryOf | None) -> None:
    """Store the images (blobs first: a row never names an image that is not on disk), then insert, replace or
    keep each detection row in one transaction (a gateway's own record is never replaced); counts go to
    ``summary``. With ``policy`` and ``category_of`` the protection the stored records earned is recorded before
    and after (coordinator.web.places)."""
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
    parsed, detector = parse_results(path, _read_json(path))

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
        timestamp, ts_source = parse_time(p.datetime, utc_offset), "json"
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

    _store_rows(store, rows, site_id=site_id, summary=summary, policy=policy, category_of=category_of)
    return summary
