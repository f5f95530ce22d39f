"""``wildfed-edge doctor``: what this machine can run, and which gateway profile fits it.

Probes (each one guarded: a missing or broken package is reported, never raised):

- training backends: ``torch`` (version, CUDA build), ``onnxruntime.training``;
- inference engines: TensorRT (``tensorrt`` Python package), ONNX Runtime and its execution providers;
- accelerators: CUDA through torch (device names, compute capability), ``nvidia-smi`` (GPU names, driver), a
  Jetson (``/etc/nv_tegra_release``, model from ``/proc/device-tree/model``), the CPU architecture and cores.

:func:`rank_profiles` then checks each profile against the probes: *requirements* (the training backend imports;
``backend: torch`` on ``device: cuda`` has CUDA; the machine is of the profile's kind: :func:`kind_fit`, which
``run`` and ``check-config`` apply too) decide whether it fits; *warnings* (TensorRT missing, so ORT is used; the x86
GPU profile on a box without a GPU or a CUDA torch, so ONNX Runtime runs on the CPU) only lower its rank. The
recommended profile is the first that fits, preferring the
detected hardware kind.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shared.profiles import GatewayKind, GatewayProfile, InferenceEngine, TrainingBackendName

__all__ = ["Probe", "MachineReport", "ProfileFit", "probe_machine", "probe_hardware", "detect_kind", "kind_fit",
           "device_fit", "rank_profiles"]

TEGRA_RELEASE = Path("/etc/nv_tegra_release")
DEVICE_TREE_MODEL = Path("/proc/device-tree/model")


@dataclass(frozen=True)
class Probe:
    """One capability: ``area`` (training / inference / accelerator / system), ``name``, ``available``, detail."""

    area: str
    name: str
    available: bool
    detail: str = ""


@dataclass(frozen=True)
class MachineReport:
    """What :func:`probe_machine` found.

    Attributes:
        probes: every probe, in display order.
        arch: ``platform.machine()`` (``x86_64``, ``aarch64``).
        jetson_model: the Jetson's model string, or ``None`` when this is not a Jetson.
        torch_cuda: torch imports and sees a CUDA device.
        gpus: GPU names (torch or nvidia-smi).
        ort_providers: ONNX Runtime execution providers (empty when ORT is absent).
    """

    probes: tuple[Probe, ...]
    arch: str
    jetson_model: str | None = None
    torch_cuda: bool = False
    gpus: tuple[str, ...] = ()
    ort_providers: tuple[str, ...] = ()

    def has(self, name: str) -> bool:
        """Whether the probe ``name`` is available."""
        return any(p.name == name and p.available for p in self.probes)


@dataclass(frozen=True)
class ProfileFit:
    """How one profile fits this machine: ``fits`` when ``problems`` is empty; ``kind_match`` when the detected
    hardware is of the profile's kind."""

    name: str
    kind: GatewayKind
    fits: bool
    kind_match: bool
    problems: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default_factory=tuple)


def _version(module: object) -> str:
    return str(getattr(module, "__version__", "?"))


def _probe_torch(probes: list[Probe]) -> tuple[bool, tuple[str, ...]]:
    try:
        torch = importlib.import_module("torch")
    except Exception as exc:  # noqa: BLE001 - missing or broken: report it
        probes.append(Probe("training", "torch", False, f"not importable ({type(exc).__name__})"))
        probes.append(Probe("accelerator", "cuda (torch)", False, "torch not installed"))
        return False, ()
    cuda_build = getattr(torch.version, "cuda", None)
    probes.append(Probe("training", "torch", True, f"{_version(torch)}, CUDA build {cuda_build or 'no'}"))
    try:
        available = bool(torch.cuda.is_available())
        names = tuple(f"{torch.cuda.get_device_name(i)} (sm {'.'.join(map(str, torch.cuda.get_device_capability(i)))})"
                      for i in range(torch.cuda.device_count())) if available else ()
    except Exception as exc:  # noqa: BLE001 - a broken driver must not break the doctor
        probes.append(Probe("accelerator", "cuda (torch)", False, f"error: {exc}"))
        return False, ()
    probes.append(Probe("accelerator", "cuda (torch)", available, ", ".join(names) if names else "no CUDA device"))
    return available, names


def _probe_ort(probes: list[Probe]) -> tuple[str, ...]:
    from edge_sdk.profiles import ort_training_importable

    if ort_training_importable():
        ort = importlib.import_module("onnxruntime")
        probes.append(Probe("training", "onnxruntime.training", True, _version(ort)))
    else:
        probes.append(Probe("training", "onnxruntime.training", False, "not importable"))
    try:
        ort = importlib.import_module("onnxruntime")
        providers = tuple(ort.get_available_providers())
    except Exception as exc:  # noqa: BLE001
        probes.append(Probe("inference", "onnxruntime", False, f"not importable ({type(exc).__name__})"))
        return ()
    probes.append(Probe("inference", "onnxruntime", True, f"{_version(ort)}; providers: {', '.join(providers)}"))
    probes.append(Probe("inference", "ort CUDAExecutionProvider", "CUDAExecutionProvider" in providers))
    probes.append(Probe("inference", "ort TensorrtExecutionProvider", "TensorrtExecutionProvider" in providers))
    return providers


def _probe_tensorrt(probes: list[Probe]) -> None:
    try:
        trt = importlib.import_module("tensorrt")
    except Exception as exc:  # noqa: BLE001
        probes.append(Probe("inference", "tensorrt", False, f"not importable ({type(exc).__name__})"))
        return
    probes.append(Probe("inference", "tensorrt", True, _version(trt)))


def _probe_nvidia_smi(probes: list[Probe]) -> tuple[str, ...]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        probes.append(Probe("accelerator", "nvidia-smi", False, "not on PATH"))
        return ()
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        probes.append(Probe("accelerator", "nvidia-smi", False, f"failed: {exc}"))
        return ()
    lines = tuple(line.strip() for line in out.stdout.splitlines() if line.strip())
    probes.append(Probe("accelerator", "nvidia-smi", out.returncode == 0 and bool(lines),
                        "; ".join(lines) if lines else (out.stderr.strip()[:120] or "no GPU listed")))
    return tuple(line.split(",")[0].strip() for line in lines) if out.returncode == 0 else ()


def _probe_jetson(probes: list[Probe]) -> str | None:
    if not TEGRA_RELEASE.is_file():
        probes.append(Probe("accelerator", "jetson", False, f"no {TEGRA_RELEASE}"))
        return None
    release = TEGRA_RELEASE.read_text(errors="replace").splitlines()[0][:80] if TEGRA_RELEASE.stat().st_size else ""
    model = "NVIDIA Jetson (model unknown)"
    if DEVICE_TREE_MODEL.is_file():
        model = DEVICE_TREE_MODEL.read_bytes().rstrip(b"\0").decode(errors="replace").strip() or model
    probes.append(Probe("accelerator", "jetson", True, f"{model}; {release}"))
    return model


def probe_hardware(*, cuda: bool = False) -> MachineReport:
    """The hardware facts alone: architecture, a Jetson's model, GPUs from ``nvidia-smi``, and (with ``cuda``)
    whether torch sees CUDA (imports torch where installed). What the profile checks of ``run`` and
    ``check-config`` need, without importing every runtime as :func:`probe_machine` does."""
    probes: list[Probe] = [Probe("system", "cpu", True, f"{platform.machine()}, {os.cpu_count() or '?'} cores")]
    torch_cuda = False
    if cuda:
        from edge_sdk.profiles import torch_cuda_available

        torch_cuda = torch_cuda_available()
    gpus = _probe_nvidia_smi(probes)
    jetson = _probe_jetson(probes)
    return MachineReport(probes=tuple(probes), arch=platform.machine(), jetson_model=jetson, torch_cuda=torch_cuda,
                         gpus=gpus)


def probe_machine() -> MachineReport:
    """Probe this machine (imports torch, onnxruntime and tensorrt if present; runs nvidia-smi for at most 10 s)."""
    probes: list[Probe] = []
    arch = platform.machine()
    probes.append(Probe("system", "cpu", True, f"{arch}, {os.cpu_count() or '?'} cores"))
    torch_cuda, torch_gpus = _probe_torch(probes)
    providers = _probe_ort(probes)
    _probe_tensorrt(probes)
    smi_gpus = _probe_nvidia_smi(probes)
    jetson = _probe_jetson(probes)
    return MachineReport(probes=tuple(probes), arch=arch, jetson_model=jetson, torch_cuda=torch_cuda,
                         gpus=torch_gpus or smi_gpus, ort_providers=providers)


def detect_kind(report: MachineReport) -> GatewayKind:
    """The hardware kind of the probed machine (a radio base station is a role, never detected)."""
    if report.jetson_model is not None:
        return GatewayKind.JETSON_XAVIER_NX if "xavier" in report.jetson_model.lower() else GatewayKind.JETSON_ORIN_NANO
    return GatewayKind.X86_GPU if report.gpus or report.torch_cuda else GatewayKind.X86_CPU


def kind_fit(kind: GatewayKind, report: MachineReport, detected: GatewayKind | None = None
             ) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of running a profile of ``kind`` on the probed machine: a Jetson profile needs that
    Jetson; the x86 kinds need an x86_64 machine; the x86 GPU kind without a GPU is a warning (it runs on ONNX
    Runtime on the CPU, and says so), not a problem. A radio base station is a role any machine can play.
    Shared by ``doctor`` and by the checks ``run`` and ``check-config`` make (:mod:`edge_sdk.preflight`)."""
    detected = detected or detect_kind(report)
    is_x86 = report.arch.lower() in ("x86_64", "amd64")
    problems: list[str] = []
    warnings: list[str] = []
    if kind in (GatewayKind.JETSON_ORIN_NANO, GatewayKind.JETSON_XAVIER_NX) and detected is not kind:
        problems.append(f"needs a {kind.value} (this is {detected.value}, {report.arch})")
    elif kind is GatewayKind.X86_GPU and not is_x86:
        problems.append(f"needs an x86_64 machine with an NVIDIA GPU (this is {report.arch})")
    elif kind is GatewayKind.X86_GPU and detected is not GatewayKind.X86_GPU:
        warnings.append("no NVIDIA GPU found: inference and training fall back to ONNX Runtime on the CPU")
    elif kind is GatewayKind.X86_CPU and not is_x86:
        problems.append(f"needs an x86_64 machine (this is {report.arch})")
    return problems, warnings


def device_fit(backend: TrainingBackendName, device: str, *, torch_cuda: bool, ort_training: bool
               ) -> tuple[list[str], list[str]]:
    """``(problems, warnings)`` of training with ``backend`` on ``device`` here, once the backend is installed:
    ``torch`` on ``cuda`` needs torch to see CUDA (``torch_cuda``); ``auto`` on ``cuda`` without it falls back to ONNX
    Runtime on the CPU where that imports (``ort_training``; a warning), else is the same problem
    (``edge_sdk.profiles.resolve_training`` is what the agent then does)."""
    if not device.startswith("cuda") or torch_cuda:
        return [], []
    if backend is TrainingBackendName.AUTO and ort_training:
        return [], [f"training.device {device}: torch sees no CUDA device here; training runs on ONNX Runtime on the "
                    "CPU"]
    if backend is TrainingBackendName.ORT:
        return [], []
    return [f"training.device {device}: torch sees no CUDA device"], []


def _check(profile: GatewayProfile, report: MachineReport, detected: GatewayKind) -> ProfileFit:
    problems, warnings = kind_fit(profile.kind, report, detected)
    backend = profile.training.backend
    torch_ok, ort_ok = report.has("torch"), report.has("onnxruntime.training")
    if backend is TrainingBackendName.TORCH and not torch_ok:
        problems.append("training backend torch is not installed")
    elif backend is TrainingBackendName.ORT and not ort_ok:
        problems.append("training backend ort: onnxruntime.training is not installed")
    elif backend is TrainingBackendName.AUTO and not (torch_ok or ort_ok):
        problems.append("no training backend installed (torch or onnxruntime-training)")
    else:
        device_problems, device_warnings = device_fit(backend, profile.training.device,
                                                      torch_cuda=report.torch_cuda, ort_training=ort_ok)
        problems += device_problems
        warnings += device_warnings
    engine = profile.inference.engine
    if not report.has("onnxruntime"):
        problems.append("onnxruntime is not installed (inference, and the fallback of TensorRT)")
    elif engine is InferenceEngine.TENSORRT and not report.has("tensorrt"):
        warnings.append("tensorrt missing: inference falls back to ONNX Runtime")
    elif engine is InferenceEngine.ORT_CUDA and "CUDAExecutionProvider" not in report.ort_providers:
        warnings.append("ORT has no CUDAExecutionProvider: inference runs on CPU")
    return ProfileFit(name=profile.name, kind=profile.kind, fits=not problems, kind_match=profile.kind is detected,
                      problems=tuple(problems), warnings=tuple(warnings))


def rank_profiles(report: MachineReport, profiles: Sequence[GatewayProfile]) -> list[ProfileFit]:
    """Every profile's fit, best first: fitting before not, the detected kind first, fewer warnings first,
    then fewer problems, then name."""
    detected = detect_kind(report)
    fits = [_check(p, report, detected) for p in profiles]
    return sorted(fits, key=lambda f: (not f.fits, not f.kind_match, len(f.warnings), len(f.problems), f.name))
