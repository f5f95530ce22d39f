"""The camera-trap animal detector: YOLOX-tiny (zamba's MegadetectorLite weights) on ONNX Runtime or TensorRT.

Pipeline (each stage matches zamba 2.7.2's ``MegadetectorLiteYoloX``, the code the weights were trained for):

1. :func:`preprocess`: RGB, ``PIL.ImageOps.pad`` to 640x640 with bicubic resampling, anchored top-left
   (``centering=(0, 0)``), black fill; float32 0..255 (no normalisation); channels first (3, 640, 640). The
   scale is ``r = min(640 / W, 640 / H)``.
2. the exported graph (:func:`export_onnx`): raw head outputs (B, 8400, 6), see ``shared.models.yolox_tiny``.
3. :func:`postprocess` in numpy: decode anchor points (strides 8/16/32), score = objectness x class score, keep
   score >= 0.25, greedy NMS at IoU 0.45 (YOLOX's ``postprocess`` with torchvision's NMS: suppress IoU > 0.45),
   divide boxes by ``r`` and clip them to the image.

The ONNX file is exported once from the checkpoint (needs torch) and cached by the checkpoint's SHA-256
(``<cache>/detector/yolox_tiny-<sha12>-opset17.onnx``, IR version <= 10 so ONNX Runtime 1.19 loads it); a gateway
without torch needs only that file (``$WILDFED_DETECTOR_ONNX``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from shared.errors import ConfigError
from shared.models.yolox_tiny import INPUT_SIZE, NUM_CLASSES, WEIGHTS_FILE, decode_outputs

from edge_sdk.inference.engines import EnginePreference, InferenceEngine, open_engine
from edge_sdk.inference.weights import CHECKPOINT_SHA256, cache_dir, detector_checkpoint

__all__ = ["CONFIDENCE_THRESHOLD", "NMS_IOU_THRESHOLD", "CATEGORY", "DETECTOR_ID", "OPSET", "MAX_IR_VERSION",
           "Box", "preprocess", "box_iou", "nms", "postprocess", "export_onnx", "detector_onnx", "YoloxDetector"]

log = logging.getLogger(__name__)

CONFIDENCE_THRESHOLD = 0.25
NMS_IOU_THRESHOLD = 0.45
CATEGORY = "animal"
DETECTOR_ID = f"{Path(WEIGHTS_FILE).stem}@{CHECKPOINT_SHA256[:12]}"
OPSET = 17
MAX_IR_VERSION = 10  # onnxruntime 1.19 reads IR <= 10


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

def export_onnx(checkpoint: str | Path, onnx_path: str | Path, *, opset: int = OPSET) -> Path:
    """Export YOLOX-tiny with the checkpoint's weights to ONNX (input ``images`` (B, 3, 640, 640), output
    ``output`` (B, 8400, 6), dynamic batch), written atomically.

    Raises:
        ConfigError: torch is missing (export needs it; run inference from an exported file instead).
        ValueError: the checkpoint does not load strictly.
    """
    try:
        import torch
    except ImportError as exc:
        raise ConfigError("exporting the detector to ONNX needs torch", field="detector",
                          fix="export once on a machine with torch and copy the file, setting "
                              "WILDFED_DETECTOR_ONNX to it") from exc
    import onnx

    from shared.models.yolox_tiny import load_weights

    model = load_weights(checkpoint)
    onnx_path = Path(onnx_path)
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=onnx_path.parent, prefix=".export-", suffix=".onnx")
    os.close(fd)
    try:
        with torch.no_grad():
            torch.onnx.export(model, (torch.zeros(1, 3, INPUT_SIZE, INPUT_SIZE),), tmp_name, dynamo=False,
                              input_names=["images"], output_names=["output"], opset_version=opset,
                              dynamic_axes={"images": {0: "batch"}, "output": {0: "batch"}},
                              do_constant_folding=True)
        proto = onnx.load(tmp_name)
        if proto.ir_version > MAX_IR_VERSION:
            proto.ir_version = MAX_IR_VERSION
        onnx.checker.check_model(proto)
        onnx.save(proto, tmp_name)
        os.replace(tmp_name, onnx_path)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
    log.info("detector: exported %s (IR %d, opset %d)", onnx_path, proto.ir_version, opset)
    return onnx_path


def detector_onnx(*, download: bool = True) -> Path:
    """The cached detector ONNX file, exporting it from the (fetched) checkpoint on first use.

    ``$WILDFED_DETECTOR_ONNX`` overrides the path (a gateway without torch).

    Raises:
        WeightsUnavailableError: the checkpoint cannot be fetched. ConfigError: torch is needed to export.
    """
    override = os.environ.get("WILDFED_DETECTOR_ONNX")
    if override:
        return Path(override).expanduser()
    target = cache_dir() / "detector" / f"yolox_tiny-{CHECKPOINT_SHA256[:12]}-opset{OPSET}.onnx"
    if target.is_file():
        return target
    return export_onnx(detector_checkpoint(download=download), target)


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
             confidence: float = CONFIDENCE_THRESHOLD, download: bool = True) -> "YoloxDetector":
        """The detector from the cached ONNX file (fetched and exported on first use) on the best engine."""
        engine = open_engine(detector_onnx(download=download), name="yolox_tiny", prefer=prefer,
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

    def detect(self, images: Sequence[Image.Image]) -> list[list[Box]]:
        """Boxes per image, most confident first (see :func:`postprocess`)."""
        raw, ratios = self.raw(images)
        return [postprocess(r, ratio=ratio, width=im.width, height=im.height, confidence=self.confidence,
                            iou_threshold=self.iou_threshold)
                for r, ratio, im in zip(raw, ratios, images)]
