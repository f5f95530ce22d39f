"""The training backend the gateway's tests run a site with, and ONNX Runtime training artifacts where torch is absent.

The gateway's tests run under two interpreters (``.ci/run``): the development venv (Python 3.11, torch and
``onnxruntime-training``) and a Python 3.10 venv with what an x86 gateway installs (``wildfed[edge-ort]``, no torch:
no CPU wheel of torch for 3.10 is on this machine's disk, and a gateway on ONNX Runtime needs none). A test that runs
a site picks :data:`GATEWAY_BACKEND`: ``torch`` where torch is installed (as before), ``ort`` otherwise.

An ``ort`` site trains with the artifact set that the coordinator makes for each model version
(``coordinator.artifacts.build_artifacts``), and making one needs torch. So the Python 3.10 run reads sets that an
interpreter with torch wrote beforehand, as a coordinator would make them for a gateway. Embedding a site's photos
needs the frozen backbone's ONNX graph, which is exported with torch too; the same folder holds the default
backbone's (EfficientNet-Lite0 at the default input size, :data:`BACKBONE_FILE`), and ``tests/conftest.py`` hands it
to the gateway as ``WILDFED_BACKBONE_ONNX``, the setting an ONNX Runtime gateway is given:

    .venv/bin/python -m tests.gateway_backend /tmp/wf-artifacts          # with torch: DIR/<model hash>/<files>
    WILDFED_TEST_ARTIFACTS=/tmp/wf-artifacts .venv310/bin/python -m pytest tests/edge tests/shared

:func:`artifact_set` makes the set where torch imports, reads it from ``$WILDFED_TEST_ARTIFACTS`` otherwise, and skips
the test (naming the commands above) where neither is possible. With ``$WILDFED_TEST_ARTIFACTS`` set, a set that is
missing there fails the test instead: the writer and the tests disagree about the models (:data:`MODELS`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from shared.codec import model_hash
from shared.models.kinds import model_spec, spec_from_weights

if TYPE_CHECKING:
    from edge_sdk.backends.base import TrainingBackend

__all__ = ["TORCH_INSTALLED", "GATEWAY_BACKEND", "NO_TORCH_REASON", "needs_torch", "ARTIFACTS_ENV", "BACKBONE_FILE",
           "MODELS", "model_weights", "artifact_set", "artifact_digests", "training_backend", "prebuilt_backbone",
           "write_artifact_sets"]

TORCH_INSTALLED = importlib.util.find_spec("torch") is not None
"""Whether ``torch`` can be imported here (found without importing it)."""

GATEWAY_BACKEND = "torch" if TORCH_INSTALLED else "ort"
"""The training backend a test's site runs with (module docstring)."""

NO_TORCH_REASON = ("needs torch, which this interpreter lacks (a gateway installed with wildfed[edge-ort], e.g. the "
                   "Python 3.10 run of .ci/run); the Python 3.11 run covers it")

needs_torch = pytest.mark.skipif(not TORCH_INSTALLED, reason=NO_TORCH_REASON)
"""Mark a test that needs torch itself (the torch backend, a model export, torch as a reference)."""

ARTIFACTS_ENV = "WILDFED_TEST_ARTIFACTS"
BACKBONE_FILE = "backbone.onnx"
"""The default backbone's embedder graph in the ``$WILDFED_TEST_ARTIFACTS`` folder."""

MODELS: dict[str, Callable[[], dict[str, np.ndarray]]] = {
    # tests/edge/test_agent.py's fake coordinator (and the tests that borrow it): K = 2, a 16-wide adapter
    "agent": lambda: model_spec("head", 2, adapter_width=16).initial_weights(0, head_init="uniform"),
    # tests/edge/test_ort_backend.py: K = 4, a 16-wide adapter
    "ort-backend": lambda: model_spec("head", 4, adapter_width=16).initial_weights(3, head_init="uniform"),
    # tests/edge/test_head_backends.py: the full-size head model (1280 -> 256 -> 10), a small one (20 -> 12 -> 5) and
    # the small one without its adapter
    "head-full": lambda: model_spec("head", 10).initial_weights(7, head_init="uniform"),
    "head-small": lambda: model_spec("head", 5, adapter_width=12, embedding_dim=20).initial_weights(
        7, head_init="uniform"),
    "head-small-no-adapter": lambda: model_spec("head", 5, adapter_width=0, embedding_dim=20).initial_weights(
        7, head_init="uniform"),
    # tests/edge/test_gateway_embeddings.py: the head alone (no adapter) on backbone embeddings, K = 2
    "head-only": lambda: model_spec("head", 2, adapter_width=0).initial_weights(0),
    # tests/edge/test_training.py (class reweighting): the head alone on 4-dimensional inputs, K = 3
    "tiny-4": lambda: model_spec("head", 3, adapter_width=0, embedding_dim=4).initial_weights(0),
    # tests/shared/test_distributed_dp.py: the head alone on 8-dimensional inputs, K = 3
    "tiny-8": lambda: model_spec("head", 3, adapter_width=0, embedding_dim=8).initial_weights(0),
}
"""The model versions the gateway's tests train with ORT, by name: float32 weights made without torch."""


def model_weights(name: str) -> dict[str, np.ndarray]:
    """The weights of model ``name`` of :data:`MODELS` (a fresh copy)."""
    return MODELS[name]()


def artifact_digests(files: dict[str, bytes]) -> dict[str, str]:
    """``{file name: hex SHA-256}``, what ``TrainingTask.artifacts`` lists (as ``coordinator.artifacts``')."""
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def _make(weights: dict[str, np.ndarray]) -> dict[str, bytes]:
    from coordinator.artifacts import build_artifacts

    return build_artifacts(weights, model_hash=model_hash(weights))


def artifact_set(name: str) -> dict[str, bytes]:
    """The ORT training artifact set ``{file name: bytes}`` of model ``name`` (module docstring).

    Skips the calling test where torch is absent and ``$WILDFED_TEST_ARTIFACTS`` is unset; fails it where that
    folder lacks the set.
    """
    weights = model_weights(name)
    if TORCH_INSTALLED:
        return _make(weights)
    root = os.environ.get(ARTIFACTS_ENV)
    if not root:
        pytest.skip(f"ORT training artifacts for model {name!r} are made with torch, which is absent here; write "
                    f"them with an interpreter that has it (python -m tests.gateway_backend DIR) and set "
                    f"{ARTIFACTS_ENV}=DIR")
    folder = Path(root) / model_hash(weights)
    if not folder.is_dir():
        pytest.fail(f"{ARTIFACTS_ENV}={root} has no artifact set for model {name!r} ({folder} is missing): rewrite "
                    f"it with python -m tests.gateway_backend {root}")
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}


def training_backend(name: str, folder: Path, **options: object) -> TrainingBackend:
    """A :data:`GATEWAY_BACKEND` backend for model ``name`` of :data:`MODELS`: torch built for the model's spec, or
    ORT loaded with the model's artifact set (stored under ``folder``, a fresh directory). ``options``: backend
    settings (``threads``, ``microbatch_size``). Skips or fails as :func:`artifact_set` does."""
    from edge_sdk.backends.base import create_backend
    from edge_sdk.backends.ort_backend import ArtifactCache

    weights = model_weights(name)
    spec = spec_from_weights(weights)
    if GATEWAY_BACKEND == "torch":
        return create_backend("torch", model=spec, **options)
    stored = ArtifactCache(folder).store(model_hash(weights), artifact_set(name))
    return create_backend("ort", num_classes=spec.num_classes, artifacts=stored, **options)


def prebuilt_backbone() -> Path | None:
    """The default backbone's embedder graph in ``$WILDFED_TEST_ARTIFACTS`` where torch is absent and the file is
    there, else None (torch exports it on first use)."""
    root = os.environ.get(ARTIFACTS_ENV)
    if TORCH_INSTALLED or not root or not (Path(root) / BACKBONE_FILE).is_file():
        return None
    return Path(root) / BACKBONE_FILE


def write_artifact_sets(root: Path) -> list[Path]:
    """Make the artifact set of every model of :data:`MODELS` under ``root/<model hash>/`` and the default backbone's
    embedder graph as ``root/backbone.onnx`` (needs torch and ``onnxruntime-training``); returns what it wrote."""
    from edge_sdk.inference.embedder import export_onnx
    from shared.models.backbone import DEFAULT_INPUT_SIZE

    root.mkdir(parents=True, exist_ok=True)
    folders = [export_onnx(root / BACKBONE_FILE, DEFAULT_INPUT_SIZE)]
    for name in MODELS:
        weights = model_weights(name)
        folder = root / model_hash(weights)
        folder.mkdir(parents=True, exist_ok=True)
        for file_name, data in _make(weights).items():
            (folder / file_name).write_bytes(data)
        folders.append(folder)
    return folders


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.gateway_backend DIR   (writes DIR/<model hash>/ for each test model)")
    for made in write_artifact_sets(Path(sys.argv[1])):
        print(f"wrote {made}")
