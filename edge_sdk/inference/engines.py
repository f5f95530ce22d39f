"""Inference engines: a TensorRT engine where the gateway has one, ONNX Runtime otherwise.

Both models the gateway runs (the YOLOX-tiny detector and the species classifier) are single-input,
single-output ONNX graphs with a dynamic batch axis, so an engine is one call: :meth:`InferenceEngine.run` takes a
float32 batch and returns the float32 output.

Choosing an engine (:func:`open_engine`, ``prefer="auto"``):

1. a GPU is found (:func:`probe_gpu`: ``nvidia-smi``, else torch's CUDA on a Jetson or beside an NVIDIA driver) and
   TensorRT imports: the ONNX file is built into an **FP16** TensorRT engine, cached (below), and run;
2. otherwise, or when the TensorRT build fails: ONNX Runtime with the CUDA execution provider where the installed
   ORT has it, else the CPU provider. Every fallback is one WARNING log line that names the reason, e.g.
   ``inference: TensorRT is not installed (No module named 'tensorrt'); falling back to ONNX Runtime (CPU)``.

``prefer="ort"`` skips TensorRT; ``prefer="tensorrt"`` is ``auto`` but logs the fallback as an error.

TensorRT engine cache (:mod:`edge_sdk.inference.engine_cache`): an engine is valid only for the GPU model and
TensorRT version that built it, so each cached engine carries a key file and is rebuilt when any key field changes,
or when it is corrupt; one engine per slot.

The TensorRT runtime path allocates device buffers with torch (CUDA); a GPU gateway without torch uses ORT's CUDA
provider instead (logged as a fallback).
The engines live in :mod:`~edge_sdk.inference.ort_engine` (ONNX Runtime) and :mod:`~edge_sdk.inference.tensorrt_engine`
(TensorRT engine and builder), their interface and errors in :mod:`~edge_sdk.inference.engine_base`; this module
probes the GPU, chooses, and exports them all as before.
"""

from __future__ import annotations

import logging
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from edge_sdk.inference.engine_base import (EngineBuildError, EngineError, EnginePreference, InferenceEngine,
                                            TensorRTUnavailableError)
from edge_sdk.inference.engine_cache import EngineBuilder, EngineCache, EngineCacheKey, GpuInfo
from edge_sdk.inference.ort_engine import OrtEngine, _import_onnxruntime, ort_providers  # noqa: F401  (preflight)
from edge_sdk.inference.tensorrt_engine import TensorRTBuilder, TensorRTEngine

__all__ = ["InferenceEngine", "OrtEngine", "TensorRTEngine", "GpuInfo", "EngineCacheKey", "EngineBuilder",
           "TensorRTBuilder", "EngineCache", "EngineError", "TensorRTUnavailableError", "EngineBuildError",
           "probe_gpu", "ort_providers", "open_engine", "EnginePreference"]

log = logging.getLogger(__name__)


def _torch_cuda_worth_asking() -> bool:
    """Whether asking torch's CUDA can find a GPU that ``nvidia-smi`` did not: torch is already imported (asking costs
    nothing), or the machine is a Jetson (aarch64, L4T: an integrated GPU and no ``nvidia-smi``), or an NVIDIA driver
    is loaded (``/proc/driver/nvidia``). Elsewhere (an x86 gateway without an NVIDIA driver) ``import torch`` would
    cost seconds at every start, and pull ``onnxruntime.training``'s torch modules in after it, to learn nothing."""
    if sys.modules.get("torch") is not None:
        return True
    if platform.machine().lower() in ("aarch64", "arm64") or Path("/etc/nv_tegra_release").exists():
        return True
    return Path("/proc/driver/nvidia").exists()


def probe_gpu() -> GpuInfo | None:
    """The first GPU, from ``nvidia-smi`` (no imports) or torch's CUDA (Jetson has no nvidia-smi; asked only where
    :func:`_torch_cuda_worth_asking`); None if none."""
    if shutil.which("nvidia-smi"):
        try:
            proc = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=20, check=False)
            line = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
            if "," in line:
                name, cc = (p.strip() for p in line.split(",", 1))
                return GpuInfo(name=name, compute_capability=cc)
        except (OSError, subprocess.TimeoutExpired):
            pass
    if not _torch_cuda_worth_asking():
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return GpuInfo(name=torch.cuda.get_device_name(0), compute_capability=f"{major}.{minor}")

# ---- choosing ---------------------------------------------------------------------------------------------------


def open_engine(onnx_path: str | Path, *, name: str, prefer: EnginePreference = "auto", max_batch: int = 8,
                threads: int | None = None, cache_root: str | Path | None = None,
                builder_factory: Callable[[], EngineBuilder] = TensorRTBuilder,
                gpu_probe: Callable[[], GpuInfo | None] = probe_gpu) -> InferenceEngine:
    """The best engine for ``onnx_path`` on this machine (see the module docstring for the order and the log
    lines).

    Args:
        onnx_path: the exported model.
        name: cache slot name for its TensorRT engine (e.g. ``yolox_tiny``).
        prefer: ``auto``, ``tensorrt`` or ``ort``.
        max_batch: largest batch of the TensorRT optimisation profile.
        threads: ORT intra-op threads.
        cache_root: engine cache folder (default ``<wildfed cache>/engines``).
        builder_factory, gpu_probe: injectable for tests.

    Raises:
        EngineError: not even ONNX Runtime can load the model.
    """
    if prefer not in ("auto", "tensorrt", "ort"):
        raise ValueError(f"prefer must be 'auto', 'tensorrt' or 'ort', got {prefer!r}")
    fallback_level = logging.ERROR if prefer == "tensorrt" else logging.WARNING
    reason: str | None = None
    if prefer != "ort":
        gpu = gpu_probe()
        if gpu is None:
            reason = "no GPU found"
        else:
            try:
                builder = builder_factory()
                cache = EngineCache(builder, cache_root)
                engine, _ = cache.open(name, onnx_path, gpu, max_batch=max_batch)
                log.info("inference: %s runs on TensorRT %s FP16 (%s)", name, builder.version, gpu.name)
                return engine
            except TensorRTUnavailableError as exc:
                reason = f"TensorRT is not available: {exc}"
            except EngineBuildError as exc:
                reason = f"TensorRT engine build failed: {exc}"
            except EngineError as exc:
                reason = f"TensorRT engine does not load: {exc}"
    engine = OrtEngine(onnx_path, threads=threads)
    if reason == "no GPU found" and prefer == "auto":  # nothing falls back: a CPU box runs ONNX Runtime
        log.info("inference: %s runs on ONNX Runtime (%s): no GPU here", name, engine.name)
    elif reason is not None:
        log.log(fallback_level, "inference: %s; falling back to ONNX Runtime (%s) for %s", reason,
                "CUDA" if engine.name == "ort-cuda" else "CPU", name)
    else:
        log.info("inference: %s runs on ONNX Runtime (%s)", name, engine.name)
    return engine
