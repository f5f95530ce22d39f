"""The ONNX Runtime engine (:class:`OrtEngine`): CUDA execution provider where the installed ORT has it, else CPU;
ORT itself imported with torch held off (:func:`_import_onnxruntime`)."""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from types import ModuleType
from typing import Literal

import numpy as np

from edge_sdk.inference.engine_base import EngineError, InferenceEngine

__all__ = ["OrtEngine", "ort_providers"]

log = logging.getLogger("edge_sdk.inference.engines")  # the engines' logger: their log lines as before


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
