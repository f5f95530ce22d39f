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

TensorRT engine cache: an engine is valid only for the GPU model and TensorRT version that built it, so each
cached engine ``engines/<name>.engine`` has a sidecar ``engines/<name>.engine.json`` holding its
:class:`EngineCacheKey`: GPU name, compute capability, TensorRT version, SHA-256 of the ONNX file, precision and
the largest batch of its optimisation profile, and beside the key the SHA-256 of the engine file itself. The
engine is reused only when every key field equals the current one; when any differs it is rebuilt (and the log
line names the fields that changed) and replaces the stale one: **one engine per slot** (gateway disks are small;
a slot is a model's role, e.g. ``yolox_tiny`` or ``camera_cnn``, never a model version). Engines are written to a
temporary file and renamed, key file last, so a crash mid-build never leaves a key that vouches for a half-written
engine.

A cached engine that is corrupt although its key is intact (bit rot, a truncated copy, a disk-full write) is not
reused forever: when its bytes no longer match the SHA-256 in the sidecar, or TensorRT cannot deserialise it, the
slot is deleted and the engine rebuilt **once** (:meth:`EngineCache.open`, WARNING log line); if that rebuild or
its load fails too, the new files are deleted as well and the model falls back to ONNX Runtime with a WARNING.

The TensorRT runtime path allocates device buffers with torch (CUDA); a GPU gateway without torch uses ORT's CUDA
provider instead (logged as a fallback).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, Protocol

import numpy as np

from shared.errors import WildFedError

from edge_sdk.inference.weights import cache_dir, sha256_file

__all__ = ["InferenceEngine", "OrtEngine", "TensorRTEngine", "GpuInfo", "EngineCacheKey", "EngineBuilder",
           "TensorRTBuilder", "EngineCache", "EngineError", "TensorRTUnavailableError", "EngineBuildError",
           "probe_gpu", "ort_providers", "open_engine", "EnginePreference"]

log = logging.getLogger(__name__)

EnginePreference = Literal["auto", "tensorrt", "ort"]


class EngineError(WildFedError):
    """An inference engine could not be opened or run."""


class TensorRTUnavailableError(EngineError):
    """TensorRT (or the CUDA memory it needs) is not available on this machine."""


class EngineBuildError(EngineError):
    """TensorRT failed to parse the ONNX file or to build an engine from it."""


# ---- engines ----------------------------------------------------------------------------------------------------

class InferenceEngine(ABC):
    """One loaded single-input, single-output model.

    Attributes:
        name: what runs it, for logs and benchmarks: ``tensorrt-fp16``, ``ort-cuda`` or ``ort-cpu``.
        max_batch: largest batch :meth:`run` accepts, or None for no limit.
    """

    name: str = "engine"
    max_batch: int | None = None

    @abstractmethod
    def run(self, batch: np.ndarray) -> np.ndarray:
        """Run one float32 batch (B, ...) and return the float32 output (B, ...)."""


def ort_providers(device: Literal["auto", "cpu", "cuda"] = "auto") -> list[str]:
    """ONNX Runtime execution providers to use: CUDA first where the installed ORT has it (``auto``/``cuda``),
    then CPU."""
    available = _import_onnxruntime().get_available_providers()
    if device != "cpu" and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class OrtEngine(InferenceEngine):
    """ONNX Runtime inference session.

    Args:
        onnx_path: the model.
        device: ``auto`` (CUDA provider when present), ``cpu`` or ``cuda``.
        threads: intra-op threads (CPU provider); None lets ORT decide.

    Raises:
        EngineError: the file does not load (e.g. IR version newer than this ORT reads).
    """

    def __init__(self, onnx_path: str | Path, *, device: Literal["auto", "cpu", "cuda"] = "auto",
                 threads: int | None = None) -> None:
        ort = _import_onnxruntime()
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = int(threads)
            options.inter_op_num_threads = 1
        options.log_severity_level = 3
        providers = ort_providers(device)
        if device == "cuda" and providers[0] != "CUDAExecutionProvider":
            log.warning("inference: ONNX Runtime here has no CUDA provider; running %s on the CPU",
                        Path(onnx_path).name)
        try:
            self._session = ort.InferenceSession(str(onnx_path), sess_options=options, providers=providers)
        except Exception as exc:  # ORT raises its own untyped errors (Fail, InvalidGraph, ...)
            raise EngineError(f"ONNX Runtime cannot load {onnx_path}: {exc}") from exc
        used = self._session.get_providers()
        self.name = "ort-cuda" if used and used[0] == "CUDAExecutionProvider" else "ort-cpu"
        self._input = self._session.get_inputs()[0].name
        self._output = self._session.get_outputs()[0].name

    def run(self, batch: np.ndarray) -> np.ndarray:
        """See :meth:`InferenceEngine.run`."""
        x = np.ascontiguousarray(batch, dtype=np.float32)
        return self._session.run([self._output], {self._input: x})[0]


class TensorRTEngine(InferenceEngine):
    """A deserialised TensorRT engine with torch-allocated CUDA buffers (TensorRT >= 8.5 tensor API).

    Raises:
        TensorRTUnavailableError: tensorrt or torch with CUDA is missing.
        EngineError: the engine does not deserialise.
    """

    name = "tensorrt-fp16"

    def __init__(self, engine_path: str | Path, *, max_batch: int) -> None:
        try:
            import tensorrt as trt
            import torch
        except ImportError as exc:
            raise TensorRTUnavailableError(f"cannot import {exc.name}") from exc
        if not torch.cuda.is_available():
            raise TensorRTUnavailableError("torch has no CUDA device for the engine's buffers")
        self._torch = torch
        self._trt = trt
        logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(logger)
        try:
            self._engine = self._runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        except Exception as exc:  # OSError, or TensorRT's untyped RuntimeError on a corrupt file
            raise EngineError(f"TensorRT cannot deserialise {engine_path}: {exc}") from exc
        if self._engine is None:
            raise EngineError(f"TensorRT cannot deserialise {engine_path}")
        self._context = self._engine.create_execution_context()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        inputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if len(inputs) != 1 or len(outputs) != 1:
            raise EngineError(f"{engine_path}: expected one input and one output, got {inputs} and {outputs}")
        self._input, self._output = inputs[0], outputs[0]
        self.max_batch = int(max_batch)
        self._stream = torch.cuda.Stream()

    def run(self, batch: np.ndarray) -> np.ndarray:
        """See :meth:`InferenceEngine.run` (host -> device copy, execute, device -> host copy)."""
        torch = self._torch
        if batch.shape[0] > self.max_batch:
            raise EngineError(f"batch {batch.shape[0]} exceeds the engine's profile maximum {self.max_batch}")
        with torch.cuda.stream(self._stream):
            x = torch.from_numpy(np.ascontiguousarray(batch, dtype=np.float32)).cuda(non_blocking=True)
            self._context.set_input_shape(self._input, tuple(x.shape))
            y = torch.empty(tuple(self._context.get_tensor_shape(self._output)), dtype=torch.float32, device="cuda")
            self._context.set_tensor_address(self._input, x.data_ptr())
            self._context.set_tensor_address(self._output, y.data_ptr())
            if not self._context.execute_async_v3(self._stream.cuda_stream):
                raise EngineError("TensorRT execution failed")
            out = y.cpu()
        self._stream.synchronize()
        return out.numpy()


# ---- the TensorRT engine cache ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GpuInfo:
    """The GPU an engine is built for: marketing name (``NVIDIA H200``) and compute capability (``9.0``)."""

    name: str
    compute_capability: str


def _import_onnxruntime() -> ModuleType:
    """``onnxruntime``, imported without importing torch. With onnxruntime-training installed (x86 gateways),
    ``import onnxruntime`` probes for ``ORTModule``, which imports torch wherever it is installed: seconds at every
    start, for nothing that inference uses. Unless torch is already imported, torch is marked absent
    (``sys.modules["torch"] = None``) during the import, so the probe fails quietly, as on a gateway without torch
    (``edge_sdk.backends.ort_backend.import_onnxruntime`` does the same for the training API)."""
    if "onnxruntime" in sys.modules or "torch" in sys.modules:
        return importlib.import_module("onnxruntime")
    sys.modules["torch"] = None  # type: ignore[assignment]  # "import torch" now raises ModuleNotFoundError
    try:
        return importlib.import_module("onnxruntime")
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


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


@dataclass(frozen=True)
class EngineCacheKey:
    """Everything a cached TensorRT engine depends on; an engine is reused only when all fields are equal.

    Attributes:
        gpu_name, compute_capability: from :class:`GpuInfo`.
        tensorrt_version: ``tensorrt.__version__`` of the builder.
        model_sha256: SHA-256 of the ONNX file's bytes.
        precision: ``"fp16"``.
        max_batch: largest batch of the engine's optimisation profile.
    """

    gpu_name: str
    compute_capability: str
    tensorrt_version: str
    model_sha256: str
    precision: str = "fp16"
    max_batch: int = 8

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    def differences(self, other: "EngineCacheKey | None") -> list[str]:
        """Names of the fields that differ from ``other`` (all of them when ``other`` is None)."""
        if other is None:
            return list(self.__dataclass_fields__)
        return [f for f in self.__dataclass_fields__ if getattr(self, f) != getattr(other, f)]


class EngineBuilder(Protocol):
    """Builds and loads engines; :class:`TensorRTBuilder` in production, a fake in tests."""

    version: str

    def build(self, onnx_path: Path, engine_path: Path, *, fp16: bool, max_batch: int) -> None:
        """Write a serialised engine built from ``onnx_path`` to ``engine_path``; raise EngineBuildError."""
        ...

    def load(self, engine_path: Path, *, max_batch: int) -> InferenceEngine:
        """Deserialise a cached engine."""
        ...


class TensorRTBuilder:
    """The real builder: TensorRT's ONNX parser, an FP16 builder config, one optimisation profile for batches
    1..``max_batch`` of the input's static trailing shape.

    Raises:
        TensorRTUnavailableError: ``import tensorrt`` fails.
    """

    def __init__(self, workspace_bytes: int = 1 << 30) -> None:
        try:
            import tensorrt as trt
        except ImportError as exc:
            raise TensorRTUnavailableError(f"TensorRT is not installed ({exc})") from exc
        self._trt = trt
        self.version = str(trt.__version__)
        self._workspace = int(workspace_bytes)

    def build(self, onnx_path: Path, engine_path: Path, *, fp16: bool, max_batch: int) -> None:
        """See :class:`EngineBuilder`. TensorRT's own errors are wrapped in EngineBuildError."""
        trt = self._trt
        try:
            logger = trt.Logger(trt.Logger.WARNING)
            builder = trt.Builder(logger)
            major = int(self.version.split(".")[0])
            flags = 0 if major >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
            network = builder.create_network(flags)
            parser = trt.OnnxParser(network, logger)
            if not parser.parse(Path(onnx_path).read_bytes()):
                errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
                raise EngineBuildError(f"TensorRT cannot parse {onnx_path}: {errors}")
            config = builder.create_builder_config()
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, self._workspace)
            if fp16:
                if not builder.platform_has_fast_fp16:
                    log.warning("inference: this GPU has no fast FP16; TensorRT builds FP16 anyway")
                config.set_flag(trt.BuilderFlag.FP16)
            profile = builder.create_optimization_profile()
            tensor = network.get_input(0)
            tail = tuple(int(d) for d in tensor.shape[1:])
            profile.set_shape(tensor.name, (1, *tail), (max_batch, *tail), (max_batch, *tail))
            config.add_optimization_profile(profile)
            serialized = builder.build_serialized_network(network, config)
        except EngineBuildError:
            raise
        except Exception as exc:  # TensorRT raises untyped RuntimeError/TypeError: wrap at this boundary
            raise EngineBuildError(f"TensorRT build of {onnx_path} failed: {exc}") from exc
        if serialized is None:
            raise EngineBuildError(f"TensorRT build of {onnx_path} returned no engine (see TensorRT's log above)")
        Path(engine_path).write_bytes(bytes(serialized))

    def load(self, engine_path: Path, *, max_batch: int) -> InferenceEngine:
        """See :class:`EngineBuilder`."""
        return TensorRTEngine(engine_path, max_batch=max_batch)


class EngineCache:
    """One cached TensorRT engine per slot name under ``root`` (see the module docstring).

    Args:
        root: cache folder (default ``<wildfed cache>/engines``).
        builder: the engine builder; its ``version`` is the key's TensorRT version.
    """

    def __init__(self, builder: EngineBuilder, root: str | Path | None = None) -> None:
        self.builder = builder
        self.root = Path(root) if root is not None else cache_dir() / "engines"

    def paths(self, name: str) -> tuple[Path, Path]:
        """``(engine file, key file)`` of the slot ``name``."""
        return self.root / f"{name}.engine", self.root / f"{name}.engine.json"

    def key_for(self, onnx_path: str | Path, gpu: GpuInfo, *, max_batch: int) -> EngineCacheKey:
        """The key an engine for ``onnx_path`` on ``gpu`` must carry."""
        return EngineCacheKey(gpu_name=gpu.name, compute_capability=gpu.compute_capability,
                              tensorrt_version=self.builder.version, model_sha256=sha256_file(onnx_path),
                              precision="fp16", max_batch=int(max_batch))

    def _sidecar(self, name: str) -> dict[str, Any] | None:
        engine, keyfile = self.paths(name)
        if not engine.is_file() or not keyfile.is_file():
            return None
        try:
            data = json.loads(keyfile.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def cached_key(self, name: str) -> EngineCacheKey | None:
        """The key stored beside the slot's engine, or None when absent or unreadable."""
        data = self._sidecar(name)
        if data is None:
            return None
        data.pop("engine_sha256", None)
        try:
            return EngineCacheKey(**data)
        except TypeError:
            return None

    def evict(self, name: str) -> None:
        """Delete the slot's engine and its key file (absent files are fine)."""
        engine, keyfile = self.paths(name)
        keyfile.unlink(missing_ok=True)  # key first: no moment where a key vouches for a missing engine
        engine.unlink(missing_ok=True)

    def _engine_intact(self, name: str) -> bool:
        """Whether the slot's engine bytes match the SHA-256 its key file recorded (True for key files written
        before the digest was recorded: the load then decides)."""
        data = self._sidecar(name) or {}
        recorded = data.get("engine_sha256")
        return recorded is None or sha256_file(self.paths(name)[0]) == recorded

    def ensure(self, name: str, onnx_path: str | Path, gpu: GpuInfo, *, max_batch: int = 8) -> tuple[Path, bool]:
        """The engine file for ``onnx_path`` on ``gpu``, building it when no valid one is cached.

        Returns:
            ``(engine path, rebuilt)``.

        Raises:
            EngineBuildError: the build failed (the previous slot contents are left as they were).
        """
        key = self.key_for(onnx_path, gpu, max_batch=max_batch)
        engine, keyfile = self.paths(name)
        old = self.cached_key(name)
        changed = key.differences(old)
        if not changed and self._engine_intact(name):
            log.info("inference: TensorRT engine cache hit for %s (%s, TensorRT %s)", name, gpu.name,
                     key.tensorrt_version)
            return engine, False
        if not changed:
            log.warning("inference: cached TensorRT engine %s does not match the SHA-256 its key recorded "
                        "(corrupt); deleting it and rebuilding", engine)
            self.evict(name)
            reason = "the cached engine was corrupt"
        else:
            reason = "no cached engine" if old is None else "changed: " + ", ".join(
                f"{f} {getattr(old, f)!r} -> {getattr(key, f)!r}" for f in changed)
        log.info("inference: building TensorRT FP16 engine for %s on %s (%s)", name, gpu.name, reason)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=self.root, prefix=f".{name}-", suffix=".engine")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            self.builder.build(Path(onnx_path), tmp, fp16=True, max_batch=int(max_batch))
            digest = sha256_file(tmp)
            keyfile.unlink(missing_ok=True)          # the old key must not vouch for the new engine
            os.replace(tmp, engine)
            keyfile.write_text(json.dumps({**key.to_json(), "engine_sha256": digest}, sort_keys=True, indent=1))
        finally:
            tmp.unlink(missing_ok=True)
        return engine, True

    def open(self, name: str, onnx_path: str | Path, gpu: GpuInfo, *, max_batch: int = 8
             ) -> tuple[InferenceEngine, bool]:
        """:meth:`ensure` the slot's engine and load it; a cached engine that does not load is deleted and rebuilt
        once.

        Returns:
            ``(engine, rebuilt)``.

        Raises:
            TensorRTUnavailableError: TensorRT or CUDA memory is missing (the cached engine is kept).
            EngineBuildError: building failed. EngineError: even a freshly built engine does not load (its files
            are deleted, so no key vouches for it).
        """
        path, rebuilt = self.ensure(name, onnx_path, gpu, max_batch=max_batch)
        try:
            return self.builder.load(path, max_batch=max_batch), rebuilt
        except TensorRTUnavailableError:
            raise
        except EngineError as exc:
            if rebuilt:
                self.evict(name)
                raise
            log.warning("inference: cached TensorRT engine %s does not load (%s); deleting it and rebuilding",
                        path, exc)
            self.evict(name)
        path, _ = self.ensure(name, onnx_path, gpu, max_batch=max_batch)
        try:
            return self.builder.load(path, max_batch=max_batch), True
        except TensorRTUnavailableError:
            raise
        except EngineError:
            self.evict(name)  # a fresh engine that does not load: no key may vouch for it
            raise


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
