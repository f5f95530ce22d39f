"""`wildfed-coordinator clusters` through typer's runner: show (a preview before round 1), pin, recluster, errors."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from shared.keys import generate_signing_key, save_public_key

from coordinator.cli import app
from coordinator.config import load_config
from coordinator.service import build_strategy
from coordinator.registry import SiteRegistry
from coordinator.storage import Store

runner = CliRunner()


def nira_federation(tmp_path, sites):
    assert runner.invoke(app, ["init", str(tmp_path), "--federation-id", "fed"]).exit_code == 0
    cfg_path = tmp_path / "coordinator.yaml"
    data = yaml.safe_load(cfg_path.read_text())
    data["strategy"] = {"kind": "nira", "distance_threshold": 0.5}
    cfg_path.write_text(yaml.safe_dump(data))
    for sid, species in sites.items():
        save_public_key(generate_signing_key().public_key(), tmp_path / f"{sid}.pub")
        result = runner.invoke(app, ["enrol", sid, "--public-key", str(tmp_path / f"{sid}.pub"), "--config",
                                     str(cfg_path), "--metadata", f'{{"capacity": 10, "species": {species}}}'
                                     .replace("'", '"')])
        assert result.exit_code == 0, result.output
    return cfg_path


def test_show_pin_and_recluster(tmp_path):
    # Prepare: a, b list {A, B} (J = 1); c lists {C} (J = 0 with both): two clusters at distance threshold 0.5
    cfg = nira_federation(tmp_path, {"a": ["A", "B"], "b": ["A", "B"], "c": ["C"]})
    # Execute / Assert: before any round, show previews the clustering; the heatmap is written
    shown = runner.invoke(app, ["clusters", "show", "--config", str(cfg), "--heatmap", str(tmp_path / "h.png")])
    assert shown.exit_code == 0, shown.output
    assert "preview" in shown.output and "c0" in shown.output and "a, b" in shown.output
    assert (tmp_path / "h.png").stat().st_size > 1000
    pinned = runner.invoke(app, ["clusters", "pin", "c", "c0", "--config", str(cfg)])
    assert pinned.exit_code == 0, pinned.output
    # the pin and the re-cluster request are stored: a fresh strategy over the same database sees them
    config = load_config(cfg)
    store = Store(config.database_url, config.data_dir)
    nira = build_strategy(config, store, SiteRegistry(store))
    state = nira.state()
    assert state["pins"] == {"c": "c0"} and state["recluster_requested"] is True
    assert nira.cluster_from_species(state["pins"]).clusters == {"c0": ("a", "b", "c")}
    store.dispose()
    again = runner.invoke(app, ["clusters", "recluster", "--config", str(cfg)])
    assert again.exit_code == 0 and "c0: a, b, c" in again.output


def test_errors_name_the_fix(tmp_path):
    cfg = nira_federation(tmp_path, {"a": ["A"], "b": ["B"]})
    unknown = runner.invoke(app, ["clusters", "pin", "zz", "c0", "--config", str(cfg)])
    assert unknown.exit_code == 2 and "not enrolled" in unknown.output
    data = yaml.safe_load(cfg.read_text())
    data["strategy"] = {"kind": "fedavg"}
    cfg.write_text(yaml.safe_dump(data))
    fedavg = runner.invoke(app, ["clusters", "show", "--config", str(cfg)])
    assert fedavg.exit_code == 2 and "strategy: {kind: nira}" in fedavg.output
