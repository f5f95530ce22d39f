"""TensorRT engine cache and ORT fallback, with a fake engine builder (no GPU or TensorRT needed)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import onnx
import pytest

from edge_sdk.inference.engines import (EngineBuildError, EngineCache, EngineCacheKey, GpuInfo, InferenceEngine,
                                        OrtEngine, TensorRTUnavailableError, open_engine)
from tests.edge.test_inference import tiny_onnx

H200 = GpuInfo("NVIDIA H200", "9.0")
ORIN = GpuInfo("Orin", "8.7")


class FakeEngine(InferenceEngine):
    name = "tensorrt-fp16"

    def __init__(self, path: Path, max_batch: int) -> None:
        self.path = path
        self.max_batch = max_batch

    def run(self, batch: np.ndarray) -> np.ndarray:
        return np.zeros((len(batch), 1), np.float32)


class FakeBuilder:
    """Records builds; writes the ONNX bytes' length as the 'engine'."""

    def __init__(self, version: str = "10.3.0", fail: bool = False) -> None:
        self.version = version
        self.fail = fail
        self.builds: list[tuple[Path, bool, int]] = []

    def build(self, onnx_path: Path, engine_path: Path, *, fp16: bool, max_batch: int) -> None:
        self.builds.append((onnx_path, fp16, max_batch))
        if self.fail:
            raise EngineBuildError("parser: unsupported node")
        engine_path.write_bytes(f"engine v{self.version} {len(onnx_path.read_bytes())}".encode())

    def load(self, engine_path: Path, *, max_batch: int) -> InferenceEngine:
        return FakeEngine(engine_path, max_batch)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save(tiny_onnx(seed=0), path)
    return path


def test_engine_is_built_once_then_reused(tmp_path, model):
    builder = FakeBuilder()
    cache = EngineCache(builder, tmp_path / "engines")
    path, rebuilt = cache.ensure("cnn", model, H200, max_batch=4)
    assert rebuilt and len(builder.builds) == 1 and builder.builds[0][1:] == (True, 4)  # FP16
    key = json.loads((tmp_path / "engines" / "cnn.engine.json").read_text())
    assert key["gpu_name"] == "NVIDIA H200" and key["compute_capability"] == "9.0"
    assert key["tensorrt_version"] == "10.3.0" and key["precision"] == "fp16" and len(key["model_sha256"]) == 64
    again, rebuilt = cache.ensure("cnn", model, H200, max_batch=4)
    assert again == path and not rebuilt and len(builder.builds) == 1


@pytest.mark.parametrize("change", ["gpu", "capability", "tensorrt", "model", "batch"])
def test_any_key_change_rebuilds(tmp_path, model, change, caplog):
    builder = FakeBuilder()
    root = tmp_path / "engines"
    EngineCache(builder, root).ensure("cnn", model, H200, max_batch=4)
    gpu, batch = H200, 4
    if change == "gpu":
        gpu = ORIN
    elif change == "capability":
        gpu = GpuInfo("NVIDIA H200", "9.1")
    elif change == "tensorrt":
        builder = FakeBuilder(version="10.4.0")
    elif change == "model":
        onnx.save(tiny_onnx(seed=1), model)
    elif change == "batch":
        batch = 8
    with caplog.at_level(logging.INFO, logger="edge_sdk.inference.engines"):
        _, rebuilt = EngineCache(builder, root).ensure("cnn", model, gpu, max_batch=batch)
    assert rebuilt
    assert "changed:" in caplog.text
    sidecar = json.loads((root / "cnn.engine.json").read_text())
    assert sidecar.pop("engine_sha256") == hashlib.sha256((root / "cnn.engine").read_bytes()).hexdigest()
    new_key = EngineCacheKey(**sidecar)
    assert new_key == EngineCache(builder, root).key_for(model, gpu, max_batch=batch)
    assert list(root.glob("*.engine")) == [root / "cnn.engine"]  # one slot, the stale engine replaced


def test_failed_build_leaves_the_old_engine_and_key(tmp_path, model):
    root = tmp_path / "engines"
    EngineCache(FakeBuilder(), root).ensure("cnn", model, H200)
    before = (root / "cnn.engine").read_bytes(), (root / "cnn.engine.json").read_text()
    with pytest.raises(EngineBuildError):
        EngineCache(FakeBuilder(version="11.0", fail=True), root).ensure("cnn", model, H200)
    assert ((root / "cnn.engine").read_bytes(), (root / "cnn.engine.json").read_text()) == before
    assert sorted(p.name for p in root.iterdir()) == ["cnn.engine", "cnn.engine.json"]  # no temp files left


def test_open_engine_uses_tensorrt_when_there_is_a_gpu(tmp_path, model):
    builder = FakeBuilder()
    engine = open_engine(model, name="cnn", cache_root=tmp_path, builder_factory=lambda: builder,
                         gpu_probe=lambda: H200, max_batch=2)
    assert isinstance(engine, FakeEngine) and engine.max_batch == 2 and len(builder.builds) == 1


def test_missing_tensorrt_falls_back_to_ort_with_a_log_line(tmp_path, model, caplog):
    def no_tensorrt():
        raise TensorRTUnavailableError("TensorRT is not installed (No module named 'tensorrt')")

    with caplog.at_level(logging.INFO, logger="edge_sdk.inference.engines"):
        engine = open_engine(model, name="cnn", cache_root=tmp_path, builder_factory=no_tensorrt,
                             gpu_probe=lambda: H200)
    assert isinstance(engine, OrtEngine) and engine.name in ("ort-cpu", "ort-cuda")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "TensorRT is not available" in warnings[0].getMessage()
    assert "falling back to ONNX Runtime" in warnings[0].getMessage()
    assert engine.run(np.zeros((2, 8), np.float32)).shape == (2, 4)


def test_failed_build_falls_back_to_ort_with_a_log_line(tmp_path, model, caplog):
    with caplog.at_level(logging.WARNING, logger="edge_sdk.inference.engines"):
        engine = open_engine(model, name="cnn", cache_root=tmp_path, builder_factory=lambda: FakeBuilder(fail=True),
                             gpu_probe=lambda: H200)
    assert isinstance(engine, OrtEngine)
    assert "TensorRT engine build failed" in caplog.text and "falling back to ONNX Runtime" in caplog.text


def test_no_gpu_never_builds_and_prefer_ort_skips_tensorrt(tmp_path, model, caplog):
    builder = FakeBuilder()
    with caplog.at_level(logging.INFO, logger="edge_sdk.inference.engines"):
        engine = open_engine(model, name="cnn", cache_root=tmp_path, builder_factory=lambda: builder,
                             gpu_probe=lambda: None)
    assert isinstance(engine, OrtEngine) and builder.builds == []
    assert "cnn runs on ONNX Runtime (ort-cpu): no GPU here" in caplog.text and "falling back" not in caplog.text

    def probe_must_not_run():
        raise AssertionError("prefer='ort' must not probe for a GPU")

    engine = open_engine(model, name="cnn", prefer="ort", cache_root=tmp_path, builder_factory=lambda: builder,
                         gpu_probe=probe_must_not_run)
    assert isinstance(engine, OrtEngine) and builder.builds == []


def test_prefer_tensorrt_logs_the_fallback_as_an_error(tmp_path, model, caplog):
    with caplog.at_level(logging.INFO, logger="edge_sdk.inference.engines"):
        open_engine(model, name="cnn", prefer="tensorrt", cache_root=tmp_path, gpu_probe=lambda: None)
    assert any(r.levelno == logging.ERROR and "falling back" in r.getMessage() for r in caplog.records)


def test_an_x86_gateway_without_a_gpu_driver_probes_without_importing_torch(tmp_path) -> None:
    """No ``nvidia-smi``, no NVIDIA driver, not a Jetson: the probe answers None without ``import torch`` (seconds at
    every start of an ORT gateway whose embeddings are not cached yet)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import shutil, sys, types
        from edge_sdk.inference import engines
        shutil.which = lambda name, *a, **k: None                        # no nvidia-smi
        engines.platform.machine = lambda: "x86_64"                      # not a Jetson
        engines.Path = lambda p: types.SimpleNamespace(exists=lambda: False)  # no L4T, no NVIDIA driver
        print(engines.probe_gpu(), "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "False"]


def test_a_jetson_or_an_imported_torch_still_asks_cuda(monkeypatch) -> None:
    """Where nvidia-smi is missing but CUDA may be there, torch's CUDA answers (a stand-in torch here)."""
    import sys
    import types

    from edge_sdk.inference import engines

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True,
                                                            get_device_capability=lambda i: (8, 7),
                                                            get_device_name=lambda i: "Orin"))
    monkeypatch.setattr(engines.shutil, "which", lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert engines.probe_gpu() == GpuInfo("Orin", "8.7")

    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setattr(engines.platform, "machine", lambda: "aarch64")
    assert engines._torch_cuda_worth_asking()
    monkeypatch.setattr(engines.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(engines, "Path", lambda p: types.SimpleNamespace(exists=lambda: p == "/proc/driver/nvidia"))
    assert engines._torch_cuda_worth_asking()
    monkeypatch.setattr(engines, "Path", lambda p: types.SimpleNamespace(exists=lambda: False))
    assert not engines._torch_cuda_worth_asking()


def test_onnx_runtime_inference_runs_without_importing_torch(tmp_path) -> None:
    """``import onnxruntime`` of onnxruntime-training probes ORTModule, which imports torch where installed; the
    inference engine imports ORT with torch held off, so an ORT gateway embeds and classifies without torch."""
    import subprocess
    import sys
    import textwrap

    model = tmp_path / "tiny.onnx"
    onnx.save(tiny_onnx(seed=0), model)
    code = textwrap.dedent(f"""
        import sys
        import numpy as np
        from edge_sdk.inference.engines import open_engine
        engine = open_engine({str(model)!r}, name="tiny", prefer="ort", threads=1)
        out = engine.run(np.ones((2, 8), np.float32))
        print(out.shape, "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["(2,", "4)", "False"]
