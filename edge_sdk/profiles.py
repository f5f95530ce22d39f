"""Gateway profiles on the gateway: the shared schema plus what depends on this machine.

The schema, the shipped profiles' folder and loading live in :mod:`shared.profiles` (the coordinator's provisioning
reads the same files). This module adds the gateway's view, :class:`FirmwareProfile`: the flat attributes the agent
reads (``backend``, ``device``, ``threads``, ``microbatch_size``; a site config's own settings override them, see
:func:`edge_sdk.agent.build_backend`), and :func:`resolve_backend`, what ``backend: auto`` means on this machine:
``ort`` where ``onnxruntime.training`` imports and an ``ort`` backend is registered, ``torch`` otherwise (Jetson:
ORT training ships no aarch64 wheel). The agent refines ``auto`` per task (ORT only for a model that has ORT
training artifacts).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from pathlib import Path

from shared.profiles import (
    GPU_KINDS,
    JETSON_KINDS,
    PROFILES_DIR,
    BrokerSettings,
    GatewayKind,
    GatewayProfile,
    IdentityFiles,
    InferenceEngine,
    InferenceSettings,
    Precision,
    PrivacyDefaults,
    StoragePaths,
    TrainingBackendName,
    TrainingSettings,
    available_profiles,
    check_profile_data,
    profile_path,
    profile_problems,
    profiles_dir,
)
from shared.profiles import load_profile as _load_profile

__all__ = [
    "GatewayKind", "TrainingBackendName", "InferenceEngine", "Precision", "TrainingSettings", "InferenceSettings",
    "StoragePaths", "BrokerSettings", "IdentityFiles", "PrivacyDefaults", "GatewayProfile", "FirmwareProfile",
    "PROFILES_DIR", "GPU_KINDS", "JETSON_KINDS", "profiles_dir", "available_profiles", "profile_path",
    "profile_problems", "check_profile_data", "load_profile", "resolve_backend", "ort_training_importable",
]

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def ort_training_importable() -> bool:
    """Whether ONNX Runtime training imports here (cached): the ORT backend's own probe where that module exists,
    else a plain ``import onnxruntime.training``."""
    try:
        from edge_sdk.backends.ort_backend import ort_training_importable as backend_probe
    except Exception:  # noqa: BLE001 - the backend module itself may be absent or broken
        backend_probe = None
    if backend_probe is not None:
        return bool(backend_probe())
    try:
        importlib.import_module("onnxruntime.training")
    except Exception:  # noqa: BLE001 - any import failure (missing, broken native library) means "not here"
        return False
    return True


def resolve_backend(name: str | TrainingBackendName) -> str:
    """The training backend name to build on this machine: ``auto`` becomes ``ort`` where
    ``onnxruntime.training`` imports and an ``ort`` backend exists (``edge_sdk.backends``), else ``torch``;
    other names pass through."""
    value = TrainingBackendName(name).value if not isinstance(name, TrainingBackendName) else name.value
    if value != TrainingBackendName.AUTO.value:
        return value
    from edge_sdk.backends.base import available_backends

    if "ort" in available_backends() and ort_training_importable():
        return "ort"
    return "torch"


class FirmwareProfile(GatewayProfile):
    """A :class:`shared.profiles.GatewayProfile` with the flat attributes the agent reads (``threads`` is a field).

    ``backend`` is the *requested* name (``auto`` stays ``auto``: the agent decides it per task, ORT only when the
    task's model has ORT artifacts); :attr:`resolved_backend` is what ``auto`` means on this machine in general.
    """

    @property
    def backend(self) -> str:
        """Requested training backend: ``auto``, ``torch`` or ``ort``."""
        return self.training.backend.value

    @property
    def resolved_backend(self) -> str:
        """The backend ``auto`` resolves to here (:func:`resolve_backend`)."""
        return resolve_backend(self.training.backend)

    @property
    def device(self) -> str:
        """Torch device for training."""
        return self.training.device

    @property
    def microbatch_size(self) -> int:
        """Per-example-gradient chunk size."""
        return self.training.microbatch_size


def load_profile(name_or_path: str | os.PathLike[str], directory: Path | None = None) -> FirmwareProfile:
    """Load a profile by name (``firmware_configs/<name>.yaml``, or ``$WILDFED_PROFILES_DIR``) or by path.

    Raises:
        ConfigError: no such profile, or the file is invalid (names the file, every bad field, and the fix).
    """
    return _load_profile(name_or_path, directory, model=FirmwareProfile)
