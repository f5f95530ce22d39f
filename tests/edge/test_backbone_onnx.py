"""Each backbone variant's ONNX export computes what its torch module computes, on a real camera-trap photo
(edge_sdk/inference/embedder.py with shared/models/backbone.py), and records its backbone id."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="exporting the backbone needs torch")
pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from shared.models import backbone as bb  # noqa: E402

from edge_sdk.inference import embedder as emb  # noqa: E402
from edge_sdk.inference.engines import OrtEngine  # noqa: E402

PHOTOS = Path(__file__).resolve().parents[2] / "wildfed_sim" / "assets" / "ena24"
# the square the project's detector gives on this black-bear photo (tests/shared/test_backbone.py, BEAR_SQUARES),
# scaled to the committed subset's size when that is the copy found
BEAR = ("9455.jpg", (455, 541, 648, 734))


def _bear_crop():
    from PIL import Image

    image = Image.open(PHOTOS / BEAR[0]).convert("RGB")
    scale = image.width / 2048  # the original is 2048 x 1536
    return image.crop(tuple(int(round(v * scale)) for v in BEAR[1]))


@pytest.mark.parametrize(("name", "size"), [("efficientnet-lite0", 224), ("efficientnet-lite1", 240),
                                            ("efficientnet-lite2", 260)])
def test_onnx_export_equals_the_torch_forward_on_a_real_photo(tmp_path, name, size):
    if not (PHOTOS / BEAR[0]).is_file():
        pytest.skip(f"{PHOTOS / BEAR[0]} not found")
    try:
        path = emb.export_onnx(tmp_path / f"{name}-{size}.onnx", size, backbone=name)
    except bb.BackboneWeightsError as exc:
        pytest.skip(f"{name} weights unavailable: {exc}")
    assert emb.onnx_input_size(path) == size
    assert emb.onnx_backbone_id(path) == bb.backbone_id(name, size)
    crop = _bear_crop()
    x = bb.preprocess_image(crop, size)[None]
    onnx_embedder = emb.OnnxEmbedder(OrtEngine(path, device="cpu", threads=1), size, backbone=name)
    got = onnx_embedder.embed_images([crop])
    expected = bb.embed(bb.load_backbone(size, backbone=name), x)
    assert got.shape == (1, 1280) and expected.max() > 1.0  # a real, non-trivial embedding
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)
    assert onnx_embedder.backbone_id == bb.backbone_id(name, size)
