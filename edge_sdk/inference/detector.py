"""The camera-trap animal detector: YOLOX-tiny (zamba's MegadetectorLite weights) on ONNX Runtime or TensorRT.

Pipeline (each stage matches zamba 2.7.2's ``MegadetectorLiteYoloX``, the code the weights were trained for):

1. :func:`preprocess`: RGB, ``PIL.ImageOps.pad`` to 640x640 with bicubic resampling, anchored top-left
   (``centering=(0, 0)``), black fill; float32 0..255 (no normalisation); channels first (3, 640, 640). The
   scale is ``r = min(640 / W, 640 / H)``.
2. the exported graph (:func:`export_onnx`): raw head outputs (B, 8400, 6), see ``shared.models.yolox_tiny``.
3. :func:`postprocess` in numpy: decode anchor points (strides 8/16/32), score = objectness x class score, keep
   score >= 0.25, greedy NMS at IoU 0.45 (YOLOX's ``postprocess`` with torchvision's NMS: suppress IoU > 0.45),
   divide boxes by ``r`` and clip them to the image.

The ONNX file (``yolox_tiny-<checkpoint sha12>-opset17.onnx``, IR version <= 10 so ONNX Runtime 1.19 loads it;
:mod:`shared.models.gateway_graphs`) is found (:func:`detector_onnx`) in the site's ``model_dir`` (where
``install-bundle`` puts the graph the coordinator exported at provisioning: a gateway without torch needs nothing
else), else in the WildFed cache (``<cache>/detector/``), else exported there from the fetched checkpoint where torch
is installed. ``$WILDFED_DETECTOR_ONNX`` names a file to use instead (development override).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from shared.errors import ConfigError
from shared.models.gateway_graphs import MAX_IR_VERSION, OPSET, detector_graph_relpath, export_detector
from shared.models.yolox_tiny import INPUT_SIZE, NUM_CLASSES, WEIGHTS_FILE, decode_outputs

from edge_sdk.inference.engines import EnginePreference, InferenceEngine, open_engine
from edge_sdk.inference.weights import CHECKPOINT_SHA256, cache_dir, detector_checkpoint

__all__ = ["CONFIDENCE_THRESHOLD", "NMS_IOU_THRESHOLD", "CATEGORY", "DETECTOR_ID", "OPSET", "MAX_IR_VERSION",
           "Box", "preprocess", "box_iou", "nms", "postprocess", "export_onnx", "detector_onnx", "find_detector_onnx",
           "YoloxDetector"]

log = logging.getLogger(__name__)

CONFIDENCE_THRESHOLD = 0.25
NMS_IOU_THRESHOLD = 0.45
CATEGORY = "animal"
DETECTOR_ID = f"{Path(WEIGHTS_FILE).stem}@{CHECKPOINT_SHA256[:12]}"


@dataclass(frozen=True)
class Box:
    """One detection in original-image pixels: corners ``(x1, y1)``-``(x2, y2)`` (x1 <= x2, y1 <= y2, inside the
    image), ``score`` in [0, 1], detector ``class_index``."""

    x1: float
    y1: float
    x2: float
    y2: float
    score: float
    class_index: int = 0

    def normalised_xywh(self, width: int, height: int) -> tuple[float, float, float, float]:
        """MegaDetector / Camtrap DP box: ``(x_min / W, y_min / H, w / W, h / H)``, each in [0, 1]."""
        x, y = self.x1 / width, self.y1 / height
        w, h = (self.x2 - self.x1) / width, (self.y2 - self.y1) / height
        x, y = min(max(x, 0.0), 1.0), min(max(y, 0.0), 1.0)
        return (x, y, min(max(w, 0.0), 1.0 - x), min(max(h, 0.0), 1.0 - y))


def preprocess(image: Image.Image, size: int = INPUT_SIZE) -> tuple[np.ndarray, float]:
    """Detector input for one image.

    Returns:
        ``(x, ratio)``: float32 (3, size, size) RGB in 0..255, image scaled by ``ratio`` and padded top-left with
        black; ``ratio = min(size / W, size / H)`` maps input pixels back to the original (divide by it).
    """
    rgb = image.convert("RGB")
    padded = ImageOps.pad(rgb, (size, size), method=Image.Resampling.BICUBIC, color=None, centering=(0, 0))
    x = np.asarray(padded, dtype=np.float32).transpose(2, 0, 1)
    return np.ascontiguousarray(x), min(size / rgb.width, size / rgb.height)


def box_iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    """IoU of one ``[x1, y1, x2, y2]`` box with each of ``others`` (M, 4) (torchvision's definition, no +1)."""
    ix1 = np.maximum(box[0], others[:, 0])
    iy1 = np.maximum(box[1], others[:, 1])
    ix2 = np.minimum(box[2], others[:, 2])
    iy2 = np.minimum(box[3], others[:, 3])
    inter = np.clip(ix2 - ix1, 0, None) * np.clip(iy2 - iy1, 0, None)
    area = (box[2] - box[0]) * (box[3] - box[1])
    areas = (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1])
    union = area + areas - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def nms(boxes: np.ndarray, scores: np.ndarray, iou_threshold: float = NMS_IOU_THRESHOLD) -> np.ndarray:
    """Greedy non-maximum suppression.

    Args:
        boxes: (N, 4) ``[x1, y1, x2, y2]``.
        scores: (N,).
        iou_threshold: a box is dropped when its IoU with a kept, higher-scoring box is **greater** than this.

    Returns:
        int64 indices of the kept boxes, highest score first (ties: lower index first).
    """
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    order = np.lexsort((np.arange(len(scores)), -scores))
    keep: list[int] = []
    while order.size:
        i = int(order[0])
        keep.append(i)
        rest = order[1:]
        order = rest[box_iou(boxes[i], boxes[rest]) <= iou_threshold]
    return np.asarray(keep, dtype=np.int64)


def postprocess(raw: np.ndarray, *, ratio: float, width: int, height: int,
                confidence: float = CONFIDENCE_THRESHOLD, iou_threshold: float = NMS_IOU_THRESHOLD) -> list[Box]:
    """Boxes of one image from its raw head output (N, 5 + C) (see the module docstring, step 3).

    NMS is per class (YOLOX's ``batched_nms``); with the detector's one class that is plain NMS.
    """
    out = decode_outputs(raw[None])[0].astype(np.float64)
    class_scores = out[:, 5:]
    class_index = class_scores.argmax(axis=1)
    score = out[:, 4] * class_scores[np.arange(len(out)), class_index]
    mask = score >= confidence
    if not mask.any():
        return []
    out, score, class_index = out[mask], score[mask], class_index[mask]
    xyxy = np.stack([out[:, 0] - out[:, 2] / 2, out[:, 1] - out[:, 3] / 2,
                     out[:, 0] + out[:, 2] / 2, out[:, 1] + out[:, 3] / 2], axis=1)
    kept: list[int] = []
    for c in np.unique(class_index):
        idx = np.flatnonzero(class_index == c)
        kept.extend(idx[nms(xyxy[idx], score[idx], iou_threshold)].tolist())
    kept.sort(key=lambda i: (-score[i], i))
    boxes = []
    for i in kept:
        x1, y1, x2, y2 = (xyxy[i] / ratio).tolist()
        x1, x2 = min(max(x1, 0.0), float(width)), min(max(x2, 0.0), float(width))
        y1, y2 = min(max(y1, 0.0), float(height)), min(max(y2, 0.0), float(height))
        boxes.append(Box(x1, y1, x2, y2, float(min(max(score[i], 0.0), 1.0)), int(class_index[i])))
    return boxes


# ---- the ONNX file ------------------------------------------------------------------------------------------------

#: ``export_onnx(checkpoint, onnx_path, *, opset)``: export the detector (needs torch;
#: :func:`shared.models.gateway_graphs.export_detector`, shared with the coordinator's provisioning).
export_onnx = export_detector


def detector_onnx(*, download: bool = True, model_dir: str | Path | None = None) -> Path:
    """The detector ONNX file: ``$WILDFED_DETECTOR_ONNX`` if set, else ``<model_dir>/detector/<name>`` (the site's
    bundle), else ``<cache>/detector/<name>``, else exported into the cache from the (fetched) checkpoint (needs
    torch; checked before anything is downloaded).

    Raises:
        ConfigError: no graph is found and torch is missing (field ``model_dir``; the fix names the bundle).
        WeightsUnavailableError: the checkpoint cannot be fetched.
    """
    override = os.environ.get("WILDFED_DETECTOR_ONNX")
    if override:
        return Path(override).expanduser()
    found = find_detector_onnx(model_dir=model_dir)
    if found is not None:
        return found
    try:
        import torch  # noqa: F401 - only whether the export can run, before a 41 MB download
    except ImportError:
        where = f"{model_dir} (the site's model_dir) or {cache_dir()}" if model_dir is not None else str(cache_dir())
        raise ConfigError(f"no exported detector graph in {where}, and exporting one needs torch, which is not "
                          "installed here", field="model_dir" if model_dir is not None else "detector",
                          fix="reinstall the site's bundle (`wildfed-edge install-bundle --force`: it ships the "
                              "graph); for `wildfed-edge detect`, pass --config <prefix>/site.yaml; or install torch "
                              "here (`pip install 'wildfed[torch]'`)") from None
    return export_onnx(detector_checkpoint(download=download), cache_dir() / detector_graph_relpath())


def find_detector_onnx(*, model_dir: str | Path | None = None) -> Path | None:
    """``<model_dir>/detector/<name>`` or ``<cache>/detector/<name>``, whichever exists first; None if neither
    (``$WILDFED_DETECTOR_ONNX`` is not consulted: :func:`detector_onnx` does that)."""
    relpath = detector_graph_relpath()
    for root in ([Path(model_dir)] if model_dir is not None else []) + [cache_dir()]:
        if (root / relpath).is_file():
            return root / relpath
    return None


class YoloxDetector:
    """Runs YOLOX-tiny on PIL images.

    Args:
        engine: an engine for the detector ONNX file (:func:`~edge_sdk.inference.engines.open_engine`).
        confidence: minimum score (objectness x class) kept; default 0.25.
        iou_threshold: NMS IoU; default 0.45.
        batch_size: images per engine call (capped by the engine's ``max_batch``).
    """

    def __init__(self, engine: InferenceEngine, *, confidence: float = CONFIDENCE_THRESHOLD,
                 iou_threshold: float = NMS_IOU_THRESHOLD, batch_size: int = 8) -> None:
        if not 0.0 <= confidence <= 1.0 or not 0.0 < iou_threshold <= 1.0 or batch_size < 1:
            raise ValueError("confidence must be in [0, 1], iou_threshold in (0, 1], batch_size >= 1")
        self.engine = engine
        self.confidence = confidence
        self.iou_threshold = iou_threshold
        self.batch_size = min(batch_size, engine.max_batch or batch_size)
        self.detector_id = DETECTOR_ID
        self.num_classes = NUM_CLASSES

    @classmethod
    def open(cls, *, prefer: EnginePreference = "auto", batch_size: int = 8, threads: int | None = None,
             confidence: float = CONFIDENCE_THRESHOLD, download: bool = True,
             model_dir: str | Path | None = None) -> "YoloxDetector":
        """The detector from its ONNX file (:func:`detector_onnx`: the site's ``model_dir``, the cache, or fetched
        and exported on first use) on the best engine."""
        engine = open_engine(detector_onnx(download=download, model_dir=model_dir), name="yolox_tiny", prefer=prefer,
                             max_batch=batch_size, threads=threads)
        return cls(engine, confidence=confidence, batch_size=batch_size)

    def raw(self, images: Sequence[Image.Image]) -> tuple[np.ndarray, list[float]]:
        """Raw head outputs (B, 8400, 6) and each image's scale ratio."""
        inputs, ratios = zip(*(preprocess(im) for im in images)) if images else ((), ())
        outs = []
        for start in range(0, len(inputs), self.batch_size):
            outs.append(self.engine.run(np.stack(inputs[start:start + self.batch_size])))
        raw = np.concatenate(outs) if outs else np.zeros((0, 8400, 5 + NUM_CLASSES), np.float32)
        return raw, list(ratios)

    def detect(self, images: Sequence[Image.Image],
               sizes: Sequence[tuple[int, int]] | None = None) -> list[list[Box]]:
        """Boxes per image, most confident first (see :func:`postprocess`).

        Args:
            images: RGB images, each the photo itself or a reduced decode of it
                (:func:`edge_sdk.inference.decode.open_for_detection`).
            sizes: each photo's own ``(width, height)`` when ``images`` are reduced decodes; boxes are then in
                those pixels (scaled by ``width / image.width`` and ``height / image.height``). None: the images'
                own sizes.

        Raises:
            ValueError: ``sizes`` of another length than ``images``.
        """
        if sizes is not None and len(sizes) != len(images):
            raise ValueError(f"sizes must give one (width, height) per image: {len(sizes)} for {len(images)}")
        raw, ratios = self.raw(images)
        out = []
        for i, (r, ratio, im) in enumerate(zip(raw, ratios, images)):
            boxes = postprocess(r, ratio=ratio, width=im.width, height=im.height, confidence=self.confidence,
                                iou_threshold=self.iou_threshold)
            if sizes is not None and tuple(sizes[i]) != im.size:
                sx, sy = sizes[i][0] / im.width, sizes[i][1] / im.height
                boxes = [Box(b.x1 * sx, b.y1 * sy, b.x2 * sx, b.y2 * sy, b.score, b.class_index) for b in boxes]
            out.append(boxes)
        return out
