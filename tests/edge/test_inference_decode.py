"""The detector's reduced JPEG decode (``edge_sdk.inference.decode``) and the concurrent detection pipeline: the
reduction chosen, boxes in the photo's own pixels, crops from the full decode, the same boxes and species as the
full decode on real photos, and the new options' validation."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edge_sdk.data.crops import bbox_square, crop_square, decode_rgb
from edge_sdk.field.photos import PhotoClassifier
from edge_sdk.inference.classifier import SpeciesClassifier
from edge_sdk.inference.decode import decode_for_detection, draft_factor
from edge_sdk.inference.detector import Box, YoloxDetector, find_detector_onnx
from edge_sdk.inference.embedder import OnnxEmbedder, find_embedder_onnx
from edge_sdk.inference.engines import OrtEngine
from edge_sdk.inference.records import DetectionPipeline
from edge_sdk.inference.run import run_detection
from tests.support import SHARED_DATA

ENA24 = SHARED_DATA / "ena24-small"
# one photo of each size in the set: 1920x1080 and 2048x1536 decode at 1/2, 2592x1944 at 1/4
REAL = ("2595.jpg", "2999.jpg", "4451.jpg")


def _jpeg(width: int, height: int, square: tuple[int, int, int, int] | None = None) -> bytes:
    rng = np.random.default_rng(width)
    a = rng.integers(60, 120, (height, width, 3), dtype=np.uint8)
    if square is not None:
        left, top, right, bottom = square
        a[top:bottom, left:right] = (230, 20, 20)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=92)
    return buf.getvalue()


@pytest.mark.parametrize(("size", "factor"), [((2048, 1536), 2), ((2592, 1944), 4), ((1920, 1080), 2),
                                              ((5184, 3456), 8), ((1279, 960), 1), ((1280, 960), 2),
                                              ((1080, 1920), 2), ((100, 75), 1), ((640, 480), 1)])
def test_the_largest_reduction_that_keeps_the_long_side_at_640(size, factor) -> None:
    assert draft_factor(*size) == factor
    assert max(size) // factor >= 640 or factor == 1
    assert factor == 8 or max(size) // (factor * 2) < 640


def test_bad_sizes_are_refused() -> None:
    for args in ((0, 10), (10, 0), (-5, 10)):
        with pytest.raises(ValueError, match="width, height and target"):
            draft_factor(*args)
    with pytest.raises(ValueError, match="target"):
        draft_factor(100, 100, target=0)


def test_a_large_jpeg_decodes_reduced_and_keeps_its_own_size() -> None:
    decoded = decode_for_detection(_jpeg(2048, 1536), draft=True)
    assert decoded.size == (2048, 1536) and decoded.image.size == (1024, 768) and decoded.factor == 2
    assert decoded.image.mode == "RGB"
    full = decode_for_detection(_jpeg(2048, 1536))  # the default: full size
    assert full.image.size == (2048, 1536) and full.factor == 1
    png = io.BytesIO()
    Image.new("RGB", (2048, 1536), (9, 9, 9)).save(png, "PNG")
    assert decode_for_detection(png.getvalue(), draft=True).image.size == (2048, 1536)  # only JPEGs draft


def test_a_truncated_jpeg_still_fails_to_decode() -> None:
    with pytest.raises(OSError):
        decode_for_detection(_jpeg(2048, 1536)[:20_000])


class _ScaledEngineDetector(YoloxDetector):
    """The real ``detect`` (size mapping) on a stub ``raw``: one box at fixed input-image pixels."""

    def __init__(self) -> None:  # noqa: D107 - no engine
        self.confidence, self.iou_threshold, self.batch_size = 0.25, 0.45, 8

    def raw(self, images):
        return np.zeros((len(images), 1, 6), np.float32), [1.0] * len(images)


def test_boxes_of_a_reduced_decode_are_in_the_photos_own_pixels(monkeypatch) -> None:
    import edge_sdk.inference.detector as det

    monkeypatch.setattr(det, "postprocess", lambda raw, **kw: [Box(10.0, 20.0, 110.0, 220.0, 0.9)])
    detector = _ScaledEngineDetector()
    small = Image.new("RGB", (1024, 768))
    (boxes,) = detector.detect([small], [(2048, 1536)])
    assert boxes == [Box(20.0, 40.0, 220.0, 440.0, 0.9)]
    assert detector.detect([small]) == [[Box(10.0, 20.0, 110.0, 220.0, 0.9)]]
    with pytest.raises(ValueError, match="one \\(width, height\\) per image"):
        detector.detect([small], [(2048, 1536), (10, 10)])


class _RedSquare:
    """Finds the red square, reporting it in the photo's own pixels (``sizes``) like ``YoloxDetector``."""

    detector_id, batch_size = "red", 1

    def detect(self, images, sizes=None):
        out = []
        for i, image in enumerate(images):
            a = np.asarray(image).astype(int)
            ys, xs = np.nonzero((a[..., 0] > 180) & (a[..., 1] < 80))
            sx = sy = 1.0
            if sizes is not None:
                sx, sy = sizes[i][0] / image.width, sizes[i][1] / image.height
            out.append([Box(xs.min() * sx, ys.min() * sy, (xs.max() + 1) * sx, (ys.max() + 1) * sy, 0.9)]
                       if len(xs) else [])
        return out


class _MeanColour:
    name, backbone_id, input_size = "stub", "stub", 128

    def embed_images(self, images):
        out = np.zeros((len(images), 1280), np.float32)
        for i, im in enumerate(images):
            out[i, :3] = np.asarray(im, np.float32).reshape(-1, 3).mean(axis=0)
            out[i, 3:5] = im.size
        return out


def test_the_field_loop_crops_from_the_full_decode(tmp_path: Path) -> None:
    data = _jpeg(2048, 1536, square=(400, 300, 800, 700))
    decoded = decode_for_detection(data, draft=True)  # detection on the reduced decode (detect --draft)
    embedder = _MeanColour()
    photos = PhotoClassifier(detector=_RedSquare(), embedder=embedder, model_path=tmp_path / "none",
                             class_names={}, site_classes=set(), threshold=0.5, outside_prior=0.1)
    photos._head = SpeciesClassifier(embedder, {"psi.weight": np.zeros((2, 1280), np.float32),
                                                "psi.bias": np.zeros(2, np.float32)})
    calls = []
    (box,) = photos.classify(decoded.image, size=decoded.size, full=lambda: calls.append(1) or decode_rgb(data))
    assert calls == [1]
    full = decode_rgb(data)
    assert box.square == bbox_square(box.bbox, 2048, 1536)
    assert abs(box.square[0] - 400) <= 2 and abs(box.square[2] - 800) <= 2  # in the photo's own pixels
    np.testing.assert_array_equal(photos.embed(full, [box.square]),
                                  embedder.embed_images([crop_square(full, box.square)]))
    with pytest.raises(ValueError, match="without `full`"):
        photos.classify(decoded.image, size=decoded.size)
    blank = decode_for_detection(_jpeg(2048, 1536), draft=True)
    assert photos.classify(blank.image, size=blank.size, full=lambda: pytest.fail("decoded a blank photo")) == []


def test_workers_keep_the_order_and_the_records(tmp_path: Path) -> None:
    paths = []
    for i in range(7):
        p = tmp_path / f"{i}.jpg"
        p.write_bytes(_jpeg(1400 + i, 1000, square=(100 + 50 * i, 100, 300 + 50 * i, 300) if i % 2 else None))
        paths.append((p, p.name))
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    paths.insert(3, (tmp_path / "broken.jpg", "broken.jpg"))
    one = list(DetectionPipeline(_RedSquare(), deployment_id="d", workers=1).run(paths))
    three = list(DetectionPipeline(_RedSquare(), deployment_id="d", workers=3).run(paths))
    assert [r.file for r in three] == [n for _, n in paths]
    assert three == one
    assert one[3].failure is not None and one[1].width == 1401 and len(one[1].detections) == 1


@pytest.mark.parametrize("workers", [0, -1, 1.5, True, "2"])
def test_bad_worker_counts_are_refused(tmp_path: Path, workers) -> None:
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        DetectionPipeline(_RedSquare(), deployment_id="d", workers=workers)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        run_detection([tmp_path], out_dir=tmp_path / "out", deployment_id="d", workers=workers,
                      detector=_RedSquare())


@pytest.mark.skipif(not all((ENA24 / n).is_file() for n in REAL),
                    reason=f"ENA24 originals not found in {ENA24} (set WILDFED_SHARED_DATA to the data folder)")
def test_real_photos_give_the_same_boxes_and_species_as_the_full_decode() -> None:
    det_path, emb_path = find_detector_onnx(), find_embedder_onnx(128)
    if det_path is None or emb_path is None:
        pytest.skip("the detector's or the backbone's exported graph is not in the WildFed cache")
    detector = YoloxDetector(OrtEngine(det_path, device="cpu", threads=1), batch_size=4)
    embedder = OnnxEmbedder(OrtEngine(emb_path, device="cpu", threads=1), 128)
    rng = np.random.default_rng(7)
    head = SpeciesClassifier(embedder, {"psi.weight": rng.normal(0, 0.05, (7, 1280)).astype(np.float32),
                                        "psi.bias": np.zeros(7, np.float32)})
    images = [(ENA24 / n, n) for n in REAL]
    old = list(DetectionPipeline(detector, head, deployment_id="d", draft=False).run(images))
    new = list(DetectionPipeline(detector, head, deployment_id="d", draft=True, workers=2).run(images))
    for a, b in zip(old, new):
        assert (a.width, a.height) == (b.width, b.height)
        assert a.detections and b.detections, a.file  # (a second, weaker box may fall either side of 0.25)
        ta, tb = a.detections[0], b.detections[0]
        (x1, y1, w1, h1), (x2, y2, w2, h2) = ta.bbox, tb.bbox
        inter = max(0.0, min(x1 + w1, x2 + w2) - max(x1, x2)) * max(0.0, min(y1 + h1, y2 + h2) - max(y1, y2))
        assert inter / (w1 * h1 + w2 * h2 - inter) >= 0.9, a.file
        assert ta.species_index == tb.species_index, a.file


def test_detect_passes_workers_and_draft_and_refuses_zero_workers(tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    import edge_sdk.inference.run as run
    from edge_sdk.cli import app

    seen = {}

    def fake(paths, **kwargs):
        seen.update(kwargs)
        return run.RunSummary()

    monkeypatch.setattr(run, "run_detection", fake)
    runner = CliRunner()
    result = runner.invoke(app, ["detect", str(tmp_path), "--out", str(tmp_path / "o"), "--workers", "3",
                                 "--draft"])
    assert result.exit_code == 0, result.output
    assert seen["workers"] == 3 and seen["draft"] is True
    runner.invoke(app, ["detect", str(tmp_path), "--out", str(tmp_path / "o")])
    assert seen["workers"] is None and seen["draft"] is False  # the full decode unless asked
    refused = runner.invoke(app, ["detect", str(tmp_path), "--workers", "0"])
    assert refused.exit_code == 2 and "workers" in refused.output


@pytest.mark.parametrize(("cores", "engine", "threads", "workers", "expected"),
                         [(2, "ort-cpu", None, None, (2, 1)), (8, "ort-cpu", None, None, (4, 2)),
                          (1, "ort-cpu", None, None, (1, 1)), (2, "ort-cpu", 2, None, (1, 2)),
                          (2, "ort-cuda", None, None, (1, 1)), (2, "ort-cpu", None, 3, (3, None))])
def test_run_detection_picks_one_worker_per_core_on_ort_cpu(tmp_path: Path, monkeypatch, cores, engine, threads,
                                                            workers, expected) -> None:
    import edge_sdk.inference.run as run

    opened, built = {}, {}

    kind = engine

    class Fake(_RedSquare):
        engine = type("E", (), {"name": kind})()

    def fake_open(**kwargs):
        opened.update(kwargs)
        return Fake()

    class Pipeline(DetectionPipeline):
        def __init__(self, *args, **kwargs):
            built.update(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(run.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(run.YoloxDetector, "open", staticmethod(fake_open))
    monkeypatch.setattr(run, "DetectionPipeline", Pipeline)
    run.run_detection([tmp_path], out_dir=tmp_path / "o", deployment_id="d", threads=threads, workers=workers)
    assert (built["workers"], opened["threads"]) == expected
