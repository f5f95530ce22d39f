"""``wildfed experiment privacy-utility``: the seed's table on the demo federation.

The fast tests check the table's arithmetic on hand-written reports; the slow one runs the whole command at tiny
settings (five demo federations, real gateway processes; about a minute on 2 cores) and checks the table against
each run's report.json and against budgets computed here from the seed's formula, not from the project's code.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from shared.errors import ConfigError

from wildfed_sim.cli import app
from wildfed_sim.animal_mnist import AnimalMNIST, fetch_animal_mnist, split_holdout
from wildfed_sim.demo import (
    DemoSettings,
    balanced_public_split,
    design_sites_with_public_split,
    load_weights,
    public_split_indices,
    save_weights,
)
from wildfed_sim.ecology import design_sites
from wildfed_sim.privacy_utility import (
    CONFIGURATIONS,
    PrivacyUtilitySettings,
    markdown_table,
    row_from_report,
    summarise,
)

# Budgets of the largest CR/EN category (EN, rank 2) and of LC (rank 5), by the seed's formula anchored at VU
# (rank 3): eps_c = eps_VU * (rank/3)^gamma; uniform DP is gamma = 0.
BUDGETS = {
    "uniform-eps1": (1.0, 1.0),
    "uniform-eps2": (2.0, 2.0),
    "ccdp-gamma1": (2 / 3, 5 / 3),
    "ccdp-gamma2": ((2 / 3) ** 2, (5 / 3) ** 2),
}


def _report(overall, cr_en, lc, eps=None):
    return {"final_accuracy": {"overall": overall, "CR/EN": cr_en, "LC": lc},
            "epsilon": {c: {"spent_max": v, "budget": b} for c, (v, b) in (eps or {}).items()}}


def test_rows_and_summary_from_reports():
    ccdp = next(c for c in CONFIGURATIONS if c.name == "ccdp-gamma1")
    none = next(c for c in CONFIGURATIONS if c.name == "none")
    eps = {"CR": (0.30, 1 / 3), "EN": (0.60, 2 / 3), "LC": (1.5, 5 / 3)}
    rows = [{"configuration": "ccdp-gamma1", **row_from_report(_report(0.5, 0.2, 0.7, eps), ccdp)},
            {"configuration": "ccdp-gamma1", **row_from_report(_report(0.7, 0.4, 0.9, eps), ccdp)},
            {"configuration": "none", **row_from_report(_report(0.9, 0.8, 1.0, {}), none)}]
    assert rows[0]["eps_cr_en"] == 0.60 and rows[0]["eps_lc"] == 1.5
    assert rows[2]["eps_cr_en"] is None and rows[2]["eps_lc"] is None
    summary = summarise(rows, [none, ccdp])
    assert [s["configuration"] for s in summary] == ["none", "ccdp-gamma1"]
    assert summary[1]["acc_overall"]["mean"] == pytest.approx(0.6)
    assert summary[1]["acc_overall"]["std"] == pytest.approx(np.std([0.5, 0.7], ddof=1))
    assert summary[0]["acc_overall"]["std"] == 0.0
    assert summary[0]["eps_lc"] == {"mean": None, "std": None}
    md = markdown_table(summary)
    assert md.count("\n") == 4
    assert "60.0 ± 14.1 %" in md and "- (no DP)" in md and "0.600 ± 0.000" in md


def test_configurations_are_the_seeds_table():
    from coordinator.config import BudgetFromAnchor
    from shared.iucn import IUCNCategory

    assert [c.name for c in CONFIGURATIONS] == ["none", "uniform-eps1", "uniform-eps2", "ccdp-gamma1", "ccdp-gamma2"]
    for c in CONFIGURATIONS[1:]:
        anchor = BudgetFromAnchor(category=IUCNCategory.VU, epsilon=c.anchor_epsilon, gamma=c.gamma)
        budgets = anchor.to_budget().table()
        assert max(budgets[IUCNCategory.CR], budgets[IUCNCategory.EN]) == pytest.approx(BUDGETS[c.name][0])
        assert budgets[IUCNCategory.LC] == pytest.approx(BUDGETS[c.name][1])


def test_settings_are_checked():
    with pytest.raises(ConfigError):
        PrivacyUtilitySettings(seeds=())
    with pytest.raises(ConfigError):
        PrivacyUtilitySettings(seeds=(0, 0))
    with pytest.raises(ConfigError):
        PrivacyUtilitySettings(configurations=("uniform-eps3",))
    with pytest.raises(ConfigError):
        DemoSettings(pretrain_epochs=2, initial_weights_path="w.safetensors")
    result = CliRunner().invoke(app, ["experiment", "privacy-utility", "--seeds", "0,x"])
    assert result.exit_code == 2, result.output


def test_public_split_is_what_no_site_holds(tmp_path):
    class Spec:
        def __init__(self, indices):
            self.indices = np.asarray(indices)

    public = public_split_indices(10, [Spec([0, 3]), Spec([4, 5, 9])])
    assert public.tolist() == [1, 2, 6, 7, 8]
    weights = {"phi.w": np.arange(6, dtype=np.float32).reshape(2, 3), "psi.b": np.ones(2, dtype=np.float32)}
    back = load_weights(save_weights(weights, tmp_path / "w.safetensors"))
    assert set(back) == set(weights) and all(np.array_equal(back[k], weights[k]) for k in weights)


def _synthetic_split(seed):
    """A 10,000-image stand-in for Animal-MNIST (1,000 per class, shuffled) and its 80/20 held-out split."""
    labels = np.random.default_rng(123).permutation(np.repeat(np.arange(10, dtype=np.int64), 1000))
    data = AnimalMNIST(images=np.zeros((labels.size, 28, 28), dtype=np.uint8), labels=labels,
                       source_indices=np.arange(labels.size, dtype=np.int64))
    return split_holdout(data, 0.2, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("per_class", [1, 100])
def test_balanced_public_split_is_disjoint_from_sites_and_test(seed, per_class):
    train, test = _synthetic_split(seed)
    specs, public = design_sites_with_public_split(train.labels, 8, seed=seed, public_per_class=per_class)

    # exactly per_class images of every class, each once
    assert public.size == 10 * per_class and np.unique(public).size == public.size
    for c in range(10):
        assert int((train.labels[public] == c).sum()) == per_class
    # no site holds a public image; sites stay disjoint and hold exactly their listed species
    held = np.concatenate([s.indices for s in specs])
    assert np.unique(held).size == held.size
    assert not set(public.tolist()) & set(held.tolist())
    for spec in specs:
        assert sorted(set(train.labels[spec.indices].tolist())) == list(spec.species)
    # disjoint from the held-out test split, checked on the images' positions in the whole data set
    assert not set(train.source_indices[public].tolist()) & set(test.source_indices.tolist())
    assert not set(train.source_indices[held].tolist()) & set(test.source_indices.tolist())
    # the same sizes as the default design (only which images go where changes), deterministic in the seed
    default = design_sites(train.labels, 8, seed=seed)
    assert sorted(s.num_images for s in specs) == sorted(s.num_images for s in default)
    specs2, public2 = design_sites_with_public_split(train.labels, 8, seed=seed, public_per_class=per_class)
    assert np.array_equal(public, public2)
    assert all(np.array_equal(a.indices, b.indices) for a, b in zip(specs, specs2))


def test_public_split_default_is_what_no_site_holds_and_bad_sizes_are_refused():
    train, _ = _synthetic_split(0)
    specs, public = design_sites_with_public_split(train.labels, 8, seed=0, public_per_class=0)
    default = design_sites(train.labels, 8, seed=0)
    assert all(np.array_equal(a.indices, b.indices) for a, b in zip(specs, default))
    held = set(np.concatenate([s.indices for s in specs]).tolist())
    assert public.tolist() == [i for i in range(len(train.labels)) if i not in held]
    with pytest.raises(ConfigError):
        balanced_public_split(train.labels, 801, seed=0)  # the training split has 800 per class
    with pytest.raises(ConfigError):
        balanced_public_split(train.labels, 0, seed=0)
    with pytest.raises(ConfigError):
        DemoSettings(public_per_class=-1)
    with pytest.raises(ConfigError):
        PrivacyUtilitySettings(public_per_class=-1)


def test_experiment_passes_the_public_split_and_reports_round0(tmp_path, monkeypatch):
    """The grid loop without federations: every demo run gets the pretrained weights and the same
    public_per_class; the markdown caption carries the hyper-parameters and the round-0 accuracy."""
    import wildfed_sim.demo as demo
    import wildfed_sim.privacy_utility as pu

    seen = []

    def fake_pretrain(settings, seed, out_dir, console):
        return {"path": str(out_dir / f"w{seed}"), "accuracy": {"CR/EN": 0.5 + seed / 10, "LC": 0.6, "overall": 0.7}}

    def fake_run_demo(settings, console=None):
        seen.append(settings)
        settings.out_dir.mkdir(parents=True)
        eps = {c: (0.5, 1.0) for c in ("CR", "EN", "LC")} if settings.privacy == "ccdp" else {}
        (settings.out_dir / "report.json").write_text(json.dumps(_report(0.8, 0.4, 0.9, eps)))

    monkeypatch.setattr(pu, "_pretrain", fake_pretrain)
    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    result = pu.run_privacy_utility(PrivacyUtilitySettings(seeds=(0, 1), public_per_class=7, learning_rate=0.02,
                                                           out_dir=tmp_path / "out"))
    assert len(seen) == 10 and {s.public_per_class for s in seen} == {7}
    assert {(s.seed, str(s.initial_weights_path)) for s in seen} == {(k, str(tmp_path / "out" / f"w{k}"))
                                                                      for k in (0, 1)}
    md = (result.out_dir / "privacy_utility.md").read_text()
    assert "local lr 0.02" in md and "7 training images per class" in md
    assert "Round-0 model (pretrained only, before any site trains): CR/EN 55.0 ± 7.1 %" in md
    assert (result.out_dir / "privacy_utility.png").stat().st_size > 10_000


@pytest.mark.slow
def test_privacy_utility_command_tiny(tmp_path):
    out = tmp_path / "pu"
    result = CliRunner().invoke(app, ["experiment", "privacy-utility", "--seeds", "0", "--rounds", "1", "--sites", "3",
                                      "--local-steps", "1", "--expected-batch-size", "16", "--pretrain-epochs", "1",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "privacy_utility.json").read_text())
    assert (out / "privacy_utility.png").stat().st_size > 10_000
    md = (out / "privacy_utility.md").read_text()
    assert sum(1 for line in md.splitlines() if line.startswith("| ") and "configuration" not in line) == 5
    assert [s["configuration"] for s in data["summary"]] == [c.name for c in CONFIGURATIONS]
    assert len(data["runs"]) == 5

    # Pretraining used only images no site holds: a class-balanced public split (the default, 100 per class),
    # less the few that are byte-identical copies of an image some site holds.
    pre = data["pretraining"]["0"]
    assert pre["public_per_class"] == 100 and all(95 <= c <= 100 for c in pre["class_counts"])
    assert pre["num_images"] == sum(pre["class_counts"]) and 990 <= pre["num_images"] <= 1000
    assert pre["num_images"] + pre["num_site_images"] <= pre["num_train"]
    public = set(pre["public_source_indices"])  # positions in the published 10,000-image array
    assert len(public) == pre["num_images"]
    data_set = fetch_animal_mnist()
    _, test = split_holdout(data_set, 0.2, seed=0)
    assert not public & set(test.source_indices.tolist())
    assert np.bincount(data_set.labels[sorted(public)], minlength=10).tolist() == pre["class_counts"]
    for run in data["runs"]:  # every run's sites, read back from the Camtrap DP packages the gateways used
        run_dir = Path(run["report"]).parent
        media = [row["mediaID"] for path in sorted(run_dir.glob("sites/*/camtrap-dp/media.csv"))
                 for row in csv.DictReader(path.open())]
        site_sources = {int(m.rsplit("-", 1)[1]) for m in media}
        assert len(media) == pre["num_site_images"] == len(site_sources)
        assert not public & site_sources
        site_bytes = {data_set.images[i].tobytes() for i in site_sources}  # no public image is a site's pixels
        assert not [i for i in public if data_set.images[i].tobytes() in site_bytes]

    for run, summary in zip(data["runs"], data["summary"]):
        report = json.loads(open(run["report"]).read())
        assert report["settings"]["initial_weights_path"] == pre["path"]
        assert report["settings"]["rounds"] == 1 and report["settings"]["sites"] == 3
        acc = report["final_accuracy"]
        assert summary["acc_overall"]["mean"] == pytest.approx(acc["overall"])
        assert summary["acc_lc"]["mean"] == pytest.approx(acc["LC"], nan_ok=True)
        assert summary["acc_cr_en"]["mean"] == pytest.approx(acc["CR/EN"], nan_ok=True)
        if run["configuration"] == "none":
            assert report["settings"]["privacy"] == "none"
            assert summary["eps_cr_en"]["mean"] is None and summary["eps_lc"]["mean"] is None
            continue
        eps = report["epsilon"]
        spent_cr_en = max(eps["CR"]["spent_max"], eps["EN"]["spent_max"])
        assert summary["eps_cr_en"]["mean"] == pytest.approx(spent_cr_en)
        assert summary["eps_lc"]["mean"] == pytest.approx(eps["LC"]["spent_max"])
        budget_cr_en, budget_lc = BUDGETS[run["configuration"]]
        # >= 0: in this 1-round run CCDP "sample" may give CR a rate whose RDP epsilon rounds to 0
        assert 0 <= spent_cr_en <= budget_cr_en + 1e-9
        assert 0 < eps["LC"]["spent_max"] <= budget_lc + 1e-9
        assert not math.isnan(summary["acc_overall"]["mean"])
