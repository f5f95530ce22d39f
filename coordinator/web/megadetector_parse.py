"""Reading a MegaDetector batch output file (format 1.x): every field checked before anything is written.

:func:`parse_results` turns the parsed JSON into one :class:`ParsedImage` per image, or raises a
:class:`~shared.errors.DatasetError` naming the field (``images[3].detections[0].bbox``) and the fix.
coordinator.web.megadetector_import writes what it returns; the decisions are listed there.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.errors import DatasetError, PayloadError
from shared.protocol import Detection

__all__ = ["MD_FIX", "ParsedImage", "parse_results", "parse_time"]

MD_FIX = "see https://lila.science/megadetector-output-format (MegaDetector batch output 1.x)"
"""The fix every parse error names."""
_BBOX_SLACK = 1e-4  # MegaDetector rounds boxes to 4 decimals: x + w may pass 1 by that much


def _bad(path: Path, where: str, message: str, fix: str = MD_FIX) -> DatasetError:
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


def parse_time(value: Any, zone: _dt.timezone) -> str | None:
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
class ParsedImage:
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


def parse_results(path: Path, results: Any) -> tuple[list[ParsedImage], str]:
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
    parsed: list[ParsedImage] = []
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
        if dt is not None and (not isinstance(dt, str) or parse_time(dt, _dt.timezone.utc) is None):
            raise _bad(path, f"{where}.datetime", f"datetime {dt!r} is neither ISO 8601 nor YYYY:MM:DD HH:MM:SS")
        parsed.append(ParsedImage(file=name, detections=detections, failure=failure, datetime=dt, width=size[0],
                              height=size[1]))
    detector = info.get("detector")
    return parsed, detector if isinstance(detector, str) else ""
