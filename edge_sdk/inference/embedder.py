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

The file is named by the backbone's identity (``<variant>-<weights sha12>-p<preprocess version>-<S>px-opset17.onnx``,
e.g. ``efficientnet-lite1-77cc7160d37b-p1-240px-opset17.onnx``; :mod:`shared.models.gateway_graphs`) and found
(:func:`find_embedder_onnx`) in the site's ``model_dir`` (where ``install-bundle`` puts the graph the coordinator
exported at provisioning: a gateway without torch needs nothing else), else in the WildFed cache, else exported into
the cache where torch is installed. ``$WILDFED_BACKBONE_ONNX`` names a file to use instead of all of these (a
development override, checked against the requested size and, where the file names one, backbone). Its engine cache
slot is :func:`engine_slot` (``efficientnet_lite0_128px``): one slot per backbone and size.

Two embedders share one interface (:class:`Embedder`: ``input_size``, ``backbone_id``, ``embed``,
``embed_images``): :class:`OnnxEmbedder` on an inference engine, :class:`TorchEmbedder` on the torch module.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from shared.errors import ConfigError
from shared.models.backbone import (DEFAULT_BACKBONE, EMBEDDING_DIM, BackboneVariant, backbone_id, get_variant,
                                    preprocess_image)
from shared.models.gateway_graphs import (BACKBONE_ID_KEY, BACKBONE_INPUT, BACKBONE_OUTPUT, MAX_IR_VERSION, OPSET,
                                          backbone_graph_relpath, export_backbone)

from edge_sdk.inference.engines import EnginePreference, InferenceEngine, open_engine
from edge_sdk.inference.weights import cache_dir

if TYPE_CHECKING:  # pragma: no cover
    from PIL import Image

__all__ = ["OPSET", "MAX_IR_VERSION", "INPUT_NAME", "OUTPUT_NAME", "BACKBONE_ID_KEY", "DEFAULT_MAX_BATCH", "Embedder",
           "engine_slot", "export_onnx", "embedder_onnx", "find_embedder_onnx", "onnx_input_size", "onnx_backbone_id",
           "OnnxEmbedder", "TorchEmbedder"]

log = logging.getLogger(__name__)

INPUT_NAME = BACKBONE_INPUT
OUTPUT_NAME = BACKBONE_OUTPUT
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

#: ``export_onnx(onnx_path, input_size, *, backbone, weights)``: export the embedder (needs torch;
#: :func:`shared.models.gateway_graphs.export_backbone`, shared with the coordinator's provisioning).
export_onnx = export_backbone


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


def find_embedder_onnx(input_size: int, backbone: str | BackboneVariant = DEFAULT_BACKBONE, *,
                       model_dir: str | Path | None = None) -> Path | None:
    """The embedder ONNX file of ``backbone`` at ``input_size`` where it already is, without exporting: the
    override ``$WILDFED_BACKBONE_ONNX`` (checked, see :func:`embedder_onnx`), else ``<model_dir>/backbone/<name>``
    (the bundle's graph), else ``<cache>/backbone/<name>``; None when none of them has it.

    Raises:
        ConfigError: the override's input size or backbone differs, or it is no embedder; an unknown backbone.
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
    relpath = backbone_graph_relpath(variant, size)
    for root in ([Path(model_dir)] if model_dir is not None else []) + [cache_dir()]:
        if (root / relpath).is_file():
            return root / relpath
    return None


def embedder_onnx(input_size: int, backbone: str | BackboneVariant = DEFAULT_BACKBONE, *,
                  model_dir: str | Path | None = None) -> Path:
    """The embedder ONNX file for ``backbone`` at ``input_size`` (:func:`find_embedder_onnx`), exported into the
    WildFed cache on first use where none is found (needs torch then).

    ``$WILDFED_BACKBONE_ONNX`` names a file to use instead (development and tests); its input size must equal
    ``input_size``, and its recorded backbone id (:func:`onnx_backbone_id`), where it has one, must be
    ``backbone_id(backbone, input_size)``.

    Raises:
        ConfigError: the override's input size or backbone differs; no graph is found and torch is missing to
            export one (field ``model_dir``; the fix names the bundle).
        shared.models.backbone.BackboneWeightsError: the weights are missing or altered.
    """
    size = _check_size(input_size)
    variant = get_variant(backbone)
    found = find_embedder_onnx(size, variant, model_dir=model_dir)
    if found is not None:
        return found
    target = cache_dir() / backbone_graph_relpath(variant, size)
    try:
        return export_onnx(target, size, backbone=variant)
    except ConfigError as exc:
        where = f"{model_dir} (the site's model_dir) or {cache_dir()}" if model_dir is not None else str(cache_dir())
        raise ConfigError(f"no exported graph of the backbone {variant.name} at {size} px in {where}, and "
                          f"{exc.message}", field="model_dir" if model_dir is not None else "backbone",
                          fix="reinstall the site's bundle (`wildfed-edge install-bundle --force`); a bundle ships the "
                              f"graph of the backbone and size it was provisioned for (`wildfed-coordinator provision "
                              f"--backbone {variant.name} --embedding-input-size {size}`), so set site.yaml's "
                              "`backbone` and `embedding_input_size` back to those, or install torch here "
                              "(`pip install 'wildfed[torch]'`)") from exc


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
             model_dir: str | Path | None = None, **engine_options) -> "OnnxEmbedder":
        """The embedder of ``backbone`` at ``input_size`` on the best engine here, in the engine slot
        :func:`engine_slot` (the ONNX file is exported on first use).

        Args:
            backbone: the variant (default Lite0).
            prefer: ``auto`` (TensorRT FP16 when a GPU and TensorRT are present, else ONNX Runtime), ``tensorrt``
                or ``ort``.
            batch_size: also the TensorRT profile's largest batch.
            threads: ONNX Runtime intra-op threads (None: ORT decides).
            model_dir: the site's graph folder (site.yaml ``model_dir``), searched first (:func:`embedder_onnx`).
            engine_options: passed to ``engines.open_engine`` (``cache_root``, ``builder_factory``,
                ``gpu_probe``).
        """
        size = _check_size(input_size)
        engine = open_engine(embedder_onnx(size, backbone, model_dir=model_dir), name=engine_slot(size, backbone),
                             prefer=prefer, max_batch=batch_size, threads=threads, **engine_options)
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
