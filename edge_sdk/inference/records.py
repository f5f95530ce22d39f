"""Camera-trap photos -> :class:`shared.protocol.DetectionRecord`, and signed publishing of the records.

:class:`DetectionPipeline` reads each image, runs the detector on batches, classifies every detection's square crop
(:mod:`edge_sdk.data.crops`: the box as it is stored, then ``shared.models.backbone.square_crop``: the very crop
training embeds) with the species classifier (backbone embedding + federated head, when one is given) and yields one
record per image, in input order. An image that cannot be
read still gets a record, with ``failure`` set (as the MegaDetector format asks), so "every image gets a record".

Timestamps: EXIF ``DateTimeOriginal`` (else EXIF ``DateTime``), with the offset of EXIF ``OffsetTimeOriginal`` when
the camera wrote one and otherwise ``utc_offset`` (the camera clock's zone; default ``+00:00``); without EXIF, the
file's modification time in UTC. Camtrap DP requires an offset on every timestamp, so one is always written.

:class:`DetectionPublisher` seals each record in a DETECTION envelope signed with the site key and publishes it on
``shared.topics.detection_topic`` through any ``edge_sdk.uplink.transport.Transport`` (QoS 1). Detection records
are not kept in the update outbox: the run's output files (MegaDetector JSON, Camtrap DP CSV) are the local copy,
and a failed publish is reported to the caller.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import logging
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from PIL import Image, UnidentifiedImageError

from shared.camtrap_dp import media_id
from shared.envelope import MessageKind, seal
from shared.protocol import Detection, DetectionRecord, encode_detection
from shared.topics import detection_topic

from edge_sdk.data.crops import bbox_square, crop_square, decode_rgb, stored_bbox
from edge_sdk.inference.classifier import SpeciesClassifier
from edge_sdk.inference.decode import open_for_detection
from edge_sdk.inference.detector import CATEGORY, YoloxDetector
from edge_sdk.uplink.transport import Transport, TransportError

__all__ = ["IMAGE_SUFFIXES", "find_images", "media_id", "read_timestamp", "parse_utc_offset", "DetectionPipeline",
           "DetectionPublisher", "TOP_CLASSES"]

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".tif", ".tiff", ".bmp")
TOP_CLASSES = 3  # classifications kept per detection in the MegaDetector file
_EXIF_IFD, _DATETIME, _DATETIME_ORIGINAL, _OFFSET_ORIGINAL = 0x8769, 306, 36867, 36881
_OFFSET = re.compile(r"^([+-])(\d{2}):(\d{2})$")


def _ordered(fn: Callable, items: Sequence, *, workers: int) -> Iterator:
    """``fn(item)`` for each item on ``workers`` threads, yielded in input order, at most ``2 * workers`` ahead;
    pending calls are cancelled when the consumer stops early."""
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="detect") as pool:
        pending: deque = deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def find_images(paths: Iterable[str | Path]) -> list[tuple[Path, str]]:
    """Images under ``paths`` (files, or folders searched recursively), sorted, as ``(path, relative name)``.

    Names are relative to the folder given (one folder), the file's own folder (one file), or the deepest folder
    common to all the paths given (several), with POSIX separators, so that they are unique within a run.

    Raises:
        FileNotFoundError: a path does not exist.
    """
    given = [Path(p) for p in paths]
    for p in given:
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
    bases = [p.resolve() if p.is_dir() else p.resolve().parent for p in given]
    base = Path(os.path.commonpath(bases)) if bases else Path(".")
    found: set[Path] = set()
    for p in given:
        if p.is_dir():
            found.update(f.resolve() for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        else:
            found.add(p.resolve())
    return sorted(((f, f.relative_to(base).as_posix()) for f in found), key=lambda t: t[1])


def parse_utc_offset(text: str) -> _dt.timezone:
    """``"+02:00"`` -> a fixed-offset timezone.

    Raises:
        ValueError: not of the form ``±HH:MM``.
    """
    m = _OFFSET.match(text.strip())
    if not m:
        raise ValueError(f"UTC offset {text!r} is not of the form +HH:MM or -HH:MM")
    delta = _dt.timedelta(hours=int(m.group(2)), minutes=int(m.group(3)))
    return _dt.timezone(-delta if m.group(1) == "-" else delta)


def read_timestamp(path: Path, image: Image.Image | None, *,
                   utc_offset: _dt.timezone = _dt.timezone.utc) -> tuple[str, str]:
    """``(ISO 8601 timestamp with offset, source)``, source ``"exif"`` or ``"mtime"`` (see the module docstring)."""
    if image is not None:
        try:
            exif = image.getexif()
            sub = exif.get_ifd(_EXIF_IFD)
            raw = sub.get(_DATETIME_ORIGINAL) or exif.get(_DATETIME)
            if raw:
                moment = _dt.datetime.strptime(str(raw).strip("\x00 ").strip(), "%Y:%m:%d %H:%M:%S")
                zone = utc_offset
                if sub.get(_OFFSET_ORIGINAL):
                    try:
                        zone = parse_utc_offset(str(sub.get(_OFFSET_ORIGINAL)).strip("\x00 "))
                    except ValueError:
                        pass
                return moment.replace(tzinfo=zone).isoformat(), "exif"
        except (ValueError, OSError, AttributeError):
            pass  # unreadable or malformed EXIF: fall back to the file time
    mtime = _dt.datetime.fromtimestamp(path.stat().st_mtime, tz=_dt.timezone.utc).replace(microsecond=0)
    return mtime.isoformat(), "mtime"


@dataclass(frozen=True)
class _Loaded:
    path: Path
    name: str
    mid: str
    image: Image.Image | None  # the detector's decode (DCT-reduced for large JPEGs)
    failure: str | None
    timestamp: tuple[str, str]
    size: tuple[int, int] = (0, 0)  # the photo's own (width, height)
    data: bytes = b""  # the file's bytes: the full decode for crops, only for photos with boxes


class DetectionPipeline:
    """Detector + optional species classifier -> one :class:`DetectionRecord` per image.

    Args:
        detector: the YOLOX-tiny detector.
        classifier: species classifier for the crops, or None (records then carry no species).
        deployment_id: Camtrap DP deployment of the images.
        utc_offset: zone of EXIF times without an offset tag.
        draft: decode large JPEGs for the detector at 1/2, 1/4 or 1/8 of their size in the DCT
            (:mod:`edge_sdk.inference.decode`); crops always come from the full decode. False: full decode only.
        workers: batches processed at once on threads (1: one after the other). Only for engines that take
            concurrent calls (ONNX Runtime); give each ORT session ``threads`` = cores / workers.
        prediction: reads a crop's float (K,) probabilities into a prediction with ``index``, ``confidence``,
            ``status`` and ``named`` (the field loop's site prior and threshold: a partial of
            :func:`edge_sdk.field.predictions.read_prediction`); an ``unknown`` one names no species (its best guess
            stays in ``species_index``). None: the top class, always named, no status.

    Raises:
        ValueError: an empty deployment id, or ``workers`` < 1.
    """

    def __init__(self, detector: YoloxDetector, classifier: SpeciesClassifier | None = None, *,
                 deployment_id: str, utc_offset: _dt.timezone = _dt.timezone.utc, draft: bool = False,
                 workers: int = 1, prediction: Callable[[np.ndarray], Any] | None = None) -> None:
        if not deployment_id:
            raise ValueError("deployment_id must be a non-empty string")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1 (threads running batches at once), got {workers!r}")
        self.workers = workers
        self.draft = bool(draft)
        self.detector = detector
        self.classifier = classifier
        self.deployment_id = deployment_id
        self.utc_offset = utc_offset
        self.prediction = prediction
        #: per record media id, the top-``TOP_CLASSES`` ``(class index, probability)`` of each detection
        self.classifications: dict[str, list[list[tuple[int, float]]]] = {}

    def _load(self, path: Path, name: str) -> _Loaded:
        try:
            data = path.read_bytes()
        except OSError as exc:
            now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
            return _Loaded(path, name, hashlib.sha256(name.encode()).hexdigest()[:32], None,
                           f"Failure image access: {exc}", (now, "run"))
        mid = media_id(data)
        try:
            with Image.open(path) as im:  # by path: an error names the file
                timestamp = read_timestamp(path, im, utc_offset=self.utc_offset)
                decoded = open_for_detection(im, draft=self.draft)
            return _Loaded(path, name, mid, decoded.image, None, timestamp, decoded.size, data)
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            return _Loaded(path, name, mid, None, f"Failure image access: {exc}",
                           read_timestamp(path, None, utc_offset=self.utc_offset))

    def run(self, images: Sequence[tuple[Path, str]], *,
            on_record: Callable[[DetectionRecord], None] | None = None) -> Iterator[DetectionRecord]:
        """Yield one record per ``(path, name)`` in order; ``on_record`` is called after each (progress bars).

        With ``workers`` > 1, batches are decoded, detected and classified on that many threads at once (the
        engines' sessions are shared; ONNX Runtime runs concurrent calls), at most ``2 * workers`` batches ahead of
        the one yielded."""
        batch = max(1, self.detector.batch_size)
        chunks = [images[start:start + batch] for start in range(0, len(images), batch)]
        if self.workers == 1:
            results: Iterable[list[DetectionRecord]] = map(self._batch, chunks)
        else:
            results = _ordered(self._batch, chunks, workers=self.workers)
        for records in results:
            for record in records:
                if on_record is not None:
                    on_record(record)
                yield record

    def _batch(self, chunk: Sequence[tuple[Path, str]]) -> list[DetectionRecord]:
        loaded = [self._load(p, n) for p, n in chunk]
        good = [item for item in loaded if item.image is not None]
        if any(i.image.size != i.size for i in good):  # reduced decodes: boxes in the photos' own pixels
            found = self.detector.detect([i.image for i in good], [i.size for i in good])
        else:
            found = self.detector.detect([i.image for i in good]) if good else []
        boxes = dict(zip((id(i) for i in good), found))
        return [self._record(item, boxes.get(id(item), [])) for item in loaded]

    def _record(self, item: _Loaded, boxes: list) -> DetectionRecord:
        timestamp, source = item.timestamp
        common = dict(media_id=item.mid, file=item.name, deployment_id=self.deployment_id, timestamp=timestamp,
                      timestamp_source=source, detector=self.detector.detector_id,
                      classifier_hash=self.classifier.model_hash if self.classifier is not None else "")
        if item.image is None:
            return DetectionRecord(width=0, height=0, failure=item.failure, **common)
        width, height = item.size
        probs = None
        bboxes = [stored_bbox(b.normalised_xywh(width, height)) for b in boxes]
        if self.classifier is not None and boxes:
            image = item.image if item.image.size == item.size else decode_rgb(item.data)  # crops: full pixels
            probs = self.classifier.probabilities([crop_square(image, bbox_square(bb, width, height))
                                                   for bb in bboxes])
        detections, tops = [], []
        for i, b in enumerate(boxes):
            species = index = conf = status = None
            if probs is not None:
                order = np.argsort(-probs[i], kind="stable")
                index, conf = int(order[0]), float(probs[i, order[0]])
                species = self.classifier.class_names[index]
                tops.append([(int(k), float(probs[i, k])) for k in order[:TOP_CLASSES]])
                if self.prediction is not None:  # the field loop's reading: site prior, threshold, status
                    read = self.prediction(probs[i])
                    index, conf, status = read.index, read.confidence, read.status
                    species = self.classifier.class_names[index] if read.named else None
            detections.append(Detection(category=CATEGORY, confidence=b.score,
                                        bbox=bboxes[i], species=species,
                                        species_index=index, species_confidence=conf, species_status=status))
        if tops:
            self.classifications[item.mid] = tops
        return DetectionRecord(width=width, height=height, detections=tuple(detections), **common)


class DetectionPublisher:
    """Seals detection records in signed DETECTION envelopes and publishes them (QoS 1).

    Args:
        transport: the uplink (connected).
        private_key: the site's Ed25519 key.
        federation_id, site_id: identities (the topic is ``detection_topic(federation_id, site_id)``).
        model_round, base_model_hash: round and hash of the global model that classified the records (``0``
            and ``""`` when unknown); they go in the envelope header.
        first_sequence: sequence number of the first envelope (default: the current Unix time in ms, so runs
            do not reuse numbers); each publish adds one.
    """

    def __init__(self, transport: Transport, *, private_key: Ed25519PrivateKey, federation_id: str, site_id: str,
                 model_round: int = 0, base_model_hash: str = "", first_sequence: int | None = None) -> None:
        self.transport = transport
        self._key = private_key
        self.federation_id = federation_id
        self.site_id = site_id
        self.topic = detection_topic(federation_id, site_id)
        self.model_round = model_round
        self.base_model_hash = base_model_hash
        self._sequence = int(time.time() * 1000) if first_sequence is None else int(first_sequence)
        self.published = 0
        self.failed: list[str] = []

    def envelope_bytes(self, record: DetectionRecord) -> bytes:
        """The signed envelope of ``record`` (advances the sequence)."""
        env = seal(private_key=self._key, federation_id=self.federation_id, site_id=self.site_id,
                   round=self.model_round, base_model_hash=self.base_model_hash, kind=MessageKind.DETECTION,
                   sequence=self._sequence, payload=encode_detection(record))
        self._sequence += 1
        return env.to_bytes()

    def publish(self, record: DetectionRecord) -> bool:
        """Publish one record; False (logged, remembered in ``failed``) when the broker does not acknowledge."""
        try:
            self.transport.publish(self.topic, self.envelope_bytes(record), qos=1)
        except TransportError as exc:
            self.failed.append(record.media_id)
            log.warning("detections: publish of %s (%s) failed: %s", record.file, record.media_id, exc)
            return False
        self.published += 1
        return True
