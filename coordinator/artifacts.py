"""ONNX Runtime training artifacts for each global model version (docs/ort.md; docs/architecture.md, "A round", step 2).

For a model version (weights of a :class:`shared.models.kinds.ModelSpec`: the head model on backbone embeddings,
``shared.models.head``, or the legacy camera CNN; told apart by the weights' names and shapes unless given) the
coordinator makes one *artifact set*, a flat mapping of file name to bytes that rides in the signed TASK payload
(``shared.protocol.encode_task``, uint8 tensors under ``artifact/``, each file's SHA-256 listed in
``TrainingTask.artifacts``):

====================  ==========================================================================================
``training_model.onnx``   forward + mean cross-entropy + gradient graph (``generate_artifacts``), outputs loss, logits
``eval_model.onnx``       forward + loss (and logits)
``optimizer_model.onnx``  ORT's SGD graph (shipped for completeness; the gateway applies its privatised step itself)
``checkpoint``            the model version's parameters (ORT checkpoint format)
``per_example_all.onnx``  one-pass per-example gradients of every parameter (``shared.models.onnx_export``)
``per_example_head.onnx`` one-pass per-example gradients of the head ``psi`` (frozen feature extractor)
``factors_all.onnx``      Linear-only models (the head model) only: per-layer inputs and output gradients, the
``factors_head.onnx``     factors of the per-example gradients (``export_factor_graph``), for every parameter / psi
``manifest.json``         format, model spec, number of classes, parameter names and shapes in layout order, which
                          file serves which scope, versions
====================  ==========================================================================================

The manifest's ``model`` (``ModelSpec.to_json``) and ``per_example_factors`` fields are optional additions to
format ``wildfed-ort-training/1``: a manifest without them is the camera CNN without factor graphs.

Graphs use opset 17 and IR version <= 10 (what ``onnxruntime-training`` 1.19.2 loads); they are made with torch's
TorchScript exporter (``dynamo=False``; no ``onnxscript``), so making artifacts needs torch and
``onnxruntime-training`` at the coordinator. Sets are cached by model hash, in memory and under
``<data_dir>/ort-artifacts/<model hash>/``; the per-example graphs depend only on the architecture and are made
once per model spec.
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

from shared.models.kinds import SCOPES, ModelSpec, spec_from_weights

__all__ = ["ARTIFACT_FORMAT", "ARTIFACT_FILES", "FACTOR_FILES", "ort_training_available", "build_artifacts",
           "ArtifactStore", "artifact_digests"]

log = logging.getLogger(__name__)

ARTIFACT_FORMAT = "wildfed-ort-training/1"
ARTIFACT_FILES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint",
                  "per_example_all.onnx", "per_example_head.onnx", "manifest.json")  # in every set
FACTOR_FILES = {"all": "factors_all.onnx", "head": "factors_head.onnx"}  # in sets of Linear-only models


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
def _per_example_graphs(spec: ModelSpec) -> dict[str, bytes]:
    """The graphs that depend only on the architecture (not the weights), made once per spec."""
    from shared.models.onnx_export import export_factor_graph, export_per_example_graph

    files = {f"per_example_{scope}.onnx": export_per_example_graph(spec, scope).SerializeToString()
             for scope in SCOPES}
    if spec.linear_only:
        files.update({FACTOR_FILES[scope]: export_factor_graph(spec, scope).SerializeToString() for scope in SCOPES})
    return files


def _resolve_spec(weights: Mapping[str, np.ndarray], num_classes: int | None, model: ModelSpec | None) -> ModelSpec:
    spec = model if model is not None else spec_from_weights(weights)
    if num_classes is not None and int(num_classes) != spec.num_classes:
        raise ValueError(f"num_classes {num_classes} disagrees with the model's {spec.num_classes} classes")
    return spec


def build_artifacts(weights: Mapping[str, np.ndarray], num_classes: int | None = None, *,
                    model: ModelSpec | None = None, model_hash: str = "") -> dict[str, bytes]:
    """The artifact set of one model version (see the module docstring).

    Args:
        weights: ``{name: float32 array}`` of the model (``phi.*``, ``psi.*``).
        num_classes: K, checked against the model's (None: the model's).
        model: the architecture; None infers it from the weights (``shared.models.kinds.spec_from_weights``).
        model_hash: recorded in the manifest (informational).

    Raises:
        ImportError: torch, onnx or onnxruntime-training missing.
        ValueError: the weights do not fit the model (``ConfigError``, a ValueError, where they fit no kind).
    """
    import onnx
    import onnxruntime
    from onnxruntime.training import artifacts as ort_artifacts

    from shared.models.onnx_export import LOGITS_NAME, MAX_IR_VERSION, OPSET, export_model

    spec = _resolve_spec(weights, num_classes, model)
    onnx_model = export_model(spec, weights)
    names = [init.name for init in onnx_model.graph.initializer]
    shapes = {init.name: [int(d) for d in init.dims] for init in onnx_model.graph.initializer}
    with tempfile.TemporaryDirectory(prefix="wildfed-ort-") as tmp, _native_stderr_silenced():
        ort_artifacts.generate_artifacts(onnx_model, requires_grad=names, frozen_params=[],
                                         loss=ort_artifacts.LossType.CrossEntropyLoss,
                                         optimizer=ort_artifacts.OptimType.SGD, artifact_directory=tmp,
                                         additional_output_names=[LOGITS_NAME])
        files = {name: (Path(tmp) / name).read_bytes()
                 for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint")}
    files.update(_per_example_graphs(spec))
    for name, data in files.items():
        if name.endswith(".onnx"):
            ir = onnx.load_from_string(data).ir_version
            if ir > MAX_IR_VERSION:  # pragma: no cover - a newer onnx/torch than pinned
                raise ValueError(f"{name} has IR version {ir} > {MAX_IR_VERSION}: onnxruntime 1.19 cannot load it; "
                                 "install onnx==1.17.0")
    manifest = {"format": ARTIFACT_FORMAT, "num_classes": spec.num_classes, "model": spec.to_json(),
                "model_hash": model_hash, "parameters": [[n, shapes[n]] for n in names], "opset": OPSET,
                "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
                "per_example": {"all": "per_example_all.onnx", "head": "per_example_head.onnx"}}
    if spec.linear_only:
        manifest["per_example_factors"] = dict(FACTOR_FILES)
    if [n for n, _ in spec.parameter_shapes()] != names:  # pragma: no cover - exporter renamed or reordered
        raise ValueError(f"exported parameter order {names} differs from the model's "
                         f"{[n for n, _ in spec.parameter_shapes()]}")
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

    def get(self, model_hash: str, weights: Mapping[str, np.ndarray], num_classes: int | None = None, *,
            model: ModelSpec | None = None) -> dict[str, bytes]:
        """The artifact set of the model version ``model_hash`` (made from ``weights`` if not cached).

        Args:
            model_hash: the version's hash (the cache key).
            weights: its tensors (only read when the set is made).
            num_classes: K, checked against the cached manifest and the model (None: not checked).
            model: the architecture (None: inferred from ``weights`` when made; a cached set of another model
                is not used).

        Raises:
            ImportError, ValueError: as :func:`build_artifacts`.
        """
        if model_hash in self._memory:
            self._memory.move_to_end(model_hash)
            return self._memory[model_hash]
        files = self._load(model_hash, num_classes, model)
        if files is None:
            files = build_artifacts(weights, num_classes, model=model, model_hash=model_hash)
            self._save(model_hash, files)
            log.info("artifacts: ORT training artifacts for model %s made (%d bytes)", model_hash[:12],
                     sum(len(v) for v in files.values()))
        self._memory[model_hash] = files
        while len(self._memory) > self._keep:
            self._memory.popitem(last=False)
        return files

    def _load(self, model_hash: str, num_classes: int | None, model: ModelSpec | None) -> dict[str, bytes] | None:
        if self._dir is None:
            return None
        folder = self._dir / model_hash
        if not all((folder / name).is_file() for name in ARTIFACT_FILES):
            return None
        files = {name: (folder / name).read_bytes() for name in ARTIFACT_FILES}
        try:
            manifest = json.loads(files["manifest.json"])
            spec = ModelSpec.from_json(manifest.get("model"), num_classes=manifest.get("num_classes"))
        except (json.JSONDecodeError, ValueError, TypeError, AttributeError):
            return None  # unreadable or foreign: made again
        if manifest.get("format") != ARTIFACT_FORMAT or (num_classes is not None
                                                          and manifest.get("num_classes") != num_classes):
            return None
        if model is not None and spec != model:
            return None
        extra = list((manifest.get("per_example_factors") or {}).values())
        if not all(isinstance(n, str) and n in FACTOR_FILES.values() and (folder / n).is_file() for n in extra):
            return None
        files.update({name: (folder / name).read_bytes() for name in extra})
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
