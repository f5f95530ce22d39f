"""Reader: MegaDetector batch output (format 1.x) plus a labels CSV: the boxes from the detector, the species
from the people.

The JSON (https://lila.science/megadetector-output-format; what ``wildfed-edge detect`` and MegaDetector write,
checked by :func:`edge_sdk.inference.formats.validate_megadetector`, here from format 1.0 on) lists per image its
``file`` (relative to the folder the detector ran on), its ``detections`` (``category`` id, ``conf``, ``bbox``
``[x_min, y_min, width, height]`` as fractions of the image) or a ``failure``. The labels CSV is read as by
:mod:`edge_sdk.packaging.labels_csv`; both name files relative to IMAGES (``--images``, default the JSON's
folder), and a label meets its boxes when both name the same file.

A box is kept when its ``conf`` is at least the threshold: ``--confidence``, else the file's own
``info.detector_metadata.typical_detection_threshold`` (what its detector recommends: 0.2 for MegaDetector v5),
else 0.25 (the YOLOX-tiny detector's threshold, ``edge_sdk.inference.detector.CONFIDENCE_THRESHOLD``).
A labelled photo the JSON does not list, or lists as failed, gets no boxes (counted); images the JSON lists without
a label are left out (counted).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from shared.errors import DatasetError

from edge_sdk.inference.detector import CONFIDENCE_THRESHOLD
from edge_sdk.inference.formats import validate_megadetector
from edge_sdk.packaging.labels_csv import read_labels_csv, resolve_photo
from edge_sdk.packaging.photos import ReadResult, SourceBox

__all__ = ["read_megadetector", "detection_threshold"]


def detection_threshold(results: dict, confidence: float | None) -> float:
    """The threshold boxes must reach (see the module docstring)."""
    if confidence is not None:
        return confidence
    meta = (results.get("info") or {}).get("detector_metadata") or {}
    typical = meta.get("typical_detection_threshold")
    return float(typical) if isinstance(typical, (int, float)) and 0 <= typical <= 1 else CONFIDENCE_THRESHOLD


def _load(json_path: Path) -> dict:
    try:
        results = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read the detector output: {exc}", source=json_path,
                           fix="pass a MegaDetector batch output .json file") from exc
    errors = [e for e in validate_megadetector(results) if not e.startswith("format_version")]
    try:
        if float((results.get("info") or {}).get("format_version", "")) < 1.0:
            errors.append("format_version < 1.0")
    except (TypeError, ValueError, AttributeError):
        errors.append("info.format_version is not a number")
    if errors:
        raise DatasetError(f"not a valid MegaDetector output: {'; '.join(errors[:5])}", source=json_path,
                           fix="pass the .json file MegaDetector (or wildfed-edge detect) wrote, unedited")
    return results


def read_megadetector(json_path: Path, labels: Path, *, images: Path | None = None, confidence: float | None = None,
                      file_column: str | None = None, species_column: str | None = None,
                      deployment_column: str | None = None, time_column: str | None = None,
                      deployment: str | None = None) -> tuple[ReadResult, float]:
    """The labelled photos of ``labels`` with their boxes from ``json_path`` (see the module docstring).

    Returns:
        ``(result, threshold)``: each photo's ``boxes`` holds the detections at or above ``threshold`` (possibly
        none), or is None when the JSON has no usable entry for it.

    Raises:
        DatasetError: the JSON does not parse or is not MegaDetector output; the labels CSV's errors
            (:func:`~edge_sdk.packaging.labels_csv.read_labels_csv`).
    """
    results = _load(json_path)
    base = images if images is not None else json_path.parent
    threshold = detection_threshold(results, confidence)
    categories = {str(k): str(v) for k, v in results["detection_categories"].items()}
    entries: dict[str, dict] = {}
    for entry in results["images"]:
        entries[os.path.normcase(str(resolve_photo(str(entry["file"]), [base]).resolve()))] = entry
    result = read_labels_csv(labels, images=base, file_column=file_column, species_column=species_column,
                             deployment_column=deployment_column, time_column=time_column, deployment=deployment)
    matched: set[str] = set()
    for i, photo in enumerate(result.photos):
        key = os.path.normcase(str(photo.path.resolve()))
        entry = entries.get(key)
        if entry is None or entry.get("failure") or entry.get("detections") is None:
            result.skip("labelled photos without a usable entry in the detector output (no boxes)")
            continue
        matched.add(key)
        boxes = tuple(SourceBox(category=categories.get(str(d["category"]), str(d["category"])),
                                confidence=float(d["conf"]), bbox=tuple(float(v) for v in d["bbox"]))
                      for d in entry["detections"] if float(d["conf"]) >= threshold)
        result.photos[i] = replace(photo, boxes=boxes)
    unlabelled = len(set(entries) - matched - {os.path.normcase(str(p.path.resolve())) for p in result.photos})
    if unlabelled:
        result.skip("images in the detector output without a label", unlabelled)
    return result, threshold
