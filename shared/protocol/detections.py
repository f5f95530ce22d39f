"""DETECTION payloads (site -> coordinator): verified detection records (:mod:`shared.protocol`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


from shared.codec import encode_tensors
from shared.errors import PayloadError

from shared.protocol.common import _positive, _metadata, _read


# ---- detection records (DETECTION envelopes, site -> coordinator) -------------------------------------------------

#: ``Detection.species_status`` values (see :class:`Detection`).
SPECIES_STATUSES = frozenset({"confident", "unexpected", "unknown"})
_BBOX_SLACK = 1e-6  # rounding slack when checking that a normalised box lies inside the image


def _unit(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0.0 <= value <= 1.0:
        raise PayloadError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Detection:
    """One detected object in an image.

    Attributes:
        category: detector category name (``"animal"``; the YOLOX-tiny detector has this one class).
        confidence: detector confidence in [0, 1] (objectness x class score).
        bbox: ``(x_min, y_min, width, height)`` normalised by the image width and height, origin top-left (the
            MegaDetector and Camtrap DP ``bbox*`` convention); the box lies inside the image.
        species: scientific name (or class label) of the classifier's top class, or None when no classifier ran.
        species_index: the classifier's class index, or None.
        species_confidence: the classifier's softmax probability of that class in [0, 1], or None.
        species_status: how the gateway reads its classifier's answer, or None when no classifier ran (and in
            records from gateways that predate it): ``"confident"`` (the species is above the site's confidence
            threshold and in the site's species table), ``"unexpected"`` (above the threshold but not in the
            site's species table: shown as "unexpected at this site", never suppressed) or ``"unknown"`` (below the
            threshold: ``species`` is None, and ``species_index`` / ``species_confidence`` keep the best guess for
            reference).
    """

    category: str
    confidence: float
    bbox: tuple[float, float, float, float]
    species: str | None = None
    species_index: int | None = None
    species_confidence: float | None = None
    species_status: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.category, str) or not self.category:
            raise PayloadError(f"detection category must be a non-empty string, got {self.category!r}")
        object.__setattr__(self, "confidence", _unit("confidence", self.confidence))
        if not isinstance(self.bbox, (tuple, list)) or len(self.bbox) != 4:
            raise PayloadError(f"bbox must be 4 numbers (x, y, w, h), got {self.bbox!r}")
        x, y, w, h = (_unit(f"bbox[{i}]", v) for i, v in enumerate(self.bbox))
        if x + w > 1.0 + _BBOX_SLACK or y + h > 1.0 + _BBOX_SLACK:
            raise PayloadError(f"bbox {self.bbox!r} extends past the image")
        object.__setattr__(self, "bbox", (x, y, w, h))
        if self.species is not None and not isinstance(self.species, str):
            raise PayloadError(f"species must be a string or null, got {self.species!r}")
        if self.species_index is not None and (type(self.species_index) is not int or self.species_index < 0):
            raise PayloadError(f"species_index must be a non-negative integer or null, got {self.species_index!r}")
        if self.species_confidence is not None:
            object.__setattr__(self, "species_confidence", _unit("species_confidence", self.species_confidence))
        if self.species_status is not None and self.species_status not in SPECIES_STATUSES:
            raise PayloadError(f"species_status must be one of {sorted(SPECIES_STATUSES)} or null, "
                               f"got {self.species_status!r}")
        if self.species_status == "unknown" and self.species is not None:
            raise PayloadError("a detection whose species_status is 'unknown' names no species")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        body = {"category": self.category, "confidence": self.confidence, "bbox": list(self.bbox),
                "species": self.species, "species_index": self.species_index,
                "species_confidence": self.species_confidence}
        if self.species_status is not None:  # written only when set: readers that predate it still parse
            body["species_status"] = self.species_status
        return body


@dataclass(frozen=True)
class DetectionRecord:
    """What a gateway's detector and species classifier made of one image (one DETECTION envelope).

    Attributes:
        media_id: stable id of the image: the first 32 hex digits of the SHA-256 of the file's bytes (the same
            photo always gets the same id, so the coordinator can drop re-deliveries).
        file: path of the image relative to the folder the run was given (POSIX separators).
        deployment_id: Camtrap DP deployment (camera placement) the image belongs to.
        timestamp: capture time, ISO 8601 with a UTC offset (EXIF ``DateTimeOriginal``, else file mtime).
        timestamp_source: ``"exif"``, ``"mtime"``, or ``"run"`` (file unreadable: the time of the run).
        width, height: image size in pixels.
        detections: the detections kept after the confidence threshold and NMS, most confident first; empty
            for an image with none.
        detector: detector id (model name and the first 12 hex digits of its checkpoint SHA-256).
        classifier_hash: ``shared.codec.model_hash`` of the species classifier weights, or ``""``.
        failure: why the image could not be processed, or None (then ``detections`` is empty).
        event_id: the Camtrap DP ``eventID`` of the event (photos of one deployment close in time) the image
            belongs to on its gateway, or None. Written to JSON only when set.

    Compatibility rules: those of the module (fields never removed, new fields optional).
    """

    media_id: str
    file: str
    deployment_id: str
    timestamp: str
    timestamp_source: str
    width: int
    height: int
    detections: tuple[Detection, ...] = ()
    detector: str = ""
    classifier_hash: str = ""
    failure: str | None = None
    event_id: str | None = None

    def __post_init__(self) -> None:
        if self.event_id is not None and (not isinstance(self.event_id, str) or not self.event_id):
            raise PayloadError(f"event_id must be a non-empty string or null, got {self.event_id!r}")
        for name in ("media_id", "file", "deployment_id"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise PayloadError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("timestamp", "timestamp_source", "detector", "classifier_hash"):
            if not isinstance(getattr(self, name), str):
                raise PayloadError(f"{name} must be a string, got {getattr(self, name)!r}")
        _positive("width", self.width, integer=True, allow_zero=self.failure is not None)
        _positive("height", self.height, integer=True, allow_zero=self.failure is not None)
        detections = tuple(self.detections)
        if not all(isinstance(d, Detection) for d in detections):
            raise PayloadError("detections must be Detection objects")
        if self.failure is not None and (not isinstance(self.failure, str) or detections):
            raise PayloadError("a failed record has a failure string and no detections")
        object.__setattr__(self, "detections", detections)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {"media_id": self.media_id, "file": self.file, "deployment_id": self.deployment_id,
                "timestamp": self.timestamp, "timestamp_source": self.timestamp_source, "width": self.width,
                "height": self.height, "detections": [d.to_json() for d in self.detections],
                "detector": self.detector, "classifier_hash": self.classifier_hash, "failure": self.failure,
                **({"event_id": self.event_id} if self.event_id is not None else {})}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> "DetectionRecord":
        """Inverse of :meth:`to_json`.

        Raises:
            PayloadError: unknown or missing fields, bad values.
        """
        if not isinstance(body, Mapping):
            raise PayloadError("detection record is not an object")
        unknown = set(body) - set(cls.__dataclass_fields__)
        if unknown:
            raise PayloadError(f"unknown fields {sorted(unknown)}")
        raw = body.get("detections", [])
        if not isinstance(raw, list):
            raise PayloadError("detections must be a list")
        detections = []
        for d in raw:
            if not isinstance(d, Mapping) or set(d) - set(Detection.__dataclass_fields__):
                raise PayloadError(f"detection {d!r} is not an object with known fields")
            try:
                detections.append(Detection(**{**d, "bbox": tuple(d.get("bbox", ()))}))
            except TypeError as exc:
                raise PayloadError(f"detection fields wrong: {exc}") from exc
        try:
            return cls(**{**body, "detections": tuple(detections)})
        except TypeError as exc:
            raise PayloadError(f"detection record fields wrong: {exc}") from exc


def encode_detection(record: DetectionRecord) -> bytes:
    """Payload of a DETECTION: no tensors, the record as metadata."""
    return encode_tensors({}, _metadata(record.to_json()))


def decode_detection(payload: bytes) -> DetectionRecord:
    """Inverse of :func:`encode_detection`.

    Raises:
        PayloadError: not safetensors, tensors present, unknown/missing fields, values out of range.
    """
    tensors, body = _read(payload, set(DetectionRecord.__dataclass_fields__))
    if tensors:
        raise PayloadError(f"a detection payload carries no tensors, got {sorted(tensors)[:5]}")
    return DetectionRecord.from_json(body)
