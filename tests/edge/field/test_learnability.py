"""The best-case signal against noise (hand-worked numbers), and check-config's report of a site's records."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from shared.iucn import IUCNCategory as Cat

from edge_sdk.field.learnability import signal_to_noise


def test_the_bound_by_hand() -> None:
    # 21 records, q = 1, C = 1, sigma = 16.65, T = 10 steps, d = 12,810 (the head on 1280-d embeddings, 10 classes):
    # signal 10 * 21 = 210, noise 16.65 * sqrt(10 * 12,810) = 5959.1, ratio 0.0352
    (row,) = signal_to_noise({Cat.LC: 21}, sampling_rates={Cat.LC: 1.0}, clipping_norms={Cat.LC: 1.0},
                             noise_std=16.65, steps=10, parameters=12_810)
    assert row.signal == pytest.approx(210.0)
    assert row.noise == pytest.approx(16.65 * math.sqrt(128_100))
    assert row.ratio == pytest.approx(210.0 / (16.65 * math.sqrt(128_100))) and not row.learns
    assert "cannot learn" in row.describe() and "21 record(s)" in row.describe()
    (big,) = signal_to_noise({Cat.LC: 4000}, sampling_rates={Cat.LC: 0.25}, clipping_norms={Cat.LC: 1.0},
                             noise_std=5.0, steps=100, parameters=12_810)
    assert big.ratio == pytest.approx(100 * 0.25 * 4000 / (5.0 * math.sqrt(1_281_000))) and big.learns
    (absent,) = signal_to_noise({}, sampling_rates={Cat.CR: 0.1}, clipping_norms={Cat.CR: 1.0}, noise_std=1.0,
                                steps=1, parameters=1)
    assert absent.records == 0 and absent.ratio == 0.0
    with pytest.raises(ValueError):
        signal_to_noise({}, sampling_rates={}, clipping_norms={}, noise_std=0.0, steps=1, parameters=1)


def test_check_config_reports_records_and_warns_in_numbers(tmp_path: Path) -> None:
    from edge_sdk.cli import app

    from ..conftest import SPECIES, write_package
    from shared.keys import generate_signing_key, save_private_key, save_public_key
    from tests.gateway_backend import GATEWAY_BACKEND

    save_private_key(generate_signing_key(), tmp_path / "keys" / "site.key")
    save_public_key(generate_signing_key().public_key(), tmp_path / "keys" / "coordinator.pub")
    write_package(tmp_path / "pkg")
    config = {"federation_id": "fed", "site_id": "site-1", "dataset": "pkg",
              "species": [{"scientific_name": n, "class_index": c, "iucn_category": cat}
                          for n, (c, cat) in SPECIES.items()],
              "private_key": "keys/site.key", "coordinator_public_key": "keys/coordinator.pub",
              "outbox": "state/outbox.sqlite", "backend": GATEWAY_BACKEND}
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["check-config", str(tmp_path / "site.yaml")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "training records (train_on: verified; 3 in all)" in out
    assert "no round trained yet: an assumed plan of 10 rounds" in out
    assert "cannot learn" in out  # 1 CR and 2 NT records under the assumed noise


def test_check_config_uses_the_coordinators_plan_written_at_provisioning(tmp_path: Path) -> None:
    """With ``federation_plan`` in site.yaml the report calibrates that plan (here 4 rounds x 5 steps, batch 2):
    the noise it prints is the one plan_ccdp gives for it, not the assumed plan's."""
    from edge_sdk.cli import app
    from edge_sdk.config import load_site_config

    from ..conftest import SPECIES, write_package
    from shared.keys import generate_signing_key, save_private_key, save_public_key
    from tests.gateway_backend import GATEWAY_BACKEND

    save_private_key(generate_signing_key(), tmp_path / "keys" / "site.key")
    save_public_key(generate_signing_key().public_key(), tmp_path / "keys" / "coordinator.pub")
    write_package(tmp_path / "pkg")
    plan = {"rounds": 4, "local_steps": 5, "expected_batch": 2, "target_delta": 1e-5, "clipping_norm": 1.0,
            "variant": "sample", "budgets": {"CR": 0.5, "EN": 1.0, "VU": 1.5, "NT": 2.0, "LC": 2.5, "NE": 3.0}}
    config = {"federation_id": "fed", "site_id": "site-1", "dataset": "pkg",
              "species": [{"scientific_name": n, "class_index": c, "iucn_category": cat}
                          for n, (c, cat) in SPECIES.items()],
              "private_key": "keys/site.key", "coordinator_public_key": "keys/coordinator.pub",
              "outbox": "state/outbox.sqlite", "backend": GATEWAY_BACKEND, "federation_plan": plan}
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["check-config", str(tmp_path / "site.yaml")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "the coordinator's plan written at provisioning, 4 rounds x 5 steps, expected batch 2" in out
    assert "assumed plan" not in out
    # the noise is plan_ccdp's for exactly that plan and its budgets (calibrated independently here; 3 records)
    from edge_sdk.privacy.ccdp import plan_ccdp

    site = load_site_config(tmp_path / "site.yaml")
    expected = plan_ccdp(variant="sample", budgets={Cat(c): e for c, e in plan["budgets"].items()},
                         active=site.categories, target_delta=1e-5, sampling_rate=2 / 3, steps=20, clipping_norm=1.0,
                         site_categories=site.categories)
    assert f"sigma={expected.noise_std:.3g}, 20 step(s)" in out
    assert "expected batch 2 of 3 (the records held: the site declared no capacity)" in out
    # with the declared capacity the rate is the rounds' expected batch / capacity, not / the records held
    (tmp_path / "cap.yaml").write_text(yaml.safe_dump(dict(config, federation_plan={**plan, "capacity": 50})))
    result = CliRunner().invoke(app, ["check-config", str(tmp_path / "cap.yaml")], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    by_capacity = plan_ccdp(variant="sample", budgets={Cat(c): e for c, e in plan["budgets"].items()},
                            active=site.categories, target_delta=1e-5, sampling_rate=2 / 50, steps=20,
                            clipping_norm=1.0, site_categories=site.categories)
    assert "expected batch 2 of 50 (the declared capacity)" in out
    assert f"sigma={by_capacity.noise_std:.3g}, 20 step(s)" in out and by_capacity.noise_std != expected.noise_std
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(dict(config, federation_plan={**plan, "budgets": {"XX": 1}})))
    with pytest.raises(Exception, match="budgets"):
        load_site_config(tmp_path / "bad.yaml")
