"""The gateway's field loop: each new photo in the incoming folder becomes a media row, machine observations, an
event and a signed detection record; the photo moves into the site's package and never leaves the gateway.

For each complete file (:mod:`edge_sdk.field.incoming`), :meth:`FieldService.process`:

1. reads its bytes; the media id is ``shared.camtrap_dp.media_id`` (SHA-256 of the bytes); a media id already in
   the index is a copy of a stored photo: the file is removed and nothing else happens (stored exactly once);
2. decodes it for the detector (a large JPEG at 1/2 to 1/8 of its size in the DCT,
   :mod:`edge_sdk.inference.decode`; a file that does not decode yet is left for the next poll,
   :meth:`IncomingFolder.defer`); capture time
   from EXIF ``DateTimeOriginal`` (with ``OffsetTimeOriginal`` or ``field.utc_offset``), else the file's
   modification time, and then the media row says so (``timestampSource:mtime`` in ``mediaComments``,
   ``shared.camtrap_dp.mark_timestamp_source``; the detection record's ``timestamp_source``);
3. detects and classifies it (:class:`edge_sdk.field.photos.PhotoClassifier`, with the newest global model);
4. in one step that a crash can repeat without doubling anything, inside the index's transaction that puts the
   photo in an event: seals its detection record (naming the event) into the durable queue
   (:mod:`edge_sdk.field.detection_queue`; the same message id replaces a record queued before a crash), copies the
   photo into the package and appends its media row and machine observations (skipped when the package already
   holds the media id), then commits;
5. removes the file from the incoming folder.

A photo with no box above the detector's threshold is recorded as ``blank``, not dropped. Detection records leave
through :meth:`FieldService.flush` (what the agent's loop calls while the broker is reachable).
"""

from __future__ import annotations

import datetime as _dt
import io
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shared.camtrap_dp import MEDIA_TYPES, mark_timestamp_source, media_id as media_id_of
from shared.protocol import Detection, DetectionRecord

from edge_sdk.config import SiteConfig, global_model_path
from edge_sdk.data.crops import decode_rgb
from edge_sdk.field.detection_queue import DetectionQueue
from edge_sdk.field.incoming import IncomingFolder
from edge_sdk.field.photos import ClassifiedBox, PhotoClassifier
from edge_sdk.field.site_package import SitePackage
from edge_sdk.field.store import FieldStore, PhotoEntry
from edge_sdk.inference.decode import open_for_detection
from edge_sdk.inference.detector import CATEGORY
from edge_sdk.inference.records import parse_utc_offset, read_timestamp
from edge_sdk.site_paths import detection_queue_path, field_index_path

__all__ = ["FieldStats", "FieldService"]

log = logging.getLogger(__name__)


@dataclass
class FieldStats:
    """Counts since the service started: photos stored, duplicates removed, deferred (not yet decodable), failed
    (moved to ``.failed/``), records published."""

    stored: int = 0
    duplicates: int = 0
    deferred: int = 0
    failed: int = 0
    published: int = 0
    last_error: str = ""
    by_status: dict[str, int] = field(default_factory=dict)


class FieldService:
    """The field loop of one site (module docstring).

    Args:
        config: the site config (``incoming`` must be set).
        classifier: the site's :class:`PhotoClassifier`.
        queue: the durable queue of detection records, or None to publish nothing (``field.publish_detections``
            false).
        clock: monotonic clock for the incoming folder's settle time (tests).

    Raises:
        ConfigError: ``incoming`` is not set.
    """

    def __init__(self, config: SiteConfig, *, classifier: PhotoClassifier, queue: DetectionQueue | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from shared.errors import ConfigError

        if config.incoming is None:
            raise ConfigError("the site config sets no incoming folder", field="incoming",
                              fix="add `incoming: incoming/` (the folder new photos arrive in) to site.yaml")
        self.config = config
        self.settings = config.field
        self.classifier = classifier
        self.queue = queue
        self.incoming = IncomingFolder(config.incoming, settle_s=self.settings.settle_s,
                                       give_up_s=self.settings.give_up_s, clock=clock)
        self.store = FieldStore(field_index_path(config), gap_s=self.settings.event_gap_s)
        self.package = SitePackage(config.dataset, site_id=config.site_id)
        self.package.ensure()
        with self.package.locked():  # coordinates given in site.yaml after the cameras' first photos
            filled = self.package.fill_coordinates({
                self.settings.deployment_id(config.site_id, name): (loc.latitude, loc.longitude, loc.location_name)
                for name, loc in self.settings.deployments.items()})
        if filled:
            log.info("field: coordinates from site.yaml given to %s", ", ".join(filled))
        self._in_package = self.package.media_ids()
        self._zone = parse_utc_offset(self.settings.utc_offset)
        self.stats = FieldStats()

    @classmethod
    def from_config(cls, config: SiteConfig, *, signing_key: object, embedder: object | None = None,
                    detector: object | None = None) -> "FieldService":
        """Open the detector and backbone on the engine the config asks for and build the service.

        Raises:
            ConfigError: the detector or backbone cannot be opened (weights missing and not downloadable).
        """
        from edge_sdk.data.embedding import open_embedder
        from edge_sdk.inference.detector import YoloxDetector

        s = config.field
        detector = detector or YoloxDetector.open(prefer=s.engine, batch_size=1,  # type: ignore[arg-type]
                                                  threads=config.threads, confidence=s.detection_threshold,
                                                  model_dir=config.model_dir)
        embedder = embedder or open_embedder(config.embedding_input_size, backbone=config.backbone,
                                             threads=config.threads, model_dir=config.model_dir)
        classifier = PhotoClassifier(detector=detector, embedder=embedder, model_path=global_model_path(config),
                                     class_names=config.names_by_class,
                                     site_classes={e.class_index for e in config.species},
                                     threshold=s.confidence_threshold, outside_prior=s.outside_prior,
                                     backbone_id=config.backbone_id)
        queue = (DetectionQueue(detection_queue_path(config), private_key=signing_key,  # type: ignore[arg-type]
                                federation_id=config.federation_id, site_id=config.site_id)
                 if s.publish_detections else None)
        return cls(config, classifier=classifier, queue=queue)

    def close(self) -> None:
        """Close the index and the queue."""
        self.store.close()
        if self.queue is not None:
            self.queue.close()

    # -- the loop ---------------------------------------------------------------------------------------------
    def poll(self) -> int:
        """Process every complete photo in the incoming folder; returns how many were stored."""
        ready = self.incoming.scan()
        if not ready:
            return 0
        self.classifier.refresh()
        stored = 0
        for path in ready:
            stored += int(self.process(path) is not None)
        return stored

    def flush(self, transport: object) -> int:
        """Publish waiting detection records (see :meth:`DetectionQueue.flush`)."""
        if self.queue is None:
            return 0
        sent = self.queue.flush(transport)  # type: ignore[arg-type]
        self.stats.published += sent
        return sent

    def process(self, path: Path) -> DetectionRecord | None:
        """One complete file (module docstring); returns its detection record, or None when it was a duplicate or
        did not decode."""
        from PIL import Image

        data = path.read_bytes()
        mid = media_id_of(data)
        if self.store.has_media(mid):
            log.info("field: %s is a copy of stored media %s; removed", path, mid)
            self.stats.duplicates += 1
            self._remove(path)
            return None
        try:
            with Image.open(io.BytesIO(data)) as im:
                timestamp, source = read_timestamp(path, im, utc_offset=self._zone)
                decoded = open_for_detection(im)  # full decode (the reduced one is detect's --draft)
        except OSError as exc:  # truncated (still arriving) or not an image
            self.stats.deferred += 1
            log.info("field: %s does not decode yet (%s); read again once it is whole", path, exc)
            if self.incoming.defer(path, str(exc)):
                self.stats.failed += 1
                self.stats.last_error = f"{path.name}: does not decode ({exc})"
            return None
        rel = path.relative_to(self.incoming.root)
        deployment = self.settings.deployment_id(self.config.site_id, rel.parts[0] if len(rel.parts) > 1 else None)
        size = decoded.size
        full = None if decoded.image.size == size else (lambda: decode_rgb(data))  # reduced: crops from full pixels
        boxes = self.classifier.classify(decoded.image, size=size, full=full)
        record = self._record(mid, rel.as_posix(), deployment, timestamp, source, size, boxes)
        photo = PhotoEntry(mid, deployment, "", rel.as_posix(), timestamp, source, size[0], size[1],
                           tuple(_box_json(b, self.classifier.class_names) for b in boxes),
                           boxes[0].probs if boxes and boxes[0].probs is not None else None)

        def write(event_id: str) -> str:  # inside the index's transaction: a crash here repeats it all
            self._queue(DetectionRecord(**{**record.__dict__, "event_id": event_id}))
            return self._write_package(data, path, photo, boxes, event_id)

        event_id = self.store.add_photo(photo, self.classifier.read, write=write)
        record = DetectionRecord(**{**record.__dict__, "event_id": event_id})
        self.stats.stored += 1
        status = "blank" if not boxes else (boxes[0].prediction.status if boxes[0].prediction else "unclassified")
        self.stats.by_status[status] = self.stats.by_status.get(status, 0) + 1
        self._remove(path)
        log.info("field: %s -> media %s, %d box(es), %s, event %s", rel, mid, len(boxes), status, event_id)
        return record

    def _queue(self, record: DetectionRecord) -> None:
        if self.queue is not None:
            model = self.classifier.model
            self.queue.add(record, model_round=model.round if model else 0,
                           model_hash=model.model_hash if model else "")

    def _remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        self.incoming.done(path)

    # -- what is written --------------------------------------------------------------------------------------
    def _record(self, mid: str, name: str, deployment: str, timestamp: str, source: str, size: tuple[int, int],
                boxes: list[ClassifiedBox]) -> DetectionRecord:
        detections = []
        for b in boxes:
            p = b.prediction
            species = self.classifier.class_names.get(p.index, f"class_{p.index}") if p and p.named else None
            detections.append(Detection(category=CATEGORY, confidence=b.confidence, bbox=b.bbox, species=species,
                                        species_index=p.index if p else None,
                                        species_confidence=p.confidence if p else None,
                                        species_status=p.status if p else None))
        return DetectionRecord(media_id=mid, file=name, deployment_id=deployment, timestamp=timestamp,
                               timestamp_source=source, width=size[0], height=size[1], detections=tuple(detections),
                               detector=getattr(self.classifier.detector, "detector_id", ""),
                               classifier_hash=self.classifier.classifier_hash)

    def _write_package(self, data: bytes, path: Path, photo: PhotoEntry, boxes: list[ClassifiedBox],
                       event_id: str) -> str:
        """Copy the photo and append its rows (inside the index's transaction); returns its ``filePath``."""
        suffix = path.suffix.lower()
        with self.package.locked():
            if photo.media_id in self._in_package:  # already in the package (e.g. built by wildfed-edge package)
                return next(r["filePath"] for r in self.package.rows("media") if r.get("mediaID") == photo.media_id)
            file_path = self.package.store_photo(data, photo.media_id, suffix)
            location = self.settings.deployments.get(photo.deployment_id.split("/", 1)[-1])
            self.package.upsert_deployment(photo.deployment_id, timestamp=photo.timestamp,
                                           latitude=location.latitude if location else None,
                                           longitude=location.longitude if location else None,
                                           location_name=location.location_name if location else "",
                                           timestamp_issue=photo.timestamp_source != "exif")
            self.package.append("media", [{
                "mediaID": photo.media_id, "deploymentID": photo.deployment_id, "captureMethod": "activityDetection",
                "timestamp": photo.timestamp, "filePath": file_path, "filePublic": "false", "fileName": path.name,
                "fileMediatype": MEDIA_TYPES.get(suffix, "image/jpeg"),
                "mediaComments": mark_timestamp_source(photo.timestamp_source)}])
            self.package.append("observations", self._machine_rows(photo, boxes, event_id))
            self._in_package.add(photo.media_id)
        return file_path

    def _machine_rows(self, photo: PhotoEntry, boxes: list[ClassifiedBox], event_id: str) -> list[dict]:
        now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
        model = self.classifier.model
        by = getattr(self.classifier.detector, "detector_id", "detector")
        by += f" + head@{model.model_hash[:12]}" if model is not None else ""
        common = {"deploymentID": photo.deployment_id, "mediaID": photo.media_id, "eventID": event_id,
                  "eventStart": photo.timestamp, "eventEnd": photo.timestamp, "observationLevel": "media",
                  "classificationMethod": "machine", "classifiedBy": by, "classificationTimestamp": now}
        if not boxes:
            return [dict(common, observationID=f"{photo.media_id}-m0", observationType="blank")]
        rows = []
        for i, b in enumerate(boxes):
            x, y, w, h = b.bbox
            row = dict(common, observationID=f"{photo.media_id}-m{i}", count=1, bboxX=f"{x:.6f}", bboxY=f"{y:.6f}",
                       bboxWidth=f"{w:.6f}", bboxHeight=f"{h:.6f}",
                       observationComments=f"detector confidence {b.confidence:.4f}")
            p = b.prediction
            if p is None:
                row.update(observationType="unclassified")
            else:
                name = self.classifier.class_names.get(p.index, f"class_{p.index}")
                row.update(observationType="animal", classificationProbability=f"{p.confidence:.4f}")
                if p.named:
                    row.update(scientificName=name)
                    if p.status == "unexpected":
                        row.update(observationTags="wildfed:unexpected-at-site")
                else:
                    row["observationComments"] += f"; species unknown (best guess {name} {p.confidence:.2f})"
            rows.append(row)
        return rows


def _box_json(box: ClassifiedBox, class_names: dict[int, str]) -> dict:
    p = box.prediction
    return {"bbox": list(box.bbox), "confidence": box.confidence,
            "species": class_names.get(p.index, f"class_{p.index}") if p and p.named else None,
            "species_index": p.index if p else None, "species_confidence": p.confidence if p else None,
            "species_status": p.status if p else None}
