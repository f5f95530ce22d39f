"""The field loop end to end on one gateway, with a fixed-box detector and a stub backbone (no network, no
engines): each photo becomes a media row, machine observations, an event and a queued signed detection record; a
copy is stored once; a half-written JPEG waits until whole; a blank photo is recorded; the package validates with
frictionless; a ranger's verdict makes the photo a training record."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from shared.camtrap_dp import media_id, timestamp_source
from shared.envelope import Envelope, verify
from shared.keys import generate_signing_key, save_private_key, save_public_key
from shared.protocol import decode_detection

from edge_sdk.config import global_model_path, load_site_config
from edge_sdk.data.camtrap_dp import load_camtrap_dp
from edge_sdk.field.detection_queue import DetectionQueue
from edge_sdk.field.photos import PhotoClassifier
from edge_sdk.field.service import FieldService
from edge_sdk.field.verdicts import apply_verdict
from edge_sdk.global_model import save_global_model
from edge_sdk.inference.detector import Box
from edge_sdk.site_paths import detection_queue_path

SPECIES = [{"scientific_name": "Lycaon pictus", "class_index": 0, "iucn_category": "EN"},
           {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}]


class RedBoxDetector:
    """Finds one box around the red square a test photo carries, none in a photo without one."""

    detector_id, batch_size = "red-square", 1

    def detect(self, images):
        out = []
        for image in images:
            a = np.asarray(image)
            red = (a[..., 0] > 200) & (a[..., 1] < 50)
            ys, xs = np.nonzero(red)
            out.append([Box(float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1), 0.9)]
                       if len(xs) else [])
        return out


class MeanColour:
    """A stub backbone: the crop's mean RGB, in the first three of 1280 dimensions."""

    name, backbone_id, input_size = "stub", "stub-backbone", 128

    def embed_images(self, images):
        out = np.zeros((len(images), 1280), np.float32)
        for i, im in enumerate(images):
            out[i, :3] = np.asarray(im, np.float32).reshape(-1, 3).mean(axis=0) / 255.0
        return out


def _photo(path: Path, *, red: bool, when: str | None, shade: int = 0) -> bytes:
    image = Image.new("RGB", (160, 120), (20 + shade, 120, 40))
    if red:
        image.paste((250, 10, 10), (40, 30, 80, 70))
    exif = Image.Exif()
    if when:
        exif.get_ifd(0x8769)[36867] = when
    buf = io.BytesIO()
    image.save(buf, "JPEG", exif=exif, quality=100, subsampling=0)  # sharp edges: the box is exact
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def site(tmp_path: Path):
    key = generate_signing_key()
    save_private_key(key, tmp_path / "keys" / "site.key")
    save_public_key(generate_signing_key().public_key(), tmp_path / "keys" / "coordinator.pub")
    config = {"federation_id": "fed", "site_id": "site-1", "dataset": "package", "incoming": "incoming",
              "species": SPECIES, "num_classes": 3, "private_key": "keys/site.key",
              "coordinator_public_key": "keys/coordinator.pub", "outbox": "state/outbox.sqlite",
              "field": {"settle_s": 5, "deployments": {"river": {"latitude": -1.5, "longitude": 36.8}}}}
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(config))
    cfg = load_site_config(tmp_path / "site.yaml")
    # a head that maps "red" (embedding dim 0) to Lycaon pictus and anything else to Equus quagga
    w = np.zeros((3, 1280), np.float32)
    w[0, 0], w[1, 1] = 12.0, 6.0
    save_global_model(global_model_path(cfg), {"psi.weight": w, "psi.bias": np.array([-4.0, 0.0, -9.0], np.float32)},
                      round_=3, model_hash_hex="ab" * 32)
    clock = Clock()
    classifier = PhotoClassifier(detector=RedBoxDetector(), embedder=MeanColour(), model_path=global_model_path(cfg),
                                 class_names=cfg.names_by_class, site_classes={0, 1}, threshold=0.5,
                                 outside_prior=0.1)
    queue = DetectionQueue(detection_queue_path(cfg), private_key=key, federation_id="fed", site_id="site-1")
    service = FieldService(cfg, classifier=classifier, queue=queue, clock=clock)
    yield cfg, service, clock, key
    service.close()


def _settle(service: FieldService, clock: Clock) -> int:
    service.incoming.scan()  # first seen
    clock.now += 10
    return service.poll()


def test_photos_become_media_observations_events_and_signed_records(site) -> None:
    cfg, service, clock, key = site
    inc = Path(cfg.incoming)
    a = _photo(inc / "river" / "IMG_0001.JPG", red=True, when="2024:05:01 10:00:00")
    _photo(inc / "river" / "IMG_0002.JPG", red=True, when="2024:05:01 10:00:20", shade=5)
    _photo(inc / "IMG_0003.JPG", red=False, when=None)  # no EXIF: the file time, marked
    (inc / "river" / "copy-of-0001.jpg").write_bytes(a)  # the same photo again

    assert _settle(service, clock) == 3
    assert service.stats.duplicates == 1 and not any(inc.rglob("*.JPG")) and not any(inc.rglob("*.jpg"))

    media = {r["fileName"]: r for r in service.package.rows("media")}
    assert set(media) == {"IMG_0001.JPG", "IMG_0002.JPG", "IMG_0003.JPG"}  # the copy is one photo, stored once
    assert media["IMG_0001.JPG"]["mediaID"] == media_id(a)
    assert media["IMG_0001.JPG"]["deploymentID"] == "site-1/river"
    assert media["IMG_0003.JPG"]["deploymentID"] == "site-1/main"
    assert timestamp_source(media["IMG_0001.JPG"]["mediaComments"]) == "exif"
    assert timestamp_source(media["IMG_0003.JPG"]["mediaComments"]) == "mtime"
    assert (service.package.root / media["IMG_0001.JPG"]["filePath"]).read_bytes() == a

    obs = service.package.rows("observations")
    kinds = {r["mediaID"]: (r["observationType"], r["scientificName"], r["classificationMethod"]) for r in obs}
    assert kinds[media_id(a)] == ("animal", "Lycaon pictus", "machine")
    assert kinds[media["IMG_0003.JPG"]["mediaID"]] == ("blank", "", "machine")  # recorded, not dropped
    red_rows = [r for r in obs if r["mediaID"] == media_id(a)]
    assert (red_rows[0]["bboxX"], red_rows[0]["bboxWidth"]) == ("0.250000", "0.250000")  # 40/160, 40/160

    events = {e.event_id: e for e in service.store.events(reviewed=None)}
    assert len(events) == 2  # the two river photos 20 s apart are one event
    river = next(e for e in events.values() if e.deployment_id == "site-1/river")
    assert river.n_media == 2 and river.status == "confident" and river.species_index == 0

    deployments = {r["deploymentID"]: r for r in service.package.rows("deployments")}
    assert deployments["site-1/river"]["latitude"] == "-1.500000"
    assert deployments["site-1/main"]["timestampIssues"] == "true"

    pending = service.queue.outbox.pending()
    assert len(pending) == 3
    envelope = Envelope.from_bytes(service.queue.outbox.get(f"detection/{media_id(a)}").payload)
    verify(envelope, key.public_key())
    record = decode_detection(envelope.payload)
    assert record.event_id == river.event_id and envelope.header.round == 3
    assert record.detections[0].species == "Lycaon pictus" and record.detections[0].species_status == "confident"

    from edge_sdk.packaging.validate import validate_package

    assert validate_package(service.package.root) == []  # frictionless, offline: 0 errors

    # a ranger confirms the river event: its two photos become training records, on their boxes
    assert len(load_camtrap_dp(cfg.dataset, cfg.species_table)) == 0
    apply_verdict(service.store, service.package, river.event_id, verdict="species", species="Lycaon pictus",
                  reviewer="alice", species_table=cfg.species_table)
    data = load_camtrap_dp(cfg.dataset, cfg.species_table)
    assert len(data) == 2 and data.labels.tolist() == [0, 0]
    assert data.boxes[data.media_ids.index(media_id(a))] == ((0.25, 0.25, 0.25, round(40 / 120, 6)),)


def test_a_half_written_photo_is_read_only_when_complete(site) -> None:
    cfg, service, clock, _ = site
    data = _photo(Path(cfg.incoming) / "IMG_0100.JPG", red=True, when="2024:05:02 08:00:00")
    path = Path(cfg.incoming) / "IMG_0100.JPG"
    path.write_bytes(data[: len(data) // 2])  # the upload is half done
    assert _settle(service, clock) == 0  # complete-looking but truncated: deferred, not stored, not lost
    assert path.exists() and service.store.counts()["media"] == 0 and service.stats.deferred == 1
    with path.open("ab") as f:
        f.write(data[len(data) // 2:])
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1))
    assert _settle(service, clock) == 1
    assert [r["mediaID"] for r in service.package.rows("media")] == [media_id(data)]  # the whole photo's id


def test_restart_after_a_crash_mid_write_stores_nothing_twice(site) -> None:
    cfg, service, clock, _ = site
    data = _photo(Path(cfg.incoming) / "IMG_0200.JPG", red=True, when="2024:05:03 08:00:00")
    original = service.store.add_photo

    def crash_before_commit(photo, read, write=None):
        def writes_then_dies(event_id):
            write(event_id)
            raise RuntimeError("power cut")

        return original(photo, read, write=writes_then_dies)

    service.store.add_photo = crash_before_commit
    with pytest.raises(RuntimeError):
        _settle(service, clock)
    service.store.add_photo = original
    assert service.store.counts()["media"] == 0  # the index rolled back; the package holds the rows
    assert _settle(service, clock) == 1
    assert [r["mediaID"] for r in service.package.rows("media")] == [media_id(data)]  # once
    assert len([r for r in service.package.rows("observations") if r["mediaID"] == media_id(data)]) == 1
    assert service.queue.pending() == 1
