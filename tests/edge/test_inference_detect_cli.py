"""`wildfed-edge detect` end to end with the species classifier (docs/inference.md): the real detector and the frozen
backbone on real ENA24 photos (the subset committed in wildfed_sim/assets/ena24), a head-model global model file,
species names from the site config's species table, in MegaDetector JSON and Camtrap DP observations.

The head is built so that the answer is known without running it: zero weights and a bias of 50 on class 2 make
every crop class 2 with probability 1 - 2e^-50, whatever the backbone computes.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from shared.codec import encode_tensors, model_hash
from shared.keys import generate_signing_key, save_private_key, save_public_key

from edge_sdk.inference.formats import validate_megadetector

PHOTOS = Path(__file__).resolve().parents[2] / "wildfed_sim" / "assets" / "ena24"
TABLE = ["Didelphis virginiana", "Sciurus niger", "Ursus americanus"]


@pytest.fixture(scope="module")
def detector_ready() -> None:
    pytest.importorskip("torch", reason="the detector's and the backbone's one-time ONNX export need torch")
    from edge_sdk.inference.weights import WeightsUnavailableError, detector_checkpoint

    try:
        detector_checkpoint(timeout_s=300)
    except WeightsUnavailableError as exc:
        pytest.skip(f"YOLOX-tiny weights unavailable (zamba==2.7.2 download failed): {exc}")


def _site_config(tmp_path: Path) -> Path:
    key = generate_signing_key()
    save_private_key(key, tmp_path / "site.key")
    save_public_key(generate_signing_key().public_key(), tmp_path / "coord.pub")
    (tmp_path / "camtrap-dp").mkdir()
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump({
        "federation_id": "fed", "site_id": "site-9", "dataset": "camtrap-dp", "num_classes": 3,
        "species": [{"scientific_name": n, "class_index": i, "iucn_category": "LC"} for i, n in enumerate(TABLE)],
        "private_key": "site.key", "coordinator_public_key": "coord.pub", "broker_url": "mqtt://127.0.0.1:1",
        "outbox": "outbox.sqlite"}))
    return path


def test_detect_names_species_from_the_site_table_in_both_outputs(tmp_path, detector_ready, monkeypatch):
    from edge_sdk.cli import app

    monkeypatch.setenv("COLUMNS", "200")
    photos = [PHOTOS / n for n in ("9455.jpg", "8786.jpg", "2480.jpg")]
    head = {"psi.weight": np.zeros((3, 1280), np.float32), "psi.bias": np.array([0.0, 0.0, 50.0], np.float32)}
    weights = tmp_path / "global.safetensors"
    weights.write_bytes(encode_tensors(head))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["detect", *map(str, photos), "--weights", str(weights), "--out", str(out),
                                      "--config", str(_site_config(tmp_path)), "--engine", "ort",
                                      "--threads", "2"])
    assert result.exit_code == 0, result.output
    assert "images: 3 with detections: 3" in " ".join(result.output.split())
    md = json.loads((out / "megadetector.json").read_text())
    assert validate_megadetector(md) == []
    assert md["info"]["classifier"] == f"head@{model_hash(head)[:12]}"
    assert md["classification_categories"] == {str(i): n for i, n in enumerate(TABLE)}
    detections = [d for im in md["images"] for d in im["detections"]]
    assert detections, "the detector finds the animals"
    for d in detections:
        top = d["classifications"][0]
        assert top[0] == "2" and top[1] == pytest.approx(1.0, abs=1e-6)
    with (out / "observations.csv").open() as fh:
        animals = [r for r in csv.DictReader(fh) if r["observationType"] == "animal"]
    assert len(animals) == len(detections)
    assert {r["scientificName"] for r in animals} == {"Ursus americanus"}
    assert {r["deploymentID"] for r in animals} == {"site-9/main"}  # SITE/DEPLOYMENT, as the site's package
    assert all(float(r["classificationProbability"]) == pytest.approx(1.0, abs=1e-3) for r in animals)


def test_detect_refuses_a_camera_cnn_model_file_naming_the_fix(tmp_path, detector_ready, monkeypatch):
    from edge_sdk.cli import app

    monkeypatch.setenv("COLUMNS", "200")
    cnn = {"phi.0.weight": np.zeros((16, 1, 3, 3), np.float32), "phi.0.bias": np.zeros(16, np.float32),
           "psi.weight": np.zeros((3, 64), np.float32), "psi.bias": np.zeros(3, np.float32)}
    weights = tmp_path / "cnn.safetensors"
    weights.write_bytes(encode_tensors(cnn))
    result = CliRunner().invoke(app, ["detect", str(PHOTOS / "2480.jpg"), "--weights", str(weights),
                                      "--out", str(tmp_path / "out"), "--engine", "ort"])
    assert result.exit_code == 2
    assert "head model" in " ".join(result.output.split())
    assert not (tmp_path / "out" / "megadetector.json").exists()


def test_detect_with_a_site_config_and_no_weights_uses_the_gateways_latest_global_model(tmp_path, detector_ready,
                                                                                       monkeypatch):
    from edge_sdk.global_model import save_global_model
    from edge_sdk.cli import app
    from edge_sdk.config import global_model_path, load_site_config

    monkeypatch.setenv("COLUMNS", "200")
    config = _site_config(tmp_path)
    head = {"psi.weight": np.zeros((3, 1280), np.float32), "psi.bias": np.array([0.0, 50.0, 0.0], np.float32)}
    kept = global_model_path(load_site_config(config))
    assert kept == tmp_path / "global-model.safetensors"
    save_global_model(kept, head, round_=4, model_hash_hex=model_hash(head),
                      backbone_id=load_site_config(config).backbone_id)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["detect", str(PHOTOS / "2480.jpg"), "--out", str(out), "--config", str(config),
                                      "--engine", "ort", "--threads", "2"])
    assert result.exit_code == 0, result.output
    assert "latest global model this gateway received" in result.output
    md = json.loads((out / "megadetector.json").read_text())
    assert md["info"]["classifier"] == f"head@{model_hash(head)[:12]}"
    assert {d["classifications"][0][0] for im in md["images"] for d in im["detections"]} == {"1"}


def test_detect_refuses_a_kept_model_of_another_backbone_naming_the_fix(tmp_path, detector_ready, monkeypatch):
    from edge_sdk.global_model import save_global_model
    from edge_sdk.cli import app
    from edge_sdk.config import global_model_path, load_site_config
    from shared.models.backbone import backbone_id

    monkeypatch.setenv("COLUMNS", "200")
    config = _site_config(tmp_path)  # Lite0 at 128 px, the defaults
    head = {"psi.weight": np.zeros((3, 1280), np.float32), "psi.bias": np.zeros(3, np.float32)}
    save_global_model(global_model_path(load_site_config(config)), head, round_=4, model_hash_hex=model_hash(head),
                      backbone_id=backbone_id("efficientnet-lite2", 260))
    result = CliRunner().invoke(app, ["detect", str(PHOTOS / "2480.jpg"), "--out", str(tmp_path / "out"),
                                      "--config", str(config), "--engine", "ort", "--threads", "2"])
    assert result.exit_code == 2
    said = " ".join(result.output.split())
    assert "efficientnet-lite2@" in said and "--backbone efficientnet-lite2 --input-size 260" in said
    assert not (tmp_path / "out" / "megadetector.json").exists()


def test_detect_with_a_site_config_names_no_species_below_the_sites_confidence_threshold(tmp_path, detector_ready,
                                                                                      monkeypatch):
    from edge_sdk.cli import app

    monkeypatch.setenv("COLUMNS", "200")
    # a head with no opinion: every class 1/3 for every crop, below the field loop's threshold of 0.5
    head = {"psi.weight": np.zeros((3, 1280), np.float32), "psi.bias": np.zeros(3, np.float32)}
    weights = tmp_path / "global.safetensors"
    weights.write_bytes(encode_tensors(head))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["detect", str(PHOTOS / "2480.jpg"), "--weights", str(weights), "--out",
                                      str(out), "--config", str(_site_config(tmp_path)), "--engine", "ort",
                                      "--threads", "2", "--deployment", "cam-1"])
    assert result.exit_code == 0, result.output
    with (out / "observations.csv").open() as fh:
        animals = [r for r in csv.DictReader(fh) if r["observationType"] == "animal"]
    assert animals and {r["scientificName"] for r in animals} == {""}  # unknown: no species named
    # the best guess (ties go to the lowest class index) in the comment, by name
    assert all(r["observationComments"].endswith("species unknown (below the confidence threshold), best guess "
                                                 f"{TABLE[0]}") for r in animals)
    assert all(float(r["classificationProbability"]) == pytest.approx(1 / 3, abs=1e-3) for r in animals)
    assert {r["deploymentID"] for r in animals} == {"site-9/cam-1"}  # the deployment within the site
    text = " ".join(result.output.split())
    assert (f"species of {len(animals)} detections: 0 named from the site's table, 0 named but not in it, "
            f"{len(animals)} unknown") in text
