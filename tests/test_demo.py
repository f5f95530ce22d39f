"""The main job end to end with small settings: embedded broker, coordinator, real gateway processes, real images.

Slow (about a minute on 2 cores): it starts one Python process per site. What it checks is computed independently of
the code under test: the epsilon the demo reports per category is recomputed from the ledger rows in the SQLite file
with dp-accounting directly, and checked against the CCDP budget formula.
"""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict

import dp_accounting
import pytest
import yaml
from typer.testing import CliRunner

from wildfed_sim.cli import app

pytestmark = pytest.mark.slow


def _direct_epsilon(rows, delta):
    acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    for z, q, steps in rows:
        for _ in range(steps):
            acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
    return acc.get_epsilon(delta)


def test_demo_small_federation(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["demo", "--sites", "3", "--rounds", "2", "--privacy", "ccdp",
                                      "--local-steps", "2", "--expected-batch-size", "16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.png").stat().st_size > 10_000
    assert [h["status"] for h in report["history"]] == ["closed", "closed"]
    assert all(len(h["accepted"]) == 3 for h in report["history"])
    assert report["rejections"] == {}
    for value in report["final_accuracy"].values():
        assert value != value or 0.0 <= value <= 1.0  # nan for a category absent from the test split

    # Every gateway holds the model the coordinator released to it after the last round (its own cluster's under
    # NIRA), with no file copied: the hash in its kept model's metadata is the one the coordinator recorded.
    assert report["final_models"] == {"sites": 3, "holding_final_model": 3, "missing": []}
    from edge_sdk.config import global_model_path, load_site_config
    from edge_sdk.global_model import kept_version

    coord_db = sqlite3.connect(out / "coordinator" / "coordinator.db")
    released = {k.split("/", 1)[1]: json.loads(v)["model"] for k, v in coord_db.execute(
        "SELECT key, value_json FROM strategy_state WHERE key LIKE 'model_release/%'")}
    assert set(released) == {site["site_id"] for site in report["sites"]}
    for site in report["sites"]:
        cfg = load_site_config(out / "sites" / site["site_id"] / "site.yaml")
        kept = kept_version(global_model_path(cfg))
        assert kept is not None and (kept.model_hash, kept.round, kept.source) == (
            released[site["site_id"]], 2, "release")

    # Each site read its data from a Camtrap DP package written for it.
    for site in report["sites"]:
        pkg = out / "sites" / site["site_id"] / "camtrap-dp"
        assert (pkg / "observations.csv").is_file() and (pkg / "datapackage.json").is_file()
        assert len(list((pkg / "media").glob("*.png"))) == site["num_images"]

    # The reported spend is what dp-accounting gives for the ledger's rows, and stays within budget.
    db = sqlite3.connect(out / "coordinator" / "coordinator.db")
    rows = defaultdict(list)
    for site, cat, z, q, steps in db.execute(
            "SELECT site_id, category, noise_multiplier, sampling_rate, steps FROM ledger"):
        rows[(site, cat)].append((z, q, steps))
    assert rows, "the ledger recorded nothing"
    budgets = {"CR": 1 / 3, "EN": 2 / 3, "VU": 1.0, "NT": 4 / 3, "LC": 5 / 3, "NE": 2.0}  # from_anchor(VU, 1, 1)
    worst = defaultdict(float)
    for (stream, cat), events in rows.items():
        # one stream per cohort: the sites' records joined in round 1 and trained 2 rounds x 2 local steps; round
        # 2's cohort (no record joined then) was charged round 2 only
        assert sum(s for *_, s in events) == (2 * 2 if stream.endswith("@c1") else 2), stream
        worst[cat] = max(worst[cat], _direct_epsilon(events, 1e-5))
    for cat, eps in worst.items():
        assert report["epsilon"][cat]["spent_max"] == pytest.approx(eps, rel=1e-6)
        assert eps <= budgets[cat] + 1e-9
        assert report["epsilon"][cat]["budget"] == pytest.approx(budgets[cat])


def test_demo_global_dp_with_secure_aggregation(tmp_path):
    # Global DP: each gateway sends its clipped, unnoised sum under secure aggregation; the coordinator adds the
    # noise once per round (real gateway processes, real MQTT, real images).
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["demo", "--sites", "3", "--rounds", "2", "--privacy", "global",
                                      "--global-noise", "trusted-server", "--local-steps", "1",
                                      "--expected-batch-size", "16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [h["status"] for h in report["history"]] == ["closed", "closed"]
    assert all(len(h["accepted"]) == 3 for h in report["history"]) and report["rejections"] == {}
    db = sqlite3.connect(out / "coordinator" / "coordinator.db")
    # the coordinator never stored an individual update: only masked vectors crossed, and only the sum was opened
    assert db.execute("SELECT count(*) FROM updates").fetchone() == (0,)
    assert [r[0] for r in db.execute("SELECT privacy FROM rounds ORDER BY round")] == ["global", "global"]
    rows = defaultdict(list)
    for site, cat, z, q, steps in db.execute(
            "SELECT site_id, category, noise_multiplier, sampling_rate, steps FROM ledger"):
        rows[(site, cat)].append((z, q, steps))
    budgets = {"CR": 1 / 3, "EN": 2 / 3, "VU": 1.0, "NT": 4 / 3, "LC": 5 / 3, "NE": 2.0}
    worst = defaultdict(float)
    top_rate = defaultdict(float)  # per site, its largest rate: q_k = min(1, B / N_k) wherever a rate is capped
    for (stream, cat), events in rows.items():
        site = stream.split("@c")[0]
        top_rate[site] = max(top_rate[site], *(q for _, q, _ in events))
    for (stream, cat), events in rows.items():
        site = stream.split("@c")[0]
        # one step per round, charged once per round to each cohort: round 1's in both rounds, round 2's in one
        assert [s for *_, s in events] == ([1, 1] if stream.endswith("@c1") else [1]), stream
        assert len({z for z, *_ in events}) == 1 and len({q for _, q, _ in events}) == 1  # the same every round
        eps = _direct_epsilon(events, 1e-5)
        worst[cat] = max(worst[cat], eps)
        # one z for every site (individualized "sample"): each category is sampled at the rate that spends its
        # budget over the 2 planned rounds, unless that rate would pass the site's q_k (then it runs at q_k)
        assert eps <= budgets[cat] + 1e-9
        assert (eps >= budgets[cat] * 0.99 or events[0][1] == top_rate[site]
                or not stream.endswith("@c1")), (stream, cat, eps)
    assert worst, "the ledger recorded nothing"
    assert len({z for events in rows.values() for z, *_ in events}) == 1
    for cat, eps in worst.items():
        assert report["epsilon"][cat]["spent_max"] == pytest.approx(eps, rel=1e-6)


def test_radio_demo_small_federation(tmp_path):
    # Two base-station gateway processes, one round, the adaptive defence at z = 3, phi = 0.5: each site's one
    # upload is the Gaussian mechanism with sensitivity 2C and std sqrt(phi) z C, i.e. noise multiplier
    # sqrt(0.5) * 3 / 2, composed here with dp-accounting directly.
    from wildfed_sim.radio_demo import RadioDemoSettings, run_radio_demo

    settings = RadioDemoSettings(sites=2, rounds=1, maps_per_site=4, pretrain_epochs=0, out_dir=tmp_path / "run")
    result = run_radio_demo(settings)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [h["status"] for h in report["history"]] == ["closed"]
    assert report["history"][0]["accepted"] == ["bs-00", "bs-01"]
    assert report["rejections"] == {}
    expected = _direct_epsilon([(0.5 ** 0.5 * 3.0 / 2, 1.0, 1)], 1e-5)
    assert report["history"][0]["epsilon"] == pytest.approx({"bs-00": expected, "bs-01": expected}, rel=1e-9)
    assert result.history[0]["val_mse_db"] < 0  # a finite MSE below 1 (normalised gain), in dB


def test_demo_global_dp_with_distributed_noise(tmp_path):
    # Distributed DP: each gateway adds its Skellam share before masking; the coordinator adds nothing and charges
    # Skellam events (real gateway processes, real MQTT, real images).
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["demo", "--sites", "3", "--rounds", "2", "--privacy", "global",
                                      "--global-noise", "distributed", "--local-steps", "1",
                                      "--expected-batch-size", "16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [h["status"] for h in report["history"]] == ["closed", "closed"]
    assert all(len(h["accepted"]) == 3 for h in report["history"])
    db = sqlite3.connect(out / "coordinator" / "coordinator.db")
    assert db.execute("SELECT count(*) FROM updates").fetchone() == (0,)
    details = [r[0] for r in db.execute("SELECT detail FROM rounds ORDER BY round")]
    assert all("distributed Skellam noise from the sites" in d for d in details)
    # the default tolerates one dropout: 3 sites, threshold t = 2 (a majority of 3), which the noise is calibrated for
    config = yaml.safe_load((out / "coordinator" / "coordinator.yaml").read_text())
    assert config["secagg"]["threshold"] == 2
    budgets = {"CR": 1 / 3, "EN": 2 / 3, "VU": 1.0, "NT": 4 / 3, "LC": 5 / 3, "NE": 2.0}
    per_cat = defaultdict(list)
    for cat, event_json in db.execute("SELECT category, event_json FROM ledger"):
        event = json.loads(event_json)
        assert event["type"] == "skellam" and event["steps"] == 1
        per_cat[cat].append(event)
    assert per_cat, "the ledger recorded nothing"
    for cat, events in per_cat.items():
        # the ledger's epsilon (dp-accounting, zCDP events) stays within the budget it was calibrated for
        assert 0 < report["epsilon"][cat]["spent_max"] <= budgets[cat] + 1e-9
