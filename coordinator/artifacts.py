"""ONNX Runtime training artifacts for each global model version (DESIGN.md "Data flow" step 2; issue 3).

For a model version (weights + number of classes) the coordinator makes one *artifact set*, a flat mapping of file
name to bytes that rides in the signed TASK payload (``shared.protocol.encode_task``, uint8 tensors under
``artifact/``, each file's SHA-256 listed in ``TrainingTask.artifacts``):

====================  ==========================================================================================
``training_model.onnx``   forward + mean cross-entropy + gradient graph (``generate_artifacts``), outputs loss, logits
``eval_model.onnx``       forward + loss (and logits)
``optimizer_model.onnx``  ORT's SGD graph (shipped for completeness; the gateway applies its privatised step itself)
``checkpoint``            the model version's parameters (ORT checkpoint format)
``per_example_all.onnx``  one-pass per-example gradients of every parameter (``shared.models.onnx_export``)
``per_example_head.onnx`` one-pass per-example gradients of the head ``psi`` (frozen feature extractor)
``manifest.json``         format, number of classes, parameter names and shapes in layout order, versions
====================  ==========================================================================================

Graphs use opset 17 and IR version <= 10 (what ``onnxruntime-training`` 1.19.2 loads); they are made with torch's
TorchScript exporter (``dynamo=False``; no ``onnxscript``), so making artifacts needs torch and
``onnxruntime-training`` at the coordinator. Sets are cached by model hash, in memory and under
``<data_dir>/ort-artifacts/<model hash>/``; the per-example graphs depend only on the architecture and are made
once per number of classes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

__all__ = ["ARTIFACT_FORMAT", "ARTIFACT_FILES", "ort_training_available", "build_artifacts", "ArtifactStore",
           "artifact_digests"]

log = logging.getLogger(__name__)

ARTIFACT_FORMAT = "wildfed-ort-training/1"
ARTIFACT_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint",
                  "per_example_all.onnx", "per_example_head.onnx", "manifest.json")


@functools.lru_cache(maxsize=1)
def ort_training_available() -> bool:
    """Whether this machine can make artifacts (``onnxruntime.training.artifacts`` and ``onnx`` import)."""
    try:
        import onnx  # noqa: F401
        from onnxruntime.training import artifacts  # noqa: F401
    except Exception:  # noqa: BLE001 - missing package or a broken native library: both mean "cannot"
        return False
    return True


def artifact_digests(files: Mapping[str, bytes]) -> dict[str, str]:
    """``{file name: hex SHA-256}``, what ``TrainingTask.artifacts`` lists."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """ORT's gradient builder logs every graph transformer at INFO level straight to file descriptor 2 and offers
    no switch for it; send fd 2 to /dev/null meanwhile (Python exceptions still propagate)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (some test runners): nothing to silence
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


@functools.lru_cache(maxsize=8)
def _per_example_graphs(num_classes: int) -> dict[str, bytes]:
    from shared.models.onnx_export import export_per_example_graph

    return {f"per_example_{scope}.onnx": export_per_example_graph(num_classes, scope).SerializeToString()
            for scope in ("all", "head")}


def build_artifacts(weights: Mapping[str, np.ndarray], num_classes: int, *, model_hash: str = "") -> dict[str, bytes]:
    """The artifact set of one model version (see the module docstring).

    Args:
        weights: ``{name: float32 array}`` of the camera CNN (``phi.*``, ``psi.*``).
        num_classes: K.
        model_hash: recorded in the manifest (informational).

    Raises:
        ImportError: torch, onnx or onnxruntime-training missing.
        ValueError: the weights do not fit the model.
    """
    import onnx
    import onnxruntime
    from onnxruntime.training import artifacts as ort_artifacts

    from shared.models.onnx_export import LOGITS_NAME, MAX_IR_VERSION, OPSET, export_model

    model = export_model(int(num_classes), weights)
    names = [init.name for init in model.graph.initializer]
    shapes = {init.name: [int(d) for d in init.dims] for init in model.graph.initializer}
    with tempfile.TemporaryDirectory(prefix="wildfed-ort-") as tmp, _native_stderr_silenced():
        ort_artifacts.generate_artifacts(model, requires_grad=names, frozen_params=[],
                                         loss=ort_artifacts.LossType.CrossEntropyLoss,
                                         optimizer=ort_artifacts.OptimType.SGD, artifact_directory=tmp,
                                         additional_output_names=[LOGITS_NAME])
        files = {name: (Path(tmp) / name).read_bytes()
                 for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")}
    files.update(_per_example_graphs(int(num_classes)))
    for name, data in files.items():
        if name.endswith(".onnx"):
            ir = onnx.load_from_string(data).ir_version
            if ir > MAX_IR_VERSION:  # pragma: no cover - a newer onnx/torch than pinned
                raise ValueError(f"{name} has IR version {ir} > {MAX_IR_VERSION}: onnxruntime 1.19 cannot load it; "
                                 "install onnx==1.17.0")
    manifest = {"format": ARTIFACT_FORMAT, "num_classes": int(num_classes), "model_hash": model_hash,
                "parameters": [[n, shapes[n]] for n in names], "opset": OPSET,
                "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
                "per_example": {"all": "per_example_all.onnx", "head": "per_example_head.onnx"}}
    files["manifest.json"] = json.dumps(manifest, sort_keys=True).encode()
    return files


class ArtifactStore:
    """Artifact sets keyed by model hash: made on first request, then served from memory or disk.

    Args:
        directory: where sets are kept (``<directory>/<model hash>/<file>``); None keeps them in memory only.
        keep_in_memory: how many recent sets to hold in memory.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None, *, keep_in_memory: int = 4) -> None:
        self._dir = Path(directory) if directory is not None else None
        self._memory: OrderedDict[str, dict[str, bytes]] = OrderedDict()
        self._keep = max(1, int(keep_in_memory))

    def get(self, model_hash: str, weights: Mapping[str, np.ndarray], num_classes: int) -> dict[str, bytes]:
        """The artifact set of the model version ``model_hash`` (made from ``weights`` if not cached).

        Raises:
            ImportError, ValueError: as :func:`build_artifacts`.
        """
        if model_hash in self._memory:
            self._memory.move_to_end(model_hash)
            return self._memory[model_hash]
        files = self._load(model_hash, num_classes)
        if files is None:
            files = build_artifacts(weights, num_classes, model_hash=model_hash)
            self._save(model_hash, files)
            log.info("artifacts: ORT training artifacts for model %s made (%d bytes)", model_hash[:12],
                     sum(len(v) for v in files.values()))
        self._memory[model_hash] = files
        while len(self._memory) > self._keep:
            self._memory.popitem(last=False)
        return files

    def _load(self, model_hash: str, num_classes: int) -> dict[str, bytes] | None:
        if self._dir is None:
            return None
        folder = self._dir / model_hash
        if not all((folder / name).is_file() for name in ARTIFACT_FILES):
            return None
        files = {name: (folder / name).read_bytes() for name in ARTIFACT_FILES}
        try:
            manifest = json.loads(files["manifest.json"])
        except json.JSONDecodeError:
            return None
        if manifest.get("format") != ARTIFACT_FORMAT or manifest.get("num_classes") != num_classes:
            return None
        return files

    def _save(self, model_hash: str, files: Mapping[str, bytes]) -> None:
        if self._dir is None:
            return
        folder = self._dir / model_hash
        staging = self._dir / f".{model_hash}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name, data in files.items():
            (staging / name).write_bytes(data)
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)  # a reader never sees a half-written set
