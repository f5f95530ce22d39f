"""`wildfed-edge evaluate` scores the kept model on labelled crops per species: a head built to name each photo
(nearest class mean) scores every record right, the same head with its classes swapped scores none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml
from typer.testing import CliRunner

from shared.codec import model_hash
from shared.keys import generate_signing_key, save_private_key, save_public_key

from edge_sdk.cli import app
from edge_sdk.config import global_model_path, load_site_config
from edge_sdk.data.camtrap_dp import load_camtrap_dp
from edge_sdk.data.embedding import embed_dataset
from edge_sdk.global_model import save_global_model
from edge_sdk.site_paths import embedding_cache_dir

from .test_training_crops import _package_with

SPECIES = [{"scientific_name": "Ursus americanus", "class_index": 0, "iucn_category": "LC"},
           {"scientific_name": "Didelphis virginiana", "class_index": 1, "iucn_category": "LC"}]


def test_evaluate_counts_right_and_wrong_per_species(tmp_path: Path) -> None:
    pkg = _package_with(tmp_path, None)  # one bear photo, labelled by a person, whole photo
    save_private_key(generate_signing_key(), tmp_path / "keys" / "site.key")
    save_public_key(generate_signing_key().public_key(), tmp_path / "keys" / "coordinator.pub")
    (tmp_path / "site.yaml").write_text(yaml.safe_dump({
        "federation_id": "f", "site_id": "s", "dataset": str(pkg), "species": SPECIES,
        "private_key": "keys/site.key", "coordinator_public_key": "keys/coordinator.pub",
        "outbox": "state/outbox.sqlite", "field": {"confidence_threshold": 0.6}}))
    cfg = load_site_config(tmp_path / "site.yaml")
    table = {e["scientific_name"]: (e["class_index"], e["iucn_category"]) for e in SPECIES}
    x = embed_dataset(load_camtrap_dp(pkg, table), embedding_cache_dir(cfg)).features[0].astype(np.float64)
    # class 0 (the photo's) scores x.x, class 1 scores 0: the bear wins with probability 1 / (1 + e^-|x|^2)
    w = np.stack([x, np.zeros_like(x)]).astype(np.float32)
    for weights, right in (({"psi.weight": w, "psi.bias": np.zeros(2, np.float32)}, "1"),
                           ({"psi.weight": w[::-1].copy(), "psi.bias": np.zeros(2, np.float32)}, "0")):
        save_global_model(global_model_path(cfg), weights, round_=4, model_hash_hex=model_hash(weights),
                          backbone_id=cfg.backbone_id)
        result = CliRunner().invoke(app, ["evaluate", "--config", str(tmp_path / "site.yaml")],
                                    env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        row = next(line for line in result.output.splitlines() if "Ursus americanus" in line)
        cells = [c.strip() for c in row.split("│") if c.strip()]
        assert cells == ["Ursus americanus", "1", right, right, "0"], cells
        assert "round 4" in result.output and "optimistic" in result.output
