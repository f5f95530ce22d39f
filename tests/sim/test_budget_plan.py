"""``wildfed plan-budgets``: each category's row is the mechanism its records go through (dp-accounting directly)
and the best-case signal against the noise in closed form."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting import rdp

from shared.iucn import IUCNCategory

from coordinator.config import CoordinatorConfig
from wildfed_sim.budget_plan import budget_plan


def test_each_row_spends_its_budget_over_the_rounds_and_the_signal_is_the_closed_form():
    cfg = CoordinatorConfig(federation_id="plan", rounds=3, local_steps=4, expected_batch_size=8)
    rows = budget_plan(cfg, capacity=80, records=10, sites=4)
    assert [r.category for r in rows] == list(IUCNCategory)
    steps = 3 * 4
    d = 1280 * 10 + 10  # the linear head on 1280-d embeddings, 10 classes
    for r in rows:
        acc = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
        acc.compose(dp_accounting.PoissonSampledDpEvent(r.sampling_rate, dp_accounting.GaussianDpEvent(
            r.noise_multiplier)), steps)
        eps = acc.get_epsilon(cfg.target_delta)
        assert eps <= r.budget * (1 + 1e-9) and eps == pytest.approx(r.budget, rel=0.02)  # spent, not overspent
        assert r.rounds == 3 and r.days == 3.0  # the default schedule: a round a day
        # sqrt(T) q n C / (sigma sqrt(d)), sigma / C = the noise multiplier
        assert r.signal.ratio == pytest.approx(math.sqrt(steps) * r.sampling_rate * 10 / (r.noise_multiplier
                                                                                         * math.sqrt(d)), rel=1e-9)
        assert r.federation_ratio == pytest.approx(2 * r.signal.ratio, rel=1e-12)
    assert rows[-1].sampling_rate == pytest.approx(8 / 80)  # the anchor (NE, the largest budget) runs at B / N_k


def test_the_table_gives_a_short_training_life_in_hours(tmp_path):
    from typer.testing import CliRunner

    from coordinator.config import save_config
    from wildfed_sim.cli import app

    cfg = CoordinatorConfig(federation_id="plan", rounds=3, local_steps=4, expected_batch_size=8,
                            schedule={"round_interval_s": 90})
    path = save_config(cfg, tmp_path / "c.yaml")
    result = CliRunner().invoke(app, ["plan-budgets", "--config", str(path), "--capacity", "80", "--records", "10",
                                      "--sites", "2", "--categories", "LC"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert f"{3 * 90 / 3600:.2g} h" in result.output  # 3 rounds 90 s apart: 0.075 h, where days showed 0.00
