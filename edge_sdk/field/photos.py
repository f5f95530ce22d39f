"""One photo through the gateway's models: detector boxes, each box's crop embedded once, the species head, and the
honest reading of its answer.

:class:`PhotoClassifier` holds the detector (YOLOX-tiny), the backbone embedder and the newest global model the
gateway keeps (``edge_sdk.config.global_model_path``, re-read when the file changes). For each box it takes the
crop of :mod:`edge_sdk.data.crops` (the stored bbox, the square the backbone sees) and embeds it: the same decode,
box and square that training uses once a ranger confirms the box, so training embeds exactly what was classified
here. (Crops are not cached here: most photos are never verified, and a cache of every detection would grow by
about 12 MB a day at 2,000 photos; a verified record is embedded once when it first trains, then cached.)
Probabilities are read with the site prior and the confidence threshold (:mod:`edge_sdk.field.predictions`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.models.backbone import EMBEDDING_DIM

from edge_sdk.data.crops import Square, bbox_square, crop_square, stored_bbox
from edge_sdk.field.predictions import Prediction, read_prediction
from edge_sdk.global_model import KeptModel
from edge_sdk.inference.classifier import SpeciesClassifier

__all__ = ["ClassifiedBox", "PhotoClassifier"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClassifiedBox:
    """One detection.

    Attributes:
        bbox: normalised ``(x, y, w, h)`` as stored (:func:`~edge_sdk.data.crops.stored_bbox`).
        confidence: the detector's score in [0, 1].
        square: the pixel square the backbone saw.
        probs: float64 (K,) softmax probabilities of the species head, or None without a model.
        prediction: their reading, or None without a model.
    """

    bbox: tuple[float, float, float, float]
    confidence: float
    square: Square
    probs: np.ndarray | None = None
    prediction: Prediction | None = None


class PhotoClassifier:
    """Detector, embedder and species head for one site (module docstring).

    Args:
        detector: a ``YoloxDetector`` (anything with ``detect([image]) -> [[Box]]`` and ``detector_id``).
        embedder: the backbone embedder (``edge_sdk.inference.embedder.Embedder``).
        model_path: the kept global model's file.
        class_names: class index -> scientific name.
        site_classes: class indices of the site's species table.
        threshold, outside_prior: see :func:`edge_sdk.field.predictions.read_prediction`.
        backbone_id: the site's backbone id (``SiteConfig.backbone_id``); a kept model trained on another backbone's
            embeddings is refused. None: not checked.
    """

    def __init__(self, *, detector: object, embedder: object, model_path: Path,
                 class_names: Mapping[int, str], site_classes: Collection[int], threshold: float,
                 outside_prior: float, backbone_id: str | None = None) -> None:
        self.detector = detector
        self.embedder = embedder
        self.model_path = Path(model_path)
        self.class_names = dict(class_names)
        self.site_classes = frozenset(int(c) for c in site_classes)
        self.threshold = threshold
        self.outside_prior = outside_prior
        self.backbone_id = backbone_id
        self.model: KeptModel | None = None
        self._head: SpeciesClassifier | None = None

    def refresh(self) -> KeptModel | None:
        """Load the kept global model when it is new or changed; returns the model in use (None: none yet)."""
        try:
            mtime = self.model_path.stat().st_mtime_ns
        except FileNotFoundError:
            return self.model
        if self.model is None or mtime != self.model.mtime_ns:
            model = KeptModel.load(self.model_path, backbone_id=self.backbone_id)
            if model is not None:
                self.model = model
                self._head = SpeciesClassifier(self.embedder, model.weights, class_names=self.class_names,
                                               model_hash=model.model_hash or None)
                log.info("field: classifying with the global model of round %d (%s)", model.round,
                         model.model_hash[:12])
        return self.model

    @property
    def classifier_hash(self) -> str:
        """``shared.codec.model_hash`` of the head in use, or ``""``."""
        return self._head.model_hash if self._head is not None else ""

    def read(self, probs: np.ndarray) -> Prediction:
        """:func:`~edge_sdk.field.predictions.read_prediction` with this site's settings."""
        return read_prediction(probs, self.site_classes, threshold=self.threshold, outside_prior=self.outside_prior)

    def embed(self, image: object, squares: list[Square]) -> np.ndarray:
        """float32 (n, 1280) backbone embeddings of the crops ``squares`` of ``image``."""
        if not squares:
            return np.zeros((0, EMBEDDING_DIM), np.float32)
        crops = [crop_square(image, s) for s in squares]  # type: ignore[arg-type]
        return np.asarray(self.embedder.embed_images(crops), dtype=np.float32)  # type: ignore[attr-defined]

    def classify(self, image: object, *, size: tuple[int, int] | None = None,
                 full: Callable[[], object] | None = None) -> list[ClassifiedBox]:
        """Detect and classify one decoded RGB photo; boxes most confident first.

        Args:
            image: the photo (``edge_sdk.data.crops.decode_rgb``), or the detector's reduced decode of it
                (``edge_sdk.inference.decode.open_for_detection``: then ``size`` and ``full`` are needed).
            size: the photo's own ``(width, height)``; None: ``image``'s size.
            full: returns the full decode (``decode_rgb``), called only when a box is to be classified: crops are
                always cut from the full pixels, as training cuts them. None: ``image`` is the full decode.

        Raises:
            ValueError: a reduced ``image`` without ``full``.
        """
        own = (image.width, image.height)  # type: ignore[attr-defined]
        width, height = own if size is None else (int(size[0]), int(size[1]))
        if (width, height) != own and full is None:
            raise ValueError(f"classify got a reduced decode ({own[0]}x{own[1]} of a {width}x{height} photo) "
                             "without `full`, the full decode the crops are cut from")
        found = (self.detector.detect([image]) if (width, height) == own  # type: ignore[attr-defined]
                 else self.detector.detect([image], [(width, height)]))  # type: ignore[attr-defined]
        raw = sorted(found[0], key=lambda b: -b.score)
        boxes = []
        for b in raw:
            bbox = stored_bbox(b.normalised_xywh(width, height))
            boxes.append(ClassifiedBox(bbox, float(b.score), bbox_square(bbox, width, height)))
        if not boxes or self._head is None:
            return boxes
        emb = self.embed(full() if full is not None else image, [b.square for b in boxes])
        probs = self._head.probabilities_from_embeddings(emb)
        return [ClassifiedBox(b.bbox, b.confidence, b.square, probs[i], self.read(probs[i]))
                for i, b in enumerate(boxes)]
