"""Config validation and the operator CLI (init, enrol, status, budget) through typer's runner."""

from __future__ import annotations

import json
import os
import stat

import pytest
import yaml
from typer.testing import CliRunner

from shared.errors import ConfigError
from shared.iucn import IUCNCategory
from shared.keys import generate_signing_key, save_public_key
from shared.privacy.events import DPSGDEvent

from coordinator.cli import app
from coordinator.config import config_from_dict, load_config
from coordinator.ledger import PrivacyLedger
from coordinator.storage import Store

runner = CliRunner()


@pytest.mark.parametrize("field,value", [("clipping_norm", 0), ("clipping_norm", float("nan")),
                                         ("target_delta", 1.5), ("quorum_fraction", 0), ("privacy", "ldp"),
                                         ("federation_id", "a/b"), ("learning_rat", 0.1)])
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ConfigError) as err:
        config_from_dict({"federation_id": "f", field: value})
    assert field in str(err.value) and "fix" in str(err.value)


def test_feature_centre_is_for_global_dp_with_the_head_model_and_must_load(tmp_path):
    import numpy as np

    from shared.models.feature_centre import save_feature_centre

    with pytest.raises(ConfigError, match="feature_centre is for privacy: global"):
        config_from_dict({"federation_id": "f", "privacy": "ccdp", "feature_centre": str(tmp_path / "c")})
    path = save_feature_centre(tmp_path / "centre.safetensors", np.zeros(7, np.float32), num_images=1, source="t")
    config = config_from_dict({"federation_id": "f", "privacy": "global", "local_steps": 1,
                               "feature_centre": str(path)})
    from shared.models.backbone import EMBEDDING_DIM
    from shared.models.feature_centre import load_feature_centre

    with pytest.raises(ConfigError, match=f"shape \\({EMBEDDING_DIM},\\)") as err:  # what RoundManager loads
        load_feature_centre(config.feature_centre, dim=EMBEDDING_DIM)
    assert err.value.field == "feature_centre"


def test_invalid_budget_names_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"federation_id": "f", "budget": {"kind": "from_max", "eps_max": -1}}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "budget" in str(err.value) and str(path) in str(err.value)


def test_both_budget_parameterisations_give_the_seed_table():
    cfg1 = config_from_dict({"federation_id": "f", "budget": {"kind": "from_max", "eps_max": 2.0, "gamma": 1.0}})
    cfg2 = config_from_dict({"federation_id": "f", "budget": {"kind": "from_anchor", "category": "VU",
                                                              "epsilon": 1.0, "gamma": 2.0}})
    assert [round(v, 2) for v in cfg1.budgets().values()] == [0.33, 0.67, 1.0, 1.33, 1.67, 2.0]
    assert [round(v, 2) for v in cfg2.budgets().values()] == [0.11, 0.44, 1.0, 1.78, 2.78, 4.0]


def test_cli_init_enrol_status_budget(tmp_path):
    d = tmp_path / "coord"
    # init
    r = runner.invoke(app, ["init", str(d), "--federation-id", "clifed", "--rounds", "3"])
    assert r.exit_code == 0, r.output
    cfg_path = d / "coordinator.yaml"
    cfg = load_config(cfg_path)
    assert cfg.federation_id == "clifed" and cfg.rounds == 3
    assert stat.S_IMODE(os.stat(cfg.signing_key_path).st_mode) == 0o600
    assert runner.invoke(app, ["init", str(d), "--federation-id", "clifed"]).exit_code == 2  # no silent overwrite
    # enrol
    pub = tmp_path / "site.pub"
    save_public_key(generate_signing_key().public_key(), pub)
    ok = runner.invoke(app, ["enrol", "siteA", "--public-key", str(pub), "--metadata",
                             json.dumps({"capacity": 120, "species": ["Giraffa camelopardalis"]}),
                             "--config", str(cfg_path)])
    assert ok.exit_code == 0, ok.output
    dup = runner.invoke(app, ["enrol", "siteA", "--public-key", str(pub), "--config", str(cfg_path)])
    assert dup.exit_code == 2 and "already enrolled" in dup.output
    bad = runner.invoke(app, ["enrol", "siteB", "--public-key", str(pub), "--metadata", "{nope",
                              "--config", str(cfg_path)])
    assert bad.exit_code == 2 and "metadata" in bad.output
    # some spend, a rejection
    store = Store(cfg.database_url, cfg.data_dir)
    PrivacyLedger(store, target_delta=cfg.target_delta).record_round("siteA", 1, {
        IUCNCategory.VU: DPSGDEvent(1.1, 0.05, 10)})
    store.add_rejection(round=1, site_id="x", topic="t", reason="bad_signature", error_kind="SignatureError",
                        detail="d")
    store.dispose()
    st = runner.invoke(app, ["status", "--config", str(cfg_path)])
    assert st.exit_code == 0 and "bad_signature" in st.output and "1 site(s)" in st.output
    bud = runner.invoke(app, ["budget", "--config", str(cfg_path)], env={"COLUMNS": "200"})
    assert bud.exit_code == 0, bud.output
    vu_line = [line for line in bud.output.splitlines() if "siteA" in line and " VU " in line][0]
    eps = PrivacyLedger(Store(cfg.database_url, cfg.data_dir), target_delta=1e-5).spent("siteA", "VU")
    assert f"{eps:.4f}" in vu_line and f"{cfg.budgets()[IUCNCategory.VU]:.4f}" in vu_line


def test_cli_missing_config_is_a_clear_error(tmp_path):
    r = runner.invoke(app, ["status", "--config", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 2 and "config file not found" in r.output


def test_enrol_warns_when_public_metadata_lists_a_cr_or_en_species(tmp_path):
    assert runner.invoke(app, ["init", str(tmp_path), "--federation-id", "fed"]).exit_code == 0
    cfg = tmp_path / "coordinator.yaml"
    data = yaml.safe_load(cfg.read_text())
    data["species"] = [{"scientific_name": "Loxodonta cyclotis", "class_index": 0, "iucn_category": "CR"},
                       {"scientific_name": "Equus quagga", "class_index": 1, "iucn_category": "NT"}]
    cfg.write_text(yaml.safe_dump(data))
    save_public_key(generate_signing_key().public_key(), tmp_path / "a.pub")
    save_public_key(generate_signing_key().public_key(), tmp_path / "b.pub")
    listed = runner.invoke(app, ["enrol", "a", "--public-key", str(tmp_path / "a.pub"), "--config", str(cfg),
                                 "--metadata", '{"species": ["Loxodonta cyclotis", "Equus quagga"]}'])
    assert listed.exit_code == 0 and "warning" in listed.output and "Loxodonta cyclotis" in listed.output
    clean = runner.invoke(app, ["enrol", "b", "--public-key", str(tmp_path / "b.pub"), "--config", str(cfg),
                                "--metadata", '{"species": ["Equus quagga"]}'])
    assert clean.exit_code == 0 and "warning" not in clean.output


def test_config_errors_name_the_allowed_fields_and_the_nearest_one(tmp_path):
    """The coordinator's config errors go through the one config formatter (shared.config.explain_error), the
    profiles' one: an unknown key inside the discriminated budget names its section's fields and the likely one."""
    d = tmp_path / "coord"
    assert runner.invoke(app, ["init", str(d), "--federation-id", "fed"]).exit_code == 0
    cfg_path = d / "coordinator.yaml"
    data = yaml.safe_load(cfg_path.read_text())
    data["budget"] = {"kind": "from_anchor", "category": "VU", "epsilon": 1.0, "gama": 1.0}
    data["privacy"] = "ldp"
    cfg_path.write_text(yaml.safe_dump(data))
    result = runner.invoke(app, ["status", "--config", str(cfg_path)], env={"COLUMNS": "1000"})
    out = " ".join(result.output.split())
    assert result.exit_code != 0
    assert "Extra inputs are not permitted" not in out and "Input should be" not in out, out
    assert ("budget.from_anchor.gama: unknown field 'gama' in budget.from_anchor; allowed fields there: kind, "
            "category, epsilon, gamma; fix: rename it to 'gamma'") in out, out
    assert "privacy: 'ldp' is not allowed; allowed values: ccdp, global, grouped, none" in out, out
    with pytest.raises(ConfigError) as err:
        config_from_dict({"federation_id": "f", "budget": {"kind": "from_anchr"}})
    assert "'from_anchr' is not allowed; allowed values: from_max, from_anchor" in str(err.value)
