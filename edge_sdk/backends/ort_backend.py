"""ONNX Runtime training backend: the camera model trained from the coordinator's artifacts, without torch.

The coordinator ships, per model version, ONNX Runtime training artifacts and two one-pass per-example gradient
graphs (``coordinator.artifacts``; the graphs are explained in ``shared.models.onnx_export``). This backend runs
them with ``onnxruntime-training`` (x86_64 wheels: ``pip install 'wildfed[edge-ort]'``) and never imports torch.

What runs where (measured choices, docs/ort.md):

- **Which model**: the artifact manifest names it (``"model"``: a :class:`shared.models.kinds.ModelSpec`, the head
  model on backbone embeddings or the legacy camera CNN; a manifest without one is the camera CNN). Inputs are
  prepared as that kind takes them (float32 (B, 1280) embeddings for the head model). A backend built with
  ``model=...`` refuses artifacts of another model.
- **DP step** (:meth:`OrtBackend.per_example`): one ``InferenceSession.run`` per micro-batch of an exported
  one-pass graph, fed the backend's current parameters as graph inputs (the explicit backward of
  ``shared.models.onnx_export``). For a model whose trainable layers are all Linear (the head model) the factor graph
  gives each layer's inputs and output gradients, and :class:`~edge_sdk.backends.factored.LinearFactors` forms norms
  and clipped sums from them without the (B, d) matrix; otherwise (the camera CNN) the per-example graph's rows are
  the gradients themselves (:class:`~edge_sdk.privacy.per_example.MaterialisedGradients`). Either way they go to the
  backend-agnostic CCDP mechanism (``edge_sdk.privacy.ccdp``): the clipping, noise and accounting code is the torch
  backend's, not a copy. With ``scope="head"`` (frozen feature extractor) the graphs give only the head's
  gradients: the outer product of ``softmax - onehot`` with the features.
- **Non-private step** (:meth:`OrtBackend.gradient`): the ORT training graph (``Module.train_step`` on the mean
  cross-entropy) and the gradient buffers of its ``CheckpointState``.
- **Update** (:meth:`OrtBackend.apply_gradient`): ``theta <- theta - lr * g`` on the backend's float32 parameter
  buffer (the privatised gradient comes from outside the graph, so ORT's optimizer graph, which reads the module's
  own gradient buffers, is not used); the buffer is copied into the training module
  (``Module.copy_buffer_to_parameters``) before the next use of the training or eval graph.

The parameter buffer is one float32 vector in the manifest's order (``model.named_parameters()`` order, the same as
the torch backend's layout), checked against the order of the training module's contiguous parameter buffer when
artifacts are loaded.

ONNX Runtime 1.19's Python package imports torch where it can and fails in ``onnxruntime/training/__init__.py``
where it cannot; :func:`import_onnxruntime` imports just what the backend needs, so the backend works on a gateway
without torch and stays torch-free on one that has it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import numpy as np

from shared.errors import ConfigError

from shared.models.head import input_layer_prefix
from shared.models.kinds import SCOPES, ModelSpec, as_spec

from edge_sdk.backends.base import ParameterSpec, TrainingBackend, checked_weights, register_backend
from edge_sdk.backends.factored import LinearFactors
from edge_sdk.privacy.per_example import MaterialisedGradients, PerExampleGradients

__all__ = ["OrtBackend", "ArtifactCache", "import_onnxruntime", "ort_training_importable", "ARTIFACT_FORMAT"]

log = logging.getLogger(__name__)

ARTIFACT_FORMAT = "wildfed-ort-training/1"  # coordinator.artifacts.ARTIFACT_FORMAT (the two sides meet on the wire)
_REQUIRED_FILES = ("training_model.onnx", "eval_model.onnx", "checkpoint", "manifest.json")
_INPUT, _LABELS = "input", "labels"


def import_onnxruntime() -> tuple[ModuleType, ModuleType]:
    """``(onnxruntime, onnxruntime.training.api)``, imported without importing torch.

    Two things in onnxruntime-training 1.19.2 pull torch: ``import onnxruntime`` probes for ``ORTModule`` (which
    imports torch wherever it is installed: ~1.5 s and hundreds of MB), and ``onnxruntime/training/__init__.py``
    imports ``optim``, which needs torch, so on a gateway *without* torch ``import onnxruntime.training`` fails
    although the on-device training API (``onnxruntime.training.api``) needs only the native library. So, unless
    torch is already imported: torch is marked absent (``sys.modules["torch"] = None``) during the import, and if
    the package ``__init__`` fails for want of it, ``onnxruntime.training`` is registered as a bare package (its
    ``__init__`` not run) and ``onnxruntime.training.api`` is imported from it.

    Raises:
        ImportError: onnxruntime-training is not installed (or its native library does not load).
    """
    if "onnxruntime.training.api" in sys.modules:
        return sys.modules["onnxruntime"], sys.modules["onnxruntime.training.api"]
    if sys.modules.get("torch") is not None:  # torch already imported: nothing to save, the ordinary import
        return importlib.import_module("onnxruntime"), importlib.import_module("onnxruntime.training.api")
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # type: ignore[assignment]  # "import torch" now raises ModuleNotFoundError
    try:
        ort = importlib.import_module("onnxruntime")
        try:
            api = importlib.import_module("onnxruntime.training.api")
        except ImportError:
            spec = importlib.util.find_spec("onnxruntime.training")
            if spec is None or spec.submodule_search_locations is None:
                raise
            package = importlib.util.module_from_spec(spec)  # bare package: __init__ (needs torch) not run
            sys.modules["onnxruntime.training"] = package
            try:
                api = importlib.import_module("onnxruntime.training.api")
            except ImportError:
                sys.modules.pop("onnxruntime.training", None)
                raise
            setattr(ort, "training", package)
            log.debug("onnxruntime.training registered without its torch-dependent __init__")
    finally:
        if blocked and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return ort, api


def ort_training_importable() -> bool:
    """Whether ``onnxruntime.training`` imports here (torch stays unimported)."""
    try:
        import_onnxruntime()
    except Exception:  # noqa: BLE001 - missing wheel, wrong platform, broken native library: all mean "not here"
        return False
    return True


class ArtifactCache:
    """ORT training artifact sets on the gateway's disk, one folder per model hash (``<root>/<model hash>/``).

    Args:
        root: the cache folder (created on first store).
        keep: how many model versions to keep (older folders are removed on store).
    """

    def __init__(self, root: str | os.PathLike[str], *, keep: int = 3) -> None:
        self.root = Path(root)
        self._keep = max(1, int(keep))

    def path(self, model_hash: str) -> Path | None:
        """The folder of ``model_hash`` if a complete set is cached, else None."""
        folder = self.root / _checked_hash(model_hash)
        return folder if all((folder / f).is_file() for f in _REQUIRED_FILES) else None

    def store(self, model_hash: str, files: Mapping[str, bytes]) -> Path:
        """Write ``files`` (already verified against the signed task) for ``model_hash``; returns the folder.

        Raises:
            ConfigError: a file name is not a plain name, or a required file is missing.
        """
        folder = self.root / _checked_hash(model_hash)
        missing = [f for f in _REQUIRED_FILES if f not in files]
        if missing:
            raise ConfigError(f"ORT artifact set lacks {missing}", field="artifacts",
                              fix="let the coordinator ship complete sets (coordinator.artifacts)")
        existing = self.path(model_hash)
        if existing is not None and all((existing / n).is_file() and (existing / n).read_bytes() == d
                                        for n, d in files.items()):
            return existing
        staging = self.root / f".{folder.name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for name, data in files.items():
            if "/" in name or "\\" in name or name.startswith(".") or not name:
                raise ConfigError(f"artifact name {name!r} is not a plain file name", field="artifacts")
            (staging / name).write_bytes(data)
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
        os.utime(folder)
        self._evict()
        return folder

    def _evict(self) -> None:
        folders = sorted((p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                         key=lambda p: p.stat().st_mtime, reverse=True)
        for old in folders[self._keep:]:
            shutil.rmtree(old, ignore_errors=True)


def _checked_hash(model_hash: str) -> str:
    if not (isinstance(model_hash, str) and len(model_hash) == 64 and all(c in "0123456789abcdef" for c in model_hash)):
        raise ConfigError(f"model hash {model_hash!r} is not a hex SHA-256", field="model_hash")
    return model_hash


@register_backend("ort")
class OrtBackend(TrainingBackend):
    """:class:`~edge_sdk.backends.base.TrainingBackend` over ONNX Runtime training artifacts (module docstring).

    Args:
        num_classes: model output size (must match the artifacts' manifest; None: take the manifest's).
        model: the expected model (a :class:`~shared.models.kinds.ModelSpec` or a kind name); artifacts of another
            model are refused. None accepts the artifacts' model (its kind and options come from the manifest).
        model_options: the kind's options with a kind name (e.g. ``{"adapter_width": 256}``).
        threads: ONNX Runtime intra-op threads (None: ORT's default).
        device: ``"cpu"`` only (``onnxruntime-training-cpu``).
        microbatch_size: per-example gradients are computed this many examples at a time (memory cap:
            about ``microbatch_size * d * 4`` bytes per chunk, plus the graph's activations).
        artifacts: a folder holding an artifact set (``coordinator.artifacts``), or None to load one later with
            :meth:`load_artifacts` (the agent does so per task).
        scope: ``"all"`` trains every parameter; ``"head"`` trains the head ``psi`` only (frozen feature extractor).

    Raises:
        ConfigError: onnxruntime-training missing, a device other than cpu, a bad scope, model or artifact set.
    """

    name = "ort"

    def __init__(self, num_classes: int | None = None, *, model: ModelSpec | str | None = None,
                 model_options: dict[str, object] | None = None, threads: int | None = None, device: str = "cpu",
                 microbatch_size: int = 256, artifacts: str | os.PathLike[str] | None = None,
                 scope: str = "all") -> None:
        if device != "cpu":
            raise ConfigError(f"the ort backend runs on cpu only, got device {device!r}", field="device",
                              fix="set device: cpu, or backend: torch for a GPU")
        if scope not in SCOPES:
            raise ConfigError(f"scope must be 'all' or 'head', got {scope!r}", field="scope")
        self._expected = as_spec(model, num_classes, model_options) if model is not None else None
        try:
            self._ort, self._api = import_onnxruntime()
        except ImportError as exc:
            raise ConfigError(f"onnxruntime-training cannot be imported: {exc}", field="backend",
                              fix="pip install 'wildfed[edge-ort]' (x86_64), or use backend: torch") from exc
        self._num_classes = None if num_classes is None else int(num_classes)
        self._threads = threads
        self._microbatch = int(microbatch_size)
        self._scope = scope
        self._folder: Path | None = None
        self._digest: str | None = None
        self._layout: tuple[ParameterSpec, ...] = ()
        self._spec: ModelSpec | None = None
        if artifacts is not None:
            self.load_artifacts(artifacts)

    # -- artifacts -----------------------------------------------------------------------------------------------
    @property
    def artifacts_folder(self) -> Path | None:
        """The folder of the loaded artifact set (None before :meth:`load_artifacts`)."""
        return self._folder

    def load_artifacts(self, folder: str | os.PathLike[str]) -> None:
        """Load an artifact set; keeps the current weights if the graphs and parameter names are unchanged.

        The model (kind and options) is the manifest's ``model`` (absent: the camera CNN); where the manifest lists
        factor graphs (Linear-only models) the DP step uses them (:meth:`per_example`).

        Raises:
            ConfigError: missing files (a listed factor graph included), another format, another number of classes,
                another model than the backend was built for (``model=``), or a module whose parameter order
                differs from the manifest's.
        """
        folder = Path(folder)
        missing = [f for f in _REQUIRED_FILES if not (folder / f).is_file()]
        if missing:
            raise ConfigError(f"ORT artifact folder {folder} lacks {missing}", field="artifacts",
                              fix="the coordinator must ship artifacts (ship_ort_artifacts: true)")
        manifest = json.loads((folder / "manifest.json").read_text())
        if manifest.get("format") != ARTIFACT_FORMAT:
            raise ConfigError(f"artifact format {manifest.get('format')!r}, expected {ARTIFACT_FORMAT!r}",
                              field="artifacts", fix="update the gateway SDK or the coordinator")
        if self._num_classes is not None and manifest.get("num_classes") != self._num_classes:
            raise ConfigError(f"artifacts are for {manifest.get('num_classes')} classes, the site has "
                              f"{self._num_classes}", field="num_classes",
                              fix="use the same number of classes on both sides")
        spec = ModelSpec.from_json(manifest.get("model"), num_classes=int(manifest.get("num_classes", 0)))
        if self._expected is not None and spec != self._expected:
            raise ConfigError(f"artifacts are for model {spec.to_json()}, this backend was built for "
                              f"{self._expected.to_json()}", field="model",
                              fix="use the same model kind and options on both sides")
        per_example = folder / manifest["per_example"][self._scope]
        factor_name = (manifest.get("per_example_factors") or {}).get(self._scope)
        factor_graph = folder / factor_name if factor_name else None
        if factor_graph is not None and not factor_graph.is_file():
            raise ConfigError(f"ORT artifact folder {folder} lacks {factor_name} (listed in its manifest)",
                              field="artifacts", fix="let the coordinator ship complete sets (coordinator.artifacts)")
        graphs = b"".join((folder / f).read_bytes() for f in ("training_model.onnx", "eval_model.onnx"))
        graphs += per_example.read_bytes() + (factor_graph.read_bytes() if factor_graph is not None else b"")
        digest = hashlib.sha256(graphs).hexdigest()
        if digest == self._digest:  # same graphs: keep the sessions and the current weights
            self._folder = folder
            return

        params = [(str(n), tuple(int(d) for d in shape)) for n, shape in manifest["parameters"]]
        all_layout, offset = [], 0
        for n, shape in params:
            all_layout.append(ParameterSpec(n, shape, offset))
            offset += int(np.prod(shape, dtype=np.int64))
        trainable = [s for s in all_layout if self._scope == "all" or s.name.startswith("psi.")]
        start = trainable[0].offset
        stop = trainable[-1].offset + trainable[-1].size
        if sum(s.size for s in trainable) != stop - start:
            raise ConfigError("trainable parameters are not contiguous in the manifest order", field="artifacts")

        options = self._ort.SessionOptions()
        if self._threads is not None:
            options.intra_op_num_threads = int(self._threads)
            options.inter_op_num_threads = 1
        options.log_severity_level = 3
        session = self._ort.InferenceSession(str(per_example), options, providers=["CPUExecutionProvider"])
        factors = (self._ort.InferenceSession(str(factor_graph), options, providers=["CPUExecutionProvider"])
                   if factor_graph is not None else None)
        state = self._api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
        module = self._api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"),
                                  device="cpu", session_options=options)
        buffer = module.get_contiguous_parameters(trainable_only=False).numpy().astype(np.float32)
        expected = np.concatenate([np.asarray(state.parameters[s.name].data, np.float32).reshape(-1)
                                   for s in all_layout])
        if buffer.shape != expected.shape or not np.array_equal(buffer, expected):
            raise ConfigError("the training module's parameter order differs from the manifest's",
                              field="artifacts", fix="regenerate the artifacts with coordinator.artifacts")

        old = self.get_weights() if self._layout else None
        self._session, self._state, self._module = session, state, module
        self._factor_session = factors
        self._factor_outputs = [o.name for o in factors.get_outputs()] if factors is not None else []
        self._spec = spec
        self._all_layout = tuple(all_layout)
        self._buffer = np.ascontiguousarray(buffer)
        self._trainable = slice(start, stop)
        self._layout = tuple(ParameterSpec(s.name, s.shape, s.offset - start) for s in trainable)
        self._views = {s.name: self._buffer[s.offset:s.offset + s.size].reshape(s.shape) for s in all_layout}
        self._output = session.get_outputs()[0].name
        self._module_stale = False
        self._folder, self._digest = folder, digest
        if old is not None and set(old) == set(self._views):
            self.set_weights(old)
        log.info("ort backend: artifacts %s loaded (scope %s, d=%d)", folder, self._scope, self.num_parameters)

    @property
    def spec(self) -> ModelSpec | None:
        """The loaded artifacts' model (None before :meth:`load_artifacts`)."""
        return self._spec

    @property
    def scope(self) -> str:
        """``"all"`` or ``"head"`` (what is trained)."""
        return self._scope

    def _require(self) -> None:
        if not self._layout:
            raise ConfigError("the ort backend has no artifacts loaded", field="artifacts",
                              fix="the task must carry ORT artifacts (coordinator ship_ort_artifacts: true)")

    # -- TrainingBackend -----------------------------------------------------------------------------------------
    @property
    def parameter_layout(self) -> tuple[ParameterSpec, ...]:
        """Trainable parameters in ``named_parameters()`` order (only ``psi.*`` with ``scope="head"``)."""
        self._require()
        return self._layout

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Copy ``{name: array}`` (every parameter of the model, frozen ones included) into the buffer.

        Raises:
            ConfigError: a parameter is missing, unknown or has the wrong shape.
        """
        self._require()
        checked = checked_weights(weights, self._all_layout)
        for spec in self._all_layout:
            self._views[spec.name][...] = checked[spec.name]
        self._module_stale = True

    def get_weights(self) -> dict[str, np.ndarray]:
        """``{name: float32 array}`` of every parameter (frozen ones included, unchanged; copies)."""
        self._require()
        return {name: view.copy() for name, view in self._views.items()}

    def _inputs(self, x: np.ndarray) -> np.ndarray:
        return self._spec.prepare_input(x)

    def per_example_gradients(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """float32 (B, d): row i is the gradient of example i's cross-entropy loss, flat in layout order."""
        self._require()
        labels = np.asarray(y, dtype=np.int64)
        n = int(labels.shape[0])
        if n == 0:
            return np.zeros((0, self.num_parameters), dtype=np.float32)
        images = self._inputs(x)
        parts = []
        for start in range(0, n, self._microbatch):
            stop = min(n, start + self._microbatch)
            feeds = {_INPUT: images[start:stop], _LABELS: labels[start:stop], **self._views}
            parts.append(self._session.run([self._output], feeds)[0])
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def per_example(self, x: np.ndarray, y: np.ndarray, *,
                    input_sq_norms: np.ndarray | None = None) -> PerExampleGradients:
        """Per-example gradients as the CCDP mechanism consumes them: the factor graph's
        :class:`~edge_sdk.backends.factored.LinearFactors` where the artifacts have one (Linear-only models: the
        head model), else the per-example graph's rows (the camera CNN).

        Raises:
            ValueError: ``x`` is not what the model kind takes (e.g. images for the head model).
        """
        self._require()
        if self._factor_session is None:
            return MaterialisedGradients(self.per_example_gradients(x, y))
        labels = np.asarray(y, dtype=np.int64)
        inputs = self._inputs(x)
        n = int(labels.shape[0])
        if n == 0:
            return MaterialisedGradients(np.zeros((0, self.num_parameters), dtype=np.float32))
        parts = []
        for start in range(0, n, self._microbatch):
            stop = min(n, start + self._microbatch)
            feeds = {_INPUT: inputs[start:stop], _LABELS: labels[start:stop], **self._views}
            parts.append(self._factor_session.run(self._factor_outputs, feeds))
        values = parts[0] if len(parts) == 1 else [np.concatenate(col, axis=0) for col in zip(*parts)]
        by_name = dict(zip(self._factor_outputs, values))
        prefixes = [name[:-len(".input")] for name in self._factor_outputs if name.endswith(".input")]
        return LinearFactors({p: (by_name[f"{p}.input"], by_name[f"{p}.delta"]) for p in prefixes}, self._layout,
                             input_sq_norms=input_sq_norms,
                             input_layer=input_layer_prefix([n for n, _ in self._spec.parameter_shapes()]))

    def _sync_module(self) -> None:
        if self._module_stale:
            self._module.copy_buffer_to_parameters(self._ort.OrtValue.ortvalue_from_numpy(self._buffer)._ortvalue,
                                                   trainable_only=False)
            self._module_stale = False

    def gradient(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """float32 (d,): gradient of the mean cross-entropy over the batch (the ORT training graph; with
        ``scope="head"``, the mean of the head's per-example gradients)."""
        self._require()
        if self._scope == "head":
            n = int(np.asarray(y).shape[0])
            return self.per_example(x, y).weighted_sum(np.full((1, n), 1.0 / n, np.float32))[0]
        self._sync_module()
        self._module.train()
        self._module.lazy_reset_grad()
        self._module(self._inputs(x), np.asarray(y, dtype=np.int64))
        return np.concatenate([np.asarray(self._state.parameters[s.name].grad, np.float32).reshape(-1)
                               for s in self._layout])

    def apply_gradient(self, flat_grad: np.ndarray, learning_rate: float) -> None:
        """``theta <- theta - learning_rate * flat_grad`` (float32 (d,)) on the trainable parameters."""
        self._require()
        flat = np.asarray(flat_grad, dtype=np.float32)
        if flat.shape != (self.num_parameters,):
            raise ValueError(f"flat gradient must have shape ({self.num_parameters},), got {flat.shape}")
        self._buffer[self._trainable] -= np.float32(learning_rate) * flat
        self._module_stale = True

    def predict(self, x: np.ndarray) -> np.ndarray:
        """int64 (B,) argmax classes (the eval graph's logits)."""
        self._require()
        self._sync_module()
        self._module.eval()
        images = self._inputs(x)
        outputs = self._module(images, np.zeros(images.shape[0], dtype=np.int64))
        return np.asarray(outputs[1]).argmax(axis=1).astype(np.int64)
