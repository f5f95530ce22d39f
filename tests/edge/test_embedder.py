"""The backbone's embedding part exported to ONNX and run by ONNX Runtime (edge_sdk/inference/embedder.py): IR and
opset that ORT 1.19 reads, a dynamic batch, parity with the torch forward pass, the export cache, and the engine
choice of ``engines.open_engine`` (no GPU here: ONNX Runtime)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="exporting the backbone needs torch")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from shared.errors import ConfigError  # noqa: E402
from shared.models import backbone as bb  # noqa: E402

from edge_sdk.inference import embedder as emb  # noqa: E402
from edge_sdk.inference.engines import OrtEngine  # noqa: E402
from tests.support import SHARED_DATA  # noqa: E402

SIZE = 96
ENA24 = SHARED_DATA / "ena24-small"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    try:
        return emb.export_onnx(tmp_path_factory.mktemp("backbone") / "lite0-96.onnx", SIZE)
    except bb.BackboneWeightsError as exc:
        pytest.skip(f"backbone weights unavailable: {exc}")


@pytest.fixture(scope="module")
def torch_model():
    return bb.load_backbone(SIZE)


def test_export_is_readable_by_ort_1_19(exported):
    proto = onnx.load(str(exported))
    assert proto.ir_version <= 10
    assert [o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [emb.OPSET]
    assert emb.onnx_input_size(exported) == SIZE
    (inp,), (out,) = proto.graph.input, proto.graph.output
    assert inp.name == "images" and out.name == "embeddings"
    assert inp.type.tensor_type.shape.dim[0].dim_param  # dynamic batch
    # the ImageNet head is not in the graph: 1280 x 1000 weights would be an initializer of that shape
    assert not any(tuple(t.dims) == (1000, 1280) for t in proto.graph.initializer)


def test_ort_matches_torch_on_random_input_at_several_batch_sizes(exported, torch_model):
    engine = OrtEngine(exported, device="cpu", threads=1)
    x = np.random.default_rng(0).normal(size=(5, 3, SIZE, SIZE)).astype(np.float32)
    with torch.no_grad():
        expected = torch_model.embed(torch.from_numpy(x)).numpy()
    embedder = emb.OnnxEmbedder(engine, SIZE, batch_size=2)  # 2 + 2 + 1: the dynamic batch axis
    got = embedder.embed(x)
    assert got.shape == (5, 1280) and got.dtype == np.float32
    assert np.abs(got - expected).max() < 1e-4
    assert np.abs(expected).max() > 1.0  # not a trivial all-zero comparison
    np.testing.assert_allclose(emb.OnnxEmbedder(engine, SIZE).embed(x[:1]), expected[:1], atol=1e-4)


@pytest.mark.skipif(not (ENA24 / "labels.csv").is_file(), reason=f"ENA24 photos not found at {ENA24}"
                                                                 " (set WILDFED_SHARED_DATA to the data folder)")
def test_ort_matches_torch_on_real_photos(exported, torch_model):
    from PIL import Image

    images = [Image.open(ENA24 / name) for name in ("9455.jpg", "4383.jpg", "5840.jpg")]
    onnx_embedder = emb.OnnxEmbedder(OrtEngine(exported, device="cpu", threads=1), SIZE)
    got = onnx_embedder.embed_images(images)
    expected = bb.embed(torch_model, np.stack([bb.preprocess_image(im, SIZE) for im in images]))
    assert np.abs(got - expected).max() < 1e-4
    assert emb.OnnxEmbedder(OrtEngine(exported, device="cpu"), SIZE).embed_images([]).shape == (0, 1280)


def test_wrong_shape_is_refused(exported):
    embedder = emb.OnnxEmbedder(OrtEngine(exported, device="cpu", threads=1), SIZE)
    with pytest.raises(ValueError, match=r"\(N, 3, 96, 96\)"):
        embedder.embed(np.zeros((1, 3, 112, 112), np.float32))


def test_embedder_onnx_exports_once_per_size_and_backbone(tmp_path, monkeypatch, exported):
    monkeypatch.setenv("WILDFED_CACHE", str(tmp_path))
    monkeypatch.delenv("WILDFED_BACKBONE_ONNX", raising=False)
    calls = []
    real = emb.export_onnx

    def counting(path, size, **kw):
        calls.append(size)
        return real(path, size, **kw)

    monkeypatch.setattr(emb, "export_onnx", counting)
    first = emb.embedder_onnx(SIZE)
    second = emb.embedder_onnx(SIZE)
    assert first == second and calls == [SIZE]
    assert first.parent == tmp_path / "backbone"
    assert first.name == f"efficientnet-lite0-579344248a93-p1-{SIZE}px-opset17.onnx"
    assert emb.onnx_backbone_id(first) == bb.backbone_id("efficientnet-lite0", SIZE)


def test_override_file_must_match_the_size(tmp_path, monkeypatch, exported):
    monkeypatch.setenv("WILDFED_BACKBONE_ONNX", str(exported))
    assert emb.embedder_onnx(SIZE) == exported
    with pytest.raises(ConfigError, match="WILDFED_BACKBONE_ONNX.*96 px"):
        emb.embedder_onnx(112)
    # the file records what it computes: asking for another backbone at the same size is refused
    with pytest.raises(ConfigError, match="WILDFED_BACKBONE_ONNX.*efficientnet-lite0@.*efficientnet-lite1@"):
        emb.embedder_onnx(SIZE, "efficientnet-lite1")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not an onnx file")
    monkeypatch.setenv("WILDFED_BACKBONE_ONNX", str(junk))
    with pytest.raises(ConfigError, match="not an ONNX file"):
        emb.embedder_onnx(SIZE)


def test_open_uses_the_engine_selection_and_falls_back_to_ort(tmp_path, monkeypatch, exported, caplog):
    monkeypatch.setenv("WILDFED_BACKBONE_ONNX", str(exported))

    class NoTensorRT:
        def __init__(self) -> None:
            from edge_sdk.inference.engines import TensorRTUnavailableError

            raise TensorRTUnavailableError("test: no tensorrt")

    from edge_sdk.inference.engines import GpuInfo

    with caplog.at_level(logging.WARNING, logger="edge_sdk.inference.engines"):
        embedder = emb.OnnxEmbedder.open(SIZE, prefer="auto", threads=1, cache_root=tmp_path,
                                         builder_factory=NoTensorRT,
                                         gpu_probe=lambda: GpuInfo("Fake GPU", "9.0"))
    assert embedder.name in ("ort-cpu", "ort-cuda")
    assert any("falling back to ONNX Runtime" in r.getMessage() and "efficientnet_lite0_96px" in r.getMessage()
               for r in caplog.records)
    assert embedder.backbone_id == bb.backbone_id("efficientnet-lite0", SIZE)
    x = np.zeros((2, 3, SIZE, SIZE), np.float32)
    assert embedder.embed(x).shape == (2, 1280)


def test_torch_embedder_has_the_same_interface(torch_model):
    te = emb.TorchEmbedder(SIZE)
    x = np.random.default_rng(2).normal(size=(2, 3, SIZE, SIZE)).astype(np.float32)
    np.testing.assert_array_equal(te.embed(x), bb.embed(torch_model, x))
    assert te.name == "torch" and te.input_size == SIZE
    assert te.backbone == "efficientnet-lite0" and te.backbone_id == bb.backbone_id("efficientnet-lite0", SIZE)
