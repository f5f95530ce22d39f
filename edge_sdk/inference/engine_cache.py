"""The TensorRT engine cache (:class:`EngineCache`): one engine per slot, kept while its key matches.

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
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from edge_sdk.inference.engine_base import EngineError, InferenceEngine, TensorRTUnavailableError
from edge_sdk.inference.weights import cache_dir, sha256_file

__all__ = ["EngineBuilder", "EngineCache", "EngineCacheKey", "GpuInfo"]

log = logging.getLogger("edge_sdk.inference.engines")  # the engines' logger: their log lines as before


@dataclass(frozen=True)
class GpuInfo:
    """The GPU an engine is built for: marketing name (``NVIDIA H200``) and compute capability (``9.0``)."""

    name: str
    compute_capability: str


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
