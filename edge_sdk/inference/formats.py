"""Output files of a detection run: MegaDetector batch-output JSON (format 1.4) and Camtrap DP observations.

MegaDetector batch output, format 1.4 (https://lila.science/megadetector-output-format; the file Timelapse imports
through "Recognition"): a JSON object with

- ``info`` (required): ``format_version`` ``"1.4"`` (required), ``detector``, ``detection_completion_time``,
  ``classifier``, ``classification_completion_time``, ``detector_metadata`` (``typical_detection_threshold``,
  ``conservative_detection_threshold``), ``classifier_metadata`` (optional fields, all written);
- ``detection_categories`` (required): string-formatted integer ids -> names; here ``{"1": "animal"}``;
- ``classification_categories`` (when a classifier ran): string-formatted integer ids (the class index) -> names;
- ``images`` (required): per image ``file`` (path relative to the folder the run was given, forward slashes: what
  Timelapse matches against its image set), ``detections`` (list, empty when none; null for a failed image), each
  ``{"category", "conf" (float), "bbox" [x_min, y_min, width, height] normalised, "classifications"
  [[class id, probability], ...] descending}``, and ``failure`` (string) for an image that could not be read.
  WildFed adds ``datetime`` (capture time) per image; readers ignore unknown per-image keys.

:func:`validate_megadetector` checks the rules of the format's own validator (``validate_batch_results.py`` of the
MegaDetector repository) and is used by the tests.

Camtrap DP 1.0 (https://camtrap-dp.tdwg.org): :func:`observation_rows` gives ``observations.csv`` rows, one per
detection (``observationLevel`` ``media``, ``observationType`` ``animal``, bounding box in the same normalised
``bboxX/bboxY/bboxWidth/bboxHeight`` convention, six decimals as ``edge_sdk.data.crops.stored_bbox`` keeps them, ``classificationMethod`` ``machine``, ``classifiedBy`` naming the
models, ``classificationProbability`` the classifier's, else the detector's confidence); an image without
detections gets one ``blank`` row and a failed image one ``unclassified`` row, so every image is accounted for.
:func:`media_rows` gives the matching ``media.csv`` rows. Deployments are the caller's (``deploymentID`` is the run's
``--deployment``).
"""

from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shared.camtrap_dp import (MEDIA_COLUMNS, MEDIA_TYPES, OBSERVATIONS_COLUMNS, TIMESTAMP_SOURCES,
                               mark_timestamp_source)
from shared.protocol import Detection, DetectionRecord

from edge_sdk.inference.detector import CATEGORY, CONFIDENCE_THRESHOLD

__all__ = ["FORMAT_VERSION", "DETECTION_CATEGORIES", "megadetector_json", "validate_megadetector",
           "OBSERVATION_COLUMNS", "MEDIA_COLUMNS", "observation_rows", "media_rows", "write_csv", "write_json"]

FORMAT_VERSION = "1.4"
DETECTION_CATEGORIES = {"1": CATEGORY}
_CATEGORY_IDS = {name: cid for cid, name in DETECTION_CATEGORIES.items()}

OBSERVATION_COLUMNS = OBSERVATIONS_COLUMNS  # Camtrap DP columns: shared.camtrap_dp
_MEDIATYPES = MEDIA_TYPES


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _r(value: float, digits: int = 4) -> float:
    return float(round(float(value), digits))


def megadetector_json(records: Sequence[DetectionRecord], *, detector: str,
                      classifier: str | None = None, class_names: Mapping[int, str] | None = None,
                      classifications: Mapping[str, Sequence[Sequence[tuple[int, float]]]] | None = None,
                      completion_time: str | None = None) -> dict[str, Any]:
    """The MegaDetector 1.4 results object for ``records``.

    Args:
        detector: detector id (``info.detector``).
        classifier: classifier id (``info.classifier``), or None when no classifier ran.
        class_names: class index -> name (``classification_categories``).
        classifications: per media id, per detection, the top ``(class index, probability)`` pairs
            (``DetectionPipeline.classifications``); without it the record's top-1 species is written.
        completion_time: ``info`` completion times (default: now, UTC, ``YYYY-MM-DD HH:MM:SS``).
    """
    done = completion_time or _now()
    info: dict[str, Any] = {
        "format_version": FORMAT_VERSION, "detector": detector, "detection_completion_time": done,
        "detector_metadata": {"megadetector_version": "zamba-megadetectorlite-yolox-tiny",
                              "typical_detection_threshold": CONFIDENCE_THRESHOLD,
                              "conservative_detection_threshold": CONFIDENCE_THRESHOLD},
        "producer": "wildfed"}
    out: dict[str, Any] = {"info": info, "detection_categories": dict(DETECTION_CATEGORIES)}
    if classifier is not None:
        info.update(classifier=classifier, classification_completion_time=done,
                    classifier_metadata={"typical_classification_threshold": 0.5})
        out["classification_categories"] = {str(i): str(n) for i, n in sorted((class_names or {}).items())}
    images = []
    for rec in records:
        entry: dict[str, Any] = {"file": rec.file, "datetime": rec.timestamp}
        if rec.failure is not None:
            entry.update(detections=None, failure=rec.failure)
        else:
            tops = (classifications or {}).get(rec.media_id)
            dets = []
            for i, d in enumerate(rec.detections):
                det: dict[str, Any] = {"category": _CATEGORY_IDS.get(d.category, "1"), "conf": _r(d.confidence, 3),
                                       "bbox": [_r(v) for v in d.bbox]}
                if tops is not None and i < len(tops):
                    det["classifications"] = [[str(k), _r(p, 3)] for k, p in tops[i]]
                elif d.species_index is not None and d.species_confidence is not None:
                    det["classifications"] = [[str(d.species_index), _r(d.species_confidence, 3)]]
                dets.append(det)
            entry["detections"] = dets
        images.append(entry)
    out["images"] = images
    return out


def validate_megadetector(results: Mapping[str, Any]) -> list[str]:
    """Errors of ``results`` against the MegaDetector output format (empty list: valid).

    Checks what MegaDetector's ``validate_batch_results.py`` checks for images: required ``info`` with
    ``format_version`` >= 1.3, ``detection_categories`` and ``images``; string-formatted integer category ids; per
    image a ``file``; per detection ``category`` (a known id), float ``conf``, ``bbox``; classification ids as
    string-formatted integers with numeric probabilities; ``failure`` a string with null detections, otherwise a
    ``detections`` list. Adds the spec's rules on boxes (four numbers in [0, 1] inside the image) and that
    classifications are sorted by descending confidence.
    """
    errors: list[str] = []
    if not isinstance(results, Mapping):
        return ["results are not a JSON object"]
    for key in ("info", "detection_categories", "images"):
        if key not in results:
            errors.append(f"missing required field {key!r}")
    if errors:
        return errors
    info = results["info"]
    if not isinstance(info, Mapping) or "format_version" not in info:
        errors.append("info must be an object with format_version")
    else:
        try:
            if float(info["format_version"]) < 1.3:
                errors.append(f"format_version {info['format_version']} < 1.3")
        except (TypeError, ValueError):
            errors.append(f"format_version {info['format_version']!r} is not a number")
    for field in ("detection_categories", "classification_categories"):
        cats = results.get(field, {})
        if not isinstance(cats, Mapping):
            errors.append(f"{field} must be an object")
            continue
        for k, v in cats.items():
            if not (isinstance(k, str) and k.lstrip("-").isdigit()) or not isinstance(v, str):
                errors.append(f"{field}: id {k!r} must be a string-formatted int naming a string")
    images = results["images"]
    if not isinstance(images, list):
        return errors + ["images must be a list"]
    det_cats = results["detection_categories"] if isinstance(results["detection_categories"], Mapping) else {}
    for i, im in enumerate(images):
        if not isinstance(im, Mapping) or "file" not in im:
            errors.append(f"image {i} has no file")
            continue
        name = im["file"]
        if im.get("failure") is not None:
            if not isinstance(im["failure"], str):
                errors.append(f"{name}: failure must be a string")
            if im.get("detections") is not None:
                errors.append(f"{name}: a failed image must have null detections")
            continue
        dets = im.get("detections")
        if not isinstance(dets, list):
            errors.append(f"{name}: detections must be a list")
            continue
        for det in dets:
            if not isinstance(det, Mapping):
                errors.append(f"{name}: detection is not an object")
                continue
            if det.get("category") not in det_cats:
                errors.append(f"{name}: detection category {det.get('category')!r} is not in detection_categories")
            if not isinstance(det.get("conf"), float):
                errors.append(f"{name}: conf {det.get('conf')!r} is not a float")
            box = det.get("bbox")
            if not (isinstance(box, list) and len(box) == 4 and all(isinstance(v, (int, float)) for v in box)):
                errors.append(f"{name}: bbox {box!r} is not four numbers")
            elif not (all(0 <= v <= 1 for v in box) and box[0] + box[2] <= 1 + 1e-4 and box[1] + box[3] <= 1 + 1e-4):
                errors.append(f"{name}: bbox {box!r} is not a normalised box inside the image")
            cls = det.get("classifications")
            if cls is not None:
                probs = []
                for c in cls:
                    if not (isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) and c[0].isdigit()
                            and isinstance(c[1], (int, float))):
                        errors.append(f"{name}: classification {c!r} must be [string-formatted int, number]")
                    else:
                        probs.append(c[1])
                if probs != sorted(probs, reverse=True):
                    errors.append(f"{name}: classifications are not in descending order of confidence")
    return errors


def observation_rows(records: Sequence[DetectionRecord], *, classified_by: str,
                     classification_timestamp: str | None = None,
                     class_names: Mapping[int, str] | None = None) -> list[dict[str, str]]:
    """Camtrap DP ``observations.csv`` rows (see the module docstring). A detection whose species is ``unknown``
    (below the site's confidence threshold) has no ``scientificName``; its comment gives the best guess, named by
    ``class_names`` (class index -> name) where given."""
    when = classification_timestamp or _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    rows: list[dict[str, str]] = []
    for rec in _first_of_each_media(records):
        base = {"deploymentID": rec.deployment_id, "mediaID": rec.media_id, "eventStart": rec.timestamp,
                "eventEnd": rec.timestamp, "observationLevel": "media", "classificationMethod": "machine",
                "classifiedBy": classified_by, "classificationTimestamp": when}
        if rec.failure is not None:
            rows.append({**base, "observationID": f"{rec.media_id}_0", "observationType": "unclassified",
                         "observationComments": rec.failure})
            continue
        if not rec.detections:
            rows.append({**base, "observationID": f"{rec.media_id}_0", "observationType": "blank"})
            continue
        for i, d in enumerate(rec.detections, start=1):
            x, y, w, h = d.bbox
            prob = d.species_confidence if d.species_confidence is not None else d.confidence
            rows.append({**base, "observationID": f"{rec.media_id}_{i}", "observationType": "animal",
                         "scientificName": d.species or "", "count": "1", "bboxX": f"{x:.6f}",
                         "bboxY": f"{y:.6f}", "bboxWidth": f"{w:.6f}", "bboxHeight": f"{h:.6f}",
                         "classificationProbability": f"{prob:.3f}",
                         "observationComments": f"detector confidence {d.confidence:.3f}" + _guess(d, class_names)})
    return rows


def _guess(d: Detection, class_names: Mapping[int, str] | None) -> str:
    """``"; species unknown, best guess NAME"`` for an unknown detection with a guess, else ``""``."""
    if d.species is not None or d.species_status != "unknown" or d.species_index is None:
        return ""
    name = (class_names or {}).get(d.species_index) or f"class {d.species_index}"
    return f"; species unknown (below the confidence threshold), best guess {name}"


def _first_of_each_media(records: Sequence[DetectionRecord]) -> list[DetectionRecord]:
    """``records`` without repeats of a media id (the same photo at two paths is one media row: mediaID is the
    SHA-256 of the bytes and unique within a package)."""
    seen: set[str] = set()
    out = []
    for r in records:
        if r.media_id not in seen:
            seen.add(r.media_id)
            out.append(r)
    return out


def media_rows(records: Sequence[DetectionRecord]) -> list[dict[str, str]]:
    """Camtrap DP ``media.csv`` rows of ``records`` (file paths relative to the run's folder), one per media id. Each
    row's ``mediaComments`` marks where its timestamp came from (``shared.camtrap_dp.mark_timestamp_source``:
    ``exif``, or ``mtime``/``run`` when it is only the file's or the run's time), since Camtrap DP requires a
    timestamp but a file time is only a guess."""
    return [{"mediaID": r.media_id, "deploymentID": r.deployment_id, "captureMethod": "activityDetection",
             "timestamp": r.timestamp, "filePath": r.file, "filePublic": "false", "fileName": Path(r.file).name,
             "fileMediatype": _MEDIATYPES.get(Path(r.file).suffix.lower(), "image/jpeg"),
             **({"mediaComments": mark_timestamp_source(r.timestamp_source)}
                if r.timestamp_source in TIMESTAMP_SOURCES else {})} for r in _first_of_each_media(records)]


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def write_csv(path: str | Path, columns: Sequence[str], rows: Sequence[Mapping[str, str]]) -> Path:
    """Write a CSV with ``columns`` (absent values empty), atomically."""
    import io

    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({c: row.get(c, "") for c in columns})
    _atomic_write(Path(path), buf.getvalue())
    return Path(path)


def write_json(path: str | Path, obj: Any) -> Path:
    """Write JSON (indent 1, as MegaDetector does), atomically."""
    _atomic_write(Path(path), json.dumps(obj, indent=1) + "\n")
    return Path(path)
