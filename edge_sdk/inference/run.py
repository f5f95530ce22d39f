"""One detection run over folders of photos: what ``wildfed-edge detect`` does, callable from the agent too.

:func:`run_detection` finds the images, opens the detector (and the classifier when weights are given) on the best
engine, turns every image into a record, optionally publishes each record signed, and writes the output files:

    <out>/megadetector.json   MegaDetector batch output 1.4 (Timelapse)
    <out>/observations.csv    Camtrap DP observations
    <out>/media.csv           Camtrap DP media
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared.models.backbone import DEFAULT_BACKBONE, DEFAULT_INPUT_SIZE, backbone_id
from shared.protocol import DetectionRecord

from edge_sdk.inference.classifier import SpeciesClassifier, load_classifier_weights
from edge_sdk.inference.detector import CONFIDENCE_THRESHOLD, YoloxDetector
from edge_sdk.inference.embedder import Embedder
from edge_sdk.inference.engines import EnginePreference
from edge_sdk.inference.formats import (MEDIA_COLUMNS, OBSERVATION_COLUMNS, media_rows, megadetector_json,
                                        observation_rows, write_csv, write_json)
from edge_sdk.inference.records import DetectionPipeline, DetectionPublisher, find_images, parse_utc_offset

__all__ = ["MAX_AUTO_WORKERS", "RunSummary", "run_detection"]

#: The most worker threads ``workers=None`` picks (one per core up to this).
MAX_AUTO_WORKERS = 4


@dataclass
class RunSummary:
    """What a run produced: the records (input order), output files, engines used, publish counts."""

    records: list[DetectionRecord] = field(default_factory=list)
    files: dict[str, Path] = field(default_factory=dict)
    detector_engine: str = ""
    classifier_engine: str = ""
    published: int = 0
    publish_failed: int = 0

    @property
    def images_with_detections(self) -> int:
        """Images with at least one detection."""
        return sum(1 for r in self.records if r.detections)

    @property
    def failures(self) -> int:
        """Images that could not be read."""
        return sum(1 for r in self.records if r.failure is not None)


def run_detection(paths: Iterable[str | Path], *, out_dir: str | Path, deployment_id: str,
                  weights: str | Path | Mapping[str, np.ndarray] | None = None,
                  class_names: Mapping[int, str] | None = None,
                  prefer: EnginePreference = "auto", batch_size: int = 8, threads: int | None = None,
                  confidence: float = CONFIDENCE_THRESHOLD, utc_offset: str = "+00:00",
                  publisher: DetectionPublisher | None = None, detector: YoloxDetector | None = None,
                  on_start: Callable[[int], None] | None = None,
                  on_record: Callable[[DetectionRecord], None] | None = None,
                  input_size: int = DEFAULT_INPUT_SIZE, embedder: Embedder | None = None,
                  backbone: str = DEFAULT_BACKBONE, model_dir: str | Path | None = None,
                  workers: int | None = None, draft: bool = False,
                  prediction: Callable[[np.ndarray], Any] | None = None) -> RunSummary:
    """Detect (and classify) every image under ``paths`` and write the output files.

    Args:
        paths: image files or folders (searched recursively).
        out_dir: folder for the output files (created).
        deployment_id: Camtrap DP deployment of the images.
        weights: a head-model global model (``.safetensors`` path, or the weights themselves) for species, or
            None for detection only.
        class_names: class index -> species name for the classifier.
        prefer: engine preference (``auto`` / ``tensorrt`` / ``ort``).
        batch_size, threads, confidence: detector batch, ORT threads, detection threshold.
        utc_offset: zone of EXIF times without an offset (``+HH:MM``).
        publisher: when given, each record is published signed as soon as it is made.
        detector: an already opened detector (reuse across runs; tests).
        on_start: called with the number of images before the first one (progress bars).
        on_record: called after each record.
        input_size: backbone input size the head was trained at (pixels).
        embedder: an already opened backbone embedder (one engine for many runs).
        backbone: the backbone variant the head was trained on (``efficientnet-lite0``, ...); a model file whose
            metadata names another backbone or input size is refused.
        model_dir: the site's graph folder (site.yaml ``model_dir``), where its bundle installed the detector's and
            the backbone's ONNX graphs; searched before the WildFed cache.
        workers: batches run at once on threads (:class:`DetectionPipeline`). None: one per CPU core (at most
            :data:`MAX_AUTO_WORKERS`), each ONNX Runtime session on ``cores / workers`` intra-op threads, when the
            detector is opened here, runs on ONNX Runtime's CPU provider and ``threads`` is not given; otherwise 1. On 2 cores two
            1-thread workers beat one 2-thread session (docs/results/photos.md).
        draft: decode large JPEGs for the detector in the DCT at 1/2..1/8 (:mod:`edge_sdk.inference.decode`).
        prediction: how a crop's probabilities are read (:class:`DetectionPipeline`): the site's prior and
            threshold, so a species below it is ``unknown``; None: the top class.

    Raises:
        FileNotFoundError: a path does not exist. ConfigError: bad weights, weights cannot be fetched, weights
            trained on another backbone.
        ValueError: bad ``utc_offset``; ``workers`` below 1.
    """
    zone = parse_utc_offset(utc_offset)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be an integer >= 1 (threads running batches at once), got {workers!r}")
    images = find_images(paths)
    cores = os.cpu_count() or 1
    auto = workers is None and threads is None and prefer != "tensorrt" and detector is None
    if auto:
        workers = min(cores, MAX_AUTO_WORKERS)
        threads = max(1, cores // workers)
    if detector is None:
        detector = YoloxDetector.open(prefer=prefer, batch_size=batch_size, threads=threads, confidence=confidence,
                                      model_dir=model_dir)
    classifier = None
    if weights is not None:
        loaded = (load_classifier_weights(weights, backbone_id=backbone_id(backbone, input_size))
                  if isinstance(weights, (str, Path)) else dict(weights))
        classifier = SpeciesClassifier.from_weights(loaded, class_names=class_names,
                                                    prefer=prefer, threads=threads, input_size=input_size,
                                                    backbone=backbone, embedder=embedder, model_dir=model_dir)
    concurrent = detector.engine.name == "ort-cpu" and (classifier is None or classifier.engine_name == "ort-cpu")
    if auto and not concurrent:
        workers = 1  # TensorRT / CUDA: one caller
    pipeline = DetectionPipeline(detector, classifier, deployment_id=deployment_id, utc_offset=zone,
                                 draft=draft, workers=workers or 1, prediction=prediction)
    summary = RunSummary(detector_engine=detector.engine.name,
                         classifier_engine=classifier.engine_name if classifier is not None else "")
    if on_start is not None:
        on_start(len(images))
    for record in pipeline.run(images):
        summary.records.append(record)
        if publisher is not None:
            if publisher.publish(record):
                summary.published += 1
            else:
                summary.publish_failed += 1
        if on_record is not None:
            on_record(record)
    out = Path(out_dir)
    classifier_id = classifier.classifier_id if classifier is not None else None
    now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
    md = megadetector_json(summary.records, detector=detector.detector_id, classifier=classifier_id,
                           class_names=classifier.class_names if classifier is not None else None,
                           classifications=pipeline.classifications,
                           completion_time=now.strftime("%Y-%m-%d %H:%M:%S"))
    classified_by = detector.detector_id + (f" + {classifier_id}" if classifier_id else "")
    summary.files = {
        "megadetector": write_json(out / "megadetector.json", md),
        "observations": write_csv(out / "observations.csv", OBSERVATION_COLUMNS,
                                  observation_rows(summary.records, classified_by=classified_by,
                                                   class_names=classifier.class_names if classifier else None,
                                                   classification_timestamp=now.isoformat())),
        "media": write_csv(out / "media.csv", MEDIA_COLUMNS, media_rows(summary.records)),
    }
    return summary
