"""The TensorRT engine cache through the real TensorRTBuilder / TensorRTEngine code, with a fake ``tensorrt``
module in ``sys.modules`` (TensorRT cannot be installed on this CPU machine):

- a corrupt engine whose key is intact is deleted and rebuilt once (it used to fall back to ONNX Runtime on every
  run); if the rebuild fails too, the slot is emptied and ONNX Runtime runs, with a WARNING;
- the species classifier keeps ONE backbone engine (slot ``efficientnet_lite0_<S>px``) however many global model
  versions of the head it has seen (the camera CNN used to build one engine per version and never evict any).

The fake implements only the calls the project makes: ``Logger``, ``Builder`` (network, builder config,
optimisation profile, ``build_serialized_network``), ``OnnxParser``, ``Runtime.deserialize_cuda_engine`` (None for
bytes it did not serialise, as TensorRT does for a corrupt file), and the engine's tensor-name API.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest

from edge_sdk.inference.classifier import SpeciesClassifier, engine_slot
from edge_sdk.inference.engines import GpuInfo, OrtEngine, TensorRTEngine, open_engine
from tests.edge.test_inference import FAKE_BACKBONE_SIZE, fake_backbone_onnx, random_head_weights, tiny_onnx

GPU = GpuInfo("NVIDIA Fake", "8.7")
MAGIC = b"FAKE-TRT-ENGINE\n"


def make_fake_tensorrt(*, fail_builds_after: int | None = None) -> types.ModuleType:
    """A ``tensorrt`` stand-in; ``trt.calls`` records builds and deserialisations. With ``fail_builds_after=n``
    every build after the n-th returns None (TensorRT's "no engine")."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.0.1"
    trt.calls = {"builds": 0, "deserialize": []}

    class Logger:
        WARNING = 2

        def __init__(self, level: int) -> None:
            self.level = level

    class Tensor:
        name, shape = "images", (-1, 1, 28, 28)

    class Network:
        onnx = b""

        def get_input(self, index: int) -> Tensor:
            return Tensor()

    class OnnxParser:
        num_errors = 0

        def __init__(self, network: Network, logger: Logger) -> None:
            self.network = network

        def parse(self, data: bytes) -> bool:
            self.network.onnx = bytes(data)
            return True

    class Profile:
        def set_shape(self, name, smallest, optimal, largest) -> None:
            self.shapes = (name, smallest, optimal, largest)

    class Config:
        def set_memory_pool_limit(self, pool, size) -> None:
            pass

        def set_flag(self, flag) -> None:
            pass

        def add_optimization_profile(self, profile: Profile) -> None:
            self.profile = profile

    class Builder:
        platform_has_fast_fp16 = True

        def __init__(self, logger: Logger) -> None:
            pass

        def create_network(self, flags: int) -> Network:
            return Network()

        def create_builder_config(self) -> Config:
            return Config()

        def create_optimization_profile(self) -> Profile:
            return Profile()

        def build_serialized_network(self, network: Network, config: Config) -> bytes | None:
            trt.calls["builds"] += 1
            if fail_builds_after is not None and trt.calls["builds"] > fail_builds_after:
                return None
            return MAGIC + hashlib.sha256(network.onnx).hexdigest().encode()

    class CudaEngine:
        num_io_tensors = 2

        def get_tensor_name(self, index: int) -> str:
            return ("images", "logits")[index]

        def get_tensor_mode(self, name: str) -> str:
            return "in" if name == "images" else "out"

        def create_execution_context(self) -> object:
            return object()

    class Runtime:
        def __init__(self, logger: Logger) -> None:
            pass

        def deserialize_cuda_engine(self, data: bytes) -> CudaEngine | None:
            trt.calls["deserialize"].append(bytes(data))
            return CudaEngine() if bytes(data).startswith(MAGIC) else None

    trt.Logger, trt.Builder, trt.OnnxParser, trt.Runtime = Logger, Builder, OnnxParser, Runtime
    trt.TensorIOMode = types.SimpleNamespace(INPUT="in", OUTPUT="out")
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE=0)
    trt.BuilderFlag = types.SimpleNamespace(FP16=1)
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(EXPLICIT_BATCH=0)
    return trt


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch reports a CUDA device (TensorRTEngine allocates its stream with torch); nothing is run on it."""
    torch = pytest.importorskip("torch", reason="the TensorRT engine allocates its CUDA stream with torch, which this "
                                "interpreter lacks (a gateway installed with wildfed[edge-ort]); the Python 3.11 run "
                                "covers it")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: object())


@pytest.fixture
def trt(monkeypatch, fake_cuda):
    fake = make_fake_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    return fake


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.onnx"
    onnx.save(tiny_onnx(seed=0), path)
    return path


def _open(model: Path, root: Path):
    return open_engine(model, name="cnn", cache_root=root, gpu_probe=lambda: GPU, max_batch=4)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _corrupt_keeping_the_key(root: Path, garbage: bytes) -> None:
    """Overwrite the slot's engine; its key file keeps vouching for it (a recorded digest is updated to match)."""
    (root / "cnn.engine").write_bytes(garbage)
    sidecar = json.loads((root / "cnn.engine.json").read_text())
    if "engine_sha256" in sidecar:
        sidecar["engine_sha256"] = _sha(root / "cnn.engine")
        (root / "cnn.engine.json").write_text(json.dumps(sidecar))


def test_first_open_builds_and_the_second_reuses(tmp_path, model, trt) -> None:
    root = tmp_path / "engines"
    engine = _open(model, root)
    assert isinstance(engine, TensorRTEngine) and trt.calls["builds"] == 1
    assert (root / "cnn.engine").read_bytes() == MAGIC + _sha(model).encode()
    assert json.loads((root / "cnn.engine.json").read_text())["engine_sha256"] == _sha(root / "cnn.engine")
    assert isinstance(_open(model, root), TensorRTEngine) and trt.calls["builds"] == 1  # cache hit


def test_corrupt_engine_with_an_intact_key_is_rebuilt_once(tmp_path, model, trt, caplog) -> None:
    root = tmp_path / "engines"
    _open(model, root)
    # Corrupt the engine and make its key file vouch for the corrupt bytes (the digest check passes): only
    # TensorRT's deserialiser can tell. Before the fix every later open fell back to ONNX Runtime.
    _corrupt_keeping_the_key(root, b"\x00garbage from a bad sector")

    with caplog.at_level(logging.WARNING, logger="edge_sdk.inference.engines"):
        engine = _open(model, root)

    assert isinstance(engine, TensorRTEngine)
    assert trt.calls["builds"] == 2  # exactly one rebuild
    assert (root / "cnn.engine").read_bytes() == MAGIC + _sha(model).encode()  # the corrupt file is gone
    assert json.loads((root / "cnn.engine.json").read_text())["engine_sha256"] == _sha(root / "cnn.engine")
    assert "does not load" in caplog.text and "rebuilding" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["cnn.engine", "cnn.engine.json"]
    # and the next run is a cache hit again
    assert isinstance(_open(model, root), TensorRTEngine) and trt.calls["builds"] == 2


def test_engine_bytes_that_differ_from_the_recorded_digest_are_never_deserialised(tmp_path, model, trt,
                                                                                   caplog) -> None:
    root = tmp_path / "engines"
    _open(model, root)
    truncated = (root / "cnn.engine").read_bytes()[:5]
    (root / "cnn.engine").write_bytes(truncated)  # key file left as it was: its digest no longer matches

    with caplog.at_level(logging.WARNING, logger="edge_sdk.inference.engines"):
        engine = _open(model, root)

    assert isinstance(engine, TensorRTEngine) and trt.calls["builds"] == 2
    assert truncated not in trt.calls["deserialize"]  # detected by the SHA-256, before TensorRT saw it
    assert "does not match the SHA-256" in caplog.text


def test_failed_rebuild_empties_the_slot_and_falls_back_to_ort_with_a_warning(tmp_path, model, monkeypatch,
                                                                              fake_cuda, caplog) -> None:
    trt = make_fake_tensorrt(fail_builds_after=1)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    root = tmp_path / "engines"
    _open(model, root)
    _corrupt_keeping_the_key(root, b"corrupt")

    with caplog.at_level(logging.WARNING, logger="edge_sdk.inference.engines"):
        engine = _open(model, root)

    assert isinstance(engine, OrtEngine)
    assert trt.calls["builds"] == 2  # one rebuild tried, not a loop
    assert list(root.glob("cnn.engine*")) == []  # no key vouches for the corrupt engine any more
    assert "falling back to ONNX Runtime" in caplog.text and "build" in caplog.text
    x = np.random.default_rng(0).random((2, 8), dtype=np.float32)
    assert engine.run(x).shape == (2, 4)


def test_missing_cuda_keeps_a_good_engine(tmp_path, model, trt, monkeypatch) -> None:
    import torch

    root = tmp_path / "engines"
    _open(model, root)
    before = (root / "cnn.engine").read_bytes()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert isinstance(_open(model, root), OrtEngine)
    assert (root / "cnn.engine").read_bytes() == before and trt.calls["builds"] == 1  # not deleted or rebuilt


def test_classifier_keeps_one_backbone_engine_across_model_versions(tmp_path, trt, monkeypatch) -> None:
    monkeypatch.setenv("WILDFED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("WILDFED_BACKBONE_ONNX", str(fake_backbone_onnx(tmp_path / "backbone.onnx")))
    engines = tmp_path / "cache" / "engines"
    engines.mkdir(parents=True)
    # engines of the retired camera CNN, one slot per model version in the earliest naming
    for leftover in ("camera_cnn-0123456789ab.engine", "camera_cnn-0123456789ab.engine.json", "camera_cnn.engine"):
        (engines / leftover).write_bytes(b"old")
    options = {"gpu_probe": lambda: GPU}
    slot = engine_slot(FAKE_BACKBONE_SIZE)

    for seed in (1, 2, 3):  # three global model versions of the head
        classifier = SpeciesClassifier.from_weights(random_head_weights(4, seed=seed), engine_options=options,
                                                    input_size=FAKE_BACKBONE_SIZE)
        assert isinstance(classifier.embedder.engine, TensorRTEngine)
        assert trt.calls["builds"] == 1  # the backbone does not change with the head: built once
        assert sorted(p.name for p in engines.iterdir()) == [f"{slot}.engine", f"{slot}.engine.json"]
        key = json.loads((engines / f"{slot}.engine.json").read_text())
        assert key["model_sha256"] == _sha(tmp_path / "backbone.onnx")
