"""The species classifier: the federation's camera CNN (``shared.models.camera_cnn``) applied to detector crops.

Crops are prepared exactly as the training loader prepares records (``edge_sdk.data.camtrap_dp``): the box's pixels
of the original image, converted to 8-bit grayscale (Pillow ``"L"``, ITU-R 601-2 luma), resized to 28x28 with
bilinear filtering, scaled to [0, 1]. The output is the softmax over the model's classes.

The ONNX graph is written directly from the weights with ``onnx.helper`` (Conv, Tanh, MaxPool x 3, Flatten, Gemm,
Tanh, Gemm: the architecture in ``shared.models.camera_cnn``), so a gateway needs neither torch nor an exporter
to classify; the file is cached as ``<cache>/classifier/camera_cnn-<model_hash12>.onnx`` (the files of earlier
model versions are deleted when a new one is written). A test checks it against the torch model.

Its TensorRT engine lives in ONE cache slot, ``camera_cnn`` (:data:`ENGINE_SLOT`): a new global model version
rebuilds the slot's engine and replaces the old one (the engine key holds the ONNX file's SHA-256), so the engine
cache holds one classifier engine however many model versions the gateway has seen. Engines left by the earlier
naming, one slot per version (``camera_cnn-<model_hash12>.engine``), are deleted on the next open.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

from shared.codec import decode_tensors, model_hash
from shared.errors import ConfigError, PayloadError
from shared.models.camera_cnn import IMAGE_SIZE

from edge_sdk.inference.engines import EnginePreference, InferenceEngine, open_engine
from edge_sdk.inference.weights import cache_dir

if TYPE_CHECKING:  # pragma: no cover
    import onnx

__all__ = ["CLASSIFIER_OPSET", "ENGINE_SLOT", "load_classifier_weights", "build_classifier_onnx", "classifier_onnx",
           "crop", "SpeciesClassifier"]

log = logging.getLogger(__name__)

CLASSIFIER_OPSET = 17
#: The classifier's TensorRT engine cache slot (one engine, whatever the model version).
ENGINE_SLOT = "camera_cnn"
_VERSIONED = re.compile(r"^camera_cnn-[0-9a-f]{12}\.(onnx|engine|engine\.json)$")
_CONVS = ("phi.0", "phi.3", "phi.6")
_NAMES = {"phi.0.weight", "phi.0.bias", "phi.3.weight", "phi.3.bias", "phi.6.weight", "phi.6.bias",
          "phi.10.weight", "phi.10.bias", "psi.weight", "psi.bias"}


def load_classifier_weights(path: str | Path) -> dict[str, np.ndarray]:
    """Camera-CNN weights from a safetensors file (a global model as the coordinator stores it).

    Raises:
        ConfigError: unreadable file, or tensors that are not the camera CNN's.
    """
    try:
        tensors, _ = decode_tensors(Path(path).read_bytes())
    except (OSError, PayloadError) as exc:
        raise ConfigError(f"cannot read classifier weights: {exc}", source=path, field="weights",
                          fix="pass a global model .safetensors file (phi.* and psi.* tensors)") from exc
    _check(tensors, source=path)
    return {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}


def _check(weights: Mapping[str, np.ndarray], source: object = None) -> None:
    if set(weights) != _NAMES:
        raise ConfigError(f"tensors are not the camera CNN's: missing {sorted(_NAMES - set(weights))}, "
                          f"unexpected {sorted(set(weights) - _NAMES)}", source=source, field="weights",
                          fix="pass weights of shared.models.camera_cnn.build_model")


def build_classifier_onnx(weights: Mapping[str, np.ndarray]) -> "onnx.ModelProto":
    """The camera CNN as an ONNX graph: input ``images`` float32 (B, 1, 28, 28) in [0, 1], output ``logits``
    (B, num_classes). IR version 8, opset 17."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    _check(weights)
    w = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
    num_classes = int(w["psi.weight"].shape[0])
    nodes, inits = [], [numpy_helper.from_array(v, name=k) for k, v in w.items()]
    x = "images"
    for i, conv in enumerate(_CONVS):
        nodes += [helper.make_node("Conv", [x, f"{conv}.weight", f"{conv}.bias"], [f"c{i}"], kernel_shape=[3, 3],
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Tanh", [f"c{i}"], [f"t{i}"]),
                  helper.make_node("MaxPool", [f"t{i}"], [f"p{i}"], kernel_shape=[2, 2], strides=[2, 2])]
        x = f"p{i}"
    nodes += [helper.make_node("Flatten", [x], ["flat"], axis=1),
              helper.make_node("Gemm", ["flat", "phi.10.weight", "phi.10.bias"], ["fc"], transB=1),
              helper.make_node("Tanh", ["fc"], ["features"]),
              helper.make_node("Gemm", ["features", "psi.weight", "psi.bias"], ["logits"], transB=1)]
    graph = helper.make_graph(
        nodes, "camera_cnn",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 1, IMAGE_SIZE, IMAGE_SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", num_classes])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", CLASSIFIER_OPSET)],
                              producer_name="wildfed")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def classifier_onnx(weights: Mapping[str, np.ndarray]) -> Path:
    """The cached ONNX file of ``weights`` (written atomically on first use)."""
    import onnx

    target = cache_dir() / "classifier" / f"camera_cnn-{model_hash(weights)[:12]}.onnx"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".cnn-", suffix=".onnx")
    os.close(fd)
    try:
        onnx.save(build_classifier_onnx(weights), tmp)
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    _remove_versioned(target.parent, keep=target.name)
    return target


def _remove_versioned(folder: Path, keep: str | None = None) -> None:
    """Delete ``camera_cnn-<model_hash12>.*`` files of earlier model versions in ``folder`` (all but ``keep``)."""
    for path in folder.glob("camera_cnn-*"):
        if path.name != keep and _VERSIONED.match(path.name):
            log.info("inference: removing %s (an earlier classifier model version)", path)
            path.unlink(missing_ok=True)


def crop(image: Image.Image, box: tuple[float, float, float, float], size: int = IMAGE_SIZE) -> np.ndarray:
    """uint8 (size, size) grayscale crop of ``box`` = ``(x1, y1, x2, y2)`` pixels (at least one pixel wide)."""
    x1, y1 = int(np.floor(max(box[0], 0))), int(np.floor(max(box[1], 0)))
    x2 = int(np.ceil(min(box[2], image.width)))
    y2 = int(np.ceil(min(box[3], image.height)))
    x1, y1 = min(x1, image.width - 1), min(y1, image.height - 1)
    x2, y2 = max(x2, x1 + 1), max(y2, y1 + 1)
    region = image.crop((x1, y1, x2, y2)).convert("L").resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(region, dtype=np.uint8)


class SpeciesClassifier:
    """Softmax over the camera CNN's classes for grayscale crops.

    Args:
        engine: an engine for the classifier ONNX file.
        class_names: name of each class index (e.g. scientific names from the site's species table); missing
            or unnamed indices are called ``class_<i>``.
        model_hash: ``shared.codec.model_hash`` of the weights (recorded in each detection record).
    """

    def __init__(self, engine: InferenceEngine, *, num_classes: int,
                 class_names: Mapping[int, str] | Sequence[str] | None = None, model_hash: str = "") -> None:
        names = dict(enumerate(class_names)) if isinstance(class_names, Sequence) else dict(class_names or {})
        self.engine = engine
        self.num_classes = num_classes
        self.class_names = {i: names.get(i) or f"class_{i}" for i in range(num_classes)}
        self.model_hash = model_hash

    @classmethod
    def from_weights(cls, weights: Mapping[str, np.ndarray], *,
                     class_names: Mapping[int, str] | Sequence[str] | None = None,
                     prefer: EnginePreference = "auto", threads: int | None = None,
                     engine_options: Mapping[str, object] | None = None) -> "SpeciesClassifier":
        """Build (or reuse) the ONNX file of ``weights`` and open it on the best engine, in the engine cache slot
        :data:`ENGINE_SLOT` (module docstring).

        Args:
            engine_options: passed to :func:`~edge_sdk.inference.engines.open_engine` (``cache_root``,
                ``builder_factory``, ``gpu_probe``; tests).
        """
        options = dict(engine_options or {})
        path = classifier_onnx(weights)
        engine_root = Path(options["cache_root"]) if options.get("cache_root") else cache_dir() / "engines"
        if engine_root.is_dir():
            _remove_versioned(engine_root)  # per-version engines of the earlier naming
        engine = open_engine(path, name=ENGINE_SLOT, prefer=prefer, max_batch=64, threads=threads,
                             **options)  # type: ignore[arg-type]
        return cls(engine, num_classes=int(weights["psi.weight"].shape[0]), class_names=class_names,
                   model_hash=model_hash(weights))

    def probabilities(self, crops: np.ndarray) -> np.ndarray:
        """float64 (B, num_classes) softmax probabilities of uint8 crops (B, 28, 28)."""
        crops = np.asarray(crops)
        if crops.ndim != 3 or crops.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(f"expected crops (B, {IMAGE_SIZE}, {IMAGE_SIZE}), got {crops.shape}")
        if len(crops) == 0:
            return np.zeros((0, self.num_classes))
        x = crops.astype(np.float32)[:, None] / 255.0
        step = self.engine.max_batch or len(x)
        logits = np.concatenate([self.engine.run(x[i:i + step]) for i in range(0, len(x), step)]).astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)
