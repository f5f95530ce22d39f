"""Gateway profiles on the gateway: the shared schema plus what depends on this machine.

The schema, the shipped profiles' folder and loading live in :mod:`shared.profiles` (the coordinator's provisioning
reads the same files). This module adds the gateway's view, :class:`FirmwareProfile`: the flat attributes the agent
reads (``backend``, ``device``, ``threads``, ``microbatch_size``; a site config's own settings override them, see
:func:`edge_sdk.rounds.backends.build_backend`), and :func:`resolve_backend` / :func:`resolve_training`, what
``backend: auto`` means on this machine: on ``device: cpu``, ``ort`` where ``onnxruntime.training`` imports and an
``ort`` backend is registered, ``torch`` otherwise (Jetson: ORT training ships no aarch64 wheel); on ``device: cuda``,
``torch`` where torch sees a CUDA device, else ``ort`` on the CPU (logged: the x86 GPU profile without a CUDA torch
or without a GPU), else ``torch``. The agent refines ``auto`` per task (ORT only for a model that has ORT training
artifacts).

What a gateway must install for its backend (:func:`install_backend`, :func:`backend_extras`): ``torch`` -> the
``edge`` and ``torch`` extras of the ``wildfed`` wheel (on a Jetson, NVIDIA's JetPack torch seen through
``--system-site-packages`` satisfies it; on x86_64 the ``torch`` extra adds ONNX Runtime for inference); ``ort`` ->
the ``edge-ort`` extra (onnxruntime-training-cpu, onnx, no torch); ``auto`` -> ``edge-ort`` on an x86_64 gateway,
whatever its device (CUDA training there is an opt-in: torch with CUDA added to the venv), ``torch`` elsewhere.
:func:`backend_import_problem` imports the backend's framework for ``check-config``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import platform
import shlex
import sys
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
    "profile_problems", "check_profile_data", "load_profile", "resolve_backend", "resolve_training",
    "torch_cuda_available", "ort_training_importable",
    "BACKEND_EXTRAS", "install_backend", "backend_extras", "backend_install_command", "backend_import_problem",
]

#: The extras of the ``wildfed`` wheel (pyproject.toml) that provide each concrete training backend.
BACKEND_EXTRAS: dict[str, tuple[str, ...]] = {"torch": ("edge", "torch"), "ort": ("edge-ort",)}

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


def torch_cuda_available() -> bool:
    """Whether torch imports here and sees a CUDA device (False without torch; imports torch when installed)."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - missing or a broken native library: no CUDA training here
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver
        return False


def resolve_training(backend: str | TrainingBackendName, device: str) -> tuple[str, str, str | None]:
    """``(backend, device, note)`` a requested training backend and device mean on this machine.

    ``torch`` and ``ort`` (and other registered names) pass through. ``auto`` on ``cpu`` is :func:`resolve_backend`.
    ``auto`` on ``cuda[:N]`` is ``torch`` on that device where torch sees CUDA; else ``ort`` on ``cpu`` where
    ``onnxruntime.training`` imports, with ``note`` saying so (the caller logs it: an x86 GPU gateway installed
    without a CUDA torch, or run on a box without a GPU); else ``torch`` on the device (which then fails, naming
    what to install).
    """
    value = getattr(backend, "value", backend)
    if value != TrainingBackendName.AUTO.value:
        return str(value), device, None
    if device == "cpu":
        return resolve_backend(value), device, None
    if torch_cuda_available():
        return "torch", device, None
    if resolve_backend(value) == "ort":
        return "ort", "cpu", (f"training.device {device}: torch with CUDA is not available here, so training runs on "
                              "ONNX Runtime on the CPU (the head model is small; to train on the GPU install torch "
                              "with CUDA into the gateway's venv: pip install 'wildfed[torch]')")
    return "torch", device, None


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


def install_backend(backend: str | TrainingBackendName, *, device: str = "cpu", arch: str | None = None) -> str:
    """The concrete backend (``torch`` or ``ort``) a fresh gateway install must provide for a requested one.

    ``torch`` and ``ort`` stand for themselves; ``auto`` is ``ort`` on an x86_64 machine, whatever the device
    (onnxruntime-training-cpu has x86_64 wheels only and no CUDA provider: an x86 GPU gateway trains on the CPU
    unless the operator adds torch with CUDA, which ``auto`` then prefers) and ``torch`` elsewhere.

    Args:
        backend: the profile's or site's ``training.backend``.
        device: the training device (``cpu``, ``cuda[:N]``).
        arch: ``platform.machine()`` of the gateway (default: this machine).

    Raises:
        ValueError: not a backend name.
    """
    value = TrainingBackendName(backend).value
    if value != TrainingBackendName.AUTO.value:
        return value
    arch = (arch or platform.machine()).lower()
    return "ort" if arch in ("x86_64", "amd64") else "torch"


def backend_extras(backend: str | TrainingBackendName, *, device: str = "cpu", arch: str | None = None
                   ) -> tuple[str, ...]:
    """The ``wildfed`` extras to install for ``backend`` (:data:`BACKEND_EXTRAS` of :func:`install_backend`)."""
    return BACKEND_EXTRAS[install_backend(backend, device=device, arch=arch)]


def backend_install_command(backend: str, *, python: str | None = None) -> str:
    """The shell command that installs a concrete backend into ``python``'s environment (for error messages):
    ``<python> -m pip install 'wildfed[edge,torch]'``; offline: add ``--no-index --find-links DIR``."""
    spec = f"wildfed[{','.join(BACKEND_EXTRAS[backend])}]"
    return f"{shlex.quote(python or sys.executable)} -m pip install {shlex.quote(spec)}"


def _import_error(module: str) -> str | None:
    try:
        if module == "onnxruntime.training":
            from edge_sdk.backends.ort_backend import import_onnxruntime

            import_onnxruntime()  # the training API without pulling torch (edge_sdk.backends.ort_backend)
        else:
            importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - missing, or a native library that does not load: both are "absent"
        return f"{type(exc).__name__}: {exc}"
    return None


def backend_import_problem(backend: str | TrainingBackendName, *, device: str = "cpu",
                           python: str | None = None) -> str | None:
    """Import the framework of a requested training backend here; ``None`` when it imports, else a message that
    names the backend, the import error and the install command (:func:`backend_install_command`).

    ``torch`` needs ``import torch``; ``ort`` needs ``onnxruntime.training``; ``auto`` needs either (the one
    :func:`install_backend` would install is named in the fix). Imports really run (a broken native library is
    caught, not only a missing package), so this takes a second or two where torch is installed.
    """
    value = TrainingBackendName(backend).value
    modules = {"torch": "torch", "ort": "onnxruntime.training"}
    wanted = ["torch", "ort"] if value == TrainingBackendName.AUTO.value else [value]
    errors = {}
    for name in wanted:
        error = _import_error(modules[name])
        if error is None:
            return None
        errors[name] = error
    target = install_backend(value, device=device)
    what = " or ".join(f"{n} ({modules[n]}: {errors[n]})" for n in wanted)
    return (f"training backend {value} cannot run here: {what} does not import; fix: "
            f"{backend_install_command(target, python=python)} (offline: add --no-index --find-links DIR with the "
            "wheels), or reinstall with `wildfed-edge install-bundle --force` (docs/gateways.md)")
