"""``wildfed experiment nira``: FedAvg vs NIRA on the demo federation (docs/nira.md).

Fast tests: the per-site evaluation against hand-computed accuracies (a fake model whose predictions are fixed),
the summary and table on hand-made rows (means, sample stds, worst decile and paired differences worked out here),
and the settings' validation. The slow test runs a tiny grid (3 sites, 2 rounds, FedAvg and NIRA, real gateway
processes) and checks the JSON it writes.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from shared.errors import ConfigError

from wildfed_sim.demo import DemoSettings
from wildfed_sim.evaluation import (evaluate_sites, rare_species, summarise_sites, worst_decile)
from wildfed_sim.nira import NiraSettings, markdown_table, summarise

# ------------------------------------------------------------------------------------------ per-site evaluation
LABELS = np.array([0, 0, 0, 0, 1, 1, 2, 2, 2, 2])
PRED_A = np.array([0, 0, 1, 0, 1, 0, 2, 2, 2, 0])  # class 0: 3/4, class 1: 1/2, class 2: 3/4
PRED_B = np.array([2, 2, 2, 2, 2, 2, 2, 2, 2, 2])  # class 0: 0, class 1: 0, class 2: 1


def _fake_models():
    a = {"phi.w": np.zeros(1), "psi.weight": np.zeros(1)}
    b = {"phi.w": a["phi.w"], "psi.weight": np.ones(1)}  # shares phi, its own head
    calls = []

    def predict(weights, images):
        calls.append(1)
        assert len(images) == len(LABELS)
        return PRED_A if float(weights["psi.weight"][0]) == 0.0 else PRED_B

    return a, b, predict, calls


def test_evaluate_sites_matches_hand_computed_accuracies():
    a, b, predict, calls = _fake_models()
    images = np.zeros((len(LABELS), 28, 28), dtype=np.uint8)
    site_counts = {"s1": {0: 30, 1: 10}, "s2": {1: 5, 2: 5}, "s3": {0: 1, 1: 2, 2: 7}}
    models = {"s1": a, "s2": b, "s3": dict(a)}  # s3 gets the very same arrays as s1: predicted once
    out = evaluate_sites(models, site_counts, images, LABELS, 3, predict=predict)
    assert len(calls) == 2

    s1, _ = out["s1"]
    assert s1.per_class == {0: 0.75, 1: 0.5}
    assert s1.test_counts == {0: 4, 1: 2}
    assert s1.accuracy == pytest.approx((30 * 0.75 + 10 * 0.5) / 40)  # 0.6875, weighted by the site's counts
    assert s1.macro == pytest.approx((0.75 + 0.5) / 2)
    assert s1.rare_species == (1,) and s1.rare == pytest.approx(0.5)

    s2, preds2 = out["s2"]
    assert np.array_equal(preds2, PRED_B)
    assert s2.per_class == {1: 0.0, 2: 1.0}
    assert s2.accuracy == pytest.approx(0.5) and s2.macro == pytest.approx(0.5)
    assert s2.rare_species == (1, 2) and s2.rare == pytest.approx(0.5)  # tie: both are rare

    s3, _ = out["s3"]
    assert s3.accuracy == pytest.approx((1 * 0.75 + 2 * 0.5 + 7 * 0.75) / 10)
    assert s3.macro == pytest.approx((0.75 + 0.5 + 0.75) / 3)
    assert s3.rare_species == (0,) and s3.rare == pytest.approx(0.75)

    # species a site does not hold: s1 lacks class 2 (3/4 right), s2 lacks class 0 (none right), s3 lacks none
    assert s1.novel == pytest.approx(0.75) and s2.novel == 0.0 and math.isnan(s3.novel)

    summary = summarise_sites([s1, s2, s3])
    assert summary["macro"] == pytest.approx((0.625 + 0.5 + 2 / 3) / 3)
    assert summary["site_mean"] == pytest.approx((0.6875 + 0.5 + 0.7) / 3)
    assert summary["site_worst_decile"] == pytest.approx(0.5)  # ceil(3/10) = 1 site: the worst
    assert summary["rare"] == pytest.approx((0.5 + 0.5 + 0.75) / 3)
    assert summary["novel"] == pytest.approx((0.75 + 0.0) / 2)


def test_a_class_without_test_images_is_left_out_of_the_means():
    a, _, predict, _ = _fake_models()
    out = evaluate_sites({"s": a}, {"s": {0: 4, 7: 1}}, np.zeros((10, 28, 28), np.uint8), LABELS, 8,
                         predict=predict)
    site, _ = out["s"]
    assert math.isnan(site.per_class[7]) and site.test_counts[7] == 0
    assert site.macro == pytest.approx(0.75) and site.accuracy == pytest.approx(0.75)
    assert site.rare_species == (7,) and math.isnan(site.rare)


def test_rare_species_and_worst_decile():
    assert rare_species({3: 10, 5: 2, 8: 2, 9: 40}) == (5, 8)
    assert rare_species({4: 7}) == (4,)
    assert rare_species({}) == ()
    values = [0.9, 0.1, 0.5, 0.3, 0.8, 0.7, 0.6, 0.2, 0.4, 0.95, 0.85, 0.05]  # 12 sites: worst ceil(1.2) = 2
    assert worst_decile(values) == pytest.approx((0.05 + 0.1) / 2)
    assert worst_decile([0.4, 0.2, 0.9]) == pytest.approx(0.2)
    assert math.isnan(worst_decile([]))


# ------------------------------------------------------------------------------------------ summary and table
def _row(config, privacy, seed, macro, eps=None, clusters=None):
    return {"configuration": config, "privacy": privacy, "seed": seed, "macro": macro, "site_mean": macro + 0.1,
            "site_worst_decile": macro - 0.2, "rare": macro - 0.1, "novel": None, "eps_cr_en": eps, "eps_lc": eps,
            "num_clusters": clusters, "history_macro": [macro / 2, macro]}


def test_summary_means_stds_and_paired_deltas():
    runs = [_row("fedavg", "none", 0, 0.5), _row("fedavg", "none", 1, 0.6), _row("fedavg", "none", 2, 0.7),
            _row("nira", "none", 0, 0.55, clusters=3), _row("nira", "none", 1, 0.7, clusters=3),
            _row("nira", "none", 2, 0.7, clusters=4),
            _row("nira", "ccdp", 0, 0.4, eps=0.5, clusters=3)]
    summary = summarise(runs)
    assert [(e["configuration"], e["privacy"]) for e in summary] == [("fedavg", "none"), ("nira", "none"),
                                                                     ("nira", "ccdp")]
    fed, nira, nira_dp = summary
    assert fed["macro"]["mean"] == pytest.approx(0.6)
    assert fed["macro"]["std"] == pytest.approx(0.1)  # sample std of 0.5, 0.6, 0.7
    assert fed["eps_cr_en"]["mean"] is None and fed["num_clusters"]["mean"] is None
    assert nira["macro"]["mean"] == pytest.approx((0.55 + 0.7 + 0.7) / 3)
    # paired differences 0.05, 0.10, 0.00 -> mean 0.05, sample std 0.05
    assert nira["delta_macro"]["mean"] == pytest.approx(0.05)
    assert nira["delta_macro"]["std"] == pytest.approx(0.05)
    assert nira["num_clusters"]["mean"] == pytest.approx(10 / 3)
    assert nira["history_macro"] == pytest.approx([0.325, 0.65])
    assert nira["site_worst_decile"]["mean"] == pytest.approx(0.65 - 0.2)
    # no FedAvg run with CCDP: no paired difference; one seed: std 0
    assert nira_dp["delta_macro"]["mean"] is None
    assert nira_dp["macro"]["std"] == 0.0 and nira_dp["eps_cr_en"]["mean"] == pytest.approx(0.5)

    table = markdown_table(summary)
    lines = table.strip().splitlines()
    assert len(lines) == 2 + 3
    assert "| FedAvg | no privacy | 3 | 60.0 ± 10.0 | - |" in lines[2]
    assert "| 40.0 ± 10.0 | 50.0 ± 10.0 | n/a | - |" in lines[2]  # worst decile, rare, novel, clusters
    assert "+5.0 ± 5.0" in lines[3]
    assert lines[4].endswith("| 0.50 | 0.50 |")


# ------------------------------------------------------------------------------------------ settings
@pytest.mark.parametrize("kwargs, field", [
    ({"strategy": "fedprox"}, "strategy"),
    ({"strategy": "nira", "privacy": "global", "local_steps": 1}, "strategy"),
    ({"strategy": "nira", "nira_recluster_every": -1}, "nira_recluster_every"),
    ({"strategy": "nira", "nira_distance_threshold": 1.5}, "nira_distance_threshold"),
    ({"strategy": "nira", "nira_distance_threshold": 0.0}, "nira_distance_threshold"),
])
def test_demo_settings_reject_bad_strategy_values(kwargs, field):
    with pytest.raises(ConfigError) as err:
        DemoSettings(**kwargs)
    assert err.value.field == field and err.value.fix


def test_nira_settings_default_grid_is_the_issues():
    s = NiraSettings()
    assert s.configurations == ("fedavg", "nira", "nira-no-recluster", "nira-no-merging")
    assert s.privacy == ("none", "ccdp") and s.seeds == (0, 1, 2)


def test_demo_settings_defaults_keep_fedavg():
    s = DemoSettings()
    assert (s.strategy, s.nira_recluster_every, s.nira_embedding_merging, s.nira_distance_threshold) == (
        "fedavg", 0, True, None)
    # the default privacy: distributed Global DP with FedAvg, local CCDP with NIRA (per-cluster heads)
    assert (s.privacy, s.global_noise, s.local_steps) == ("global", "distributed", 1)
    nira = DemoSettings(strategy="nira", nira_recluster_every=3, nira_distance_threshold=0.7)  # valid
    assert nira.privacy == "ccdp"


@pytest.mark.parametrize("kwargs, field", [
    ({"configurations": ("fedavg", "fedprox")}, "configurations"),
    ({"configurations": ()}, "configurations"),
    ({"privacy": ("global",)}, "privacy"),
    ({"seeds": ()}, "seeds"),
    ({"seeds": (0, 0)}, "seeds"),
    ({"recluster_every": 0}, "recluster_every"),
])
def test_nira_settings_reject_bad_values(kwargs, field):
    with pytest.raises(ConfigError) as err:
        NiraSettings(**kwargs)
    assert err.value.field == field and err.value.fix


# ------------------------------------------------------------------------------------------ smoke run
@pytest.mark.slow
def test_tiny_grid_writes_json_table_and_plot(tmp_path):
    from rich.console import Console

    from wildfed_sim.nira import run_nira_experiment

    settings = NiraSettings(seeds=(0,), rounds=2, sites=3, local_steps=2, expected_batch_size=32,
                            recluster_every=1, configurations=("fedavg", "nira"), privacy=("none",),
                            out_dir=tmp_path / "nira", round_deadline_s=120)
    result = run_nira_experiment(settings, console=Console(quiet=True))
    out = json.loads((tmp_path / "nira" / "nira.json").read_text())
    assert (tmp_path / "nira" / "nira.md").is_file() and (tmp_path / "nira" / "nira.png").stat().st_size > 0
    assert [(r["configuration"], r["privacy"], r["seed"]) for r in out["runs"]] == [("fedavg", "none", 0),
                                                                                    ("nira", "none", 0)]
    for row in out["runs"]:
        assert len(row["per_site"]) == 3
        assert len(row["history_macro"]) == 2
        assert 0.0 <= row["macro"] <= 1.0 and row["eps_cr_en"] is None
        report = json.loads(open(row["report"]).read())
        # the row is the report's per-site summary, recomputed here from its per-site entries
        sites = report["per_site"]["sites"]
        assert row["macro"] == pytest.approx(np.nanmean([s["macro"] for s in sites]))
        assert row["site_mean"] == pytest.approx(np.mean([s["accuracy"] for s in sites]))
        assert row["site_worst_decile"] == pytest.approx(min(s["accuracy"] for s in sites))
    fed, nira = out["runs"]
    assert fed["num_clusters"] is None
    assert nira["num_clusters"] >= 1
    members = sorted(s for m in nira["clusters"].values() for s in m)
    assert members == sorted(s["site_id"] for s in nira["per_site"])
    assert [e["configuration"] for e in out["summary"]] == ["fedavg", "nira"]
    assert result.summary[1]["delta_macro"]["mean"] == pytest.approx(nira["macro"] - fed["macro"])
