"""How the review page shows the model's readings, photos and verdicts: plain dicts for the templates, built from the
gateway's index (:mod:`edge_sdk.field.store`).

A reading says what the model said, honestly (:mod:`edge_sdk.field.predictions`): a named species with its
confidence (``confident``), the same with an "unexpected at this site" badge (``unexpected``: a species the site's
table does not list won), ``unknown`` (no species above the threshold; the best guess is shown beside it, marked as
a guess), ``blank`` (no detection) or ``unclassified`` (detections, but no model yet). Boxes are in the photo's own
pixel frame, as the templates draw them over the photo (an SVG layer with the photo's pixel size as its viewBox).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edge_sdk.field.store import EventEntry, PhotoEntry

__all__ = ["STATUS_LABELS", "VERDICT_LABELS", "reading", "event_reading", "photo_view", "verdict_view",
           "species_options"]

STATUS_LABELS = {"confident": "confident", "unexpected": "unexpected at this site", "unknown": "unknown",
                 "blank": "blank", "unclassified": "not classified (no model yet)"}
#: Verdict kind (``edge_sdk.field.verdicts.VERDICTS``) -> what the button and the record say.
VERDICT_LABELS = {"species": "species", "blank": "blank", "unknown": "unknown animal", "person": "person",
                  "vehicle": "vehicle"}


def reading(status: str | None, index: int | None, confidence: float | None,
            names: Mapping[int, str]) -> dict[str, Any]:
    """A reading for display.

    Args:
        status: ``confident``, ``unexpected``, ``unknown``, ``blank``, ``unclassified`` (None: ``unclassified``).
        index, confidence: the top class and its posterior (None for blank and unclassified).
        names: class index -> scientific name.

    Returns:
        ``{"status", "label", "species", "confidence", "guess", "badge"}``: ``species`` is the named species (None
        unless confident or unexpected), ``guess`` the best guess of an unknown reading, ``label`` one line of text.
    """
    status = status or "unclassified"
    name = names.get(index, f"class {index}") if index is not None else None
    named = status in ("confident", "unexpected") and name is not None
    out: dict[str, Any] = {"status": status, "species": name if named else None, "confidence": confidence,
                           "guess": name if status == "unknown" else None,
                           "badge": STATUS_LABELS["unexpected"] if status == "unexpected" else None}
    if named:
        out["label"] = f"{name} {confidence:.2f}" if confidence is not None else name
    elif status == "unknown" and name is not None and confidence is not None:
        out["label"] = f"unknown (best guess {name} {confidence:.2f})"
    else:
        out["label"] = STATUS_LABELS.get(status, status)
    return out


def event_reading(event: EventEntry, names: Mapping[int, str]) -> dict[str, Any]:
    """The reading of an event (the mean of its photos' probabilities, read with the site prior)."""
    return reading(event.status, event.species_index, event.confidence, names)


def _box(n: int, box: Mapping[str, Any], width: int, height: int, names: Mapping[int, str]) -> dict[str, Any]:
    x, y, w, h = (float(v) for v in box.get("bbox") or (0, 0, 0, 0))
    return {"n": n, "x": x * width, "y": y * height, "w": w * width, "h": h * height, "bbox": (x, y, w, h),
            "confidence": box.get("confidence"),
            "reading": reading(box.get("species_status"), box.get("species_index"), box.get("species_confidence"),
                               names)}


def photo_view(photo: PhotoEntry, names: Mapping[int, str]) -> dict[str, Any]:
    """A photo for the event page: identity, time, size, its boxes (pixels of the stored frame, most confident
    first) and its reading (that of its most confident box; ``blank`` without a box)."""
    boxes = [_box(i + 1, b, photo.width, photo.height, names) for i, b in enumerate(photo.boxes) if b.get("bbox")]
    photo_reading = boxes[0]["reading"] if boxes else reading("blank", None, None, names)
    return {"media_id": photo.media_id, "timestamp": photo.timestamp, "timestamp_source": photo.timestamp_source,
            "source_name": photo.source_name, "width": photo.width, "height": photo.height, "boxes": boxes,
            "reading": photo_reading, "stroke": max(2.0, max(photo.width, photo.height) / 300.0),
            "font": max(12.0, max(photo.width, photo.height) / 40.0)}


def verdict_view(event: EventEntry) -> dict[str, Any] | None:
    """The ranger's last verdict on an event (``{"kind", "label", "by", "at"}``), or None when unreviewed."""
    if event.verdict is None:
        return None
    label = VERDICT_LABELS.get(event.verdict, event.verdict)
    if event.verdict == "species" and event.verdict_species:
        label = event.verdict_species
    return {"kind": event.verdict, "label": label, "by": event.verdict_by, "at": event.verdict_at}


def species_options(species: Any) -> list[dict[str, str]]:
    """The site's species table as select options, by scientific name: ``{"name", "category"}``.

    Args:
        species: the site config's ``species`` (``edge_sdk.config.SpeciesEntry`` items).
    """
    return [{"name": s.scientific_name, "category": s.iucn_category.value}
            for s in sorted(species, key=lambda s: s.scientific_name)]
