"""Labelled photos -> the rows of a Camtrap DP 1.0 package (deployments, media, observations) and the files to copy.

The same for every input kind (:mod:`edge_sdk.packaging.photos`):

- labels become observation types and scientific names (:mod:`edge_sdk.packaging.labels`), all checked against
  the site's species table before any file is read;
- ``mediaID`` is :func:`shared.camtrap_dp.media_id` of the file's bytes, so a photo present twice (same bytes)
  is one media row; its labels are merged (one observation per distinct label) and the duplicates are counted;
- ``timestamp`` from EXIF, else the input table, else the file time (:mod:`edge_sdk.packaging.timestamps`), its
  source marked in ``mediaComments`` (:func:`shared.camtrap_dp.mark_timestamp_source`); a deployment with a file
  time has ``timestampIssues`` true;
- the photo is copied to ``media/<deployment>/<file name>`` (``filePath``, relative to the package;
  ``filePublic`` false: the photos stay on the gateway);
- one media-level observation per distinct label, ``classificationMethod`` human, ``count`` 1 (none for blank);
  an animal photo gets one observation per box (``bboxX/Y/Width/Height``, fractions of the image, 6 decimals) from
  the detector (``boxes="detect"``) or the detector output file (``boxes="file"``; a human or vehicle label
  takes that file's ``person`` / ``vehicle`` boxes), and one without a box when there is none (counted);
- deployments ``SITE/DEPLOYMENT`` span their media's timestamps; coordinates from ``--deployments`` or empty.
"""

from __future__ import annotations

import datetime as _dt
import io
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from PIL import Image, UnidentifiedImageError

from shared.camtrap_dp import MEDIA_TYPES, mark_timestamp_source, media_id
from shared.errors import DatasetError

from edge_sdk.packaging.coordinates import Coordinates
from edge_sdk.packaging.labels import Label, check_site_species, classify, looks_scientific
from edge_sdk.packaging.photos import ReadResult, SourceBox, SourcePhoto
from edge_sdk.packaging.timestamps import capture_time

__all__ = ["BoxDetector", "PackageOptions", "PackageSummary", "PackageContent", "build_content"]

_BOX_CATEGORY = {"animal": "animal", "human": "person", "vehicle": "vehicle"}


class BoxDetector(Protocol):
    """What the builder needs of a detector (:class:`edge_sdk.inference.detector.YoloxDetector`)."""

    detector_id: str

    def detect(self, images: list[Image.Image]) -> list[list[Any]]:
        """Per image, boxes with ``x1, y1, x2, y2`` (pixels), ``score`` and ``normalised_xywh(width, height)``."""


@dataclass(frozen=True)
class PackageOptions:
    """How to build a site's package.

    Attributes:
        site: the site id (``deploymentID`` = ``<site>/<deployment>``).
        classified_by: ``observations.classifiedBy`` (the person who labelled the photos).
        boxes: ``"detect"`` (run ``detector`` on animal photos), ``"file"`` (the photos' own boxes from a detector
            output file) or ``"none"``.
        detector: the detector for ``"detect"``.
        utc_offset: zone of times written without one.
        species_map: ``{casefolded label: scientific name or reserved word}`` (:func:`labels.load_species_map`).
        site_species: the site's scientific names (None: not checked).
        site_config: the site config file (named in errors).
        coordinates: ``--deployments`` entries by deployment name or id.
        now: the classification time (default: now, UTC).
    """

    site: str
    classified_by: str
    boxes: str = "none"
    detector: BoxDetector | None = None
    utc_offset: _dt.timezone = _dt.timezone.utc
    species_map: Mapping[str, str] | None = None
    site_species: frozenset[str] | None = None
    site_config: Path | None = None
    coordinates: Mapping[str, Coordinates] | None = None
    now: _dt.datetime | None = None


@dataclass
class PackageSummary:
    """What a build did, for the command's summary table.

    Attributes:
        photos: labelled photos the input named. media: media rows (distinct photos). duplicates: photos that
        repeat another's bytes. observations: ``(observationType, scientificName) -> count``. boxes: observations
        with a box. unboxed: animal photos that got no box (with boxes asked for). animal_labels: animal labels read. timestamps: ``source -> media
        rows``. skipped: ``reason -> inputs left out``. warnings: one line each.
    """

    photos: int = 0
    media: int = 0
    duplicates: int = 0
    observations: Counter = field(default_factory=Counter)
    boxes: int = 0
    unboxed: int = 0
    animal_labels: int = 0
    timestamps: Counter = field(default_factory=Counter)
    skipped: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


@dataclass
class PackageContent:
    """The rows of the three tables, the files to copy (``source -> filePath``), the deployments schema's fields
    left empty although the standard requires them, the package's species and time span, and the summary."""

    deployments: list[dict[str, str]]
    media: list[dict[str, str]]
    observations: list[dict[str, str]]
    copies: list[tuple[Path, str]]
    relaxed: tuple[str, ...]
    species: list[str]
    span: tuple[str, str]
    summary: PackageSummary


@dataclass
class _Media:
    mid: str
    photo: SourcePhoto
    timestamp: str
    moment: _dt.datetime
    source: str
    file_path: str
    labels: list[Label]
    boxes: list[SourceBox] | None = None


def _safe(text: str) -> str:
    """A file or folder name safe in ``filePath`` (letters, digits, ``._()-``; no ``..``, no leading dot)."""
    cleaned = re.sub(r"\.{2,}", "_", re.sub(r"[^0-9A-Za-z._()-]+", "_", text)).lstrip(".")
    return cleaned or "_"


def _detect(detector: BoxDetector, image: Image.Image) -> list[SourceBox]:
    boxes = detector.detect([image])[0]
    return [SourceBox("animal", float(b.score), tuple(b.normalised_xywh(image.width, image.height))) for b in boxes]


def _open(photo: SourcePhoto, data: bytes, options: PackageOptions, detect: bool):
    with Image.open(io.BytesIO(data)) as image:
        timestamp, source = capture_time(photo.path, image, photo.table_time, utc_offset=options.utc_offset,
                                         origin=photo.origin or None)
        boxes = _detect(options.detector, image.convert("RGB")) if detect else None
    return timestamp, source, boxes


def build_content(read: ReadResult, options: PackageOptions, *,
                  on_photo: Callable[[SourcePhoto], None] | None = None) -> PackageContent:
    """The package's rows and files from a reader's photos (see the module docstring).

    Args:
        read: the reader's output.
        options: how to build.
        on_photo: called after each photo (progress bars).

    Raises:
        DatasetError: no labelled photo; species not in the site's table (all listed); a table time that does not
            parse; ``boxes="detect"`` without a detector.
    """
    if not read.photos:
        raise DatasetError("no labelled photos found", fix="check the input: every photo needs a label")
    if options.boxes == "detect" and options.detector is None:
        raise DatasetError("boxes='detect' needs a detector", field="--boxes", fix="use --boxes none")
    labels = [(p.label, classify(p.label, options.species_map)) for p in read.photos]
    if options.site_species is not None:
        check_site_species(labels, options.site_species, site_config=options.site_config or Path("site.yaml"),
                           mapped=options.species_map is not None)
    summary = PackageSummary(photos=len(read.photos), skipped=dict(read.skipped), warnings=list(read.notes))
    media: dict[str, _Media] = {}
    used_paths: set[str] = set()
    unreadable: list[str] = []
    for photo, (_, label) in zip(read.photos, labels, strict=True):
        try:
            data = photo.path.read_bytes()
        except OSError as exc:
            raise DatasetError(f"cannot read the photo: {exc}", source=photo.path, fix="make it readable") from exc
        mid = media_id(data)
        detect = options.boxes == "detect" and label.observation_type == "animal"
        known = media.get(mid)
        if known is not None:
            summary.duplicates += 1
            if photo.deployment != known.photo.deployment:
                summary.warnings.append(f"{photo.path.name} ({photo.deployment}) repeats {known.photo.path.name} "
                                        f"({known.photo.deployment}) byte for byte: kept in {known.photo.deployment}")
            if label not in known.labels:
                known.labels.append(label)
            if detect and known.boxes is None:
                known.boxes = _open(photo, data, options, True)[2]
        else:
            try:
                timestamp, source, boxes = _open(photo, data, options, detect)
            except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
                unreadable.append(f"{photo.path.name} ({exc})")
                if on_photo is not None:
                    on_photo(photo)
                continue
            folder, name = _safe(photo.deployment), _safe(photo.path.name)
            file_path = f"media/{folder}/{name}"
            if file_path in used_paths:
                stem, dot, suffix = name.rpartition(".")
                file_path = f"media/{folder}/{stem or suffix}-{mid[:8]}{dot}{suffix if stem else ''}"
            used_paths.add(file_path)
            media[mid] = _Media(mid, photo, timestamp, _dt.datetime.fromisoformat(timestamp), source, file_path,
                                [label], boxes if detect else (list(photo.boxes) if photo.boxes is not None
                                                               else None))
        if on_photo is not None:
            on_photo(photo)
    if unreadable:
        summary.skipped["photos that cannot be read as images"] = len(unreadable)
        summary.warnings.append(f"{len(unreadable)} photo(s) could not be read and were left out: "
                                + "; ".join(unreadable[:5]))
    if not media:
        raise DatasetError("none of the labelled photos could be read", fix="check the photo files")
    return _assemble(media, options, summary)


def _observation_rows(m: _Media, options: PackageOptions, summary: PackageSummary, when: str) -> list[dict]:
    deployment_id = f"{options.site}/{m.photo.deployment}"
    base = {"deploymentID": deployment_id, "mediaID": m.mid, "eventStart": m.timestamp, "eventEnd": m.timestamp,
            "observationLevel": "media", "classificationMethod": "human", "classifiedBy": options.classified_by,
            "classificationTimestamp": when}
    rows: list[dict] = []
    for label in m.labels:
        kind = label.observation_type
        row = {**base, "observationType": kind, "scientificName": label.scientific_name,
               "count": "" if kind == "blank" else "1"}
        boxes = [b for b in (m.boxes or ()) if b.category == _BOX_CATEGORY.get(kind)
                 and round(b.bbox[2], 6) > 0 and round(b.bbox[3], 6) > 0]
        for box in boxes:
            x, y, w, h = (min(max(v, 0.0), 1.0) for v in box.bbox)
            rows.append({**row, "bboxX": f"{x:.6f}", "bboxY": f"{y:.6f}", "bboxWidth": f"{w:.6f}",
                         "bboxHeight": f"{h:.6f}",
                         "observationTags": f"detectorConfidence:{box.confidence:.3f}"
                         + (f" | detector:{options.detector.detector_id}" if options.boxes == "detect" else "")})
        summary.boxes += len(boxes)
        summary.animal_labels += kind == "animal"
        if not boxes:
            rows.append(row)
            if kind == "animal" and options.boxes != "none":
                summary.unboxed += 1
        summary.observations[(kind, label.scientific_name)] += max(1, len(boxes))
    for i, row in enumerate(rows, start=1):
        row["observationID"] = f"{m.mid}-{i}"
    return rows


def _assemble(media: dict[str, _Media], options: PackageOptions, summary: PackageSummary) -> PackageContent:
    when = (options.now or _dt.datetime.now(_dt.timezone.utc)).replace(microsecond=0).isoformat()
    ordered = sorted(media.values(), key=lambda m: (m.photo.deployment, m.moment, m.file_path))
    media_rows, observation_rows, copies = [], [], []
    by_deployment: dict[str, list[_Media]] = {}
    for m in ordered:
        by_deployment.setdefault(m.photo.deployment, []).append(m)
        summary.timestamps[m.source] += 1
        if len(m.labels) > 1:
            summary.warnings.append(f"{m.photo.path.name}: the same photo carries {len(m.labels)} labels "
                                    f"({', '.join(sorted(l.scientific_name or l.observation_type for l in m.labels))})"
                                    "; the gateway's loader leaves a photo with several species out")
        media_rows.append({"mediaID": m.mid, "deploymentID": f"{options.site}/{m.photo.deployment}",
                           "timestamp": m.timestamp, "filePath": m.file_path, "filePublic": "false",
                           "fileName": m.photo.path.name,
                           "fileMediatype": MEDIA_TYPES.get(m.photo.path.suffix.lower(), "image/jpeg"),
                           "mediaComments": mark_timestamp_source(m.source)})
        observation_rows += _observation_rows(m, options, summary, when)
        copies.append((m.photo.path, m.file_path))
    summary.media = len(media_rows)
    animals = summary.animal_labels
    if options.boxes != "none" and summary.unboxed and 2 * summary.unboxed >= animals:
        summary.warnings.append(f"no box in {summary.unboxed} of {animals} animal photo(s): those records train on "
                                "the whole photo while detect and the field loop classify the detector's crops "
                                "(small or low-light photos: the detector finds little); check a few with "
                                "`wildfed-edge detect`, or label boxes (--from megadetector)")
    if summary.duplicates:
        summary.warnings.append(f"{summary.duplicates} photo(s) repeat another photo byte for byte: one media row "
                                "each (mediaID is the hash of the bytes)")
    deployment_rows, without_place, unused = _deployment_rows(by_deployment, options)
    if unused:
        summary.warnings.append(f"--deployments lists {len(unused)} deployment(s) no photo belongs to: "
                                f"{', '.join(unused[:6])}")
    if without_place:
        summary.warnings.append(f"{len(without_place)} deployment(s) without coordinates ({', '.join(without_place)}): "
                                "latitude/longitude left empty; Camtrap DP requires them before the package is "
                                "published (--deployments FILE)")
    odd = sorted({m.labels[0].scientific_name for m in ordered if m.labels[0].observation_type == "animal"
                  and not looks_scientific(m.labels[0].scientific_name)})
    if odd and options.site_species is None:
        summary.warnings.append(f"{len(odd)} label(s) do not look like scientific names ({', '.join(odd[:6])}): "
                                "map them with --species-map FILE")
    moments = [m.moment for m in ordered]
    span = (min(moments).date().isoformat(), max(moments).date().isoformat())
    species = sorted({l.scientific_name for m in ordered for l in m.labels if l.observation_type == "animal"})
    return PackageContent(deployment_rows, media_rows, observation_rows, copies,
                          ("latitude", "longitude") if without_place else (), species, span, summary)


def _deployment_rows(by_deployment: dict[str, list[_Media]],
                     options: PackageOptions) -> tuple[list[dict[str, str]], list[str], list[str]]:
    places = dict(options.coordinates or {})
    rows, without_place = [], []
    for name, items in by_deployment.items():
        deployment_id = f"{options.site}/{name}"
        first = min(items, key=lambda m: m.moment)
        last = max(items, key=lambda m: m.moment)
        file_times = sum(m.source == "mtime" for m in items)
        row = {"deploymentID": deployment_id, "locationName": name, "deploymentStart": first.timestamp,
               "deploymentEnd": last.timestamp, "timestampIssues": "true" if file_times else "false",
               "deploymentComments": f"start and end: the first and last of its {len(items)} photo(s)"}
        if file_times:
            row["deploymentComments"] += (f"; {file_times} timestamp(s) are file modification times "
                                          "(timestampSource:mtime in media.mediaComments)")
        place = places.pop(name, None) or places.pop(deployment_id, None)
        if place is None:
            without_place.append(deployment_id)
        else:
            row.update(latitude=f"{place.latitude:.6f}", longitude=f"{place.longitude:.6f}",
                       coordinateUncertainty="" if place.uncertainty_m is None else str(place.uncertainty_m))
        rows.append(row)
    return rows, without_place, sorted(places)
