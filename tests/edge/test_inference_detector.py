"""The real YOLOX-tiny detector: zamba's checkpoint, its ONNX export, and the camtrapR sample photos.

Needs the detector checkpoint, fetched once from the ``zamba==2.7.2`` wheel into ``$WILDFED_CACHE`` (default
``~/.cache/wildfed``); the tests skip with the reason when the download fails. The photo tests skip when
``../shared/data/camtrapr-sample`` is absent.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from edge_sdk.inference.detector import YoloxDetector, detector_onnx, postprocess, preprocess
from edge_sdk.inference.engines import OrtEngine
from edge_sdk.inference.formats import validate_megadetector
from edge_sdk.inference.records import find_images
from edge_sdk.inference.run import run_detection
from edge_sdk.inference.weights import CHECKPOINT_SHA256, WeightsUnavailableError, detector_checkpoint, sha256_file
from tests.support import SHARED_DATA

SAMPLE = SHARED_DATA / "camtrapr-sample"
needs_sample = pytest.mark.skipif(not SAMPLE.is_dir(), reason=f"camtrapR sample photos not found at {SAMPLE}"
                                                              " (set WILDFED_SHARED_DATA to the data folder)")


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    # every use of the checkpoint here (loading it, exporting the detector) needs torch: no 41 MB download without
    pytest.importorskip("torch", reason="the detector's checkpoint is read and exported with torch")
    try:
        return detector_checkpoint(timeout_s=300)
    except WeightsUnavailableError as exc:
        pytest.skip(f"YOLOX-tiny weights unavailable (zamba==2.7.2 download failed): {exc}")


@pytest.fixture(scope="module")
def onnx_path(checkpoint: Path) -> Path:
    pytest.importorskip("torch", reason="exporting the detector needs torch")
    return detector_onnx()


@pytest.fixture(scope="module")
def detector(onnx_path: Path) -> YoloxDetector:
    return YoloxDetector(OrtEngine(onnx_path, device="cpu"), batch_size=8)


def test_the_checkpoint_is_fetched_with_the_gateways_own_python(tmp_path, monkeypatch):
    """The one-time download runs pip under the gateway's interpreter: the zamba wheel's ``Requires-Python >= 3.11``
    must not stop a Python 3.10 gateway (JetPack 6), since nothing of zamba is installed. Skipped only when the
    wheel cannot be had at all (offline)."""
    monkeypatch.setenv("WILDFED_CACHE", str(tmp_path))
    monkeypatch.delenv("WILDFED_YOLOX_WEIGHTS", raising=False)
    try:
        path = detector_checkpoint(timeout_s=300)
    except WeightsUnavailableError as exc:
        assert "different python version" not in str(exc), exc
        pytest.skip(f"zamba==2.7.2 could not be downloaded here: {exc}")
    assert path.parent == tmp_path / "detector" and sha256_file(path) == CHECKPOINT_SHA256


def test_checkpoint_loads_with_no_missing_or_unexpected_keys(checkpoint):
    pytest.importorskip("torch")
    from shared.models.yolox_tiny import build_model, load_checkpoint

    model = build_model()
    state = load_checkpoint(checkpoint)
    result = model.load_state_dict(state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert set(state) == set(model.state_dict())
    assert sum(p.numel() for p in model.parameters()) == 5_032_866  # YOLOX-tiny, one class


def test_onnx_export_loads_in_ort_and_has_ir_at_most_10(onnx_path):
    import onnx

    proto = onnx.load(onnx_path)
    assert proto.ir_version <= 10
    assert [i.name for i in proto.graph.input] == ["images"] and [o.name for o in proto.graph.output] == ["output"]


@needs_sample
def test_onnx_and_torch_agree_on_a_real_photo(checkpoint, detector):
    torch = pytest.importorskip("torch")
    from shared.models.yolox_tiny import load_weights

    path = sorted(SAMPLE.rglob("*.JPG"))[0]
    image = Image.open(path)
    x, ratio = preprocess(image)
    model = load_weights(checkpoint)
    with torch.no_grad():
        expected = model(torch.from_numpy(x[None])).numpy()
    got = detector.engine.run(x[None])
    assert got.shape == expected.shape == (1, 8400, 6)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)
    # the boxes decoded from either agree too (low threshold so there is something to compare)
    a = postprocess(got[0], ratio=ratio, width=image.width, height=image.height, confidence=0.01)
    b = postprocess(expected[0], ratio=ratio, width=image.width, height=image.height, confidence=0.01)
    assert len(a) == len(b) > 0
    for p, q in zip(a, b):
        assert (p.x1, p.y1, p.x2, p.y2, p.score) == pytest.approx((q.x1, q.y1, q.x2, q.y2, q.score), abs=1e-2)


def _check_run(tmp_path: Path, detector: YoloxDetector, paths: list[Path]) -> list:
    images = find_images(paths)
    summary = run_detection(paths, out_dir=tmp_path, deployment_id="camtrapr", detector=detector)
    records = summary.records
    assert len(records) == len(images) and summary.failures == 0
    assert [r.file for r in records] == [n for _, n in images]
    assert len({r.media_id for r in records}) == len(records)
    for r in records:
        assert r.deployment_id == "camtrapr" and r.timestamp_source == "exif" and (r.width, r.height) == (100, 75)
        for d in r.detections:
            x, y, w, h = d.bbox
            assert 0 <= x and 0 <= y and w > 0 and h > 0 and x + w <= 1 + 1e-9 and y + h <= 1 + 1e-9
            assert 0.25 <= d.confidence <= 1 and d.category == "animal"
    # camtrapR's sample names carry the capture time (Station__YYYY-MM-DD__HH-MM-SS(n).JPG); EXIF agrees
    for r in records:
        day, clock = Path(r.file).stem.split("__")[1:3]
        assert r.timestamp == f"{day}T{clock[:8].replace('-', ':')}+00:00"
    md = json.loads(summary.files["megadetector"].read_text())
    assert validate_megadetector(md) == [] and len(md["images"]) == len(images)
    with summary.files["observations"].open() as fh:
        rows = list(csv.DictReader(fh))
    assert {row["mediaID"] for row in rows} == {r.media_id for r in records}
    return records


@needs_sample
def test_one_photo_per_folder_gets_a_record_with_boxes_inside_the_image(tmp_path, detector):
    """The fast version of the next test: the first photo of every station/species folder (10 of 68)."""
    firsts = [sorted(folder.glob("*.JPG"))[0] for folder in sorted({p.parent for p in SAMPLE.rglob("*.JPG")})]
    assert len(firsts) >= 10
    _check_run(tmp_path, detector, firsts)


@pytest.mark.slow
@needs_sample
def test_every_sample_photo_gets_a_record_with_boxes_inside_the_image(tmp_path, detector):
    records = _check_run(tmp_path, detector, [SAMPLE])
    assert len(records) == 68
    assert sum(1 for r in records if r.detections) >= 1  # YOLOX-tiny finds the leopard cat (PBE) in one StationC photo


@needs_sample
def test_cli_detect_with_a_classifier(tmp_path, onnx_path, monkeypatch):
    pytest.importorskip("torch")  # exports the backbone on first use
    from shared.codec import encode_tensors
    from shared.models.head import HeadConfig, initial_weights

    from edge_sdk.cli import app

    photos = tmp_path / "photos"
    for src in sorted(SAMPLE.rglob("*.JPG"))[:3] + [p for p in SAMPLE.rglob("StationC__2009-05-05__18-25-00(1).JPG")]:
        target = photos / src.parent.name / src.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, target)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(encode_tensors(initial_weights(HeadConfig(10), 0, head_init="uniform")))
    monkeypatch.setenv("WILDFED_DETECTOR_ONNX", str(onnx_path))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["detect", str(photos), "--weights", str(weights), "--out", str(out),
                                      "--deployment", "dep-7", "--engine", "ort"])
    assert result.exit_code == 0, result.output
    assert "images: 4" in result.output
    md = json.loads((out / "megadetector.json").read_text())
    assert validate_megadetector(md) == []
    assert md["info"]["classifier"].startswith("head@") and len(md["classification_categories"]) == 10
    classified = [d for im in md["images"] for d in im["detections"]]
    assert all(d["classifications"] for d in classified)
    with (out / "observations.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {r["deploymentID"] for r in rows} == {"dep-7"}
    assert all(r["scientificName"].startswith("class_") for r in rows if r["observationType"] == "animal")
