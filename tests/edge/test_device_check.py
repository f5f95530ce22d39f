"""The Python side of ``benchmarks/device_check.sh`` on a CPU machine (the script itself needs a GPU with TensorRT):

- the parity measures on hand-computed cases (max |diff|, cosine; box IoU, score, unmatched strong boxes);
- ``measure`` on a fake clock: no call starts that would end past the deadline;
- the corrupt stage through WildFed's real ``EngineCache`` / ``TensorRTBuilder`` / ``TensorRTEngine`` code with the
  fake ``tensorrt`` module of ``test_inference_trt_cache`` (engine outputs from ONNX Runtime; needs torch): a
  flipped and a truncated engine are each noticed, rebuilt and recorded, and the stage's checks match WildFed's log
  lines;
- the report's statuses and exit codes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from edge_sdk.inference import engines
from edge_sdk.inference.engines import OrtEngine, TensorRTEngine
from tests.edge.test_inference import FAKE_BACKBONE_SIZE, fake_backbone_onnx, tiny_onnx
from tests.edge.test_inference_trt_cache import GPU, MAGIC, make_fake_tensorrt

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _device_common  # noqa: E402
import _device_report  # noqa: E402
import _device_trt  # noqa: E402
from _device_compare import box_parity, embedding_parity  # noqa: E402


def test_embedding_parity_on_hand_computed_values() -> None:
    ref = np.array([[1.0, 0.0], [0.0, 2.0]])
    close = embedding_parity(ref, ref + 0.01)
    # row 0: (1.01, 0.01) . (1, 0) / |(1.01, 0.01)| = 1.01 / sqrt(1.0202)
    assert close["ok"] and close["max_abs"] == pytest.approx(0.01)
    assert close["min_cosine"] == pytest.approx(1.01 / np.sqrt(1.0202))
    far = embedding_parity(ref, np.array([[1.0, 0.1], [0.0, 2.0]]))
    assert not far["ok"] and far["min_cosine"] == pytest.approx(1 / np.sqrt(1.01))  # 0.99504 < 0.9995
    assert not embedding_parity(ref, np.array([[1.0, np.nan], [0.0, 2.0]]))["ok"]
    assert not embedding_parity(ref, ref[:1])["ok"]


def test_box_parity_on_hand_computed_values() -> None:
    ref = [[(10, 10, 110, 110, 0.9, 0)], []]
    # IoU 100*100 / (100*105) = 0.95238; the weak extra box (0.30 < 0.35) is counted, never failed
    ok = box_parity(ref, [[(10, 10, 110, 115, 0.895, 0)], [(0, 0, 5, 5, 0.30, 0)]])
    assert ok["ok"] and ok["checked"] == 1 and ok["unmatched"] == 0
    assert ok["min_iou"] == pytest.approx(100 * 100 / (100 * 105)) and ok["max_score_diff"] == pytest.approx(0.005)
    # IoU 100*100 / (100*120) = 0.833 fails; a strong extra box (0.5) has no match
    bad = box_parity(ref, [[(10, 10, 110, 130, 0.9, 0)], [(0, 0, 50, 50, 0.5, 0)]])
    assert not bad["ok"] and bad["unmatched"] == 1 and bad["min_iou"] == pytest.approx(1 / 1.2)
    other_class = box_parity(ref, [[(10, 10, 110, 110, 0.9, 1)], []])
    assert not other_class["ok"] and other_class["unmatched"] == 2
    assert not box_parity([[]], [[]])["ok"]  # nothing compared is not a pass


class FakeClock:
    """``time.time`` / ``time.perf_counter`` that move only when the timed function runs (``cost`` s a call)."""

    def __init__(self, cost: float) -> None:
        self.now, self.cost, self.calls = 1000.0, cost, 0

    def time(self) -> float:
        return self.now

    perf_counter = time

    def call(self) -> None:
        self.calls += 1
        self.now += self.cost


def test_measure_never_starts_a_call_that_would_end_past_the_deadline(monkeypatch) -> None:
    clock = FakeClock(cost=0.5)
    monkeypatch.setattr(_device_common, "time", clock)
    # 2 warm-ups, then timed calls until max_seconds (2 s: 4 calls); 16 items per call at 0.5 s -> 32 per second
    result = _device_common.measure(clock.call, 16, deadline=clock.now + 100, max_seconds=2.0)
    assert result == {"per_s": 32.0, "median_s": 0.5, "min_s": 0.5, "repeats": 4} and clock.calls == 6
    clock = FakeClock(cost=2.0)
    monkeypatch.setattr(_device_common, "time", clock)
    # a 2 s call: one warm-up (over a second), then calls while now + 2 <= deadline (1000 + 7): ends at 1006
    result = _device_common.measure(clock.call, 1, deadline=clock.now + 7, max_seconds=60.0)
    assert result is not None and result["repeats"] == 2 and clock.now == 1006.0
    assert _device_common.measure(clock.call, 1, deadline=clock.now - 1) is None


@pytest.fixture
def trt(monkeypatch):
    """The fake tensorrt, whose deserialiser also refuses an engine of the wrong length (a truncated file); torch
    reports a CUDA device (TensorRTEngine allocates its stream with torch; nothing runs on it)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: object())
    fake = make_fake_tensorrt()
    good = fake.Runtime.deserialize_cuda_engine
    fake.Runtime.deserialize_cuda_engine = (lambda self, data: good(self, data)
                                            if len(data) == len(MAGIC) + 64 else None)
    monkeypatch.setitem(sys.modules, "tensorrt", fake)
    monkeypatch.setattr(engines, "probe_gpu", lambda: GPU)
    monkeypatch.setitem(engines.open_engine.__kwdefaults__, "gpu_probe", lambda: GPU)
    return fake


def test_corrupt_stage_sees_wildfed_notice_and_rebuild_both_damages(tmp_path, monkeypatch, trt) -> None:
    onnx_dir = tmp_path / "onnx"
    onnx_dir.mkdir()
    fake_backbone_onnx(onnx_dir / "backbone.onnx")
    onnx.save(tiny_onnx(), onnx_dir / "detector.onnx")
    (onnx_dir / "manifest.json").write_text(json.dumps({
        "detector": {"file": "detector.onnx"},
        "backbone": {"file": "backbone.onnx", "backbone": "efficientnet-lite0", "input_size": FAKE_BACKBONE_SIZE}}))
    for name in ("WILDFED_DETECTOR_ONNX", "WILDFED_BACKBONE_ONNX"):
        monkeypatch.setenv(name, "")  # restored after the test (load_manifest sets them)
    monkeypatch.setenv("WILDFED_CACHE", str(tmp_path / "cache"))
    ort = OrtEngine(onnx_dir / "backbone.onnx", device="cpu")
    monkeypatch.setattr(TensorRTEngine, "run", lambda self, batch: ort.run(batch))
    manifest = _device_common.load_manifest(onnx_dir)
    assert _device_trt._open("backbone", manifest).name == "tensorrt-fp16" and trt.calls["builds"] == 1
    for path in _device_trt.engine_files(manifest)["detector"]:
        path.write_text("the detector's slot; this stage does not use it")
    args = argparse.Namespace(dry_run=False, onnx_dir=onnx_dir, work=tmp_path, photos=2)
    stage = _device_common.Stage("corrupt", tmp_path / "corrupt.json")

    _device_trt.corrupt(stage, args)

    doc = json.loads((tmp_path / "corrupt.json").read_text())
    assert doc["status"] == "pass", doc["checks"]
    assert [c["name"].split(":")[0] for c in doc["checks"]] == ["flip"] * 4 + ["truncate"] * 4
    assert trt.calls["builds"] == 3  # the first build and one rebuild per damage
    assert any("does not match the SHA-256" in line for line in doc["data"]["flip"]["log"])
    assert any("does not load" in line for line in doc["data"]["truncate"]["log"])


def _stage_files(folder: Path, **statuses: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, status in statuses.items():
        (folder / f"{name}.json").write_text(json.dumps({"stage": name, "status": status, "summary": name,
                                                         "checks": [], "data": {}}))
        (folder / f"{name}.meta").write_text("0 1 60")


def test_report_statuses_and_exit_codes(tmp_path) -> None:
    work = tmp_path / "work"
    _stage_files(work / "stages", probe="info", build="skip", parity="skip", corrupt="skip", fallback="pass",
                 bench="info")
    (work / "stages" / "bench-ortcuda.skip").write_text("no ORT CUDA")
    assert _device_report.report(work, tmp_path / "dry", mode="dry-run", seconds=1, budget=450) == 0
    assert _device_report.report(work, tmp_path / "dev", mode="device", seconds=1, budget=450) == 3
    summary = json.loads((tmp_path / "dev" / "device_check.json").read_text())
    assert summary["verdict"].startswith("INCOMPLETE") and summary["stages"]["bench-ortcuda"]["status"] == "skip"
    # a stage stopped at its time box before its final status; the others' results stay in the report
    _stage_files(work / "stages", bench="running")
    (work / "stages" / "bench.meta").write_text("124 75 75")
    assert _device_report.report(work, tmp_path / "t", mode="device", seconds=1, budget=450) == 1
    summary = json.loads((tmp_path / "t" / "device_check.json").read_text())
    assert summary["stages"]["bench"]["status"] == "timeout" and summary["stages"]["fallback"]["status"] == "pass"
    assert "| fallback | PASS |" in (tmp_path / "t" / "device_check.md").read_text()
