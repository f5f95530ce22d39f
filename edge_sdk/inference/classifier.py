"""The species classifier: the frozen backbone's embedding of each detector crop, then the federated head.

A detection box becomes the square the backbone sees (``shared.models.backbone.square_crop``: side max(w, h),
centred on the box, moved inside the image), the crop's RGB pixels are embedded by the public EfficientNet-Lite
backbone (Lite0 by default; :mod:`edge_sdk.inference.embedder`: TensorRT FP16 where present, ONNX Runtime
otherwise), and the head model of
``shared.models.head`` (phi adapter 1280 -> H, tanh; psi H -> K; or psi alone on the embedding) turns the
embedding into class logits. The output is the softmax over the model's K classes.

This is the same function the federation trains: the gateway's training data are embeddings of the same square
crops at the same input size (``edge_sdk.data.embedding_cache``), so ``backbone`` and ``input_size`` must be the
ones the head was trained at (default Lite0 at ``shared.models.backbone.DEFAULT_INPUT_SIZE``, 128 px). A model file
whose metadata names its backbone (``shared.models.backbone.BACKBONE_METADATA_KEY``: the gateway records its own
``backbone_id`` with the global model it keeps) is refused on another backbone (:func:`check_head_backbone`): a head
on another backbone's embeddings would name species at random, without any error.

Engines. The backbone is the only network that needs an engine: it lives in ONE engine cache slot per backbone and
input size, ``efficientnet_lite0_<S>px`` (:func:`engine_slot`), whatever the head's model version, because the
backbone never changes with a new global model (the engine key holds the ONNX file's SHA-256, so new backbone
weights rebuild the slot). The head is at most 1280 x 256 + 256 x K numbers: it runs as two numpy matrix products (float32), so a new
global model version costs no engine build at all. Files of the retired 28x28 camera CNN
(``camera_cnn-<model_hash12>.onnx`` and its engines) are deleted on the next open.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from shared.codec import decode_tensors, model_hash
from shared.errors import ConfigError, PayloadError
from shared.models.backbone import (BACKBONE_METADATA_KEY, DEFAULT_BACKBONE, DEFAULT_INPUT_SIZE, EMBEDDING_DIM,
                                    backbone_id, get_variant, parse_backbone_id, square_crop)
from shared.models.head import HeadConfig

from edge_sdk.inference.embedder import Embedder, OnnxEmbedder, engine_slot
from edge_sdk.inference.engines import EnginePreference
from edge_sdk.inference.weights import cache_dir

__all__ = ["engine_slot", "check_head_backbone", "load_classifier_weights", "head_logits", "crop",
           "SpeciesClassifier"]

log = logging.getLogger(__name__)

_LEGACY = re.compile(r"^camera_cnn(-[0-9a-f]{12})?\.(onnx|engine|engine\.json)$")


def _head_config(weights: Mapping[str, np.ndarray], source: object = None) -> HeadConfig:
    try:
        config = HeadConfig.from_weights(weights)
    except ValueError as exc:
        raise ConfigError(f"the species classifier needs a head model (phi.0.* adapter, psi.* head): {exc}",
                          source=source, field="weights",
                          fix="pass a global model of the head kind (shared.models.head); the 28x28 camera CNN "
                              "is retired") from None
    if config.embedding_dim != EMBEDDING_DIM:
        raise ConfigError(f"the head takes {config.embedding_dim}-d input but the backbone gives {EMBEDDING_DIM}",
                          source=source, field="weights", fix="train the head on EfficientNet-Lite embeddings (1280-d)")
    return config


def check_head_backbone(metadata: Mapping[str, str], expected: str, *, source: object = None) -> None:
    """Refuse a head model whose metadata names another backbone than ``expected``.

    Args:
        metadata: the model file's safetensors metadata; without :data:`BACKBONE_METADATA_KEY` nothing is checked
            (a model file from the coordinator or an older gateway records no backbone).
        expected: ``shared.models.backbone.backbone_id(backbone, input_size)`` of the embedder about to be used.

    Raises:
        ConfigError: field ``backbone``; the fix names the recorded backbone and input size.
    """
    recorded = metadata.get(BACKBONE_METADATA_KEY)
    if recorded is None or recorded == expected:
        return
    parsed = parse_backbone_id(recorded)
    fix = (f"classify with --backbone {parsed[0]} --input-size {parsed[1]} (site config: backbone: {parsed[0]}, "
           f"embedding_input_size: {parsed[1]}), the backbone every site of the federation uses"
           if parsed is not None else "classify with the backbone the model was trained on, or retrain it")
    raise ConfigError(f"the model's head was trained on the embeddings of {recorded}, but the embedder here is "
                      f"{expected}", source=source, field="backbone", fix=fix)


def load_classifier_weights(path: str | Path, *, backbone_id: str | None = None) -> dict[str, np.ndarray]:
    """Head-model weights (float32 arrays by name) from a safetensors file, a global model as the coordinator
    stores it or as the gateway keeps it.

    Args:
        backbone_id: when given, the file's recorded backbone (where it records one) must be this one
            (:func:`check_head_backbone`).

    Raises:
        ConfigError: unreadable file, tensors that are not a head model's (``shared.models.head``), or a model
            trained on another backbone.
    """
    try:
        tensors, metadata = decode_tensors(Path(path).read_bytes())
    except (OSError, PayloadError) as exc:
        raise ConfigError(f"cannot read classifier weights: {exc}", source=path, field="weights",
                          fix="pass a global model .safetensors file (psi.* and optionally phi.0.* tensors)") from exc
    weights = {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}
    _head_config(weights, source=path)
    if backbone_id is not None:
        check_head_backbone(metadata, backbone_id, source=path)
    return weights


def head_logits(weights: Mapping[str, np.ndarray], embeddings: np.ndarray) -> np.ndarray:
    """The head model's forward pass in numpy: ``psi(tanh(phi(x)))`` (or ``psi(x)`` without an adapter).

    Args:
        weights: head-model weights (``phi.0.weight`` (H, E), ``phi.0.bias`` (H,), ``psi.weight`` (K, H),
            ``psi.bias`` (K,); the phi tensors absent for head only).
        embeddings: float (B, E) backbone embeddings.

    Returns:
        float32 (B, K) logits; equal to ``shared.models.head.build_model`` in torch up to float32 rounding.

    Raises:
        ConfigError: not a head model. ValueError: embeddings of another shape.
    """
    config = _head_config(weights)
    x = np.asarray(embeddings, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != config.embedding_dim:
        raise ValueError(f"embeddings must be (B, {config.embedding_dim}), got {x.shape}")
    if config.has_adapter:
        x = np.tanh(x @ np.asarray(weights["phi.0.weight"], np.float32).T
                    + np.asarray(weights["phi.0.bias"], np.float32))
    return (x @ np.asarray(weights["psi.weight"], np.float32).T
            + np.asarray(weights["psi.bias"], np.float32)).astype(np.float32, copy=False)


def crop(image: Image.Image, box: tuple[float, float, float, float]) -> Image.Image:
    """The RGB square the backbone sees for ``box`` = ``(x1, y1, x2, y2)`` image pixels
    (``shared.models.backbone.square_crop``); degenerate boxes give at least one pixel.

    Raises:
        ValueError: a non-finite or reversed box.
    """
    left, top, right, bottom = square_crop(box, image.width, image.height)
    return image.crop((left, top, right, bottom)).convert("RGB")


def _remove_legacy(folder: Path) -> None:
    """Delete files of the retired camera CNN (``camera_cnn*.onnx|engine|engine.json``) in ``folder``."""
    if folder.is_dir():
        for path in folder.glob("camera_cnn*"):
            if _LEGACY.match(path.name):
                log.info("inference: removing %s (the retired 28x28 camera CNN)", path)
                path.unlink(missing_ok=True)


class SpeciesClassifier:
    """Softmax over the head model's classes for detector crops (module docstring).

    Args:
        embedder: the backbone embedder (``OnnxEmbedder`` on TensorRT / ONNX Runtime, or ``TorchEmbedder``); its
            ``input_size`` must be the head's training input size.
        weights: the head model's weights (a global model version).
        class_names: name of each class index (e.g. scientific names from the site's species table); missing
            or unnamed indices are called ``class_<i>``.
        model_hash: ``shared.codec.model_hash`` of the weights (recorded in each detection record); computed when
            not given.

    Raises:
        ConfigError: the weights are not a head model on 1280-d embeddings.
    """

    def __init__(self, embedder: Embedder, weights: Mapping[str, np.ndarray], *,
                 class_names: Mapping[int, str] | Sequence[str] | None = None, model_hash: str | None = None) -> None:
        self.config = _head_config(weights)
        self.weights = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
        names = dict(enumerate(class_names)) if isinstance(class_names, Sequence) else dict(class_names or {})
        self.embedder = embedder
        self.num_classes = self.config.num_classes
        self.class_names = {i: names.get(i) or f"class_{i}" for i in range(self.num_classes)}
        self.model_hash = model_hash if model_hash is not None else _hash(self.weights)

    @property
    def engine_name(self) -> str:
        """What runs the backbone (``tensorrt-fp16``, ``ort-cpu``, ``ort-cuda``, ``torch``); the head is numpy."""
        return self.embedder.name

    @property
    def classifier_id(self) -> str:
        """``head@<model hash 12>``: the classifier's name in MegaDetector ``info.classifier``."""
        return f"head@{self.model_hash[:12]}"

    @classmethod
    def from_weights(cls, weights: Mapping[str, np.ndarray], *,
                     class_names: Mapping[int, str] | Sequence[str] | None = None,
                     prefer: EnginePreference = "auto", threads: int | None = None,
                     input_size: int = DEFAULT_INPUT_SIZE, backbone: str = DEFAULT_BACKBONE,
                     embedder: Embedder | None = None, model_dir: str | Path | None = None,
                     engine_options: Mapping[str, object] | None = None) -> "SpeciesClassifier":
        """Open the backbone on the best engine here (slot :func:`engine_slot`) and bind the head ``weights``.

        Args:
            input_size: S of the backbone input the head was trained on.
            backbone: the backbone variant the head was trained on (``efficientnet-lite0``, ...).
            embedder: an already opened embedder to reuse (one backbone engine for many sites / model versions);
                it must be that backbone at that size.
            model_dir: the site's graph folder (site.yaml ``model_dir``: the bundle's backbone graph).
            engine_options: passed to :func:`~edge_sdk.inference.engines.open_engine` (``cache_root``,
                ``builder_factory``, ``gpu_probe``; tests).

        Raises:
            ConfigError: not a head model; an unknown backbone; an embedder of another backbone or size; the
                backbone's graph is not in ``model_dir`` or the cache and cannot be exported (no torch).
        """
        _head_config(weights)
        wanted = backbone_id(get_variant(backbone), input_size)
        options = dict(engine_options or {})
        _remove_legacy(cache_dir() / "classifier")
        _remove_legacy(Path(options["cache_root"]) if options.get("cache_root") else cache_dir() / "engines")
        if embedder is None:
            embedder = OnnxEmbedder.open(input_size, backbone=backbone, prefer=prefer, threads=threads,
                                         model_dir=model_dir, **options)
        elif embedder.input_size != input_size:
            raise ConfigError(f"the embedder takes {embedder.input_size} px input, the head wants {input_size} px",
                              field="input_size", fix="open the embedder at the head's training input size")
        elif embedder.backbone_id != wanted:
            raise ConfigError(f"the embedder computes {embedder.backbone_id}, the head wants {wanted}",
                              field="backbone", fix="open the embedder of the head's backbone")
        return cls(embedder, weights, class_names=class_names)

    def probabilities_from_embeddings(self, embeddings: np.ndarray) -> np.ndarray:
        """float64 (B, K) softmax probabilities of float (B, 1280) embeddings."""
        logits = head_logits(self.weights, embeddings).astype(np.float64)
        if len(logits) == 0:
            return np.zeros((0, self.num_classes))
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        return p / p.sum(axis=1, keepdims=True)

    def probabilities(self, crops: Sequence[Image.Image]) -> np.ndarray:
        """float64 (B, K) softmax probabilities of PIL crops (:func:`crop`, or whole already-cropped images)."""
        crops = list(crops)
        if not all(isinstance(c, Image.Image) for c in crops):
            raise ValueError("crops must be PIL images (edge_sdk.inference.classifier.crop of a detection box)")
        if not crops:
            return np.zeros((0, self.num_classes))
        return self.probabilities_from_embeddings(self.embedder.embed_images(crops))


def _hash(weights: Mapping[str, np.ndarray]) -> str:
    return model_hash(dict(weights))
