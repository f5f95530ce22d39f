"""The TensorRT engine (:class:`TensorRTEngine`: a deserialised engine run with torch-allocated CUDA buffers) and
its builder (:class:`TensorRTBuilder`: ONNX -> FP16 engine with one optimisation profile). Both import tensorrt (and
torch) only when made, so importing this module needs neither."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from edge_sdk.inference.engine_base import EngineBuildError, EngineError, InferenceEngine, TensorRTUnavailableError

__all__ = ["TensorRTBuilder", "TensorRTEngine"]

log = logging.getLogger("edge_sdk.inference.engines")  # the engines' logger: their log lines as before


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
