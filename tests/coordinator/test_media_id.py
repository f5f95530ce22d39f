"""One media id everywhere: a photo imported from MegaDetector output (``import-detections --images``) and the same
photo in a gateway's signed detection record are one row, in either order. The expected id is computed here with
hashlib (first 32 hex digits of the SHA-256 of the file's bytes), independently of shared.camtrap_dp."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

from PIL import Image

from shared.camtrap_dp import media_id
from shared.envelope import MessageKind, seal
from shared.keys import generate_signing_key, public_key_to_pem
from shared.protocol import Detection, DetectionRecord, encode_detection
from shared.topics import detection_topic

from coordinator.detections import DetectionIngestor
from coordinator.registry import SiteRegistry
from coordinator.storage import DetectionRow, Store
from coordinator.web.formats import import_megadetector

FED, SITE = "f", "site-a"


def _photo(folder: Path) -> bytes:
    folder.mkdir(parents=True)
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 120, 60)).save(buf, format="JPEG")
    (folder / "IMG_0001.JPG").write_bytes(buf.getvalue())
    return buf.getvalue()


def _megadetector(path: Path) -> Path:
    path.write_text(json.dumps({
        "info": {"format_version": "1.4", "detector": "md_v5a"}, "detection_categories": {"1": "animal"},
        "images": [{"file": "IMG_0001.JPG", "datetime": "2024-05-01 06:12:33",
                    "detections": [{"category": "1", "conf": 0.9, "bbox": [0.1, 0.2, 0.3, 0.4]}]}]}))
    return path


def _federation(tmp_path: Path):  # noqa: ANN202 - (store, ingestor, key)
    store = Store("sqlite://", tmp_path / "data")
    key = generate_signing_key()
    registry = SiteRegistry(store)
    registry.enrol(SITE, public_key_to_pem(key.public_key()))
    return store, DetectionIngestor(federation_id=FED, store=store, registry=registry), key


def _gateway_record(ingest: DetectionIngestor, key, data: bytes, *, timestamp_ms: int) -> str:  # noqa: ANN001
    rec = DetectionRecord(media_id=media_id(data), file="cam1/IMG_0001.JPG", deployment_id="cam1",
                          timestamp="2024-05-01T06:12:33+00:00", timestamp_source="exif", width=64, height=48,
                          detections=(Detection("animal", 0.8, (0.1, 0.2, 0.3, 0.4)),), detector="yolox")
    env = seal(private_key=key, federation_id=FED, site_id=SITE, round=0, base_model_hash="",
               kind=MessageKind.DETECTION, sequence=1, payload=encode_detection(rec), timestamp=timestamp_ms)
    return ingest.handle(detection_topic(FED, SITE), env.to_bytes()).status


def _rows(store: Store) -> list[tuple[str, str]]:
    with store.session() as s:
        return [(r.media_id, r.source) for r in s.query(DetectionRow)]


def test_import_then_gateway_is_one_row(tmp_path: Path) -> None:
    store, ingest, key = _federation(tmp_path)
    data = _photo(tmp_path / "images")
    expected = hashlib.sha256(data).hexdigest()[:32]
    summary = import_megadetector(store, _megadetector(tmp_path / "md.json"), site_id=SITE, deployment_id="cam1",
                                  images_dir=tmp_path / "images")
    assert summary.stored == 1 and _rows(store) == [(expected, "import:md.json")]
    # the gateway's record of the same photo, sent after the import: it replaces the imported row
    assert _gateway_record(ingest, key, data, timestamp_ms=4_102_444_800_000) == "replaced"  # 2100-01-01
    assert _rows(store) == [(expected, "gateway")]


def test_gateway_then_import_is_one_row(tmp_path: Path) -> None:
    store, ingest, key = _federation(tmp_path)
    data = _photo(tmp_path / "images")
    expected = hashlib.sha256(data).hexdigest()[:32]
    assert _gateway_record(ingest, key, data, timestamp_ms=1_700_000_000_000) == "stored"
    summary = import_megadetector(store, _megadetector(tmp_path / "md.json"), site_id=SITE, deployment_id="cam1",
                                  images_dir=tmp_path / "images")
    assert (summary.stored, summary.kept_gateway) == (0, 1)  # a gateway row is never overwritten by an import
    assert _rows(store) == [(expected, "gateway")]
