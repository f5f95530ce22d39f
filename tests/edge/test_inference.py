"""Inference pieces that need no downloaded weights: NMS, decoding, preprocessing, the classifier graph, records,
output formats and signed publishing."""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shared.envelope import Envelope, MessageKind, verify
from shared.errors import PayloadError
from shared.keys import generate_signing_key
from shared.models.yolox_tiny import grid_and_strides
from shared.protocol import Detection, DetectionRecord, decode_detection, encode_detection
from shared.topics import detection_topic

from edge_sdk.inference.classifier import SpeciesClassifier, crop
from edge_sdk.inference.detector import YoloxDetector, box_iou, nms, postprocess, preprocess
from edge_sdk.inference.engines import InferenceEngine, OrtEngine
from edge_sdk.inference.formats import (megadetector_json, media_rows, observation_rows, validate_megadetector,
                                        write_csv, MEDIA_COLUMNS, OBSERVATION_COLUMNS)
from edge_sdk.inference.records import DetectionPipeline, DetectionPublisher, find_images, read_timestamp
from edge_sdk.uplink.transport import InMemoryBroker, InMemoryTransport


def tiny_onnx(seed: int = 0) -> "onnx.ModelProto":
    """A small valid ONNX graph (Gemm, Tanh; input ``images`` (batch, 8)) for engine and cache tests."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).standard_normal((4, 8)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["images", "w"], ["g"], transB=1), helper.make_node("Tanh", ["g"], ["logits"])],
        "tiny", [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


FAKE_BACKBONE_SIZE = 32


def fake_backbone_onnx(path: Path, seed: int = 0) -> Path:
    """A stand-in for the exported backbone with its interface (``images`` (batch, 3, 32, 32) -> ``embeddings``
    (batch, 1280)): the per-channel means times a fixed (3, 1280) matrix, then ReLU. Lets the classifier run on
    ONNX Runtime without torch or the real weights; the expected embedding is computable in numpy
    (:func:`fake_backbone_numpy`)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    m = fake_backbone_matrix(seed)
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["images"], ["mean"], axes=[2, 3], keepdims=0),
         helper.make_node("MatMul", ["mean", "m"], ["z"]), helper.make_node("Relu", ["z"], ["embeddings"])],
        "fake_backbone",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, FAKE_BACKBONE_SIZE,
                                                                     FAKE_BACKBONE_SIZE])],
        [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", 1280])],
        [numpy_helper.from_array(m, "m")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def fake_backbone_matrix(seed: int = 0) -> np.ndarray:
    """The (3, 1280) matrix of :func:`fake_backbone_onnx`."""
    return np.random.default_rng(seed).standard_normal((3, 1280)).astype(np.float32)


def fake_backbone_numpy(images: list[Image.Image], seed: int = 0) -> np.ndarray:
    """What :func:`fake_backbone_onnx` gives for PIL images, computed in numpy (the preprocessing written out:
    RGB, bicubic resize to 32x32, (pixel - 127) / 128)."""
    rows = []
    for im in images:
        px = np.asarray(im.convert("RGB").resize((FAKE_BACKBONE_SIZE, FAKE_BACKBONE_SIZE),
                                                 Image.Resampling.BICUBIC), dtype=np.float64)
        rows.append(((px - 127.0) / 128.0).mean(axis=(0, 1)))
    return np.maximum(np.asarray(rows) @ fake_backbone_matrix(seed).astype(np.float64), 0.0)


def random_head_weights(num_classes: int = 4, adapter_width: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """Head-model-shaped float32 weights (``shared.models.head``; no torch needed)."""
    from shared.models.head import HeadConfig, initial_weights

    return initial_weights(HeadConfig(num_classes, adapter_width=adapter_width), seed, head_init="uniform")


# ---- NMS and decoding -------------------------------------------------------------------------------------------

def test_nms_hand_worked_case():
    # Prepare: A (score .9) and B (.8) overlap: intersection 8x10 = 80, union 100 + 100 - 80 = 120, IoU 2/3 > 0.45
    # -> B suppressed. C (.7) overlaps A by 2x10 = 20, union 180, IoU 1/9 -> kept. D (.95) is far away -> kept.
    # E (.6) overlaps C: C = [8,0,18,10], E = [12,0,22,10]: inter 6x10 = 60, union 140, IoU 0.4286 <= 0.45 -> kept.
    boxes = np.array([[0, 0, 10, 10], [2, 0, 12, 10], [8, 0, 18, 10], [100, 100, 110, 110], [12, 0, 22, 10]], float)
    scores = np.array([0.9, 0.8, 0.7, 0.95, 0.6])
    # Execute
    keep = nms(boxes, scores, 0.45)
    # Assert: highest score first
    assert keep.tolist() == [3, 0, 2, 4]
    np.testing.assert_allclose(box_iou(boxes[0], boxes[1:2]), [80 / 120])
    np.testing.assert_allclose(box_iou(boxes[2], boxes[4:5]), [60 / 140])
    # a lower threshold drops E too (0.4286 > 0.4)
    assert nms(boxes, scores, 0.4).tolist() == [3, 0, 2]
    assert nms(np.zeros((0, 4)), np.zeros(0)).tolist() == []


def test_postprocess_decodes_thresholds_and_maps_back():
    # Prepare: raw head output with two confident anchors at stride 8 and one weak one.
    grid, strides = grid_and_strides()
    raw = np.zeros((len(grid), 6), np.float32)
    raw[:, 4] = 0.01
    raw[:, 5] = 0.5
    # anchor (x=10, y=5) at stride 8: centre (10 + 0.5) * 8 = 84, (5 + 0.5) * 8 = 44; w = exp(log 4) * 8 = 32, h = 16
    i = 5 * 80 + 10
    assert grid[i].tolist() == [10, 5] and strides[i, 0] == 8
    raw[i] = [0.5, 0.5, np.log(4), np.log(2), 0.9, 0.8]                 # score 0.72
    raw[i + 1] = [0.5, 0.5, np.log(4), np.log(2), 0.9, 0.5]             # same box shifted 8 px: IoU 24/40 -> gone
    raw[100 * 0 + 30] = [0.0, 0.0, 0.0, 0.0, 0.5, 0.49]                  # score 0.245 < 0.25: dropped
    # Execute: the original image was 1280x960 -> ratio 0.5
    boxes = postprocess(raw, ratio=0.5, width=1280, height=960)
    # Assert
    assert len(boxes) == 1
    b = boxes[0]
    assert b.score == pytest.approx(0.72)
    assert (b.x1, b.y1, b.x2, b.y2) == pytest.approx(((84 - 16) / 0.5, (44 - 8) / 0.5, (84 + 16) / 0.5,
                                                     (44 + 8) / 0.5))
    assert b.normalised_xywh(1280, 960) == pytest.approx((136 / 1280, 72 / 960, 64 / 1280, 32 / 960))


def test_postprocess_clips_boxes_to_the_image():
    grid, _ = grid_and_strides()
    raw = np.zeros((len(grid), 6), np.float32)
    raw[0] = [0.0, 0.0, np.log(10), np.log(10), 1.0, 1.0]  # centre (0, 0), 80 px wide: half outside
    (b,) = postprocess(raw, ratio=1.0, width=50, height=40)
    assert (b.x1, b.y1, b.x2, b.y2) == pytest.approx((0.0, 0.0, 40.0, 40.0))
    x, y, w, h = b.normalised_xywh(50, 40)
    assert 0 <= x and 0 <= y and x + w <= 1 and y + h <= 1


def test_preprocess_pads_top_left_with_black_and_keeps_0_255():
    image = Image.new("RGB", (320, 160), (200, 100, 50))
    x, ratio = preprocess(image)
    assert x.shape == (3, 640, 640) and x.dtype == np.float32 and ratio == 2.0
    assert x[:, :320, :].mean(axis=(1, 2)) == pytest.approx([200, 100, 50], abs=0.5)
    assert np.all(x[:, 320:, :] == 0)


class _FixedEngine(InferenceEngine):
    """Returns the same raw output for every image."""

    name = "fake"

    def __init__(self, raw: np.ndarray) -> None:
        self.raw = raw
        self.calls = 0

    def run(self, batch: np.ndarray) -> np.ndarray:
        self.calls += 1
        assert batch.shape[1:] == (3, 640, 640)
        return np.repeat(self.raw[None], len(batch), axis=0)


def fixed_detector() -> YoloxDetector:
    grid, _ = grid_and_strides()
    raw = np.zeros((len(grid), 6), np.float32)
    i = 20 * 80 + 20  # anchor (20, 20) at stride 8: centre (160, 160), 64 x 64 input pixels
    raw[i] = [0.0, 0.0, np.log(8), np.log(8), 0.9, 0.9]
    return YoloxDetector(_FixedEngine(raw), batch_size=4)


# ---- classifier -------------------------------------------------------------------------------------------------

@pytest.fixture
def fake_backbone(tmp_path, monkeypatch) -> Path:
    """The classifier's backbone replaced by :func:`fake_backbone_onnx` (through ``$WILDFED_BACKBONE_ONNX``, the
    gateway's own override), engines and caches in ``tmp_path``."""
    monkeypatch.setenv("WILDFED_CACHE", str(tmp_path / "cache"))
    path = fake_backbone_onnx(tmp_path / "fake-backbone.onnx")
    monkeypatch.setenv("WILDFED_BACKBONE_ONNX", str(path))
    return path


def test_head_logits_match_the_torch_head_model():
    torch = pytest.importorskip("torch")
    from shared.models.head import HeadConfig, build_model
    from shared.models.state import load_numpy_state

    from edge_sdk.inference.classifier import head_logits

    x = np.random.default_rng(1).random((7, 1280), dtype=np.float32) * 6
    for width in (16, 0):  # with the adapter, and head only
        weights = random_head_weights(5, adapter_width=width, seed=3)
        model = build_model(HeadConfig(5, adapter_width=width))
        load_numpy_state(model, weights)
        with torch.no_grad():
            expected = model(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(head_logits(weights, x), expected, rtol=1e-5, atol=1e-5)


def test_head_logits_hand_worked_case():
    from edge_sdk.inference.classifier import head_logits

    # head only: logits = x W^T + b with x = e_0 + 2 e_1, W rows (1, 0, ...), (0, 1, ...)
    w = np.zeros((2, 1280), np.float32)
    w[0, 0], w[1, 1] = 1.0, 1.0
    x = np.zeros((1, 1280), np.float32)
    x[0, 0], x[0, 1] = 1.0, 2.0
    out = head_logits({"psi.weight": w, "psi.bias": np.array([0.5, -0.5], np.float32)}, x)
    np.testing.assert_allclose(out, [[1.5, 1.5]])
    # adapter of width 1 = tanh(x_0), head weights (2, -1): logits = (2 tanh 1, -tanh 1)
    a = np.zeros((1, 1280), np.float32)
    a[0, 0] = 1.0
    out = head_logits({"phi.0.weight": a, "phi.0.bias": np.zeros(1, np.float32),
                       "psi.weight": np.array([[2.0], [-1.0]], np.float32),
                       "psi.bias": np.zeros(2, np.float32)}, x)
    np.testing.assert_allclose(out, [[2 * np.tanh(1.0), -np.tanh(1.0)]], rtol=1e-6)


def test_crop_is_the_backbone_square_and_survives_degenerate_boxes():
    image = Image.new("RGB", (100, 80), (255, 0, 0))
    c = crop(image, (10.2, 5.5, 40.0, 30.0))  # 29.8 x 24.5 -> a 30 px square centred on (25.1, 17.75)
    assert c.mode == "RGB" and c.size == (30, 30)
    assert crop(image, (99.9, 79.9, 99.9, 79.9)).size == (1, 1)
    assert crop(image, (0, 0, 100, 80)).size == (100, 80)  # side 100, cut by the image's height only


def test_species_classifier_probabilities_are_softmax_of_backbone_then_head(fake_backbone):
    weights = random_head_weights(4, seed=2)
    clf = SpeciesClassifier.from_weights(weights, class_names={0: "Vulpes vulpes"}, prefer="ort",
                                         input_size=FAKE_BACKBONE_SIZE)
    crops = [Image.new("RGB", (50, 50), c) for c in ((200, 30, 30), (30, 200, 30), (30, 30, 200))]
    p = clf.probabilities(crops)
    # independently: numpy backbone stand-in, then the head in float64, then softmax
    e = fake_backbone_numpy(crops)
    h = np.tanh(e @ weights["phi.0.weight"].T.astype(np.float64) + weights["phi.0.bias"])
    z = h @ weights["psi.weight"].T.astype(np.float64) + weights["psi.bias"]
    expected = np.exp(z - z.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(p, expected, rtol=1e-4, atol=1e-6)
    assert clf.class_names == {0: "Vulpes vulpes", 1: "class_1", 2: "class_2", 3: "class_3"}
    assert clf.engine_name == "ort-cpu" and clf.classifier_id.startswith("head@")
    assert clf.probabilities([]).shape == (0, 4)


def test_classifier_refuses_camera_cnn_weights_naming_the_fix(fake_backbone, tmp_path):
    from shared.codec import encode_tensors
    from shared.errors import ConfigError

    from edge_sdk.inference.classifier import load_classifier_weights

    cnn = {"phi.0.weight": np.zeros((16, 1, 3, 3), np.float32), "phi.0.bias": np.zeros(16, np.float32),
           "psi.weight": np.zeros((4, 64), np.float32), "psi.bias": np.zeros(4, np.float32)}
    path = tmp_path / "cnn.safetensors"
    path.write_bytes(encode_tensors(cnn))
    with pytest.raises(ConfigError, match="head model"):
        load_classifier_weights(path)
    with pytest.raises(ConfigError, match="head model"):
        SpeciesClassifier.from_weights(cnn, input_size=FAKE_BACKBONE_SIZE, prefer="ort")


def test_opening_the_classifier_removes_retired_camera_cnn_files(fake_backbone, tmp_path):
    folder = tmp_path / "cache" / "classifier"
    folder.mkdir(parents=True)
    (folder / "camera_cnn-0123456789ab.onnx").write_bytes(b"old")
    (folder / "keep.txt").write_text("not ours")
    SpeciesClassifier.from_weights(random_head_weights(3), input_size=FAKE_BACKBONE_SIZE, prefer="ort")
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"]


# ---- records, timestamps, formats -------------------------------------------------------------------------------

def _jpeg_with_exif(path: Path, when: str | None, size=(120, 90), offset: str | None = None) -> Path:
    image = Image.new("RGB", size, (90, 120, 60))
    exif = Image.Exif()
    if when is not None:
        exif.get_ifd(0x8769)[36867] = when
        if offset is not None:
            exif.get_ifd(0x8769)[36881] = offset
    image.save(path, exif=exif)
    return path


def test_timestamps_from_exif_with_offset_and_from_mtime(tmp_path):
    a = _jpeg_with_exif(tmp_path / "a.jpg", "2009:04:21 00:40:00")
    b = _jpeg_with_exif(tmp_path / "b.jpg", "2009:04:21 00:40:00", offset="+02:00")
    c = _jpeg_with_exif(tmp_path / "c.jpg", None)
    os.utime(c, (1_600_000_000, 1_600_000_000))
    with Image.open(a) as im:
        assert read_timestamp(a, im) == ("2009-04-21T00:40:00+00:00", "exif")
        zone = dt.timezone(dt.timedelta(hours=-5))
        assert read_timestamp(a, im, utc_offset=zone) == ("2009-04-21T00:40:00-05:00", "exif")
    with Image.open(b) as im:
        assert read_timestamp(b, im) == ("2009-04-21T00:40:00+02:00", "exif")
    with Image.open(c) as im:
        assert read_timestamp(c, im) == ("2020-09-13T12:26:40+00:00", "mtime")


def test_pipeline_gives_every_image_a_record_even_unreadable_ones(tmp_path):
    folder = tmp_path / "cam"
    (folder / "sub").mkdir(parents=True)
    _jpeg_with_exif(folder / "a.jpg", "2020:01:02 03:04:05", size=(640, 480))
    _jpeg_with_exif(folder / "sub" / "b.jpg", None, size=(320, 240))
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    (folder / "notes.txt").write_text("ignored")
    images = find_images([folder])
    assert [n for _, n in images] == ["a.jpg", "broken.jpg", "sub/b.jpg"]
    from edge_sdk.inference.embedder import OnnxEmbedder

    embedder = OnnxEmbedder(OrtEngine(fake_backbone_onnx(tmp_path / "fb.onnx"), device="cpu"), FAKE_BACKBONE_SIZE)
    clf = SpeciesClassifier(embedder, random_head_weights(4), class_names=["A a", "B b", "C c", "D d"],
                            model_hash="f" * 64)
    pipeline = DetectionPipeline(fixed_detector(), clf, deployment_id="dep-1")
    seen = []
    records = list(pipeline.run(images, on_record=seen.append))
    assert [r.file for r in records] == ["a.jpg", "broken.jpg", "sub/b.jpg"] and seen == records
    a, broken, b = records
    assert broken.failure and broken.detections == () and broken.width == 0
    assert a.timestamp == "2020-01-02T03:04:05+00:00" and a.timestamp_source == "exif"
    assert b.timestamp_source == "mtime"
    for rec in (a, b):
        assert rec.deployment_id == "dep-1" and rec.classifier_hash == "f" * 64 and len(rec.detections) == 1
        d = rec.detections[0]
        x, y, w, h = d.bbox
        assert 0 <= x <= x + w <= 1 and 0 <= y <= y + h <= 1
        assert d.species in {"A a", "B b", "C c", "D d"} and 0 < d.species_confidence <= 1
        assert decode_detection(encode_detection(rec)) == rec
    # 640x480 -> ratio 1: the box [128, 192] stays in pixels; 320x240 -> ratio 2: halved
    # the box as stored: six decimals (edge_sdk.data.crops.stored_bbox)
    assert a.detections[0].bbox == tuple(round(v, 6) for v in (128 / 640, 128 / 480, 64 / 640, 64 / 480))
    assert b.detections[0].bbox == tuple(round(v, 6) for v in (64 / 320, 64 / 240, 32 / 320, 32 / 240))
    assert len(pipeline.classifications[a.media_id][0]) == 3


def sample_records() -> list[DetectionRecord]:
    det = Detection("animal", 0.91, (0.1, 0.2, 0.3, 0.4), "Vulpes vulpes", 2, 0.8)
    return [
        DetectionRecord(media_id="a" * 32, file="A/x.jpg", deployment_id="d1", timestamp="2020-01-01T00:00:00+00:00",
                        timestamp_source="exif", width=100, height=80, detections=(det,), detector="yolox",
                        classifier_hash="c" * 64),
        DetectionRecord(media_id="b" * 32, file="A/y.jpg", deployment_id="d1", timestamp="2020-01-01T00:01:00+00:00",
                        timestamp_source="exif", width=100, height=80, detector="yolox"),
        DetectionRecord(media_id="c" * 32, file="A/z.jpg", deployment_id="d1", timestamp="2020-01-01T00:02:00+00:00",
                        timestamp_source="mtime", width=0, height=0, detector="yolox", failure="Failure image access"),
    ]


def test_megadetector_json_has_the_required_structure(tmp_path):
    md = megadetector_json(sample_records(), detector="yolox", classifier="cnn",
                           class_names={0: "A a", 1: "B b", 2: "Vulpes vulpes"},
                           classifications={"a" * 32: [[(2, 0.8), (0, 0.15), (1, 0.05)]]})
    assert validate_megadetector(md) == []
    assert md["info"]["format_version"] == "1.4"
    assert md["detection_categories"] == {"1": "animal"}
    assert md["classification_categories"] == {"0": "A a", "1": "B b", "2": "Vulpes vulpes"}
    x, y, z = md["images"]
    assert x["file"] == "A/x.jpg" and x["detections"][0] == {
        "category": "1", "conf": 0.91, "bbox": [0.1, 0.2, 0.3, 0.4],
        "classifications": [["2", 0.8], ["0", 0.15], ["1", 0.05]]}
    assert y["detections"] == [] and "failure" not in y
    assert z["detections"] is None and z["failure"] == "Failure image access"
    json.loads(json.dumps(md))  # plain JSON


@pytest.mark.parametrize("breakage, message", [
    (lambda d: d.pop("info"), "missing required field 'info'"),
    (lambda d: d["info"].pop("format_version"), "format_version"),
    (lambda d: d.pop("detection_categories"), "detection_categories"),
    (lambda d: d["images"][0].pop("file"), "has no file"),
    (lambda d: d["images"][0]["detections"][0].update(conf=1), "is not a float"),
    (lambda d: d["images"][0]["detections"][0].update(category="7"), "not in detection_categories"),
    (lambda d: d["images"][0]["detections"][0].update(bbox=[0.9, 0.1, 0.3, 0.1]), "inside the image"),
    (lambda d: d["images"][0]["detections"][0].update(classifications=[["0", 0.1], ["1", 0.9]]), "descending"),
    (lambda d: d["images"][1].update(detections=None), "detections must be a list"),
    (lambda d: d["images"][2].update(detections=[]), "null detections"),
])
def test_megadetector_validator_catches_broken_files(breakage, message):
    md = megadetector_json(sample_records(), detector="yolox")
    breakage(md)
    errors = validate_megadetector(md)
    assert errors and any(message in e for e in errors), errors


def test_camtrap_dp_observation_and_media_rows(tmp_path):
    records = sample_records()
    rows = observation_rows(records, classified_by="yolox + cnn", classification_timestamp="2026-01-01T00:00:00Z")
    assert [(r["observationID"], r["observationType"]) for r in rows] == [
        ("a" * 32 + "_1", "animal"), ("b" * 32 + "_0", "blank"), ("c" * 32 + "_0", "unclassified")]
    animal = rows[0]
    assert animal["scientificName"] == "Vulpes vulpes" and animal["observationLevel"] == "media"
    assert (animal["bboxX"], animal["bboxY"], animal["bboxWidth"], animal["bboxHeight"]) == (
        "0.100000", "0.200000", "0.300000", "0.400000")  # six decimals: the stored box (edge_sdk.data.crops)
    assert animal["classificationMethod"] == "machine" and animal["classificationProbability"] == "0.800"
    assert animal["eventStart"] == animal["eventEnd"] == "2020-01-01T00:00:00+00:00"
    path = write_csv(tmp_path / "observations.csv", OBSERVATION_COLUMNS, rows)
    with path.open() as fh:
        read = list(csv.DictReader(fh))
    assert list(read[0]) == list(OBSERVATION_COLUMNS) and len(read) == 3
    for required in ("observationID", "deploymentID", "eventStart", "eventEnd", "observationLevel",
                     "observationType"):
        assert all(r[required] for r in read)
    media = media_rows(records)
    assert media[0]["mediaID"] == "a" * 32 and media[0]["filePath"] == "A/x.jpg"
    assert media[0]["fileMediatype"] == "image/jpeg"
    # every row marks where its timestamp came from; a file-time guess says what it is
    from shared.camtrap_dp import timestamp_source

    assert [timestamp_source(m["mediaComments"]) for m in media] == [r.timestamp_source for r in records]
    assert media[2]["mediaComments"] == "timestampSource:mtime"
    read = list(csv.DictReader(write_csv(tmp_path / "media.csv", MEDIA_COLUMNS, media).open()))
    assert [r["mediaComments"] for r in read] == [m["mediaComments"] for m in media]


# ---- the wire ---------------------------------------------------------------------------------------------------

def test_detection_record_codec_rejects_bad_records():
    rec = sample_records()[0]
    assert decode_detection(encode_detection(rec)) == rec
    with pytest.raises(PayloadError):
        Detection("animal", 0.5, (0.8, 0.1, 0.3, 0.1))  # past the right edge
    with pytest.raises(PayloadError):
        Detection("animal", 1.5, (0.1, 0.1, 0.1, 0.1))
    with pytest.raises(PayloadError):
        DetectionRecord(media_id="m", file="f", deployment_id="d", timestamp="t", timestamp_source="exif",
                        width=0, height=10)
    from shared.codec import encode_tensors

    body = json.dumps({**rec.to_json(), "extra": 1})
    with pytest.raises(PayloadError, match="unknown fields"):
        decode_detection(encode_tensors({}, {"wildfed": body}))
    with pytest.raises(PayloadError, match="no tensors"):
        decode_detection(encode_tensors({"x": np.zeros(1, np.float32)}, {"wildfed": json.dumps(rec.to_json())}))


def test_publisher_signs_each_record_on_the_site_detection_topic():
    broker = InMemoryBroker()
    transport = InMemoryTransport(broker)
    transport.connect()
    key = generate_signing_key()
    publisher = DetectionPublisher(transport, private_key=key, federation_id="fed", site_id="site-1",
                                   first_sequence=10)
    records = sample_records()
    assert all(publisher.publish(r) for r in records)
    assert publisher.published == 3 and publisher.failed == []
    for i, (topic, raw) in enumerate(broker.published):
        assert topic == detection_topic("fed", "site-1")
        env = Envelope.from_bytes(raw)
        verify(env, key.public_key())
        assert env.header.kind is MessageKind.DETECTION and env.header.sequence == 10 + i
        assert decode_detection(env.payload) == records[i]
    transport.go_offline()
    assert publisher.publish(records[0]) is False and publisher.failed == ["a" * 32]


def test_published_records_are_verified_and_stored_by_the_coordinator(tmp_path):
    """Edge publisher -> (bridge standing in for the broker) -> coordinator detection ingest."""
    from shared.keys import public_key_to_pem

    from coordinator.service import Coordinator
    from coordinator.transport import InMemoryTransport as CoordinatorTransport
    from tests.coordinator.helpers import FED, make_config, tiny_weights

    # Prepare: a coordinator on its in-memory bus, one enrolled site, and an edge transport bridged to that bus
    bus = CoordinatorTransport()
    coord = Coordinator(make_config(tmp_path), transport=bus, signing_key=generate_signing_key(),
                        initial_weights=tiny_weights())
    coord.start()
    key = generate_signing_key()
    coord.enrol("site-7", public_key_to_pem(key.public_key()))
    broker = InMemoryBroker()
    edge = InMemoryTransport(broker)
    edge.connect()
    broker_subscriber = InMemoryTransport(broker)
    broker_subscriber.connect()
    broker_subscriber.subscribe("#", bus.publish)
    publisher = DetectionPublisher(edge, private_key=key, federation_id=FED, site_id="site-7")
    # Execute
    records = sample_records()
    assert all(publisher.publish(r) for r in records)
    # Assert
    assert coord.detections.records("site-7") == records
    assert coord.status().rejections == {}
    coord.close()


def test_find_images_names_are_unique_across_several_folders(tmp_path):
    for cam in ("cam1", "cam2"):
        (tmp_path / cam).mkdir()
        Image.new("RGB", (8, 8)).save(tmp_path / cam / "IMG_0001.JPG")
    assert [n for _, n in find_images([tmp_path / "cam1", tmp_path / "cam2"])] == ["cam1/IMG_0001.JPG",
                                                                                  "cam2/IMG_0001.JPG"]
    assert [n for _, n in find_images([tmp_path / "cam1"])] == ["IMG_0001.JPG"]
    assert [n for _, n in find_images([tmp_path / "cam2" / "IMG_0001.JPG"])] == ["IMG_0001.JPG"]
    with pytest.raises(FileNotFoundError):
        find_images([tmp_path / "nope"])


def test_a_photo_has_one_media_id_wherever_it_lies():
    import hashlib

    from edge_sdk.inference.formats import media_rows
    from shared.camtrap_dp import media_id
    from shared.protocol import DetectionRecord

    data = b"\xff\xd8same jpeg bytes"
    assert media_id(data) == hashlib.sha256(data).hexdigest()[:32]  # the bytes alone: name and folder do not count
    assert media_id(data) != media_id(data + b"x")
    records = [DetectionRecord(media_id=media_id(data), file=name, deployment_id="d", timestamp="2024-01-01T00:00:00Z",
                               timestamp_source="exif", width=4, height=4) for name in ("A/a.jpg", "A/b.jpg")]
    assert [r["filePath"] for r in media_rows(records)] == ["A/a.jpg"]  # one media row per photo
