"""What every stage of ``device_check.sh`` shares: the stage result file, the prepared ONNX files, the photos, log
capture and timing.

A stage result is one JSON file ``{"stage", "status", "summary", "checks": [...], "data": {...}, "seconds"}``;
``status`` is ``pass``, ``fail``, ``skip`` (with the reason in ``summary``), ``info`` (measured, nothing to pass) or
``error`` (the stage raised). A check is ``{"name", "ok", "value", "threshold"}``. Stages that take long write their
file after each step (``running``), so a stage stopped by its time box still leaves what it measured.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PHOTOS = ROOT / "wildfed_sim" / "assets" / "ena24"
MANIFEST = "manifest.json"
#: Detector batch: the x86-gpu-gateway profile's ``inference.batch_size`` (the TensorRT profile's largest batch).
DETECTOR_BATCH = 16
#: Batches timed: the Jetson Orin Nano profile's 4, the x86 GPU profile's 16, and the embedder's default 64
#: (``edge_sdk.inference.embedder.DEFAULT_MAX_BATCH``, the backbone engine's largest batch).
EMBED_BATCHES = (4, 16, 64)
DETECT_BATCHES = (4, 16)


class Stage:
    """One stage's result file, written atomically after every change.

    Args:
        name: the stage (``build``, ``parity``, ...).
        path: where the JSON goes.
    """

    def __init__(self, name: str, path: str | Path) -> None:
        self.path = Path(path)
        self.t0 = time.perf_counter()
        self.doc: dict[str, Any] = {"stage": name, "status": "running", "summary": "", "checks": [], "data": {}}
        self.write()

    def check(self, name: str, ok: bool, value: Any, threshold: str = "") -> bool:
        """Record one pass/fail check and print it; returns ``ok``."""
        self.doc["checks"].append({"name": name, "ok": bool(ok), "value": value, "threshold": threshold})
        print(f"  {'PASS' if ok else 'FAIL'} {name}: {value}{f' ({threshold})' if threshold else ''}", flush=True)
        self.write()
        return bool(ok)

    def data(self, **values: Any) -> None:
        """Merge measurements into ``data``."""
        self.doc["data"].update(values)
        self.write()

    def finish(self, status: str | None = None, summary: str = "") -> None:
        """Set the final status (default: ``pass`` when every check passed, ``fail`` otherwise)."""
        if status is None:
            status = "pass" if all(c["ok"] for c in self.doc["checks"]) else "fail"
        self.doc["status"], self.doc["summary"] = status, summary
        print(f"  {status.upper()}: {summary}" if summary else f"  {status.upper()}", flush=True)
        self.write()

    def write(self) -> None:
        """Write the file (temporary file + rename)."""
        self.doc["seconds"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=_jsonable))
        os.replace(tmp, self.path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_manifest(onnx_dir: Path) -> dict[str, Any]:
    """The ``--prepare`` manifest of ``onnx_dir``, and point WildFed's ONNX overrides at its files
    (``WILDFED_DETECTOR_ONNX``, ``WILDFED_BACKBONE_ONNX``: the paths a gateway without torch uses).

    Raises:
        SystemExit: no manifest (``device_check.sh --prepare`` was not run).
    """
    path = onnx_dir / MANIFEST
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run benchmarks/device_check.sh --prepare where torch is installed")
    manifest = json.loads(path.read_text())
    os.environ["WILDFED_DETECTOR_ONNX"] = str(onnx_dir / manifest["detector"]["file"])
    os.environ["WILDFED_BACKBONE_ONNX"] = str(onnx_dir / manifest["backbone"]["file"])
    return manifest


def photos(limit: int) -> list:
    """The committed ENA24 photos (sorted by name, at most ``limit``) as RGB PIL images."""
    from PIL import Image

    paths = sorted(PHOTOS.glob("*.jpg"))[:limit]
    if not paths:
        raise SystemExit(f"no photos in {PHOTOS}")
    return [Image.open(p).convert("RGB") for p in paths]


def crops(images: list, size: int) -> np.ndarray:
    """float32 (N, 3, size, size) backbone input: each photo's centre square (as ``benchmarks/embed.py``)."""
    from shared.models.backbone import preprocess_image

    out = []
    for im in images:
        side = min(im.size)
        left, top = (im.width - side) // 2, (im.height - side) // 2
        out.append(preprocess_image(im.crop((left, top, left + side, top + side)), size))
    return np.stack(out)


def tile(x: np.ndarray, batch: int) -> np.ndarray:
    """The first ``batch`` rows of ``x`` repeated as often as needed."""
    reps = -(-batch // len(x))
    return np.ascontiguousarray(np.concatenate([x] * reps)[:batch])


class LogCapture(logging.Handler):
    """Collects the messages of ``edge_sdk``'s loggers (INFO and up) so that a stage can check what WildFed said
    (``building TensorRT FP16 engine``, ``falling back to ONNX Runtime``); they are printed as well."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[logging.LogRecord] = []
        logging.basicConfig(level=logging.WARNING, format="    log %(levelname)s %(name)s: %(message)s")
        logger = logging.getLogger("edge_sdk")
        logger.setLevel(logging.INFO)
        for old in [h for h in logger.handlers if isinstance(h, LogCapture)]:
            logger.removeHandler(old)  # one capture at a time: a stage opens one, a test may open several
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def since(self, start: int) -> list[str]:
        """``LEVEL message`` of the records from index ``start`` on."""
        return [f"{r.levelname} {r.getMessage()}" for r in self.records[start:]]


def measure(fn: Callable[[], object], items: int, *, deadline: float, max_seconds: float = 3.0,
            min_repeats: int = 3, max_repeats: int = 50) -> dict[str, Any] | None:
    """Time ``fn`` (one call processes ``items`` inputs): two untimed warm-up calls (one when the first takes over
    a second), then at least ``min_repeats`` timed calls and more until ``max_seconds`` or ``max_repeats``. No call
    starts that would end past ``deadline`` (``time.time()``, judged by the previous call's duration).

    Returns:
        ``{"per_s": items / median, "median_s", "min_s", "repeats"}``, or None when no timed call fitted.
    """
    times: list[float] = []
    last, calls, stop = 0.0, 0, float("inf")
    while len(times) < max_repeats and time.time() + last <= deadline:
        warming = calls < 1 or (calls < 2 and last <= 1.0)
        if not warming and not times:
            stop = time.time() + max_seconds
        if not warming and len(times) >= min_repeats and time.time() >= stop:
            break
        t0 = time.perf_counter()
        fn()
        last = time.perf_counter() - t0
        calls += 1
        if not warming:
            times.append(last)
    if not times:
        return None
    median = statistics.median(times)
    return {"per_s": items / median, "median_s": median, "min_s": min(times), "repeats": len(times)}
