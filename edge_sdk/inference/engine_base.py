"""What every inference engine is (:class:`InferenceEngine`: one single-input, single-output model that runs a
float32 batch), the engine errors, and the engine preference ``open_engine`` takes
(:mod:`edge_sdk.inference.engines`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import numpy as np

from shared.errors import WildFedError

__all__ = ["EngineBuildError", "EngineError", "EnginePreference", "InferenceEngine", "TensorRTUnavailableError"]

EnginePreference = Literal["auto", "tensorrt", "ort"]


class EngineError(WildFedError):
    """An inference engine could not be opened or run."""


class TensorRTUnavailableError(EngineError):
    """TensorRT (or the CUDA memory it needs) is not available on this machine."""


class EngineBuildError(EngineError):
    """TensorRT failed to parse the ONNX file or to build an engine from it."""


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
