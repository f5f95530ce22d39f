"""``wildfed experiment privacy-utility``: the statistics against hand-worked values, the epsilon
against dp-accounting called here, the protocol's rules (equal tuning effort, tuning seeds never reported), and a
tiny end-to-end run checked against its own runs.jsonl and resumed."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
from typer.testing import CliRunner

from shared.errors import ConfigError
from shared.iucn import IUCNCategory as Cat
from shared.privacy.events import DPSGDEvent

from wildfed_sim.cli import app
from wildfed_sim.common.stats import paired_interval
from wildfed_sim.privacy_utility import (
    CONFIGURATIONS,
    DP_GRID,
    GLOBAL_GRID,
    NON_PRIVATE_GRID,
    PrivacyUtilitySettings,
    choose,
    epsilon_by_category,
)


def _dp_accounting_epsilon(z: float, q: float, steps: int, delta: float = 1e-5) -> float:
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return acc.get_epsilon(delta)


def test_paired_interval_is_the_hand_worked_student_t_interval():
    a = [0.80, 0.70, 0.90, 0.60, 0.75]
    b = [0.50, 0.60, 0.55, 0.50, 0.45]
    # differences 0.30 0.10 0.35 0.10 0.30: mean 0.23, squared deviations sum 0.058, sd sqrt(0.058 / 4)
    # t(0.975, 4 dof) = 2.7764451 (tables); half-width 2.7764451 * 0.1204159 / sqrt(5) = 0.1495162
    ci = paired_interval(a, b)
    assert ci["n"] == 5 and ci["mean"] == pytest.approx(0.23)
    assert ci["sd"] == pytest.approx(math.sqrt(0.058 / 4))
    assert ci["low"] == pytest.approx(0.23 - 0.1495162, abs=1e-6)
    assert ci["high"] == pytest.approx(0.23 + 0.1495162, abs=1e-6)
    one = paired_interval([0.5], [0.4])
    assert one["low"] == -math.inf and one["high"] == math.inf
    with pytest.raises(ValueError, match="equal, non-zero lengths"):
        paired_interval([0.1, 0.2], [0.1])


def test_epsilon_per_category_is_the_largest_over_sites_from_dp_accounting():
    events = {"site-00": {Cat.CR: DPSGDEvent(3.0, 0.05, 40), Cat.LC: DPSGDEvent(3.0, 0.5, 40)},
              "site-01": {Cat.CR: DPSGDEvent(2.0, 0.05, 40)}}
    eps = epsilon_by_category(events, 1e-5)
    assert set(eps) == {"CR", "LC"}
    assert eps["CR"] == pytest.approx(max(_dp_accounting_epsilon(3.0, 0.05, 40), _dp_accounting_epsilon(2.0, 0.05, 40)),
                                      rel=1e-9)
    assert eps["LC"] == pytest.approx(_dp_accounting_epsilon(3.0, 0.5, 40), rel=1e-9)


def test_choose_keeps_the_best_mean_over_the_tuning_seeds():
    rows = [{"configuration": "x", "point": [10, 1, 1.0, 2.0], "overall": 0.9},
            {"configuration": "x", "point": [10, 1, 1.0, 2.0], "overall": 0.5},   # mean 0.70
            {"configuration": "x", "point": [10, 1, 1.0, 4.0], "overall": 0.72},
            {"configuration": "x", "point": [10, 1, 1.0, 4.0], "overall": 0.70},  # mean 0.71: kept
            {"configuration": "y", "point": [10, 1, 1.0, 8.0], "overall": 0.99}]
    chosen = choose(rows, "x")
    assert chosen["point"] == [10, 1, 1.0, 4.0] and chosen["tuning_mean"] == pytest.approx(0.71)
    assert chosen["grid_points"] == 2 and chosen["tuning_runs"] == 2
    with pytest.raises(ValueError, match="no tuning run"):
        choose(rows, "z")


def test_every_configuration_gets_the_same_tuning_effort_and_the_seeds_budgets():
    assert len(DP_GRID) == len(GLOBAL_GRID) == len(NON_PRIVATE_GRID) == 25
    assert all(steps == 1 for _, steps, _, _ in GLOBAL_GRID)  # a Global DP task runs exactly one step
    by_name = {c.name: c for c in CONFIGURATIONS}
    # eps_c = eps_VU * (rank(c) / 3) ** gamma, ranks CR 1 ... NE 6 (computed here from the formula)
    for name, gamma in (("ccdp-g1-sample", 1), ("ccdp-g2-scale", 2), ("global-ccdp-g1-distributed", 1)):
        table = by_name[name].budgets()
        for cat, rank in ((Cat.CR, 1), (Cat.EN, 2), (Cat.VU, 3), (Cat.LC, 5), (Cat.NE, 6)):
            assert table[cat] == pytest.approx((rank / 3) ** gamma)
    assert all(v == pytest.approx(1 / 3) for v in by_name["uniform-eps0.33"].budgets().values())


def test_settings_refuse_tuning_on_reported_seeds_and_name_the_field():
    for kwargs, field in (({"seeds": (0, 101)}, "tuning_seeds"), ({"seeds": ()}, "seeds"),
                          ({"seeds": (1, 1)}, "seeds"), ({"configurations": ("ccdp",)}, "configurations"),
                          ({"grid": "huge"}, "grid"), ({"processes": 0}, "processes")):
        with pytest.raises(ConfigError) as err:
            PrivacyUtilitySettings(**kwargs)
        assert err.value.field == field


@pytest.mark.slow
def test_privacy_utility_command_tiny(tmp_path):
    out = tmp_path / "pu"
    names = "none,uniform-eps0.33,ccdp-g1-sample,global-ccdp-g1-distributed"
    args = ["experiment", "privacy-utility", "--seeds", "0", "--tuning-seeds", "1", "--grid", "tiny",
            "--configurations", names, "--processes", "1", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "privacy_utility.json").read_text())
    lines = (out / "runs.jsonl").read_text().splitlines()
    assert len(lines) == 8  # 4 configurations x (1 tuning point x 1 tuning seed + 1 reported seed)
    assert [r["seed"] for r in report["runs"]] == [0] * 4 and {r["seed"] for r in report["tuning"]} == {1}
    for run in report["runs"]:
        assert 0.0 <= run["overall"] <= 1.0
        if run["configuration"] == "none":
            assert run["epsilon"] == {} and run["events"] == {}
            continue
        for code, eps in run["epsilon"].items():  # every category's epsilon is within its budget, and spends it
            assert 0.99 * run["budget"][code] <= eps <= run["budget"][code] * (1 + 1e-6)
        if run["configuration"] != "global-ccdp-g1-distributed":  # DP-SGD events: recomputed with dp-accounting
            for per_site in run["events"].values():
                for code, ev in per_site.items():
                    got = _dp_accounting_epsilon(ev["noise_multiplier"], ev["sampling_rate"], ev["steps"])
                    assert got <= run["epsilon"][code] * (1 + 1e-9)
            worst = {code: max(_dp_accounting_epsilon(ev[code]["noise_multiplier"], ev[code]["sampling_rate"],
                                                      ev[code]["steps"]) for ev in run["events"].values() if code in ev)
                     for code in run["epsilon"]}
            assert worst == pytest.approx(run["epsilon"], rel=1e-9)
    md = (out / "privacy_utility.md").read_text()
    for name in names.split(","):
        label = next(c.label for c in CONFIGURATIONS if c.name == name)
        assert f"| {label} |" in md
    assert "ccdp-g1-sample - uniform-eps0.33" in md and (out / "privacy_utility.png").stat().st_size > 10_000
    # resumed: the same command finds every run in runs.jsonl and runs none again
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert (out / "runs.jsonl").read_text().splitlines() == lines


def test_mixture_prediction_is_the_hand_worked_weighted_sum_of_the_uniform_runs():
    from wildfed_sim.privacy_utility import MIXTURE_REFERENCE, mixture_prediction

    # two seeds; each uniform run is perfect on "its" category and 0 elsewhere except uniform eps 2 (0.5 on NE);
    # the held-out records: CR 10 %, EN 10 %, VU 20 %, NT 10 %, LC 20 %, NE 30 %
    w = {"CR": 0.1, "EN": 0.1, "VU": 0.2, "NT": 0.1, "LC": 0.2, "NE": 0.3}
    acc = {"CR": 0.4, "EN": 0.5, "VU": 0.6, "NT": 0.7, "LC": 0.8, "NE": 0.9}
    runs = []
    for seed, ccdp_overall in ((0, 0.70), (1, 0.60)):
        for cat, ref in MIXTURE_REFERENCE.items():
            runs.append({"configuration": ref, "seed": seed, "groups": {"overall": 0.0},
                         "by_category": {c: (acc[c] if c == cat else 0.0) for c in w}})
        runs.append({"configuration": "ccdp-g1-sample", "seed": seed, "groups": {"overall": ccdp_overall},
                     "by_category": {c: acc[c] - 0.1 for c in w}})
    runs.append({"configuration": "ccdp-g1-sample", "seed": 2, "groups": {"overall": 0.9},  # no references: left out
                 "by_category": dict(acc)})
    mix = mixture_prediction(runs, {"0": w, "1": w, "2": w})
    # predicted overall, by hand: 0.1*0.4 + 0.1*0.5 + 0.2*0.6 + 0.1*0.7 + 0.2*0.8 + 0.3*0.9 = 0.71
    assert mix["seeds"] == [0, 1]
    assert mix["predicted_overall"] == pytest.approx(0.71) and mix["actual_overall"] == pytest.approx(0.65)
    assert mix["overall"]["mean"] == pytest.approx(-0.06) and mix["overall"]["n"] == 2
    for cat in w:  # CCDP is 0.1 below the reference on every category, on both seeds: sd 0
        assert mix["by_category"][cat]["mean"] == pytest.approx(-0.1)
        assert mix["by_category"][cat]["reference"] == MIXTURE_REFERENCE[cat]
    assert mixture_prediction(runs[-1:], {"2": w}) is None


def test_one_dropout_configuration_sets_the_threshold_from_the_number_of_sites():
    by_name = {c.name: c for c in CONFIGURATIONS}
    assert by_name["global-ccdp-g1-distributed-1dropout"].threshold(8) == 7
    assert by_name["global-ccdp-g1-distributed"].threshold(8) is None  # the coordinator's default
    for name, eps in (("uniform-eps0.67", 2 / 3), ("uniform-eps1.33", 4 / 3), ("uniform-eps1.67", 5 / 3)):
        assert all(v == pytest.approx(eps) for v in by_name[name].budgets().values())
