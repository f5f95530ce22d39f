"""The demo's closing detection run (wildfed_sim/detections.py) through the real path: the real YOLOX-tiny detector
and frozen backbone on real ENA24 photos, each site's signed records over a real MQTT broker (the demo's embedded
amqtt broker) into a real coordinator's detection ingest; plus the committed photo subset (size, licence, labels).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from shared.keys import generate_signing_key, public_key_to_pem, save_private_key, save_public_key

from wildfed_sim.detections import COMMITTED_ENA24, demo_photos, run_demo_detections

SPECIES = ["Ursus americanus", "Didelphis virginiana", "Vulpes vulpes"]


def test_committed_ena24_subset_is_small_licensed_and_labelled():
    files = sorted(COMMITTED_ENA24.iterdir())
    assert sum(f.stat().st_size for f in files) <= 3 * 1024 * 1024
    names = {f.name for f in files}
    assert {"README.md", "LICENSE-zamba-MIT.txt", "labels.csv"} <= names
    assert "CDLA-Permissive-1.0" in (COMMITTED_ENA24 / "README.md").read_text()
    with (COMMITTED_ENA24 / "labels.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 21 and len({r["label"] for r in rows}) == 7
    for r in rows:
        with Image.open(COMMITTED_ENA24 / r["filepath"]) as im:
            assert max(im.size) <= 720 and not dict(im.getexif())  # downscaled, metadata stripped


def test_demo_photos_fall_back_to_the_committed_subset(tmp_path):
    assert demo_photos(tmp_path) == sorted(COMMITTED_ENA24.glob("*.jpg"), key=lambda p: p.name)
    shared = tmp_path / "data"
    (shared / "ena24-small").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(shared / "ena24-small" / "a.jpg")
    (shared / "ena24-small" / "labels.csv").write_text("filepath,label\na.jpg,Chicken\n")
    station = shared / "camtrapr-sample" / "StationA" / "PBE"
    station.mkdir(parents=True)
    for n in ("2.JPG", "1.JPG"):
        Image.new("RGB", (8, 8)).save(station / n, format="JPEG")
    assert demo_photos(shared) == [shared / "ena24-small" / "a.jpg", station / "1.JPG"]


def _site(tmp_path: Path, site_id: str, fed: str, broker_url: str, key) -> Path:
    folder = tmp_path / "sites" / site_id
    save_private_key(key, folder / "keys" / "site.key")
    (folder / "camtrap-dp").mkdir(parents=True)
    config = {"federation_id": fed, "site_id": site_id, "dataset": "camtrap-dp",
              "species": [{"scientific_name": SPECIES[0], "class_index": 0, "iucn_category": "LC"}],
              "num_classes": 3, "private_key": "keys/site.key",
              "coordinator_public_key": str(tmp_path / "coord.pub"), "broker_url": broker_url,
              "outbox": "state/outbox.sqlite"}
    path = folder / "site.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_gateways_publish_signed_real_detections_that_the_coordinator_stores(tmp_path):
    pytest.importorskip("amqtt")
    torch = pytest.importorskip("torch", reason="the backbone's one-time ONNX export needs torch")
    from shared.models.backbone import DEFAULT_INPUT_SIZE, load_backbone, preprocess_image, square_crop
    from shared.models.head import HeadConfig, initial_weights

    from coordinator.config import config_from_dict
    from coordinator.service import Coordinator
    from edge_sdk.inference.classifier import head_logits
    from edge_sdk.inference.weights import WeightsUnavailableError, detector_checkpoint
    from wildfed_sim.embedded_broker import embedded_broker

    try:
        detector_checkpoint(timeout_s=300)
    except WeightsUnavailableError as exc:
        pytest.skip(f"YOLOX-tiny weights unavailable: {exc}")
    # Prepare: 3 real photos (bear, bear, opossum), two sites, the second signing with a key never enrolled
    bears = [COMMITTED_ENA24 / n for n in ("9455.jpg", "8786.jpg")]
    photos = bears + [COMMITTED_ENA24 / "2480.jpg"]
    weights = initial_weights(HeadConfig(3, adapter_width=16), 5, head_init="uniform")
    fed = "fed-detections-test"
    coord_key = generate_signing_key()
    save_private_key(coord_key, tmp_path / "coord.key")
    save_public_key(coord_key.public_key(), tmp_path / "coord.pub")
    good, impostor = generate_signing_key(), generate_signing_key()
    with embedded_broker(log_path=tmp_path / "broker.log") as url:
        config = config_from_dict({
            "federation_id": fed, "data_dir": str(tmp_path / "coord"), "broker_url": url,
            "signing_key_path": str(tmp_path / "coord.key"), "public_key_path": str(tmp_path / "coord.pub"),
            "rounds": 1, "num_classes": 3, "privacy": "none",
            "species": [{"scientific_name": n, "class_index": i, "iucn_category": "LC"}
                        for i, n in enumerate(SPECIES)]}).resolved(tmp_path)
        with Coordinator(config, initial_weights=weights) as coordinator:
            coordinator.start()
            sites = [_site(tmp_path, "site-a", fed, url, good), _site(tmp_path, "site-b", fed, url, impostor)]
            coordinator.enrol("site-a", public_key_to_pem(good.public_key()))
            coordinator.enrol("site-b", public_key_to_pem(generate_signing_key().public_key()))
            # Execute
            result = run_demo_detections(coordinator=coordinator, site_configs=sites, out_dir=tmp_path / "out",
                                         weights_for_site=weights, photos=photos, prefer="ort", threads=2,
                                         timeout_s=60)
            stored = coordinator.detections.records("site-a")
            stored_b = coordinator.detections.records("site-b")
    # Assert: photos dealt round-robin (a: 9455, 2480; b: 8786), all published and handled
    a, b = result.sites
    assert (a.photos, b.photos) == (2, 1) and result.published == 3 and result.arrived
    assert result.stored == 2 and result.rejected == 1  # site-b's signature does not verify
    assert stored_b == [] and [r.file for r in stored] == ["2480.jpg", "9455.jpg"]
    md = json.loads((a.files["megadetector"]).read_text())
    assert {im["file"] for im in md["images"]} == {"2480.jpg", "9455.jpg"}
    # the bear photo has a box, and its species is the head's argmax on the torch backbone's embedding of the
    # square crop (an independent implementation of the backbone), named from the site's table / federation's
    bear = next(r for r in stored if r.file == "9455.jpg")
    assert bear.detections, "the detector finds the bear"
    image = Image.open(bears[0]).convert("RGB")
    model = load_backbone(DEFAULT_INPUT_SIZE)
    for d in bear.detections:
        x, y, w, h = d.bbox
        box = (x * image.width, y * image.height, (x + w) * image.width, (y + h) * image.height)
        crop = image.crop(square_crop(box, image.width, image.height))
        with torch.no_grad():
            emb = model.embed(torch.from_numpy(preprocess_image(crop, DEFAULT_INPUT_SIZE)[None])).numpy()
        logits = head_logits(weights, emb)[0]
        assert d.species_index == int(np.argmax(logits)) and d.species == SPECIES[d.species_index]
        p = np.exp(logits - logits.max())
        assert d.species_confidence == pytest.approx(float(p.max() / p.sum()), abs=2e-3)
